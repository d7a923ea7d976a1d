// The routed experts of one MoE layer on the CPU as one operator each way: gather the tokens in expert order,
// each expert's SwiGLU as three BLAS calls on its segment, the gate-weighted combine into the tokens' rows; and
// the backward of all of it. The same arithmetic as moe.py's `grouped` dispatch (grouped_mm + silu * mul +
// FusedCombine), without its ~20 autograd nodes, its per-segment tensor views and dispatcher calls inside
// grouped_mm, and the separate add of the two input gradients: at the pilot's 512-token microbatch those fixed
// costs were ~15% of the layer (BENCHMARKS.md, issue 3). The activation uses PyTorch's own vectorized silu and
// silu_backward, so elementwise results equal the reference's bit for bit; the matmuls call the BLAS that
// torch's own CPU matmul calls (MKL's sgemm_/dgemm_) when torch exports it, else at::mm on views.
// Loaded with routing_kernel.cpp by pilotrun/model/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

// Fortran BLAS as exported by torch's CPU library on x86 Linux (MKL). Weak: where a torch build does not export
// them, they are null and `gemm` below uses at::mm instead, so the library still loads.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace {

// Whether gemm calls the exported BLAS: where torch exports it, unless a test asks for the at::mm path (the one
// other platforms take) with use_exported_blas(false).
bool prefer_exported_blas = true;
bool blas_exported() { return prefer_exported_blas && sgemm_ != nullptr && dgemm_ != nullptr; }

// Row-major C[M,N] = op(A)[M,K] @ op(B)[K,N] (+ C when accumulate), op = transpose when the flag is set; A, B, C
// row-major with leading dimensions lda, ldb, ldc. Column-major BLAS computes C^T = op(B)^T op(A)^T, so the
// operands swap places and keep their flags.
template <typename T>
void gemm(bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
          int64_t ldb, bool accumulate, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(T) * N);
    return;
  }
  if (blas_exported()) {
    const char ta = transpose_a ? 'T' : 'N', tb = transpose_b ? 'T' : 'N';
    const int m = N, n = M, k = K, la = lda, lb = ldb, lc = ldc;
    const T one = 1, beta = accumulate ? 1 : 0;
    if constexpr (std::is_same_v<T, float>) sgemm_(&tb, &ta, &m, &n, &k, &one, B, &lb, A, &la, &beta, C, &lc);
    else dgemm_(&tb, &ta, &m, &n, &k, &one, B, &lb, A, &la, &beta, C, &lc);
    return;
  }
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  // Views of the raw blocks: a transposed operand is stored [K, M] (or [N, K]) with its own leading dimension.
  at::Tensor a = transpose_a ? at::from_blob(const_cast<T*>(A), {K, M}, {lda, 1}, options).t()
                             : at::from_blob(const_cast<T*>(A), {M, K}, {lda, 1}, options);
  at::Tensor b = transpose_b ? at::from_blob(const_cast<T*>(B), {N, K}, {ldb, 1}, options).t()
                             : at::from_blob(const_cast<T*>(B), {K, N}, {ldb, 1}, options);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, options);
  if (accumulate) c.addmm_(a, b);
  else at::mm_out(c, a, b);
}

// Forward. x [N,d], gate weights [N,K] (same dtype), w1, w3 [E,F,d], w2 [E,d,F], the sorted layout (order and
// token_of_slot [S=N*K] int64, counts [E] int64). Returns the combined output [N,d] and what the backward reads:
// gathered [S,d], a = x W1^T and b = x W3^T [S,F], silu(a) [S,F], h = silu(a) * b [S,F], routed [S,d].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
experts_forward(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& w1_in,
                const at::Tensor& w2_in, const at::Tensor& w3_in, const at::Tensor& order_in,
                const at::Tensor& token_of_slot_in, const at::Tensor& counts_in) {
  const at::Tensor x = x_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous(), w3 = w3_in.contiguous();
  const at::Tensor order = order_in.contiguous(), token_of_slot = token_of_slot_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && x.device().is_cpu(), "experts_forward: CPU x [N,d], w1 [E,F,d]");
  TORCH_CHECK(x.scalar_type() == weights.scalar_type() && x.scalar_type() == w1.scalar_type() &&
              w1.scalar_type() == w2.scalar_type() && w1.scalar_type() == w3.scalar_type(),
              "experts_forward: x, gate weights and expert weights must share one dtype");
  const int64_t tokens = x.size(0), width = x.size(1), experts = w1.size(0), hidden = w1.size(1);
  const int64_t slots = order.size(0);
  TORCH_CHECK(w1.size(2) == width && w3.sizes() == w1.sizes() && w2.size(0) == experts && w2.size(1) == width &&
              w2.size(2) == hidden && counts.size(0) == experts, "experts_forward: weight shapes disagree");
  at::Tensor gathered = at::empty({slots, width}, x.options());
  at::Tensor a = at::empty({slots, hidden}, x.options()), b = at::empty({slots, hidden}, x.options());
  at::Tensor h = at::empty({slots, hidden}, x.options()), routed = at::empty({slots, width}, x.options());
  at::Tensor silu_a;
  at::Tensor output = at::zeros({tokens, width}, x.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* tok = token_of_slot.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "experts_forward", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* g = gathered.data_ptr<scalar_t>();
    for (int64_t slot = 0; slot < slots; ++slot)
      std::memcpy(g + slot * width, xs + tok[slot] * width, sizeof(scalar_t) * width);
    const scalar_t* W1 = w1.data_ptr<scalar_t>();
    const scalar_t* W3 = w3.data_ptr<scalar_t>();
    scalar_t* A = a.data_ptr<scalar_t>();
    scalar_t* B = b.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
      gemm<scalar_t>(false, true, count[e], hidden, width, g + start * width, width, W1 + e * hidden * width, width,
                     false, A + start * hidden, hidden);
      gemm<scalar_t>(false, true, count[e], hidden, width, g + start * width, width, W3 + e * hidden * width, width,
                     false, B + start * hidden, hidden);
    }
    silu_a = at::silu(a);  // PyTorch's vectorized kernel: the reference's values bit for bit
    const scalar_t* S = silu_a.data_ptr<scalar_t>();
    scalar_t* H = h.data_ptr<scalar_t>();
    for (int64_t i = 0; i < slots * hidden; ++i) H[i] = S[i] * B[i];
    const scalar_t* W2 = w2.data_ptr<scalar_t>();
    scalar_t* R = routed.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e)
      gemm<scalar_t>(false, true, count[e], width, hidden, H + start * hidden, hidden, W2 + e * width * hidden, hidden,
                     false, R + start * width, width);
    const scalar_t* w = weights.data_ptr<scalar_t>();
    scalar_t* y = output.data_ptr<scalar_t>();
    for (int64_t slot = 0; slot < slots; ++slot) {
      const scalar_t weight = w[ord[slot]];
      const scalar_t* row = R + slot * width;
      scalar_t* target = y + tok[slot] * width;
      for (int64_t j = 0; j < width; ++j) target[j] += weight * row[j];
    }
  });
  return {output, gathered, a, b, silu_a, h, routed};
}

// Backward of experts_forward: gradients of x [N,d], the gate weights [N,K], w1, w2, w3.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
experts_backward(const at::Tensor& grad_output_in, const at::Tensor& weights_in, const at::Tensor& w1_in,
                 const at::Tensor& w2_in, const at::Tensor& w3_in, const at::Tensor& order_in,
                 const at::Tensor& token_of_slot_in, const at::Tensor& counts_in, const at::Tensor& gathered,
                 const at::Tensor& a, const at::Tensor& b, const at::Tensor& silu_a, const at::Tensor& h,
                 const at::Tensor& routed) {
  const at::Tensor grad_output = grad_output_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous(), w3 = w3_in.contiguous();
  const at::Tensor order = order_in.contiguous(), token_of_slot = token_of_slot_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  const int64_t tokens = grad_output.size(0), width = grad_output.size(1), experts = w1.size(0);
  const int64_t hidden = w1.size(1), slots = order.size(0);
  at::Tensor grad_weights = at::empty_like(weights);
  at::Tensor grad_routed = at::empty({slots, width}, grad_output.options());
  at::Tensor grad_silu = at::empty({slots, hidden}, grad_output.options());
  at::Tensor grad_b = at::empty({slots, hidden}, grad_output.options());
  at::Tensor grad_gathered = at::empty({slots, width}, grad_output.options());
  at::Tensor grad_w1 = at::empty_like(w1), grad_w2 = at::empty_like(w2), grad_w3 = at::empty_like(w3);
  at::Tensor grad_x = at::zeros({tokens, width}, grad_output.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* tok = token_of_slot.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "experts_backward", [&] {
    // The combine: d routed[s] = w_s dy[t_s]; d w_s = dy[t_s] . routed[s] (eight partial sums, as combine_backward).
    const scalar_t* dy = grad_output.data_ptr<scalar_t>();
    const scalar_t* R = routed.data_ptr<scalar_t>();
    const scalar_t* w = weights.data_ptr<scalar_t>();
    scalar_t* dR = grad_routed.data_ptr<scalar_t>();
    scalar_t* dw = grad_weights.data_ptr<scalar_t>();
    for (int64_t slot = 0; slot < slots; ++slot) {
      const scalar_t weight = w[ord[slot]];
      const scalar_t* upstream = dy + tok[slot] * width;
      const scalar_t* row = R + slot * width;
      scalar_t* out = dR + slot * width;
      for (int64_t j = 0; j < width; ++j) out[j] = weight * upstream[j];
      scalar_t partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= width; j += 8) {
        for (int lane = 0; lane < 8; ++lane) partial[lane] += upstream[j + lane] * row[j + lane];
      }
      scalar_t dot = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                     ((partial[4] + partial[5]) + (partial[6] + partial[7]));
      for (; j < width; ++j) dot += upstream[j] * row[j];
      dw[ord[slot]] = dot;
    }
    // W2: d h = d routed W2_e; d W2_e = d routed_e^T h_e.
    const scalar_t* W1 = w1.data_ptr<scalar_t>();
    const scalar_t* W2 = w2.data_ptr<scalar_t>();
    const scalar_t* W3 = w3.data_ptr<scalar_t>();
    const scalar_t* H = h.data_ptr<scalar_t>();
    const scalar_t* G = gathered.data_ptr<scalar_t>();
    scalar_t* dS = grad_silu.data_ptr<scalar_t>();  // holds d h until the product rule below
    scalar_t* dW2 = grad_w2.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
      gemm<scalar_t>(false, false, count[e], hidden, width, dR + start * width, width, W2 + e * width * hidden, hidden,
                     false, dS + start * hidden, hidden);
      gemm<scalar_t>(true, false, width, hidden, count[e], dR + start * width, width, H + start * hidden, hidden,
                     false, dW2 + e * width * hidden, hidden);
    }
    // h = silu(a) * b: d silu(a) = d h * b, d b = d h * silu(a) (single products: the reference's mul, exactly).
    const scalar_t* S = silu_a.data_ptr<scalar_t>();
    const scalar_t* Bv = b.data_ptr<scalar_t>();
    scalar_t* dB = grad_b.data_ptr<scalar_t>();
    for (int64_t i = 0; i < slots * hidden; ++i) {
      const scalar_t dh = dS[i];
      dB[i] = dh * S[i];
      dS[i] = dh * Bv[i];
    }
    const at::Tensor grad_a = at::silu_backward(grad_silu, a);  // PyTorch's kernel, as the reference's backward
    const scalar_t* dA = grad_a.data_ptr<scalar_t>();
    scalar_t* dW1 = grad_w1.data_ptr<scalar_t>();
    scalar_t* dW3 = grad_w3.data_ptr<scalar_t>();
    scalar_t* dG = grad_gathered.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
      gemm<scalar_t>(true, false, hidden, width, count[e], dA + start * hidden, hidden, G + start * width, width,
                     false, dW1 + e * hidden * width, width);
      gemm<scalar_t>(true, false, hidden, width, count[e], dB + start * hidden, hidden, G + start * width, width,
                     false, dW3 + e * hidden * width, width);
      gemm<scalar_t>(false, false, count[e], width, hidden, dA + start * hidden, hidden, W1 + e * hidden * width,
                     width, false, dG + start * width, width);
      gemm<scalar_t>(false, false, count[e], width, hidden, dB + start * hidden, hidden, W3 + e * hidden * width,
                     width, true, dG + start * width, width);
    }
    // The gather's backward: add each slot's row into its token's (slot order, as index_add_).
    scalar_t* dx = grad_x.data_ptr<scalar_t>();
    for (int64_t slot = 0; slot < slots; ++slot) {
      const scalar_t* row = dG + slot * width;
      scalar_t* target = dx + tok[slot] * width;
      for (int64_t j = 0; j < width; ++j) target[j] += row[j];
    }
  });
  return {grad_x, grad_weights, grad_w1, grad_w2, grad_w3};
}

bool use_exported_blas(bool enabled) {
  prefer_exported_blas = enabled;
  return blas_exported();
}

}  // namespace

TORCH_LIBRARY(pilotrun_experts, m) {
  m.def("experts_forward(Tensor x, Tensor weights, Tensor w1, Tensor w2, Tensor w3, Tensor order, "
        "Tensor token_of_slot, Tensor counts) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("experts_backward(Tensor grad_output, Tensor weights, Tensor w1, Tensor w2, Tensor w3, Tensor order, "
        "Tensor token_of_slot, Tensor counts, Tensor gathered, Tensor a, Tensor b, Tensor silu_a, Tensor h, "
        "Tensor routed) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("use_exported_blas(bool enabled) -> bool", use_exported_blas);
}

TORCH_LIBRARY_IMPL(pilotrun_experts, CPU, m) {
  m.impl("experts_forward", experts_forward);
  m.impl("experts_backward", experts_backward);
}
