// bert_impl::sgemm: y = x W^T + b in float32 with AVX2 + FMA, for the products of the compiled program
// (modeling_bert_impl/avx2_gemm.py says why and when). W comes packed by avx2_gemm.pack: (panels, in, 16), panel j
// holding output columns 16j..16j+15 (zeros past the last), each input row's 16 weights side by side, so that a panel
// streams from memory once, in order. Each block of 6 rows x 16 columns of y is summed in 12 AVX registers; the
// panels are split over the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t PANEL = 16;  // output columns per panel: two AVX registers
constexpr int ROWS = 6;        // rows per block: 12 sums + 2 weights + 1 input in the 16 AVX registers

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
  alignas(32) float last[PANEL];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
    if (ncols == PANEL) {
      _mm256_storeu_ps(y + r * N, sum[r][0]);
      _mm256_storeu_ps(y + r * N + 8, sum[r][1]);
    } else {  // the last panel of an N that is not a multiple of 16
      _mm256_store_ps(last, sum[r][0]);
      _mm256_store_ps(last + 8, sum[r][1]);
      std::memcpy(y + r * N, last, ncols * sizeof(float));
    }
  }
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
      int64_t m = 0;
      for (; m + ROWS <= M; m += ROWS) {
        block<ROWS>(a + m * K, K, panel, next, bias16, out + m * N + j * PANEL, N, ncols);
      }
      const float* am = a + m * K;
      float* ym = out + m * N + j * PANEL;
      switch (M - m) {
        case 5: block<5>(am, K, panel, next, bias16, ym, N, ncols); break;
        case 4: block<4>(am, K, panel, next, bias16, ym, N, ncols); break;
        case 3: block<3>(am, K, panel, next, bias16, ym, N, ncols); break;
        case 2: block<2>(am, K, panel, next, bias16, ym, N, ncols); break;
        case 1: block<1>(am, K, panel, next, bias16, ym, N, ncols); break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(bert_impl, m) { m.def("sgemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(bert_impl, CPU, m) { m.impl("sgemm", sgemm); }
