"""One optimizer for the whole model: Muon for hidden matrices, AdamW for everything else.

Muon and AdamW live in ONE `torch.optim.Optimizer` (param groups flagged `use_muon`; docs/MODEL.md,
"The optimizer"), for three reasons: one `scaler.step()` makes one global skip decision
for fp16 overflows (two optimizers would skip independently and desynchronise), one LR schedule sets every
group, and one state dict is checkpointed.

Muon, per matrix W [A, B] (or per expert slice of a stacked [E, A, B] tensor), gradient G:

    M <- mu*M + G                      momentum buffer, fp32
    U <- G + mu*M  (nesterov)  or  M
    O <- NS5(U)                        quintic Newton-Schulz, approximately U_svd V_svd^T
    W <- W*(1 - lr*wd) - lr*s*O        s = 0.2*sqrt(max(A, B)) ("moonlight") or sqrt(max(1, A/B)) ("keller")

The AdamW groups follow torch.optim.AdamW's single-tensor arithmetic operation for operation, so they
agree with it bit for bit (tests/optim/test_muon_adamw.py checks this on the same parameters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pilotrun.config import MUON_NS_VARIANTS, OptimConfig
from pilotrun.optim.polar_express import polar_express_coefficients

# Keller Jordan's quintic coefficients (KJ-muon zeropower_via_newtonschulz5; Moonlight eq. 2): they maximise
# the slope at zero, so small singular values grow fast; the result has singular values in roughly [0.5, 1.3],
# not exactly 1, which is fine for an update direction.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The "hybrid" variant's last iterations (DeepSeek-V4): p(x) = 2x - 1.5x^3 + 0.5x^5 has p(1) = 1 and
# p'(1) = 0, so two of them after the quintic steps pull the singular values onto 1 instead of leaving them in
# about [0.5, 1.3]. Hybrid runs 8 quintic iterations then 2 of these (ns_steps does not apply).
NEWTON_SCHULZ_PINNING_COEFFICIENTS = (2.0, -1.5, 0.5)
NEWTON_SCHULZ_EPS = 1e-7
# One stacked Newton-Schulz chain's working set on the CPU (see chunk_matrices): about two cores' L2 caches
# of 512 KiB, where chunks of 4 matrices of 128 x 128 run fastest (BENCHMARKS.md, bench_optim).
NEWTON_SCHULZ_CPU_CHUNK_BYTES = 1 << 20
NS_DTYPES = ("auto", "float32", "bfloat16")


def newton_schulz_orthogonalize(
    update: torch.Tensor, steps: int = 5, compute_dtype: torch.dtype = torch.float32, variant: str = "quintic"
) -> torch.Tensor:
    """Approximate orthogonalisation of a matrix [A, B] or a batch of matrices [E, A, B].

    Returns a tensor of the input's shape in fp32 (a transposed view for a tall input). Iterates on the short
    side (a tall matrix is transposed first) so the Gram matrix is min(A, B)^2. A zero input gives a zero
    output: the epsilon in the Frobenius normalisation keeps 0/0 away. A batch runs as one batched iteration
    (bmm and baddbmm), which on the CPU measured as fast as one 2-D iteration per matrix or faster
    (bench_optim).
    """
    if update.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz expects a 2-D matrix or a 3-D batch of matrices, got shape "
                         f"{tuple(update.shape)}")
    return newton_schulz_iterate(update, newton_schulz_schedule(steps, variant), compute_dtype).to(
        torch.float32
    )


def newton_schulz_schedule(steps: int, variant: str) -> list[tuple[float, float, float]]:
    """The (a, b, c) coefficients of each iteration: `steps` quintic ones, hybrid's fixed 8 + 2, or the first
    `steps` of polar_express's sequence (polar_express.py)."""
    if variant == "polar_express":
        return list(polar_express_coefficients(steps))
    if variant == "quintic":
        return [NEWTON_SCHULZ_COEFFICIENTS] * steps
    if variant == "hybrid":
        return [NEWTON_SCHULZ_COEFFICIENTS] * 8 + [NEWTON_SCHULZ_PINNING_COEFFICIENTS] * 2
    raise ValueError(f"unknown Newton-Schulz variant '{variant}' (expected one of {MUON_NS_VARIANTS})")


def newton_schulz_iterate(update: torch.Tensor, schedule: list[tuple[float, float, float]],
                          compute_dtype: torch.dtype) -> torch.Tensor:
    """x <- a x + (b G + c G G) x with G = x x^T, per (a, b, c) of the schedule, from the normalised update.

    Each step is three matrix products, two of them fused with their sums (addmm / baddbmm): one rounding per
    product-and-sum instead of separate scale, product and add operators, which is both faster and, in bf16,
    closer to the exact iteration.
    """
    x = update.to(compute_dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        # The short side first, as one contiguous copy, so that NS(G) and NS(G^T)^T run the very same matmuls
        # on the very same memory layout (bit for bit); the result is handed back as a transposed view, no
        # copy.
        x = x.mT.contiguous()
        x.div_(torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NEWTON_SCHULZ_EPS)
    else:
        x = x / (torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NEWTON_SCHULZ_EPS)
    product, multiply_add = (torch.mm, torch.addmm) if x.ndim == 2 else (torch.bmm, torch.baddbmm)
    # Three buffers for the whole iteration (x and `spare` swap each step): the same products as fresh
    # tensors, without an allocation per product, a noticeable share of the small matrices' time.
    gram = x.new_empty((*x.shape[:-1], x.size(-2)))
    polynomial = torch.empty_like(gram)
    spare = torch.empty_like(x)
    for a, b, c in schedule:
        product(x, x.mT, out=gram)
        multiply_add(gram, gram, gram, beta=b, alpha=c, out=polynomial)
        multiply_add(x, polynomial, x, beta=a, out=spare)
        x, spare = spare, x
    return x.mT if tall else x


def muon_update_scale(rows: int, cols: int, scale_mode: str) -> float:
    """The shape-based factor s that multiplies the orthogonalised update.

    "moonlight": 0.2*sqrt(max(A, B)) makes the update RMS about 0.2, like AdamW's, so Muon can reuse
    AdamW's learning rate and weight decay (Moonlight eq. 4, Lemma 1). "keller": sqrt(max(1, A/B)), with the
    learning rate in spectral-norm units (KJ-muon muon_update).
    """
    if scale_mode == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale_mode == "keller":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown Muon scale_mode '{scale_mode}' (expected 'moonlight' or 'keller')")


def resolve_ns_dtype(ns_dtype: str, device: torch.device) -> torch.dtype:
    """"auto": Newton-Schulz in bf16 on CUDA (fast, stable per KJ-muon), fp32 on CPU (bf16 is slow there)."""
    if ns_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if ns_dtype == "float32":
        return torch.float32
    if ns_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(
        f"unknown ns_dtype '{ns_dtype}' (expected one of {NS_DTYPES}); fp16 is never used for NS"
    )


class MuonAdamW(torch.optim.Optimizer):
    """Muon for groups with `use_muon=True`, AdamW for the others; one step(), one state dict.

    Every group carries `lr` and `weight_decay`. Muon groups also carry `momentum`, `nesterov`, `ns_steps`,
    `scale_mode` and `ns_dtype`; AdamW groups carry `betas` and `eps`. Extra keys (`name`, `base_lr`,
    `param_names`) are kept as they are, so a schedule and the run record can read them.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]]):
        defaults = {"lr": 1e-3, "weight_decay": 0.0, "use_muon": False}
        super().__init__(list(param_groups), defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                for key, default in (
                    ("momentum", 0.95),
                    ("nesterov", True),
                    ("ns_steps", 5),
                    ("scale_mode", "moonlight"),
                    ("ns_dtype", "auto"),
                    ("ns_variant", "quintic"),
                ):
                    group.setdefault(key, default)
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"Muon group '{group.get('name', '?')}' holds a tensor of shape "
                            f"{tuple(p.shape)}; Muon takes only 2-D matrices or 3-D expert stacks"
                        )
            else:
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-8)
        self.measure_update_rms = False  # the default of step(measure_update_rms=None)
        self.last_update_rms: dict[str, float] = {}
        self.newton_schulz_ranks: tuple[int, int] | None = None  # see distribute_orthogonalization

    def distribute_orthogonalization(self, rank: int, world_size: int) -> None:
        """Under DDP (every rank holds the same averaged gradients and so the same momentum): let each rank
        run Newton-Schulz for its share of the Muon matrices, balanced by cost, and exchange the results with
        one all_gather per step, instead of every rank orthogonalizing every matrix. The same inputs give the
        same bits on any rank, so the update is the one each rank would have computed alone, bit for bit; only
        the replicated work shrinks. All ranks must call step() together (DDP's applied-update decision is
        global). FSDP2's sharded (DTensor) parameters keep their own path. world_size 1 turns it off."""
        self.newton_schulz_ranks = (rank, world_size) if world_size > 1 else None

    @torch.no_grad()
    def step(self, closure=None, *, measure_update_rms: bool | None = None):  # type: ignore[override]
        """One update of every group. `measure_update_rms`: this step also measures the RMS of each group's
        update direction (decoupled weight decay excluded; the update is lr times it), Muon's scale * O and
        AdamW's m_hat / (sqrt(v_hat) + eps), into `last_update_rms`. None takes the attribute of that name
        (False unless set), since measuring costs a pass over every tensor."""
        if measure_update_rms is None:
            measure_update_rms = self.measure_update_rms
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        measured: dict[str, list] = {}

        def squares_of(group: dict[str, Any]) -> list | None:
            if not measure_update_rms:
                return None
            return measured.setdefault(group.get("name", str(len(measured))), [])

        muon = [(group, p) for group in self.param_groups if group["use_muon"] for p in group["params"]]
        if any(isinstance(p, DTensor) for _, p in muon):
            # FSDP2's row-sharded matrices: one at a time, each gathered whole on every rank; only one
            # direction and one orthogonalized update exist at any moment.
            for group, p in muon:
                orthogonal = self._orthogonalize_one(group, p, self._muon_direction(group, p))
                self._muon_apply(group, p, orthogonal, squares_of(group))
        else:
            self._muon_stacked_step(muon, squares_of)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group, squares_of(group))
        if measure_update_rms:
            self.last_update_rms = {
                name: root_mean_square(squares) for name, squares in measured.items() if squares
            }
        return loss

    def _muon_direction(
        self, group: dict[str, Any], p: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Update the momentum buffer; return the fp32 direction U that Newton-Schulz orthogonalizes (written
        into `out` when given, for Nesterov's direction, the one that is a new tensor)."""
        # A missing gradient counts as zeros (momentum and decay still act), so Muon never
        # silently freezes a matrix the way stock AdamW does for grad=None.
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if len(state) == 0:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buffer = state["momentum_buffer"]
        grad = grad.to(torch.float32)
        torch.add(grad, buffer, alpha=group["momentum"], out=buffer)  # M <- G + mu*M in one pass over memory
        # Never modify p.grad in place (unlike KJ-muon's lerp_ on the gradient): the gradient stays what
        # backward produced for anything that reads it after the step.
        if not group["nesterov"]:
            return buffer
        if out is None:
            return grad.add(buffer, alpha=group["momentum"])
        return torch.add(grad, buffer, alpha=group["momentum"], out=out)

    def _muon_stacked_step(self, muon: list[tuple[dict[str, Any], torch.Tensor]], squares_of) -> None:
        """Muon for plain tensors, batched across parameters. Every matrix Newton-Schulz sees (a whole
        parameter, an expert slice, a head's row block) joins the stack of its short-side-first shape and
        Newton-Schulz settings, whatever its group; the directions are written into the stacks, each stack is
        orthogonalized in chunks of one stacked matmul chain (bmm / baddbmm) each, and the updates are applied
        from it.

        On this CPU a stacked chain gives each matrix the bits its own 2-D chain gives (tests/optim), so the
        update is the per-matrix one; what changes is the number of chains (28 a step at the stability size
        instead of 41, its 85 matrices of 128 x 128 in chunks of 4) and of operator calls, and on a GPU the
        number of kernel launches. Holds every direction at once (one fp32 copy of the Muon weights, as large
        as the momentum buffers). Under DDP with distribute_orthogonalization, each rank orthogonalizes its
        share of the chunks (one all_gather)."""
        stacks: dict[tuple, list[tuple[dict[str, Any], torch.Tensor, int, int, int]]] = {}
        for group, p in muon:
            rows, cols = row_block(group, p) or p.size(-2), p.size(-1)
            key = (min(rows, cols), max(rows, cols), p.device, group["ns_steps"], group["ns_variant"],
                   resolve_ns_dtype(group["ns_dtype"], p.device))
            stacks.setdefault(key, []).append((group, p, p.numel() // (rows * cols), rows, cols))
        sharing = self.newton_schulz_ranks[1] if self.newton_schulz_ranks is not None else 1
        filled, chunks = [], []
        for (short, long, device, steps, variant, ns_dtype), members in stacks.items():
            stack = torch.empty((sum(member[2] for member in members), short, long), dtype=torch.float32,
                                device=device)
            offset = 0
            for group, p, count, rows, cols in members:
                slot = stack[offset:offset + count]
                # tall: short side first, a transposing copy as 2-D NS makes
                if rows > cols or not group["nesterov"]:
                    matrices = self._muon_direction(group, p).reshape(count, rows, cols)
                    slot.copy_(matrices.mT if rows > cols else matrices)
                else:  # already short side first: Nesterov's direction straight into its slot
                    self._muon_direction(group, p, out=slot.view(p.shape))
                offset += count
            filled.append((stack, members))
            chunks += [(chunk, (steps, ns_dtype, variant))
                       for chunk in stack.split(chunk_matrices(stack, ns_dtype, sharing))]
        self._orthogonalize_chunks(chunks)
        for stack, members in filled:
            offset = 0
            for group, p, count, rows, cols in members:
                whole = stack[offset:offset + count]
                self._muon_apply(
                    group, p, (whole.mT if rows > cols else whole).reshape(p.shape), squares_of(group)
                )
                offset += count

    @staticmethod
    def _orthogonalize_one(group: dict[str, Any], p: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """NS5 of one direction: the whole matrix, fp32 (per_head: each head's row block as its own
        matrix)."""
        ns_dtype = resolve_ns_dtype(group["ns_dtype"], direction.device)
        # FSDP2 shards each matrix by rows; NS needs the whole matrix. Every rank gathers it and runs the same
        # NS on the same values (_muon_apply keeps its own rows).
        whole = direction.full_tensor() if isinstance(direction, DTensor) else direction
        block = row_block(group, p)
        matrices = whole.reshape(-1, block, whole.shape[-1]) if block else whole
        orthogonal = newton_schulz_orthogonalize(matrices, group["ns_steps"], ns_dtype, group["ns_variant"])
        return orthogonal.reshape(whole.shape)

    def _orthogonalize_chunks(self, chunks: list[tuple[torch.Tensor, tuple[int, torch.dtype, str]]]) -> None:
        """Newton-Schulz of each stacked chunk (short side first), written back over it. Under DDP with
        distribute_orthogonalization each chunk is computed by one rank (cost-balanced) and shared by one
        all_gather; the same inputs give the same bits on any rank, so every rank ends with the same
        stacks."""
        if self.newton_schulz_ranks is None:
            for chunk, (steps, ns_dtype, variant) in chunks:
                # positional arguments: tests and bench_optim count and time this function by wrapping it
                chunk.copy_(newton_schulz_orthogonalize(chunk, steps, ns_dtype, variant))
            return
        rank, world_size = self.newton_schulz_ranks
        owners = balanced_owners([chunk.numel() * chunk.size(-2) for chunk, _ in chunks], world_size)
        mine = [newton_schulz_orthogonalize(chunk, *settings).flatten()
                for (chunk, settings), owner in zip(chunks, owners, strict=True) if owner == rank]
        sizes = [sum(chunk.numel() for (chunk, _), owner in zip(chunks, owners, strict=True) if owner == r)
                 for r in range(world_size)]
        device = chunks[0][0].device if chunks else torch.device("cpu")
        packed = torch.zeros(max(sizes, default=0), dtype=torch.float32, device=device)
        if mine:
            torch.cat(mine, out=packed[:sizes[rank]])
        gathered = [torch.empty_like(packed) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, packed)
        offsets = [0] * world_size
        for (chunk, _), owner in zip(chunks, owners, strict=True):
            chunk.copy_(gathered[owner][offsets[owner]:offsets[owner] + chunk.numel()].view(chunk.shape))
            offsets[owner] += chunk.numel()

    def _muon_apply(
        self, group: dict[str, Any], p: torch.Tensor, whole: torch.Tensor, squares: list | None
    ) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        # per_head: the scale of one head's block, the matrix Newton-Schulz saw (Moonlight 2.2 warns that
        # per-head matrices get too large updates without the shape-dependent scale)
        scale = muon_update_scale(row_block(group, p) or p.size(-2), p.size(-1), group["scale_mode"])
        orthogonal = whole
        # keep this rank's rows of the whole matrix (src_data_rank=None: no scatter)
        if isinstance(p, DTensor):
            orthogonal = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        if squares is not None:  # the whole matrix on every rank: no collective needed
            squares.append((whole.float().square().sum() * scale**2, whole.numel()))
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)  # decoupled decay with the unadjusted lr (ML-code)
        p.add_(orthogonal.to(p.dtype), alpha=-lr * scale)

    def _adamw_group_step(self, group: dict[str, Any], squares: list | None) -> None:
        # Operation for operation the single-tensor path of torch.optim.AdamW (torch/optim/adam.py,
        # decoupled_weight_decay=True, amsgrad=False), so that the two agree bit for bit, each operation
        # applied to the whole group at once (torch._foreach_*): on the CPU a foreach operation runs the same
        # per-tensor kernel in one C++ loop (no fused kernel exists there), so the bits stay the single-tensor
        # path's and only the per-parameter Python dispatch goes. torch's fused AdamW computes in another
        # order (other bits).
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        params = [p for p in group["params"] if p.grad is not None]  # as torch.optim.AdamW: no gradient, no
        if not params:                                                # update, no decay
            return
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                # `step` as a CPU float tensor, exactly torch's layout, so state dicts look the same
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        step_tensors = [s["step"] for s in states]
        torch._foreach_add_(step_tensors, 1)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # Each parameter's own step count (a parameter without a gradient at some step has fewer).
        steps = [step_tensor.item() for step_tensor in step_tensors]
        bias_corrections1 = [1 - beta1**step for step in steps]
        bias_corrections2 = [1 - beta2**step for step in steps]
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [correction**0.5 for correction in bias_corrections2])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(
            params, exp_avgs, denoms, [-(lr / correction) for correction in bias_corrections1]
        )
        if squares is not None:
            for p, exp_avg, denom, correction in zip(
                params, exp_avgs, denoms, bias_corrections1, strict=True
            ):
                square_sum = (exp_avg / denom).float().square().sum() / correction**2
                if isinstance(square_sum, DTensor):  # a sharded parameter: sum over every rank's shard
                    square_sum = square_sum.full_tensor()
                squares.append((square_sum, p.numel()))


def row_block(group: dict[str, Any], p: torch.Tensor) -> int:
    """Rows per independent matrix of `p` under optim.muon.granularity "per_head" (0: the whole parameter)."""
    blocks = group.get("row_blocks")
    if not blocks:
        return 0
    return next(block for block, q in zip(blocks, group["params"], strict=True) if q is p)


def chunk_matrices(stack: torch.Tensor, compute_dtype: torch.dtype, parts: int = 1) -> int:
    """Matrices per stacked Newton-Schulz chain. On the CPU, as many as keep one chain's working set (the
    iterate, its spare and two Gram-sized buffers) within NEWTON_SCHULZ_CPU_CHUNK_BYTES: one chain over a
    whole stack streams every product through memory and runs slower than one chain per matrix, while chunks
    that fit run faster than either (BENCHMARKS.md, bench_optim). Elsewhere the whole stack (one launch per
    product), cut into `parts` when DDP ranks share the chunks out."""
    count, short, long = stack.shape
    if stack.device.type == "cpu":
        working_set = compute_dtype.itemsize * (2 * short * long + 2 * short * short)
        return max(1, min(count, NEWTON_SCHULZ_CPU_CHUNK_BYTES // working_set))
    return max(1, -(-count // parts))


def balanced_owners(costs: list[int], world_size: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest cost first, each to the least-loaded rank so far
    (ties to the lower rank). A pure function of the costs, so every rank computes the same assignment."""
    loads = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
    return owners


def root_mean_square(squares: list[tuple[torch.Tensor, int]]) -> float:
    """sqrt(sum of squares / element count) over a group's (square sum, numel) pairs: one host sync per
    group."""
    total = torch.stack([square_sum.to(torch.float64).cpu() for square_sum, _ in squares]).sum()
    return math.sqrt(float(total) / sum(count for _, count in squares))


def parameter_rms(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The `weight_rms` diagnostic per group: the RMS of each named parameter group's weights (all ranks'
    shards under FSDP2, so every rank must call it)."""
    figures = {}
    for group in optimizer.param_groups:
        squares = []
        for p in group["params"]:
            square_sum = p.detach().float().square().sum()
            if isinstance(square_sum, DTensor):
                square_sum = square_sum.full_tensor()
            squares.append((square_sum, p.numel()))
        if squares:
            figures[group.get("name", str(len(figures)))] = root_mean_square(squares)
    return figures


def build_optimizer(model: torch.nn.Module, optim_cfg: OptimConfig) -> MuonAdamW:
    """The combined optimizer over `partition.partition_parameters(model, optim_cfg)`."""
    from pilotrun.optim.partition import partition_parameters

    return MuonAdamW(partition_parameters(model, optim_cfg))
