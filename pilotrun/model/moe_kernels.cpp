// The MoE layer's CPU kernels, loaded by pilotrun/model/cpu_kernels.py, which keeps moe.py's reference PyTorch
// path for every case they do not cover. On a CPU every small operator, and every autograd node, costs ~5-20 us
// whatever its size (more when the work before it has evicted their code and data from the caches), so at pilot
// microbatches the reference path's ~100 operators per layer cost as much as the expert matmuls (BENCHMARKS.md,
// bench_model). Same definitions as moe.py / balancing.py:
// - routing (namespace pilotrun_routing): one pass over the router scores does the biased top-k, gate
//   normalization, sequence-wise balance term, router statistics and the stable sort of (token, slot) pairs by
//   expert; one pass computes the logits' gradient. The gate-weighted combine, one pass each way. `router`, what
//   the layer runs, puts the router's matmul in front, records the step's statistics and scales the balance loss,
//   with its backward as an autograd node in C++.
// - experts (namespace pilotrun_experts): `experts` is the grouped dispatch's routed experts and the layer's
//   shared experts as one operator each way: gather in expert order, each expert's SwiGLU as three BLAS calls on
//   its segment, the shared SwiGLU on all tokens, the combine; and the backward of all of it as an autograd node in
//   C++, without the ~30 autograd nodes, grouped_mm's per-segment views and dispatcher calls, and the adds of the
//   input gradients of the PyTorch path. The activation is PyTorch's own vectorized silu and silu_backward, so
//   elementwise results equal the reference's bit for bit; the matmuls call the BLAS that torch's own CPU matmul
//   calls (MKL's sgemm_/dgemm_) where torch exports it, else at::mm on views.
// One file of ~850 lines, over this project's ~500-line module size: it is one compiled library (one build, one
// load, one pair of op namespaces), and its forward and backward kernels share the same layout helpers.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
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

  // log(max(s, 1e-30)) for the entropy statistic, by PyTorch's vectorized log over all N*E scores at once: a
  // scalar log per score cost more than the rest of this pass.
  at::Tensor log_scores = at::clamp_min(scores, 1e-30).log_();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "route_forward", [&] {
    const scalar_t* z = logits.data_ptr<scalar_t>();
    const scalar_t* s = scores.data_ptr<scalar_t>();
    const scalar_t* log_s = log_scores.data_ptr<scalar_t>();
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
    // Eight running maxima: one would chain every comparison on the previous one. NaN never wins a comparison
    // here, so the result is the single running maximum's.
    scalar_t lane_max[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= tokens * experts; i += 8)
      for (int lane = 0; lane < 8; ++lane) lane_max[lane] = std::max(lane_max[lane], std::abs(z[i + lane]));
    for (; i < tokens * experts; ++i) lane_max[0] = std::max(lane_max[0], std::abs(z[i]));
    scalar_t absmax = 0;
    for (int lane = 0; lane < 8; ++lane) absmax = std::max(absmax, lane_max[lane]);
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
      // route_margin (a routing diagnostic): how far the K-th choice stands above the best expert left out.
      if (top_k < experts) {
        const int64_t next_best = best_untaken(choice.data(), taken.data(), experts);
        margin_sum += double(choice[idx[t * top_k + top_k - 1]] - choice[next_best]);
      }
      // bias_flip_rate (a routing diagnostic): does the top-k of the unbiased scores pick another set of experts?
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
      // Statistics: entropy of s' = s / row (s normalized over experts; softmax rows already sum to 1), as
      // -sum s' log s' = log(row) - sum s log s / row, so that only the scores' logs are needed (the clamp at 1e-30
      // moves from s' to s: both only touch terms of ~1e-28 or less); the population std of s over experts, the
      // selected mass; and P's sums for the balance term.
      const scalar_t inverse_row = sigmoid ? scalar_t(1) / row : scalar_t(1);
      const scalar_t mean = row / scalar_t(experts);
      const scalar_t* log_st = log_s + t * experts;
      scalar_t weighted_log = 0, spread = 0;
      scalar_t* group_probability = probability.data() + group * experts;
      for (int64_t e = 0; e < experts; ++e) {
        weighted_log += st[e] * log_st[e];
        spread += (st[e] - mean) * (st[e] - mean);
        group_probability[e] += st[e] * inverse_row;
      }
      entropy_sum += sigmoid ? double(std::log(row)) - double(weighted_log * inverse_row) : -double(weighted_log);
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
  for (int64_t t = 0, slot = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k, ++slot) {
      const int64_t position = next[idx[slot]]++;
      ord[position] = slot;
      tok[position] = t;
    }
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

// ---- Matrix products ----

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

// ---- Router ----
// What the layer runs: the router's matmul and score function, route_forward, the recording of the step's
// statistics and the scaled balance loss in one operator, and their backward (route_backward, then two BLAS calls
// for the gradients of x and the router weight) as its autograd node, in C++. On the CPU each operator and each
// Python autograd node costs microseconds whatever its size, more when the previous work has evicted their code
// from the caches, so a routing made of one node beats the reference's linear, transpose, routing, loss scaling
// and ~8 statistics updates.

struct RouterOutputs {
  at::Tensor logits, scores, weights, balance, aux, indices, order, token_of_slot, counts, fraction, row_sums, sums;
};

// x [N,d] and the router weight [E,d] (one dtype, fp32 or fp64) -> logits = x W^T [N,E] (the BLAS call torch's
// own CPU linear makes, so the reference's logits bit for bit), their scores (PyTorch's sigmoid or softmax
// kernel), route_forward's outputs, the balance value as a 0-dim tensor and aux = balance_weight * balance (the
// balance loss; zeros, not 0 * balance, when the weight is 0).
RouterOutputs router_compute(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& bias, int64_t top_k,
                             bool sigmoid, bool route_norm, double route_scale, int64_t groups,
                             double balance_weight) {
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.device().is_cpu() && weight.size(1) == x.size(1) &&
                  x.scalar_type() == weight.scalar_type(),
              "router: CPU x [N,d] and router weight [E,d] of one dtype expected");
  const int64_t tokens = x.size(0), width = x.size(1), experts = weight.size(0);
  RouterOutputs r;
  r.logits = at::empty({tokens, experts}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "router", [&] {
    gemm<scalar_t>(false, true, tokens, experts, width, x.data_ptr<scalar_t>(), width, weight.data_ptr<scalar_t>(),
                   width, false, r.logits.data_ptr<scalar_t>(), experts);
  });
  r.scores = sigmoid ? at::sigmoid(r.logits) : at::softmax(r.logits, -1);
  std::tie(r.indices, r.weights, r.order, r.token_of_slot, r.counts, r.fraction, r.row_sums, r.sums) =
      route_forward(r.logits, r.scores, bias, top_k, sigmoid, route_norm, route_scale, groups);
  r.balance = at::empty({}, x.options());
  r.aux = at::empty({}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "router", [&] {
    const scalar_t balance = r.sums.data_ptr<scalar_t>()[4];  // ROUTER_STATISTICS order (moe.py)
    r.balance.data_ptr<scalar_t>()[0] = balance;
    r.aux.data_ptr<scalar_t>()[0] = balance_weight == 0 ? scalar_t(0) : scalar_t(balance_weight) * balance;
  });
  return r;
}

// MoE.record_statistics for a routing of this operator: the step's buffers (fp32, or fp64 in a model cast to fp64)
// tokens_per_expert [E] += counts, router_statistics [8] += sums[:8], router_logit_absmax = max(itself, sums[8]
// rounded to fp32) (NaN if either is NaN, as torch.maximum).
void record_statistics(const at::Tensor& counts, const at::Tensor& sums, at::Tensor& tokens_per_expert,
                       at::Tensor& router_statistics, at::Tensor& router_logit_absmax) {
  const auto dtype = tokens_per_expert.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kDouble) && router_statistics.scalar_type() == dtype &&
                  router_logit_absmax.scalar_type() == dtype && tokens_per_expert.is_contiguous() &&
                  router_statistics.is_contiguous() && tokens_per_expert.numel() == counts.numel() &&
                  router_statistics.numel() == sums.numel() - 1 && router_logit_absmax.numel() == 1,
              "router: the statistics buffers must be contiguous [E], [8] and [] of one floating dtype");
  AT_DISPATCH_FLOATING_TYPES(dtype, "record_statistics", [&] {
    using buffer_t = scalar_t;
    buffer_t* per_expert = tokens_per_expert.data_ptr<buffer_t>();
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0; e < counts.numel(); ++e) per_expert[e] += buffer_t(count[e]);
    buffer_t* statistics = router_statistics.data_ptr<buffer_t>();
    buffer_t* absmax = router_logit_absmax.data_ptr<buffer_t>();
    AT_DISPATCH_FLOATING_TYPES(sums.scalar_type(), "record_statistics", [&] {
      const scalar_t* sum = sums.data_ptr<scalar_t>();
      for (int64_t i = 0; i + 1 < sums.numel(); ++i) statistics[i] += buffer_t(sum[i]);
      const buffer_t latest = buffer_t(float(sum[sums.numel() - 1]));
      *absmax = std::isnan(*absmax) || std::isnan(latest) ? std::numeric_limits<buffer_t>::quiet_NaN()
                                                          : std::max(*absmax, latest);
    });
  });
}

class RouterFunction : public torch::autograd::Function<RouterFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                                                bool sigmoid, bool route_norm, double route_scale, int64_t groups,
                                                double balance_weight) {
    const RouterOutputs r =
        router_compute(x, weight, bias, top_k, sigmoid, route_norm, route_scale, groups, balance_weight);
    ctx->save_for_backward({x, weight, r.scores, r.indices, r.weights, r.fraction, r.row_sums});
    ctx->saved_data["sigmoid"] = sigmoid;
    ctx->saved_data["route_norm"] = route_norm;
    ctx->saved_data["route_scale"] = route_scale;
    ctx->saved_data["balance_weight"] = balance_weight;
    ctx->set_materialize_grads(false);  // an unused output (the logits without a z-loss) sends no gradient
    ctx->mark_non_differentiable({r.indices, r.order, r.token_of_slot, r.counts, r.sums});
    return {r.logits, r.weights, r.balance, r.aux, r.indices, r.order, r.token_of_slot, r.counts, r.sums};
  }

  // Gradients of x and the router weight from those of the logits (the z-loss's), the gate weights, the balance
  // value and the balance loss; an output that the loss does not reach sends none.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &scores = saved[2], &weights = saved[4];
    const double balance_weight = ctx->saved_data["balance_weight"].toDouble();
    const at::Tensor grad_weights = grads[1].defined() ? grads[1] : at::zeros_like(weights);
    at::Tensor grad_balance = grads[2].defined() ? grads[2].clone() : at::zeros({}, scores.options());
    if (grads[3].defined()) grad_balance.add_(grads[3], balance_weight);
    at::Tensor grad = route_backward(grad_weights, grad_balance, scores, saved[3], weights, saved[5], saved[6],
                                     ctx->saved_data["sigmoid"].toBool(), ctx->saved_data["route_norm"].toBool(),
                                     ctx->saved_data["route_scale"].toDouble());
    if (grads[0].defined()) grad.add_(grads[0]);
    const int64_t tokens = x.size(0), width = x.size(1), experts = weight.size(0);
    at::Tensor grad_x = at::empty({tokens, width}, x.options()), grad_weight = at::empty({experts, width}, x.options());
    const at::Tensor x_rows = x.contiguous(), weight_rows = weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "router_backward", [&] {
      const scalar_t* g = grad.data_ptr<scalar_t>();
      gemm<scalar_t>(false, false, tokens, width, experts, g, experts, weight_rows.data_ptr<scalar_t>(), width,
                     false, grad_x.data_ptr<scalar_t>(), width);
      gemm<scalar_t>(true, false, experts, width, tokens, g, experts, x_rows.data_ptr<scalar_t>(), width, false,
                     grad_weight.data_ptr<scalar_t>(), width);
    });
    return {grad_x, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

using RouterResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                at::Tensor, at::Tensor>;

// The router operator (schema below) where autograd records: RouterFunction, then the statistics when `record`.
RouterResult router_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                             bool sigmoid, bool route_norm, double route_scale, int64_t groups, double balance_weight,
                             bool record, at::Tensor& tokens_per_expert, at::Tensor& router_statistics,
                             at::Tensor& router_logit_absmax) {
  const auto o = RouterFunction::apply(x, weight, bias, top_k, sigmoid, route_norm, route_scale, groups,
                                       balance_weight);
  if (record) record_statistics(o[7], o[8], tokens_per_expert, router_statistics, router_logit_absmax);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8]};
}

// The same without autograd (inference mode, where the dispatcher skips the autograd kernel).
RouterResult router_inference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                              bool sigmoid, bool route_norm, double route_scale, int64_t groups,
                              double balance_weight, bool record, at::Tensor& tokens_per_expert,
                              at::Tensor& router_statistics, at::Tensor& router_logit_absmax) {
  const RouterOutputs r =
      router_compute(x, weight, bias, top_k, sigmoid, route_norm, route_scale, groups, balance_weight);
  if (record) record_statistics(r.counts, r.sums, tokens_per_expert, router_statistics, router_logit_absmax);
  return {r.logits, r.weights, r.balance, r.aux, r.indices, r.order, r.token_of_slot, r.counts, r.sums};
}

// ---- Experts ----

// The shared experts' SwiGLU (w1, w3 [Fs,d], w2 [d,Fs]; all three empty when the layer has none) runs inside the
// same operator as the routed experts: it needs no gather (its matmuls take all N tokens as they are), its output
// is added in the combine, and its input gradient is accumulated by the BLAS into the one gradient of x, which
// saves the PyTorch path's separate SwiGLU nodes, the add of the two FFN outputs and the adds of their input
// gradients. Its activations follow the routed ones in the same buffers (routed [S*F] first, then shared [N*Fs]),
// so that one elementwise pass covers both.
struct SharedExperts {
  const at::Tensor w1, w2, w3;
  int64_t hidden;  // Fs; 0 = no shared experts
  SharedExperts(const at::Tensor& w1_in, const at::Tensor& w2_in, const at::Tensor& w3_in, const at::Tensor& x)
      : w1(w1_in.contiguous()), w2(w2_in.contiguous()), w3(w3_in.contiguous()),
        hidden(w1_in.numel() > 0 ? w1_in.size(0) : 0) {
    if (hidden == 0) return;
    TORCH_CHECK(w1.dim() == 2 && w1.size(1) == x.size(1) && w3.sizes() == w1.sizes() && w2.dim() == 2 &&
                    w2.size(0) == x.size(1) && w2.size(1) == hidden,
                "experts: shared expert weights must be w1, w3 [Fs,d] and w2 [d,Fs]");
    TORCH_CHECK(w1.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type() &&
                    w3.scalar_type() == x.scalar_type(),
                "experts: the shared expert weights must have x's dtype");
  }
};

// out[t] = (sum over t's slots, in sorted order, of w_s * routed[s]) + shared[t] for every token t, with shared[t]
// the row already in out (none: 0 is added). The same sums, in the same order, as add_weighted_rows into zeros and
// then the add of the shared experts' output: the PyTorch path's index_add_ and `routed + shared`, bit for bit,
// but in one pass over the output and without its zero fill. position [S] is order's inverse (the sorted place of
// each flat slot); a token's slots go to distinct experts, so sorting their places gives index_add_'s order.
template <typename scalar_t>
void combine_per_token(const scalar_t* routed, const scalar_t* w, const int64_t* position, int64_t tokens,
                       int64_t top_k, int64_t width, bool add_shared, scalar_t* out) {
  std::vector<std::pair<int64_t, scalar_t>> places(top_k);  // (sorted place, gate weight) of the token's slots
  std::vector<scalar_t> sum(width);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {  // insertion sort by place (K is small)
      const std::pair<int64_t, scalar_t> slot(position[t * top_k + k], w[t * top_k + k]);
      int64_t i = k;
      for (; i > 0 && places[i - 1].first > slot.first; --i) places[i] = places[i - 1];
      places[i] = slot;
    }
    std::fill(sum.begin(), sum.end(), scalar_t(0));
    for (int64_t k = 0; k < top_k; ++k) {
      const scalar_t weight = places[k].second;
      const scalar_t* row = routed + places[k].first * width;
      for (int64_t j = 0; j < width; ++j) sum[j] += weight * row[j];
    }
    scalar_t* target = out + t * width;
    if (add_shared) for (int64_t j = 0; j < width; ++j) target[j] = sum[j] + target[j];
    else std::memcpy(target, sum.data(), sizeof(scalar_t) * width);
  }
}

// Forward. x [N,d], gate weights [N,K] (same dtype), w1, w3 [E,F,d], w2 [E,d,F], the sorted layout (order and
// token_of_slot [S=N*K] int64, counts [E] int64), the shared experts' w1, w3 [Fs,d], w2 [d,Fs] (empty: none).
// Returns the layer's FFN output [N,d] (routed combine + shared) and what the backward reads: gathered [S,d]; the
// flat activations a = x W1^T, b = x W3^T, silu(a), h = silu(a) * b, each [S*F + N*Fs] (routed, then shared); and
// routed [S,d] (each slot's expert output before its gate weight).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
experts_forward(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& w1_in,
                const at::Tensor& w2_in, const at::Tensor& w3_in, const at::Tensor& order_in,
                const at::Tensor& token_of_slot_in, const at::Tensor& counts_in, const at::Tensor& shared_w1,
                const at::Tensor& shared_w2, const at::Tensor& shared_w3) {
  const at::Tensor x = x_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous(), w3 = w3_in.contiguous();
  const at::Tensor order = order_in.contiguous(), token_of_slot = token_of_slot_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && x.device().is_cpu(), "experts_forward: CPU x [N,d], w1 [E,F,d]");
  TORCH_CHECK(x.scalar_type() == weights.scalar_type() && x.scalar_type() == w1.scalar_type() &&
              w1.scalar_type() == w2.scalar_type() && w1.scalar_type() == w3.scalar_type(),
              "experts_forward: x, gate weights and expert weights must share one dtype");
  const int64_t tokens = x.size(0), width = x.size(1), experts = w1.size(0), hidden = w1.size(1);
  const int64_t slots = order.size(0), top_k = weights.size(1);
  TORCH_CHECK(w1.size(2) == width && w3.sizes() == w1.sizes() && w2.size(0) == experts && w2.size(1) == width &&
              w2.size(2) == hidden && counts.size(0) == experts && slots == tokens * top_k,
              "experts_forward: weight shapes disagree");
  const SharedExperts shared(shared_w1, shared_w2, shared_w3, x);
  const int64_t routed_size = slots * hidden, shared_size = tokens * shared.hidden;
  at::Tensor gathered = at::empty({slots, width}, x.options());
  at::Tensor a = at::empty({routed_size + shared_size}, x.options());
  at::Tensor b = at::empty({routed_size + shared_size}, x.options());
  at::Tensor silu_a = at::empty({routed_size + shared_size}, x.options());
  at::Tensor h = at::empty({routed_size + shared_size}, x.options());
  at::Tensor routed = at::empty({slots, width}, x.options());
  at::Tensor output = at::empty({tokens, width}, x.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* tok = token_of_slot.data_ptr<int64_t>();
  std::vector<int64_t> position(slots);
  for (int64_t place = 0; place < slots; ++place) position[ord[place]] = place;
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
    const int64_t Fs = shared.hidden;
    if (Fs > 0) {
      gemm<scalar_t>(false, true, tokens, Fs, width, xs, width, shared.w1.data_ptr<scalar_t>(), width, false,
                     A + routed_size, Fs);
      gemm<scalar_t>(false, true, tokens, Fs, width, xs, width, shared.w3.data_ptr<scalar_t>(), width, false,
                     B + routed_size, Fs);
    }
    // PyTorch's vectorized kernel: the reference's values bit for bit. One call per part, as the reference makes
    // them: which elements the vector loop leaves to its scalar tail depends on the length of the call.
    at::Tensor routed_silu = silu_a.narrow(0, 0, routed_size);
    at::Tensor shared_silu = silu_a.narrow(0, routed_size, shared_size);
    at::silu_out(routed_silu, a.narrow(0, 0, routed_size));
    if (Fs > 0) at::silu_out(shared_silu, a.narrow(0, routed_size, shared_size));
    const scalar_t* S = silu_a.data_ptr<scalar_t>();
    scalar_t* H = h.data_ptr<scalar_t>();
    for (int64_t i = 0; i < routed_size + shared_size; ++i) H[i] = S[i] * B[i];
    const scalar_t* W2 = w2.data_ptr<scalar_t>();
    scalar_t* R = routed.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e)
      gemm<scalar_t>(false, true, count[e], width, hidden, H + start * hidden, hidden, W2 + e * width * hidden, hidden,
                     false, R + start * width, width);
    scalar_t* out = output.data_ptr<scalar_t>();
    if (Fs > 0)  // the shared experts' output goes first into the output rows, the combine adds the routed sums
      gemm<scalar_t>(false, true, tokens, width, Fs, H + routed_size, Fs, shared.w2.data_ptr<scalar_t>(), Fs, false,
                     out, width);
    combine_per_token(R, weights.data_ptr<scalar_t>(), position.data(), tokens, top_k, width, Fs > 0, out);
  });
  return {output, gathered, a, b, silu_a, h, routed};
}

// Backward of experts_forward: gradients of x [N,d], the gate weights [N,K], w1, w2, w3 and the shared experts'
// w1, w2, w3 (empty when there are none). Temporaries are reused once their values are spent: the gradient of
// silu(a) becomes that of a in place, and the buffer of the routed outputs' gradient takes the gathered rows'.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
experts_backward(const at::Tensor& grad_output_in, const at::Tensor& x_in, const at::Tensor& weights_in,
                 const at::Tensor& w1_in, const at::Tensor& w2_in, const at::Tensor& w3_in,
                 const at::Tensor& order_in, const at::Tensor& token_of_slot_in, const at::Tensor& counts_in,
                 const at::Tensor& shared_w1, const at::Tensor& shared_w2, const at::Tensor& shared_w3,
                 const at::Tensor& gathered, const at::Tensor& a, const at::Tensor& b, const at::Tensor& silu_a,
                 const at::Tensor& h, const at::Tensor& routed) {
  const at::Tensor grad_output = grad_output_in.contiguous(), x = x_in.contiguous();
  const at::Tensor weights = weights_in.contiguous();
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous(), w3 = w3_in.contiguous();
  const at::Tensor order = order_in.contiguous(), token_of_slot = token_of_slot_in.contiguous();
  const at::Tensor counts = counts_in.contiguous();
  const SharedExperts shared(shared_w1, shared_w2, shared_w3, x);
  const int64_t tokens = grad_output.size(0), width = grad_output.size(1), experts = w1.size(0);
  const int64_t hidden = w1.size(1), slots = order.size(0), Fs = shared.hidden;
  const int64_t routed_size = slots * hidden, shared_size = tokens * Fs;
  at::Tensor grad_weights = at::empty_like(weights);
  at::Tensor grad_rows = at::empty({slots, width}, grad_output.options());  // d routed, later d gathered
  at::Tensor grad_silu = at::empty({routed_size + shared_size}, grad_output.options());  // d h, d silu(a), d a
  at::Tensor grad_b = at::empty({routed_size + shared_size}, grad_output.options());
  at::Tensor grad_w1 = at::empty_like(w1), grad_w2 = at::empty_like(w2), grad_w3 = at::empty_like(w3);
  at::Tensor grad_shared_w1 = at::empty_like(shared.w1), grad_shared_w2 = at::empty_like(shared.w2);
  at::Tensor grad_shared_w3 = at::empty_like(shared.w3);
  // Without shared experts nothing writes x's gradient before the gather's backward adds into it.
  at::Tensor grad_x = Fs > 0 ? at::empty({tokens, width}, grad_output.options())
                             : at::zeros({tokens, width}, grad_output.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* tok = token_of_slot.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "experts_backward", [&] {
    const scalar_t* dy = grad_output.data_ptr<scalar_t>();
    const scalar_t* W1 = w1.data_ptr<scalar_t>();
    const scalar_t* W2 = w2.data_ptr<scalar_t>();
    const scalar_t* W3 = w3.data_ptr<scalar_t>();
    const scalar_t* H = h.data_ptr<scalar_t>();
    const scalar_t* G = gathered.data_ptr<scalar_t>();
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* dS = grad_silu.data_ptr<scalar_t>();  // holds d h until the product rule below
    // The combine: d routed[s] = w_s dy[t_s]; d w_s = dy[t_s] . routed[s].
    scalar_t* dR = grad_rows.data_ptr<scalar_t>();
    weighted_rows_backward(dy, routed.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(), ord, tok, slots, width,
                           dR, grad_weights.data_ptr<scalar_t>());
    // W2: d h = d routed W2_e; d W2_e = d routed_e^T h_e. The shared experts' output gradient is dy itself.
    scalar_t* dW2 = grad_w2.data_ptr<scalar_t>();
    for (int64_t e = 0, start = 0; e < experts; start += count[e], ++e) {
      gemm<scalar_t>(false, false, count[e], hidden, width, dR + start * width, width, W2 + e * width * hidden, hidden,
                     false, dS + start * hidden, hidden);
      gemm<scalar_t>(true, false, width, hidden, count[e], dR + start * width, width, H + start * hidden, hidden,
                     false, dW2 + e * width * hidden, hidden);
    }
    if (Fs > 0) {
      gemm<scalar_t>(false, false, tokens, Fs, width, dy, width, shared.w2.data_ptr<scalar_t>(), Fs, false,
                     dS + routed_size, Fs);
      gemm<scalar_t>(true, false, width, Fs, tokens, dy, width, H + routed_size, Fs, false,
                     grad_shared_w2.data_ptr<scalar_t>(), Fs);
    }
    // h = silu(a) * b: d silu(a) = d h * b, d b = d h * silu(a) (single products: the reference's mul, exactly).
    const scalar_t* S = silu_a.data_ptr<scalar_t>();
    const scalar_t* Bv = b.data_ptr<scalar_t>();
    scalar_t* dB = grad_b.data_ptr<scalar_t>();
    for (int64_t i = 0; i < routed_size + shared_size; ++i) {
      const scalar_t dh = dS[i];
      dB[i] = dh * S[i];
      dS[i] = dh * Bv[i];
    }
    at::silu_backward_out(grad_silu, grad_silu, a);  // PyTorch's kernel, as the reference's backward; now d a
    const scalar_t* dA = dS;
    scalar_t* dW1 = grad_w1.data_ptr<scalar_t>();
    scalar_t* dW3 = grad_w3.data_ptr<scalar_t>();
    scalar_t* dG = dR;  // d routed is spent: the gathered rows' gradient takes its buffer
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
    scalar_t* dx = grad_x.data_ptr<scalar_t>();
    if (Fs > 0) {
      gemm<scalar_t>(true, false, Fs, width, tokens, dA + routed_size, Fs, xs, width, false,
                     grad_shared_w1.data_ptr<scalar_t>(), width);
      gemm<scalar_t>(true, false, Fs, width, tokens, dB + routed_size, Fs, xs, width, false,
                     grad_shared_w3.data_ptr<scalar_t>(), width);
      gemm<scalar_t>(false, false, tokens, width, Fs, dA + routed_size, Fs, shared.w1.data_ptr<scalar_t>(), width,
                     false, dx, width);
      gemm<scalar_t>(false, false, tokens, width, Fs, dB + routed_size, Fs, shared.w3.data_ptr<scalar_t>(), width,
                     true, dx, width);
    }
    // The gather's backward: add each slot's row into its token's (slot order, as index_add_).
    for (int64_t slot = 0; slot < slots; ++slot) {
      const scalar_t* row = dG + slot * width;
      scalar_t* target = dx + tok[slot] * width;
      for (int64_t j = 0; j < width; ++j) target[j] += row[j];
    }
  });
  return {grad_x, grad_weights, grad_w1, grad_w2, grad_w3, grad_shared_w1, grad_shared_w2, grad_shared_w3};
}

// The experts operator (schema below): experts_forward, with experts_backward as its autograd node in C++, so that
// neither direction goes through Python.
class ExpertsFunction : public torch::autograd::Function<ExpertsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weights,
                            const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3, const at::Tensor& order,
                            const at::Tensor& token_of_slot, const at::Tensor& counts, const at::Tensor& shared_w1,
                            const at::Tensor& shared_w2, const at::Tensor& shared_w3) {
    auto [output, gathered, a, b, silu_a, h, routed] =
        experts_forward(x, weights, w1, w2, w3, order, token_of_slot, counts, shared_w1, shared_w2, shared_w3);
    ctx->save_for_backward({x, weights, w1, w2, w3, order, token_of_slot, counts, shared_w1, shared_w2, shared_w3,
                            gathered, a, b, silu_a, h, routed});
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_x, grad_weights, grad_w1, grad_w2, grad_w3, grad_shared_w1, grad_shared_w2, grad_shared_w3] =
        experts_backward(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12],
                         s[13], s[14], s[15], s[16]);
    const bool shared = s[8].numel() > 0;  // without shared experts their (empty) weights take no gradient
    return {grad_x, grad_weights, grad_w1, grad_w2, grad_w3, at::Tensor(), at::Tensor(), at::Tensor(),
            shared ? grad_shared_w1 : at::Tensor(), shared ? grad_shared_w2 : at::Tensor(),
            shared ? grad_shared_w3 : at::Tensor()};
  }
};

at::Tensor experts_autograd(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& w3, const at::Tensor& order, const at::Tensor& token_of_slot,
                            const at::Tensor& counts, const at::Tensor& shared_w1, const at::Tensor& shared_w2,
                            const at::Tensor& shared_w3) {
  return ExpertsFunction::apply(x, weights, w1, w2, w3, order, token_of_slot, counts, shared_w1, shared_w2,
                                shared_w3);
}

// The same without autograd (inference mode): the forward's output alone.
at::Tensor experts_inference(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& w1,
                             const at::Tensor& w2, const at::Tensor& w3, const at::Tensor& order,
                             const at::Tensor& token_of_slot, const at::Tensor& counts, const at::Tensor& shared_w1,
                             const at::Tensor& shared_w2, const at::Tensor& shared_w3) {
  return std::get<0>(
      experts_forward(x, weights, w1, w2, w3, order, token_of_slot, counts, shared_w1, shared_w2, shared_w3));
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
  // -> (logits, gate weights, balance value, balance loss, indices, order, token_of_slot, counts, sums)
  m.def("router(Tensor x, Tensor weight, Tensor bias, int top_k, bool sigmoid, bool route_norm, float route_scale, "
        "int groups, float balance_weight, bool record, Tensor(a!) tokens_per_expert, Tensor(b!) router_statistics, "
        "Tensor(c!) router_logit_absmax) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pilotrun_routing, CPU, m) {
  m.impl("route_forward", route_forward);
  m.impl("route_backward", route_backward);
  m.impl("combine_forward", combine_forward);
  m.impl("combine_backward", combine_backward);
  m.impl("router", router_inference);
}

TORCH_LIBRARY_IMPL(pilotrun_routing, Autograd, m) { m.impl("router", router_autograd); }

TORCH_LIBRARY(pilotrun_experts, m) {
  m.def("experts(Tensor x, Tensor weights, Tensor w1, Tensor w2, Tensor w3, Tensor order, Tensor token_of_slot, "
        "Tensor counts, Tensor shared_w1, Tensor shared_w2, Tensor shared_w3) -> Tensor");
  m.def("use_exported_blas(bool enabled) -> bool", use_exported_blas);
}

TORCH_LIBRARY_IMPL(pilotrun_experts, CPU, m) { m.impl("experts", experts_inference); }

TORCH_LIBRARY_IMPL(pilotrun_experts, Autograd, m) { m.impl("experts", experts_autograd); }
