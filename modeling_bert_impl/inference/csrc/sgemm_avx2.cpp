// bert_impl::sgemm: y = x W^T + b in float32 with AVX2 + FMA, bert_impl::qgemm, its int8 counterpart, for the products
// of the compiled program, and bert_impl::attention, its self-attention on sgemm's blocks (both below;
// modeling_bert_impl/avx2_gemm.py says why and when). W comes packed by
// avx2_gemm.pack: (panels, in, 16), panel j holding output columns 16j..16j+15 (zeros past the last), each input row's
// 16 weights side by side, so that a panel streams from memory once, in order. Each block of 6 rows x 16 columns of y
// is summed in 12 AVX registers; the threads take the panels one at a time (`share`).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t PANEL = 16;  // output columns per panel: two AVX registers
constexpr int ROWS = 6;        // rows per block: 12 sums + 2 weights + 1 input in the 16 AVX registers

// run(rows, m) for each block of R rows of M from row m (rows a std::integral_constant<int, R>), then once for the
// 1..R-1 rows left, with their number
template <int R, typename Run>
inline void rows_left(int64_t left, int64_t m, Run run) {
  if constexpr (R > 0) {
    if (left == R) return run(std::integral_constant<int, R>{}, m);
    rows_left<R - 1>(left, m, run);
  }
}

template <int R, typename Run>
inline void in_blocks(int64_t M, Run run) {
  int64_t m = 0;
  for (; m + R <= M; m += R) run(std::integral_constant<int, R>{}, m);
  rows_left<R - 1>(M - m, m, run);
}

// run(take) on each thread (at most n), take(i) setting i to the next of 0, 1, ..., n - 1 not yet taken, false when
// none is left: a thread takes the next piece of work when it is done with its last, so that a core slowed by other
// work (another process on a shared machine) takes fewer, where a static split would wait for its share
// (benchmarks/NOTES.md, "The AVX2 program's kernels": sharing the work)
template <typename Run>
inline void share(int64_t n, Run run) {
  std::atomic<int64_t> next{0};
  auto take = [&](int64_t& i) { return (i = next.fetch_add(1, std::memory_order_relaxed)) < n; };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) { run(take); });
}

// the largest of the 8 floats of v
inline float largest(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
}

// y[:ncols] = the 16 floats of lo, hi: all of them, or the first ncols of the last panel of an N not a multiple of 16
inline void store16(float* y, __m256 lo, __m256 hi, int64_t ncols) {
  if (ncols == PANEL) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float last[PANEL];
  _mm256_store_ps(last, lo);
  _mm256_store_ps(last + 8, hi);
  std::memcpy(y, last, ncols * sizeof(float));
}

// The exact (erf) GELU x (1 + erf(x / sqrt 2)) / 2, 8 at a time, for the feed-forward's first product: erf(x / sqrt 2)
// as c P(c^2) / Q(c^2), c = x clamped to +-5.5437 (where erf is 1 in float32), P and Q of degree 5 in c^2 (a rational
// least-squares fit, within 3e-8 of erf; 4e-7 evaluated in float32). The GELU is within 2.2e-7 max(1, |x|) of float64's
// (torch's 1.6e-7), in about 16 operations: inductor's loop after the product (an exp and a division, 35) took
// noticeably more (benchmarks/NOTES.md, "The AVX2 program's kernels").
inline __m256 gelu8(__m256 x) {
  const __m256 most = _mm256_set1_ps(5.5437174f);
  const __m256 c = _mm256_max_ps(_mm256_min_ps(x, most), _mm256_sub_ps(_mm256_setzero_ps(), most));
  const __m256 t = _mm256_mul_ps(c, c);
  __m256 p = _mm256_set1_ps(4.496154e-08f), q = _mm256_set1_ps(1.189699e-06f);
  for (float k : {1.2704755e-05f, 0.0003419076f, 0.00937981f, 0.06815178f, 0.79788446f}) {
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(k));
  }
  for (float k : {7.425571e-05f, 0.0018965162f, 0.028770968f, 0.25208142f, 1.0f}) {
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(k));
  }
  const __m256 half = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
  return _mm256_fmadd_ps(half, _mm256_div_ps(_mm256_mul_ps(c, p), q), half);
}

// y[r, :ncols] = bias + sum_k a[r, k] * panel[k, :] for the R rows of a block (its gelu8 where GELU), fetching `next`
// (the panel this thread will likely take next) into the cache meanwhile: the product then waits for memory only on
// its first panel
template <int R, bool GELU = false>
inline void block(const float* a, int64_t K, const float* panel, const float* next, const float* bias, float* y,
                  int64_t N, int64_t ncols) {
  __m256 sum[R][2];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
    sum[r][0] = _mm256_loadu_ps(bias);
    sum[r][1] = _mm256_loadu_ps(bias + 8);
  }
  for (int64_t k = 0; k < K; k++) {
    _mm_prefetch(reinterpret_cast<const char*>(next + k * PANEL), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(panel + k * PANEL), w1 = _mm256_loadu_ps(panel + k * PANEL + 8);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
      __m256 x = _mm256_broadcast_ss(a + r * K + k);
      sum[r][0] = _mm256_fmadd_ps(x, w0, sum[r][0]);
      sum[r][1] = _mm256_fmadd_ps(x, w1, sum[r][1]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
    if constexpr (GELU) store16(y + r * N, gelu8(sum[r][0]), gelu8(sum[r][1]), ncols);
    else store16(y + r * N, sum[r][0], sum[r][1], ncols);
  }
}

// (..., K) float32, (panels, K, 16), (N,) or none, N, whether to take the GELU of the result -> (..., N)
at::Tensor sgemm(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N,
                 bool gelu) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "sgemm: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == input.size(-1) && packed.is_contiguous()
              && packed.size(0) == (N + PANEL - 1) / PANEL, "sgemm: packed weight of another shape");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->is_contiguous()), "sgemm: bias of another size");
  at::Tensor x = input.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* a = x.const_data_ptr<float>();
  const float* w = packed.const_data_ptr<float>();
  const float* b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* out = y.mutable_data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  share(packed.size(0), [&](auto take) {
    for (int64_t j; take(j);) {
      const float* panel = w + j * K * PANEL;
      const int64_t after = j + threads;  // the panel this thread likely takes next
      const float* next = after < packed.size(0) ? w + after * K * PANEL : panel;
      const int64_t ncols = std::min(PANEL, N - j * PANEL);
      alignas(32) float bias16[PANEL] = {0};
      if (b) std::memcpy(bias16, b + j * PANEL, ncols * sizeof(float));
      in_blocks<ROWS>(M, [&](auto rows, int64_t m) {
        if (gelu) block<rows.value, true>(a + m * K, K, panel, next, bias16, out + m * N + j * PANEL, N, ncols);
        else block<rows.value>(a + m * K, K, panel, next, bias16, out + m * N + j * PANEL, N, ncols);
      });
    }
  });
  return y;
}

// int8: Int8Linear's traced formulation, its products in integers: each row x scaled by the smoothing scales s to
// v = x s, m = max(max |v|, 1e-12), q = round(127 v / m) + 128 (uint8), then y = b + m (q - 128) W^T * scale / 127.
// W packed by avx2_gemm.pack_int8: (panels, in / 4, 16, 4), each column's 4 consecutive weights side by side, so
// that one register holds 8 columns x 4 inputs. vpmaddubsw adds pairs of uint8 x int8 products in int16, which holds
// for weights of 7 bits (255 x 63 x 2 < 32768: quantization.weight_levels), vpmaddwd the pairs into int32.
constexpr int QROWS = 4;  // 8 sums + 2 weights + input + ones + product: 13 AVX registers

using four_bytes = int32_t __attribute__((may_alias));  // a row's 4 uint8 inputs, read as one

// s0 += madd(maddubs(x, w0), ones), s1 += madd(maddubs(x, w1), ones), x the 4 inputs at `a` in each 32-bit lane.
// Written in assembly: from the same steps as intrinsics, GCC 12 keeps one of qblock's 8 sums on the stack and
// interleaves the rows into 8 live products, which takes longer (benchmarks/NOTES.md, "The AVX2 program's kernels").
inline void qstep(__m256i& s0, __m256i& s1, const uint8_t* a, __m256i w0, __m256i w1, __m256i ones) {
  __m256i x, t;
  __asm__("vpbroadcastd %[a], %[x]\n\t"
          "vpmaddubsw %[w0], %[x], %[t]\n\t"  // t = pairs of x (uint8) * w0 (int8) summed in int16
          "vpmaddubsw %[w1], %[x], %[x]\n\t"
          "vpmaddwd %[ones], %[t], %[t]\n\t"  // and those pairs summed in int32
          "vpmaddwd %[ones], %[x], %[x]\n\t"
          "vpaddd %[t], %[s0], %[s0]\n\t"
          "vpaddd %[x], %[s1], %[s1]"
          : [s0] "+x"(s0), [s1] "+x"(s1), [t] "=&x"(t), [x] "=&x"(x)
          : [a] "m"(*reinterpret_cast<const four_bytes*>(a)), [w0] "x"(w0), [w1] "x"(w1), [ones] "x"(ones));
}

template <int R>
inline void qblock(const uint8_t* a, int64_t K4, const int8_t* panel, const float* factor, const int32_t* offset,
                   const float* bias, const float* row_max, float* y, int64_t N, int64_t ncols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum[R][2];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K4; k++) {
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * 64));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * 64 + 32));
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
      qstep(sum[r][0], sum[r][1], a + r * K4 * 4 + k * 4, w0, w1, ones);
    }
  }
  const __m256i off0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset));
  const __m256i off1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + 8));
  const __m256 f0 = _mm256_loadu_ps(factor), f1 = _mm256_loadu_ps(factor + 8);
  const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
    const __m256 m = _mm256_set1_ps(row_max[r]);
    store16(y + r * N, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[r][0], off0)), f0), m, b0),
            _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[r][1], off1)), f1), m, b1), ncols);
  }
}

// q = round(127 x s / m) + 128 (to even, as torch.round), saturated to [0, 255], m = max(max |x s|, 1e-12), with the
// traced formulation's float32 steps (x s, then / m, then * 127): 32 at a time, then one by one; returns m. A NaN in
// the row makes m NaN, as the formulation's amax does (vmaxps alone would drop it), so that the row's outputs are NaN.
float quantize_row(const float* x, const float* smooth, int64_t K, uint8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(smooth + k));
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float most = std::max(largest(top), 1e-12f);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; k < K; k++) {
    const float v = std::abs(x[k] * smooth[k]);
    most = std::max(most, v);
    any_nan |= std::isnan(v);
  }
  if (any_nan) most = std::numeric_limits<float>::quiet_NaN();
  const __m256 m = _mm256_set1_ps(most), s = _mm256_set1_ps(127.0f);
  const __m256i zero_point = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (k = 0; k + 32 <= K; k += 32) {
    __m256i ints[4];
    for (int i = 0; i < 4; i++) {  // _mm256_cvtps_epi32 rounds to nearest even
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * i), _mm256_loadu_ps(smooth + k + 8 * i));
      ints[i] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_div_ps(v, m), s)), zero_point);
    }
    __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; k < K; k++) {
    q[k] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[k] * smooth[k] / most * 127.0f) + 128.0f, 0.0f, 255.0f));
  }
  return most;
}

// (..., K) float32, (K,) smoothing scales, (panels, ceil(K / 4), 16, 4) int8, (N,) int32 column sums, (N,) float32
// scales and bias, N -> (..., N)
at::Tensor qgemm(const at::Tensor& input, const at::Tensor& smooth, const at::Tensor& packed,
                 const at::Tensor& column_sums, const at::Tensor& scale, const at::Tensor& bias, int64_t N) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar, "qgemm: float32 x, int8 W");
  const int64_t K = input.size(-1), K4 = (K + 3) / 4;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + PANEL - 1) / PANEL && packed.size(1) == K4
              && packed.size(2) == PANEL && packed.size(3) == 4 && packed.is_contiguous(),
              "qgemm: packed weight of another shape");
  TORCH_CHECK(column_sums.scalar_type() == at::kInt && column_sums.numel() == N && scale.numel() == N
              && scale.scalar_type() == at::kFloat && bias.numel() == N && bias.scalar_type() == at::kFloat
              && smooth.numel() == K && smooth.scalar_type() == at::kFloat,
              "qgemm: smoothing scales, column sums, scales or bias of another size");
  at::Tensor x = input.contiguous(), s = smooth.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  std::vector<uint8_t> q(M * K4 * 4, 0);  // the rows in uint8, zero past K (the packed weights are zero there)
  std::vector<float> row_max(M);
  const float *xs = x.const_data_ptr<float>(), *ss = s.const_data_ptr<float>();
  share((M + 15) / 16, [&](auto take) {  // 16 rows at a time
    for (int64_t c; take(c);) {
      for (int64_t i = c * 16; i < std::min(M, c * 16 + 16); i++) {
        row_max[i] = quantize_row(xs + i * K, ss, K, q.data() + i * K4 * 4);
      }
    }
  });
  const int8_t* w = packed.const_data_ptr<int8_t>();
  const int32_t* sums = column_sums.const_data_ptr<int32_t>();
  const float* scales = scale.const_data_ptr<float>();
  const float* biases = bias.const_data_ptr<float>();
  float* out = y.mutable_data_ptr<float>();
  share(packed.size(0), [&](auto take) {
    for (int64_t j; take(j);) {
      const int8_t* panel = w + j * K4 * 64;
      const int64_t ncols = std::min(PANEL, N - j * PANEL);
      alignas(32) float factor[PANEL] = {0}, bias16[PANEL] = {0};
      alignas(32) int32_t offset[PANEL] = {0};
      for (int64_t c = 0; c < ncols; c++) {
        factor[c] = scales[j * PANEL + c] * (1.0f / 127.0f);
        offset[c] = 128 * sums[j * PANEL + c];
        bias16[c] = biases[j * PANEL + c];
      }
      in_blocks<QROWS>(M, [&](auto rows, int64_t m) {
        qblock<rows.value>(q.data() + m * K4 * 4, K4, panel, factor, offset, bias16, row_max.data() + m,
                           out + m * N + j * PANEL, N, ncols);
      });
    }
  });
  return y;
}

// Attention: softmax(q k^T * scaling, masked) v for each head, from the fused product's (B, T, 3, N, D) q, k, v.
// Per head and chunk of up to QCHUNK queries: k packed as the panels of a weight (keys as output columns; past T,
// key T - 1 again, its scores masked), the queries' scores by `block` (6 queries x 16 keys at a time), each row's
// softmax in place, then the chunk's output by `block` again over v packed the same way (its D columns as output
// columns, each key a step of the sum). Both products' operands are in the cache by then: each block's `next` is its
// own panel.
constexpr int64_t QCHUNK = 64;  // queries per task: a chunk's scores stay in L2 up to 512 keys (128 KB)

// e^x for x <= 0 (Cephes' expf: x = n ln 2 + r, e^r by its degree-7 polynomial, 2^n in the exponent bits); within 2
// float32 ulp of e^x down to -87.3, and 0 below, where e^x is no longer a normal float32
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), _mm256_max_ps(x, low));
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), _mm256_cmp_ps(x, low, _CMP_GE_OQ));
}

// s[:Tp] = softmax of s[:T] where keep (every key when keep is null), 0 elsewhere; a row that keeps no key gives 0s
inline void softmax_row(float* s, int64_t T, int64_t Tp, const bool* keep) {
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 top = none;
  for (int64_t j = 0; j < Tp; j += 8) {  // scores past T and of keys not kept to -inf, and their maximum
    __m256i out = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(T - j)), lane);  // j + lane < T
    if (keep && j < T) {
      int64_t eight = 0;  // the 8 bools, those past T left 0
      if (j + 8 <= T) std::memcpy(&eight, keep + j, 8);
      else std::memcpy(&eight, keep + j, T - j);
      const __m256i kept = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
      out = _mm256_andnot_si256(_mm256_cmpeq_epi32(kept, _mm256_setzero_si256()), out);
    }
    const __m256 v = _mm256_blendv_ps(none, _mm256_loadu_ps(s + j), _mm256_castsi256_ps(out));
    _mm256_storeu_ps(s + j, v);
    top = _mm256_max_ps(top, v);
  }
  const float most = largest(top);
  if (most == -std::numeric_limits<float>::infinity()) return (void)std::fill(s, s + Tp, 0.0f);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < Tp; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(most)));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  const __m256 inverse = _mm256_set1_ps(1.0f / std::accumulate(lanes, lanes + 8, 0.0f));
  for (int64_t j = 0; j < Tp; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inverse));
}

// A head's keys as the panels of a weight, (Tp / 16, D, 16), 16 keys side by side (past T, key T - 1 again: its scores
// are masked), and its values in panels of 16 columns, (Dp / 16, Tp, 16); q of token t at head + t 3H, k at + H, v at
// + 2H
inline void pack_head(const float* head, int64_t T, int64_t Tp, int64_t D, int64_t H, float* keys, float* values) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t t = 0; t < Tp; t += 8) {  // keys t..t+7, gathered
    const __m256i key = _mm256_min_epi32(_mm256_add_epi32(_mm256_set1_epi32(t), lane), _mm256_set1_epi32(T - 1));
    const __m256i at = _mm256_mullo_epi32(key, _mm256_set1_epi32(3 * H));
    float* panel = keys + t / PANEL * D * PANEL + t % PANEL;
    for (int64_t d = 0; d < D; d++) _mm256_storeu_ps(panel + d * PANEL, _mm256_i32gather_ps(head + H + d, at, 4));
  }
  for (int64_t t = 0; t < T; t++) {
    const float* value = head + t * 3 * H + 2 * H;
    for (int64_t d = 0; d < D; d += PANEL) {
      float* to = values + (d / PANEL * Tp + t) * PANEL;
      if (d + PANEL <= D) {
        _mm256_storeu_ps(to, _mm256_loadu_ps(value + d));
        _mm256_storeu_ps(to + 8, _mm256_loadu_ps(value + d + 8));
      } else {
        std::copy(value + d, value + D, to);
      }
    }
  }
}

// (B, T, 3 N D) float32, keep: bool (B | 1, 1, T | 1, T) or none, N, scaling -> (B, T, N D)
at::Tensor attention(const at::Tensor& qkv, const std::optional<at::Tensor>& keep, int64_t heads, double scaling) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 3 && heads > 0 && qkv.size(2) % (3 * heads) == 0,
              "attention: (B, T, 3 N D) float32");
  const int64_t B = qkv.size(0), T = qkv.size(1), H = qkv.size(2) / 3, D = H / heads;
  const int64_t Tp = (T + PANEL - 1) / PANEL * PANEL, Dp = (D + PANEL - 1) / PANEL * PANEL;  // 16 columns a panel
  at::Tensor mask;
  int64_t steps[2] = {0, 0};  // keep's strides over batch and query (0 where broadcast)
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->dim() == 4 && keep->size(1) == 1 && keep->size(3) == T
                && (keep->size(0) == B || keep->size(0) == 1) && (keep->size(2) == T || keep->size(2) == 1),
                "attention: keep is a bool (B | 1, 1, T | 1, T)");
    mask = keep->stride(3) == 1 ? *keep : keep->contiguous();  // each query's keys side by side
    for (int i = 0; i < 2; i++) steps[i] = mask.size(2 * i) == 1 ? 0 : mask.stride(2 * i);
  }
  at::Tensor x = qkv.contiguous();
  at::Tensor y = at::empty({B, T, H}, x.options());
  const float* in = x.const_data_ptr<float>();
  const bool* kept = keep.has_value() ? mask.const_data_ptr<bool>() : nullptr;
  float* out = y.mutable_data_ptr<float>();
  const int64_t chunks = (T + QCHUNK - 1) / QCHUNK;
  const float scale = static_cast<float>(scaling);
  // a thread takes a head's chunks together (its keys and values packed once) where there are heads enough to share
  const int64_t together = B * heads >= 4 * at::get_num_threads() ? chunks : 1;
  share(B * heads * chunks / together, [&](auto take) {
    std::vector<float> keys(Tp * D, 0.0f), values(Dp * Tp, 0.0f), queries(QCHUNK * D), scores(QCHUNK * Tp);
    alignas(32) const float zeros[PANEL] = {0};
    int64_t packed = -1;  // the head whose keys and values are packed
    for (int64_t unit; take(unit);) {
      for (int64_t task = unit * together; task < (unit + 1) * together; task++) {
        const int64_t bh = task / chunks, b = bh / heads, h = bh % heads, first = task % chunks * QCHUNK;
        const int64_t rows = std::min(QCHUNK, T - first);
        const float* head = in + b * T * 3 * H + h * D;  // q of token t at head + t 3H, k at + H, v at + 2H
        if (bh != packed) {
          pack_head(head, T, Tp, D, H, keys.data(), values.data());
          packed = bh;
        }
        for (int64_t i = 0; i < rows; i++) {
          for (int64_t d = 0; d < D; d++) queries[i * D + d] = head[(first + i) * 3 * H + d] * scale;
        }
        for (int64_t j = 0; j < Tp / PANEL; j++) {  // scores (rows, Tp)
          in_blocks<ROWS>(rows, [&](auto r, int64_t m) {
            const float* panel = keys.data() + j * D * PANEL;
            float* y = scores.data() + m * Tp + j * PANEL;
            block<r.value>(queries.data() + m * D, D, panel, panel, zeros, y, Tp, PANEL);
          });
        }
        for (int64_t i = 0; i < rows; i++) {
          const bool* row = kept ? kept + b * steps[0] + (first + i) * steps[1] : nullptr;
          softmax_row(scores.data() + i * Tp, T, Tp, row);
        }
        for (int64_t j = 0; j < Dp / PANEL; j++) {  // output (rows, D) of this head
          in_blocks<ROWS>(rows, [&](auto r, int64_t m) {
            const float* panel = values.data() + j * Tp * PANEL;
            float* y = out + (b * T + first + m) * H + h * D + j * PANEL;
            block<r.value>(scores.data() + m * Tp, Tp, panel, panel, zeros, y, H, std::min(PANEL, D - j * PANEL));
          });
        }
      }
    }
  });
  return y;
}

}  // namespace

// a fragment: bert_padding.py defines other bert_impl operators from Python
TORCH_LIBRARY_FRAGMENT(bert_impl, m) {
  m.def("sgemm(Tensor x, Tensor packed, Tensor? bias, int out_features, bool gelu=False) -> Tensor");
  m.def("qgemm(Tensor x, Tensor smooth, Tensor packed, Tensor column_sums, Tensor scale, Tensor bias, int out_features)"
        " -> Tensor");
  m.def("attention(Tensor qkv, Tensor? keep, int heads, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(bert_impl, CPU, m) {
  m.impl("sgemm", sgemm);
  m.impl("qgemm", qgemm);
  m.impl("attention", attention);
}
