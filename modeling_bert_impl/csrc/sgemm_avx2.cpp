// bert_impl::sgemm: y = x W^T + b in float32 with AVX2 + FMA, and bert_impl::qgemm, its int8 counterpart (below), for
// the products of the compiled program (modeling_bert_impl/avx2_gemm.py says why and when). W comes packed by
// avx2_gemm.pack: (panels, in, 16), panel j holding output columns 16j..16j+15 (zeros past the last), each input row's
// 16 weights side by side, so that a panel streams from memory once, in order. Each block of 6 rows x 16 columns of y
// is summed in 12 AVX registers; the panels are split over the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

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

// y[r, :ncols] = bias + sum_k a[r, k] * panel[k, :] for the R rows of a block, fetching `next` (the panel after this
// one) into the cache meanwhile: the product then waits for memory only on its first panel
template <int R>
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
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) store16(y + r * N, sum[r][0], sum[r][1], ncols);
}

// (..., K) float32, (panels, K, 16), (N,) or none, N -> (..., N)
at::Tensor sgemm(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N) {
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
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j++) {
      const float* panel = w + j * K * PANEL;
      const float* next = j + 1 < packed.size(0) ? panel + K * PANEL : panel;
      const int64_t ncols = std::min(PANEL, N - j * PANEL);
      alignas(32) float bias16[PANEL] = {0};
      if (b) std::memcpy(bias16, b + j * PANEL, ncols * sizeof(float));
      in_blocks<ROWS>(M, [&](auto rows, int64_t m) {
        block<rows.value>(a + m * K, K, panel, next, bias16, out + m * N + j * PANEL, N, ncols);
      });
    }
  });
  return y;
}

// int8: y = (q - 128) W^T * scale / 127 with q = round(127 x) + 128 (uint8) for rows x in [-1, 1]: what Int8Linear's
// traced formulation computes, its products in integers. W packed by avx2_gemm.pack_int8: (panels, in / 4, 16, 4),
// each column's 4 consecutive weights side by side, so that one register holds 8 columns x 4 inputs. vpmaddubsw adds
// pairs of uint8 x int8 products in int16, which holds for weights of 7 bits (255 x 63 x 2 < 32768:
// quantization.weight_levels), vpmaddwd the pairs into int32.
constexpr int QROWS = 4;  // 8 sums + 2 weights + input + ones + product: 13 AVX registers

using four_bytes = int32_t __attribute__((may_alias));  // a row's 4 uint8 inputs, read as one

// s0 += madd(maddubs(x, w0), ones), s1 += madd(maddubs(x, w1), ones), x the 4 inputs at `a` in each 32-bit lane.
// Written in assembly: from the same steps as intrinsics, GCC 12 keeps one of qblock's 8 sums on the stack and
// interleaves the rows into 8 live products, 1.21-1.39x the time of this (alternating, 16 to 2,048 rows).
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
                   float* y, int64_t N, int64_t ncols) {
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
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
    store16(y + r * N, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[r][0], off0)), f0),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[r][1], off1)), f1), ncols);
  }
}

// q = round(127 x) + 128 (to even, as torch.round), saturated to [0, 255]: 32 at a time, then one by one
void quantize_row(const float* x, int64_t K, uint8_t* q) {
  const __m256 s = _mm256_set1_ps(127.0f);
  const __m256i zero_point = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; i++) {  // _mm256_cvtps_epi32 rounds to nearest even
      v[i] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * i), s)), zero_point);
    }
    __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; k < K; k++) q[k] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[k] * 127.0f) + 128.0f, 0.0f, 255.0f));
}

// (..., K) float32 in [-1, 1], (panels, ceil(K / 4), 16, 4) int8, (N,) int32 column sums, (N,) float32 scales, N
// -> (..., N)
at::Tensor qgemm(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& column_sums,
                 const at::Tensor& scale, int64_t N) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar, "qgemm: float32 x, int8 W");
  const int64_t K = input.size(-1), K4 = (K + 3) / 4;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == (N + PANEL - 1) / PANEL && packed.size(1) == K4
              && packed.size(2) == PANEL && packed.size(3) == 4 && packed.is_contiguous(),
              "qgemm: packed weight of another shape");
  TORCH_CHECK(column_sums.scalar_type() == at::kInt && column_sums.numel() == N && scale.numel() == N
              && scale.scalar_type() == at::kFloat, "qgemm: column sums or scales of another size");
  at::Tensor x = input.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  std::vector<uint8_t> q(M * K4 * 4, 0);  // the rows in uint8, zero past K (the packed weights are zero there)
  const float* xs = x.const_data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) quantize_row(xs + i * K, K, q.data() + i * K4 * 4);
  });
  const int8_t* w = packed.const_data_ptr<int8_t>();
  const int32_t* sums = column_sums.const_data_ptr<int32_t>();
  const float* scales = scale.const_data_ptr<float>();
  float* out = y.mutable_data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j++) {
      const int8_t* panel = w + j * K4 * 64;
      const int64_t ncols = std::min(PANEL, N - j * PANEL);
      alignas(32) float factor[PANEL] = {0};
      alignas(32) int32_t offset[PANEL] = {0};
      for (int64_t c = 0; c < ncols; c++) {
        factor[c] = scales[j * PANEL + c] * (1.0f / 127.0f);
        offset[c] = 128 * sums[j * PANEL + c];
      }
      in_blocks<QROWS>(M, [&](auto rows, int64_t m) {
        qblock<rows.value>(q.data() + m * K4 * 4, K4, panel, factor, offset, out + m * N + j * PANEL, N, ncols);
      });
    }
  });
  return y;
}

}  // namespace

// a fragment: bert_padding.py defines other bert_impl operators from Python
TORCH_LIBRARY_FRAGMENT(bert_impl, m) {
  m.def("sgemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("qgemm(Tensor x, Tensor packed, Tensor column_sums, Tensor scale, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(bert_impl, CPU, m) {
  m.impl("sgemm", sgemm);
  m.impl("qgemm", qgemm);
}
