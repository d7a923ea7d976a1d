// The MoE layer's CPU kernels, loaded by pilotrun/model/cpu_kernels.py, which keeps moe.py's reference PyTorch
// path for every case they do not cover. On a CPU every small operator costs ~5-20 us whatever its size, so at
// pilot microbatches the reference path's ~100 operators per layer cost as much as the expert matmuls
// (BENCHMARKS.md, issue 3). Same definitions as moe.py / balancing.py:
// - routing (namespace pilotrun_routing): one pass over the router scores does the biased top-k, gate
//   normalization, sequence-wise balance term, router statistics and the stable sort of (token, slot) pairs by
//   expert; one pass computes the logits' gradient. The gate-weighted combine, one pass each way.
// - experts (namespace pilotrun_experts): the grouped dispatch's routed experts as one operator each way: gather
//   in expert order, each expert's SwiGLU as three BLAS calls on its segment, the combine; and the backward of
//   all of it, without the ~20 autograd nodes, grouped_mm's per-segment views and dispatcher calls, and the add
//   of the two input gradients of the PyTorch path. The activation is PyTorch's own vectorized silu and
//   silu_backward, so elementwise results equal the reference's bit for bit; the matmuls call the BLAS that
//   torch's own CPU matmul calls (MKL's sgemm_/dgemm_) where torch exports it, else at::mm on views.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

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

// The expert with the largest value among those not yet taken: the lower id on an exact tie; a NaN value never
// wins a comparison, so repeated calls still give distinct experts when some values are NaN.
template <typename scalar_t>
int64_t best_untaken(const scalar_t* values, const char* taken, int64_t experts) {
  int64_t best = -1;
  for (int64_t e = 0; e < experts; ++e) {
    if (taken[e]) continue;
    if (best < 0 || values[e] > values[best]) best = e;
  }
  return best;
}

// Inputs: fp32/fp64 router logits [N,E] and their scores (sigmoid or softmax, computed by PyTorch's vectorized
// operator, so that they equal the reference path's bit for bit) of G equal groups of tokens (the sequences, for
// the sequence-wise balance term; G = 1 for the batch-wise one), the aux-free bias [E] (empty: none).
// Outputs: indices [N,K] int64, weights [N,K], order [N*K] int64 (flat slot ids t*K+k sorted by expert, stable),
// token_of_slot [N*K] int64, counts [E] int64, fraction f [G,E], row_sums [N] (the per-token sum the balance
// term normalizes by; 1 for softmax), sums [9]: tokens, entropy sum, score-spread sum, top-k-mass sum, balance
// value (mean over groups of sum_i f_i P_i), route-margin sum (K-th minus (K+1)-th biased choice score; 0 when
// K = E), tokens whose expert set the bias changed, 1 (one microbatch), |logit| max.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
route_forward(const at::Tensor& logits_in, const at::Tensor& scores_in, const at::Tensor& bias_in, int64_t top_k,
              bool sigmoid, bool route_norm, double route_scale, int64_t groups) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.device().is_cpu(), "route_forward: CPU logits [N, E] expected");
  TORCH_CHECK(scores_in.sizes() == logits_in.sizes() && scores_in.scalar_type() == logits_in.scalar_type(),
              "route_forward: scores must match the logits");
  const at::Tensor logits = logits_in.contiguous(), scores = scores_in.contiguous();
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "route_forward: 1 <= top_k <= E");
  TORCH_CHECK(groups >= 1 && tokens % groups == 0, "route_forward: tokens must split into equal groups");
  const bool with_bias = bias_in.numel() > 0;
  const at::Tensor bias = with_bias ? bias_in.to(logits.scalar_type()).contiguous() : bias_in;
  const int64_t per_group = tokens / groups;

  at::Tensor indices = at::empty({tokens, top_k}, logits.options().dtype(at::kLong));
  at::Tensor weights = at::empty({tokens, top_k}, logits.options());
  at::Tensor order = at::empty({tokens * top_k}, logits.options().dtype(at::kLong));
  at::Tensor token_of_slot = at::empty({tokens * top_k}, logits.options().dtype(at::kLong));
  at::Tensor counts = at::zeros({experts}, logits.options().dtype(at::kLong));
  at::Tensor fraction = at::zeros({groups, experts}, logits.options());
  at::Tensor row_sums = at::empty({tokens}, logits.options());
  at::Tensor sums = at::zeros({9}, logits.options());

  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "route_forward", [&] {
    const scalar_t* z = logits.data_ptr<scalar_t>();
    const scalar_t* s = scores.data_ptr<scalar_t>();
    const scalar_t* b = with_bias ? bias.data_ptr<scalar_t>() : nullptr;
    int64_t* idx = indices.data_ptr<int64_t>();
    scalar_t* w = weights.data_ptr<scalar_t>();
    int64_t* count = counts.data_ptr<int64_t>();
    scalar_t* frac = fraction.data_ptr<scalar_t>();
    scalar_t* rows = row_sums.data_ptr<scalar_t>();
    std::vector<scalar_t> probability(groups * experts, 0);  // per group: sum over its tokens of normalized scores
    std::vector<int64_t> group_counts(groups * experts, 0);
    std::vector<scalar_t> choice(experts);
    std::vector<char> taken(experts), unbiased(experts);
    double entropy_sum = 0, spread_sum = 0, mass_sum = 0, margin_sum = 0;
    int64_t flips = 0;
    scalar_t absmax = 0;
    for (int64_t i = 0; i < tokens * experts; ++i) absmax = std::max(absmax, std::abs(z[i]));
    for (int64_t t = 0; t < tokens; ++t) {
      const scalar_t* st = s + t * experts;
      const int64_t group = t / per_group;
      scalar_t row = 0;
      for (int64_t e = 0; e < experts; ++e) {
        row += st[e];
        choice[e] = with_bias ? st[e] + b[e] : st[e];
        taken[e] = 0;
      }
      rows[t] = sigmoid ? row : scalar_t(1);
      // Top-k by repeated arg-max: the largest first, the lower expert id on an exact tie; never one expert twice
      // (a NaN choice never wins a comparison, so NaN logits still give K distinct experts).
      scalar_t selected = 0;
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t best = best_untaken(choice.data(), taken.data(), experts);
        taken[best] = 1;
        idx[t * top_k + k] = best;
        w[t * top_k + k] = st[best];  // gate weights from the UNBIASED scores
        selected += st[best];
        count[best] += 1;
        group_counts[group * experts + best] += 1;
      }
      // Spec 5 route_margin: how far the K-th choice stands above the best expert left out.
      if (top_k < experts) {
        const int64_t next_best = best_untaken(choice.data(), taken.data(), experts);
        margin_sum += double(choice[idx[t * top_k + top_k - 1]] - choice[next_best]);
      }
      // Spec 5 bias_flip_rate: does the top-k of the unbiased scores pick another set of experts?
      if (with_bias) {
        std::fill(unbiased.begin(), unbiased.end(), char(0));
        bool flipped = false;
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t best = best_untaken(st, unbiased.data(), experts);
          unbiased[best] = 1;
          flipped = flipped || !taken[best];
        }
        flips += flipped;
      }
      if (route_norm) {
        const scalar_t denominator = selected + scalar_t(1e-20);
        for (int64_t k = 0; k < top_k; ++k) w[t * top_k + k] = w[t * top_k + k] / denominator;
      }
      for (int64_t k = 0; k < top_k; ++k) w[t * top_k + k] = w[t * top_k + k] * scalar_t(route_scale);
      // Statistics: entropy of s' (s normalized over experts; softmax rows already sum to 1), the population
      // std of s over experts, the selected mass; and P's sums for the balance term.
      const scalar_t inverse_row = sigmoid ? scalar_t(1) / row : scalar_t(1);
      const scalar_t mean = row / scalar_t(experts);
      scalar_t entropy = 0, spread = 0;
      scalar_t* group_probability = probability.data() + group * experts;
      for (int64_t e = 0; e < experts; ++e) {
        const scalar_t normalized = st[e] * inverse_row;
        entropy -= normalized * std::log(std::max(normalized, scalar_t(1e-30)));
        spread += (st[e] - mean) * (st[e] - mean);
        group_probability[e] += normalized;
      }
      entropy_sum += double(entropy);
      spread_sum += std::sqrt(double(spread) / double(experts));
      mass_sum += double(selected);
    }
    // f_i = E / (K T) * tokens choosing i, P_i = mean normalized score; balance value = mean over groups of sum f P.
    double balance = 0;
    for (int64_t g = 0; g < groups; ++g) {
      double term = 0;
      for (int64_t e = 0; e < experts; ++e) {
        const double f = double(group_counts[g * experts + e]) * double(experts) / double(top_k * per_group);
        frac[g * experts + e] = scalar_t(f);
        term += f * double(probability[g * experts + e]) / double(per_group);
      }
      balance += term;
    }
    scalar_t* out = sums.data_ptr<scalar_t>();  // moe.py's ROUTER_STATISTICS order, then the |logit| maximum
    out[0] = scalar_t(tokens);
    out[1] = scalar_t(entropy_sum);
    out[2] = scalar_t(spread_sum);
    out[3] = scalar_t(mass_sum);
    out[4] = scalar_t(balance / double(groups));
    out[5] = scalar_t(margin_sum);
    out[6] = scalar_t(flips);
    out[7] = scalar_t(1);
    out[8] = absmax;
  });

  // Stable counting sort of the flat (token, slot) ids by expert: the same permutation as argsort(stable=True).
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> next(experts, 0);
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + count[e - 1];
  const int64_t* idx = indices.data_ptr<int64_t>();
  int64_t* ord = order.data_ptr<int64_t>();
  int64_t* tok = token_of_slot.data_ptr<int64_t>();
  for (int64_t slot = 0; slot < tokens * top_k; ++slot) {
    const int64_t position = next[idx[slot]]++;
    ord[position] = slot;
    tok[position] = slot / top_k;
  }
  return {indices, weights, order, token_of_slot, counts, fraction, row_sums, sums};
}

// d(loss)/d(logits) from the gradient of the gate weights [N,K] and of the balance value (a scalar tensor; zero
// where the balance term is not part of the loss).
at::Tensor route_backward(const at::Tensor& grad_weights_in, const at::Tensor& grad_balance, const at::Tensor& scores,
                          const at::Tensor& indices, const at::Tensor& weights, const at::Tensor& fraction,
                          const at::Tensor& row_sums, bool sigmoid, bool route_norm, double route_scale) {
  const at::Tensor grad_weights = grad_weights_in.contiguous();
  const int64_t tokens = scores.size(0), experts = scores.size(1), top_k = indices.size(1);
  const int64_t groups = fraction.size(0), per_group = tokens / groups;
  at::Tensor grad_logits = at::empty_like(scores);
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "route_backward", [&] {
    const scalar_t* s = scores.data_ptr<scalar_t>();
    const int64_t* idx = indices.data_ptr<int64_t>();
    const scalar_t* w = weights.data_ptr<scalar_t>();
    const scalar_t* gw = grad_weights.data_ptr<scalar_t>();
    const scalar_t* frac = fraction.data_ptr<scalar_t>();
    const scalar_t* rows = row_sums.data_ptr<scalar_t>();
    const scalar_t balance_grad = grad_balance.item<scalar_t>() / scalar_t(groups * per_group);
    scalar_t* out = grad_logits.data_ptr<scalar_t>();
    std::vector<scalar_t> ds(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      const scalar_t* st = s + t * experts;
      std::fill(ds.begin(), ds.end(), scalar_t(0));
      // Gate weights: w_k = scale * g_k / (sum_j g_j + eps) with g = the selected scores.
      if (route_norm) {
        scalar_t selected = 0, dot = 0;
        for (int64_t k = 0; k < top_k; ++k) selected += st[idx[t * top_k + k]];
        const scalar_t denominator = selected + scalar_t(1e-20);
        for (int64_t k = 0; k < top_k; ++k) dot += gw[t * top_k + k] * w[t * top_k + k];
        for (int64_t k = 0; k < top_k; ++k)
          ds[idx[t * top_k + k]] += (gw[t * top_k + k] * scalar_t(route_scale) - dot) / denominator;
      } else {
        for (int64_t k = 0; k < top_k; ++k) ds[idx[t * top_k + k]] += gw[t * top_k + k] * scalar_t(route_scale);
      }
      // Balance value = mean_g sum_e f_ge * mean_t n_te, n = s / row_sum (sigmoid) or s (softmax).
      if (balance_grad != scalar_t(0)) {
        const scalar_t* f = frac + (t / per_group) * experts;
        if (sigmoid) {
          scalar_t weighted = 0;
          for (int64_t e = 0; e < experts; ++e) weighted += f[e] * st[e];
          const scalar_t row = rows[t];
          for (int64_t e = 0; e < experts; ++e) ds[e] += balance_grad * (f[e] - weighted / row) / row;
        } else {
          for (int64_t e = 0; e < experts; ++e) ds[e] += balance_grad * f[e];
        }
      }
      scalar_t* dz = out + t * experts;
      if (sigmoid) {
        for (int64_t e = 0; e < experts; ++e) dz[e] = ds[e] * st[e] * (scalar_t(1) - st[e]);
      } else {
        scalar_t dot = 0;
        for (int64_t e = 0; e < experts; ++e) dot += ds[e] * st[e];
        for (int64_t e = 0; e < experts; ++e) dz[e] = st[e] * (ds[e] - dot);
      }
    }
  });
  return grad_logits;
}

// y[t] += w_s * routed[s] for every slot s in sorted order, w_s = w[order[s]], t = token_of_slot[s]: the order of
// index_add_, so the sums match the reference path bit for bit.
template <typename scalar_t>
void add_weighted_rows(const scalar_t* routed, const scalar_t* w, const int64_t* ord, const int64_t* tok,
                       int64_t slots, int64_t width, scalar_t* y) {
  for (int64_t slot = 0; slot < slots; ++slot) {
    const scalar_t weight = w[ord[slot]];
    const scalar_t* row = routed + slot * width;
    scalar_t* target = y + tok[slot] * width;
    for (int64_t j = 0; j < width; ++j) target[j] += weight * row[j];
  }
}

// The gradients of add_weighted_rows: d routed[s] = w_s dy[t_s] and d w[order[s]] = dy[t_s] . routed[s].
template <typename scalar_t>
void weighted_rows_backward(const scalar_t* dy, const scalar_t* routed, const scalar_t* w, const int64_t* ord,
                            const int64_t* tok, int64_t slots, int64_t width, scalar_t* d_routed, scalar_t* dw) {
  for (int64_t slot = 0; slot < slots; ++slot) {
    const scalar_t weight = w[ord[slot]];
    const scalar_t* upstream = dy + tok[slot] * width;
    const scalar_t* row = routed + slot * width;
    scalar_t* out = d_routed + slot * width;
    for (int64_t j = 0; j < width; ++j) out[j] = weight * upstream[j];
    // Eight partial sums: a strict left-to-right sum cannot be vectorized (the compiler may not reorder
    // floating-point additions), and this loop is most of the combine's backward.
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
}

// y[t] = sum over t's slots s of w_s * routed[s]: routed [S,d] in expert-sorted order, w_s = weights.flat[order[s]].
at::Tensor combine_forward(const at::Tensor& routed_in, const at::Tensor& weights_in, const at::Tensor& order,
                           const at::Tensor& token_of_slot, int64_t tokens) {
  const at::Tensor routed = routed_in.contiguous(), weights = weights_in.contiguous();
  TORCH_CHECK(routed.scalar_type() == weights.scalar_type(), "combine_forward: routed and weights dtypes differ");
  const int64_t slots = routed.size(0), width = routed.size(1);
  at::Tensor output = at::zeros({tokens, width}, routed.options());
  AT_DISPATCH_FLOATING_TYPES(routed.scalar_type(), "combine_forward", [&] {
    const scalar_t* r = routed.data_ptr<scalar_t>();
    const scalar_t* w = weights.data_ptr<scalar_t>();
    const int64_t* ord = order.data_ptr<int64_t>();
    const int64_t* tok = token_of_slot.data_ptr<int64_t>();
    add_weighted_rows(r, w, ord, tok, slots, width, output.data_ptr<scalar_t>());
  });
  return output;
}

// Gradients of combine_forward: routed [S,d] (w_s * dy[t_s]) and weights [N,K] (dy[t_s] . routed[s]).
std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad_output_in, const at::Tensor& routed_in,
                                                    const at::Tensor& weights_in, const at::Tensor& order,
                                                    const at::Tensor& token_of_slot) {
  const at::Tensor grad_output = grad_output_in.contiguous(), routed = routed_in.contiguous();
  const at::Tensor weights = weights_in.contiguous();
  const int64_t slots = routed.size(0), width = routed.size(1);
  at::Tensor grad_routed = at::empty_like(routed);
  at::Tensor grad_weights = at::empty_like(weights);
  AT_DISPATCH_FLOATING_TYPES(routed.scalar_type(), "combine_backward", [&] {
    const scalar_t* dy = grad_output.data_ptr<scalar_t>();
    const scalar_t* r = routed.data_ptr<scalar_t>();
    const scalar_t* w = weights.data_ptr<scalar_t>();
    const int64_t* ord = order.data_ptr<int64_t>();
    const int64_t* tok = token_of_slot.data_ptr<int64_t>();
    weighted_rows_backward(dy, r, w, ord, tok, slots, width, grad_routed.data_ptr<scalar_t>(),
                           grad_weights.data_ptr<scalar_t>());
  });
  return {grad_routed, grad_weights};
}

// ---- Routed experts ----


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
    add_weighted_rows(R, weights.data_ptr<scalar_t>(), ord, tok, slots, width, output.data_ptr<scalar_t>());
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
    // The combine: d routed[s] = w_s dy[t_s]; d w_s = dy[t_s] . routed[s].
    scalar_t* dR = grad_routed.data_ptr<scalar_t>();
    weighted_rows_backward(grad_output.data_ptr<scalar_t>(), routed.data_ptr<scalar_t>(),
                           weights.data_ptr<scalar_t>(), ord, tok, slots, width, dR,
                           grad_weights.data_ptr<scalar_t>());
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

TORCH_LIBRARY(pilotrun_routing, m) {
  m.def("route_forward(Tensor logits, Tensor scores, Tensor bias, int top_k, bool sigmoid, bool route_norm, "
        "float route_scale, int groups) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("route_backward(Tensor grad_weights, Tensor grad_balance, Tensor scores, Tensor indices, Tensor weights, "
        "Tensor fraction, Tensor row_sums, bool sigmoid, bool route_norm, float route_scale) -> Tensor");
  m.def("combine_forward(Tensor routed, Tensor weights, Tensor order, Tensor token_of_slot, int tokens) -> Tensor");
  m.def("combine_backward(Tensor grad_output, Tensor routed, Tensor weights, Tensor order, Tensor token_of_slot) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pilotrun_routing, CPU, m) {
  m.impl("route_forward", route_forward);
  m.impl("route_backward", route_backward);
  m.impl("combine_forward", combine_forward);
  m.impl("combine_backward", combine_backward);
}

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
