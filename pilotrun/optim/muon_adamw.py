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

# Keller Jordan's quintic coefficients (KJ-muon zeropower_via_newtonschulz5; Moonlight eq. 2): they maximise the
# slope at zero, so small singular values grow fast; the result has singular values in roughly [0.5, 1.3],
# not exactly 1, which is fine for an update direction.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The "hybrid" variant's last iterations (DeepSeek-V4): p(x) = 2x - 1.5x^3 + 0.5x^5 has p(1) = 1 and
# p'(1) = 0, so two of them after the quintic steps pull the singular values onto 1 instead of leaving them in
# about [0.5, 1.3]. Hybrid runs 8 quintic iterations then 2 of these (ns_steps does not apply).
NEWTON_SCHULZ_PINNING_COEFFICIENTS = (2.0, -1.5, 0.5)
NEWTON_SCHULZ_EPS = 1e-7
NS_DTYPES = ("auto", "float32", "bfloat16")


def newton_schulz_orthogonalize(update: torch.Tensor, steps: int = 5,
                                compute_dtype: torch.dtype = torch.float32, variant: str = "quintic") -> torch.Tensor:
    """Approximate orthogonalisation of a matrix [A, B] or a batch of matrices [E, A, B].

    Returns a tensor of the input's shape in fp32 (a transposed view for a tall input). Iterates on the short
    side (a tall matrix is transposed first) so the Gram matrix is min(A, B)^2. A zero input gives a zero output:
    the epsilon in the Frobenius normalisation keeps 0/0 away. A batch runs as one batched iteration (bmm and
    baddbmm), which on the CPU measured as fast as one 2-D iteration per matrix or faster (bench_optim).
    """
    if update.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz expects a 2-D matrix or a 3-D batch of matrices, got shape "
                         f"{tuple(update.shape)}")
    if variant == "quintic":
        schedule = [NEWTON_SCHULZ_COEFFICIENTS] * steps
    elif variant == "hybrid":
        schedule = [NEWTON_SCHULZ_COEFFICIENTS] * 8 + [NEWTON_SCHULZ_PINNING_COEFFICIENTS] * 2
    else:
        raise ValueError(f"unknown Newton-Schulz variant '{variant}' (expected one of {MUON_NS_VARIANTS})")
    return newton_schulz_iterate(update, schedule, compute_dtype).to(torch.float32)


def newton_schulz_iterate(update: torch.Tensor, schedule: list[tuple[float, float, float]],
                          compute_dtype: torch.dtype) -> torch.Tensor:
    """x <- a x + (b G + c G G) x with G = x x^T, per (a, b, c) of the schedule, from the normalised update.

    Each step is three matrix products, two of them fused with their sums (addmm / baddbmm): one rounding per
    product-and-sum instead of separate scale, product and add operators, which is both faster and, in bf16,
    about half as far from the exact iteration.
    """
    x = update.to(compute_dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        # The short side first, as one contiguous copy, so that NS(G) and NS(G^T)^T run the very same matmuls on
        # the very same memory layout (bit for bit); the result is handed back as a transposed view, no copy.
        x = x.mT.contiguous()
        x.div_(torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NEWTON_SCHULZ_EPS)
    else:
        x = x / (torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NEWTON_SCHULZ_EPS)
    product, multiply_add = (torch.mm, torch.addmm) if x.ndim == 2 else (torch.bmm, torch.baddbmm)
    # Three buffers for the whole iteration (x and `spare` swap each step): the same products as fresh tensors,
    # without an allocation per product, which measured 2-8% of the small matrices' time.
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
    raise ValueError(f"unknown ns_dtype '{ns_dtype}' (expected one of {NS_DTYPES}); fp16 is never used for NS")


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
                for key, default in (("momentum", 0.95), ("nesterov", True), ("ns_steps", 5),
                                     ("scale_mode", "moonlight"), ("ns_dtype", "auto"), ("ns_variant", "quintic")):
                    group.setdefault(key, default)
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon group '{group.get('name', '?')}' holds a tensor of shape "
                                         f"{tuple(p.shape)}; Muon takes only 2-D matrices or 3-D expert stacks")
            else:
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-8)
        self.measure_update_rms = False  # the default of step(measure_update_rms=None)
        self.last_update_rms: dict[str, float] = {}
        self.newton_schulz_ranks: tuple[int, int] | None = None  # see distribute_orthogonalization

    def distribute_orthogonalization(self, rank: int, world_size: int) -> None:
        """Under DDP (every rank holds the same averaged gradients and so the same momentum): let each rank run
        Newton-Schulz for its share of the Muon matrices, balanced by cost, and exchange the results with one
        all_gather per step, instead of every rank orthogonalizing every matrix. The same inputs give the same
        bits on any rank, so the update is the one each rank would have computed alone, bit for bit; only the
        replicated work shrinks. All ranks must call step() together (DDP's applied-update decision is global).
        FSDP2's sharded (DTensor) parameters keep their own path. world_size 1 turns it off."""
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
        if self.newton_schulz_ranks is None or any(isinstance(p, DTensor) for _, p in muon):
            # One matrix at a time: only one direction and one orthogonalized update exist at any moment.
            for group, p in muon:
                orthogonal = self._orthogonalize_one(group, p, self._muon_direction(group, p))
                self._muon_apply(group, p, orthogonal, squares_of(group))
        else:
            # Shared out across DDP ranks, in three passes: every direction, their orthogonalization (each rank
            # its share, then one all_gather), the updates. Holds every direction and update at once.
            work = [(group, p, self._muon_direction(group, p)) for group, p in muon]
            orthogonals = self._orthogonalize_shared(work)
            for (group, p, _), orthogonal in zip(work, orthogonals, strict=True):
                self._muon_apply(group, p, orthogonal, squares_of(group))
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group_step(group, squares_of(group))
        if measure_update_rms:
            self.last_update_rms = {name: root_mean_square(squares) for name, squares in measured.items() if squares}
        return loss

    def _muon_direction(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """Update the momentum buffer; return the fp32 direction U that Newton-Schulz orthogonalizes."""
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
        return grad.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer

    @staticmethod
    def _orthogonalize_one(group: dict[str, Any], p: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """NS5 of one direction: the whole matrix, fp32 (per_head: each head's row block as its own matrix)."""
        ns_dtype = resolve_ns_dtype(group["ns_dtype"], direction.device)
        # FSDP2 shards each matrix by rows; NS needs the whole matrix. Every rank gathers it and runs the same NS
        # on the same values (_muon_apply keeps its own rows).
        whole = direction.full_tensor() if isinstance(direction, DTensor) else direction
        block = row_block(group, p)
        matrices = whole.reshape(-1, block, whole.shape[-1]) if block else whole
        orthogonal = newton_schulz_orthogonalize(matrices, group["ns_steps"], ns_dtype, group["ns_variant"])
        return orthogonal.reshape(whole.shape)

    def _orthogonalize_shared(self, work: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Every direction's NS5, each computed by one DDP rank (cost-balanced) and shared by one all_gather."""
        rank, world_size = self.newton_schulz_ranks
        owners = balanced_owners([direction.numel() * min(row_block(group, p) or direction.shape[-2],
                                                           direction.shape[-1]) for group, p, direction in work],
                                 world_size)
        mine = [self._orthogonalize_one(group, p, direction).flatten()
                for (group, p, direction), owner in zip(work, owners, strict=True) if owner == rank]
        sizes = [sum(direction.numel() for (_, _, direction), owner in zip(work, owners, strict=True) if owner == r)
                 for r in range(world_size)]
        device = work[0][2].device if work else torch.device("cpu")
        packed = torch.zeros(max(sizes, default=0), dtype=torch.float32, device=device)
        if mine:
            torch.cat(mine, out=packed[:sizes[rank]])
        gathered = [torch.empty_like(packed) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, packed)
        offsets = [0] * world_size
        results = []
        for (_, _, direction), owner in zip(work, owners, strict=True):
            results.append(gathered[owner][offsets[owner]:offsets[owner] + direction.numel()].view(direction.shape))
            offsets[owner] += direction.numel()
        return results

    def _muon_apply(self, group: dict[str, Any], p: torch.Tensor, whole: torch.Tensor, squares: list | None) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        # per_head: the scale of one head's block, the matrix Newton-Schulz saw (Moonlight 2.2 warns that
        # per-head matrices get too large updates without the shape-dependent scale)
        scale = muon_update_scale(row_block(group, p) or p.size(-2), p.size(-1), group["scale_mode"])
        orthogonal = whole
        if isinstance(p, DTensor):  # keep this rank's rows of the whole matrix (src_data_rank=None: no scatter)
            orthogonal = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        if squares is not None:  # the whole matrix on every rank: no collective needed
            squares.append((whole.float().square().sum() * scale**2, whole.numel()))
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)  # decoupled decay with the unadjusted lr (ML-code)
        p.add_(orthogonal.to(p.dtype), alpha=-lr * scale)

    def _adamw_group_step(self, group: dict[str, Any], squares: list | None) -> None:
        # Operation for operation the single-tensor path of torch.optim.AdamW (torch/optim/adam.py,
        # decoupled_weight_decay=True, amsgrad=False), so that the two agree bit for bit.
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:  # as torch.optim.AdamW: no gradient, no update, no decay
                continue
            grad = p.grad
            state = self.state[p]
            if len(state) == 0:
                # `step` as a CPU float tensor, exactly torch's layout, so state dicts look the same
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avg, exp_avg_sq, step_tensor = state["exp_avg"], state["exp_avg_sq"], state["step"]
            step_tensor += 1
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_tensor.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)
            if squares is not None:
                square_sum = (exp_avg / denom).float().square().sum() / bias_correction1**2
                if isinstance(square_sum, DTensor):  # a sharded parameter: sum over every rank's shard
                    square_sum = square_sum.full_tensor()
                squares.append((square_sum, p.numel()))


def row_block(group: dict[str, Any], p: torch.Tensor) -> int:
    """Rows per independent matrix of `p` under optim.muon.granularity "per_head" (0: the whole parameter)."""
    blocks = group.get("row_blocks")
    if not blocks:
        return 0
    return next(block for block, q in zip(blocks, group["params"], strict=True) if q is p)


def balanced_owners(costs: list[int], world_size: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest cost first, each to the least-loaded rank so far (ties
    to the lower rank). A pure function of the costs, so every rank computes the same assignment."""
    loads = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
    return owners


def root_mean_square(squares: list[tuple[torch.Tensor, int]]) -> float:
    """sqrt(sum of squares / element count) over a group's (square sum, numel) pairs: one host sync per group."""
    total = torch.stack([square_sum.to(torch.float64).cpu() for square_sum, _ in squares]).sum()
    return math.sqrt(float(total) / sum(count for _, count in squares))


def parameter_rms(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The `weight_rms` diagnostic per group: the RMS of each named parameter group's weights (all ranks' shards under
    FSDP2, so every rank must call it)."""
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
