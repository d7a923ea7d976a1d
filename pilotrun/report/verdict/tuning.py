"""What the learning-rate and batch checks of a pilot (`pilotrun tune`, commands/tune.py) found, from the
validation losses of their branches: pure functions over numbers, and the reader of RUN/tune/tune.json that
the verdict shows as evidence (never a rule: a recipe whose LR is a grid step off still learns; the researcher
decides what to do with a better factor).

The yardstick is the pilot's own noise: the robust spread of its successive train-window losses
(stability.loss_noise), scaled from a train window's tokens to the tokens one evaluation reads (the spread of
a mean falls as one over the square root of the tokens averaged). Two branches whose validation losses differ
by less than that are not told apart.

Learning rate: branches at the recipe's Muon and AdamW learning rates times each factor of LR_FACTORS (both
scaled together), the same updates on the same batches from one checkpoint. The recipe's value is "within one
step" where the best branch is the recipe's own or its neighbour on the grid, or its own loss is within the
yardstick of the best; otherwise the better factor is named with the loss it gains. Sensitivity: the spread
(max - min) of the validation loss across the sweep (Wortsman et al. 2023, arXiv 2309.14322).

Batch: from each checkpoint, branches at BATCH_MULTIPLES of the recipe's global batch, each reading the same
tokens. A batch keeps up where its loss per token is within the yardstick of the best branch from that
checkpoint; the critical batch is the largest multiple that keeps up (Merrill et al. 2025, arXiv 2505.23971),
its band runs up to the next multiple tried (which did not keep up), or is open above the largest tried.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pilotrun.report.verdict.stability import loss_noise

LR_FACTORS = (0.5, 1 / math.sqrt(2), 1.0, math.sqrt(2), 2.0)
BATCH_MULTIPLES = (0.5, 1.0, 2.0, 4.0)
TUNE_DIR = "tune"
TUNE_JSON = "tune.json"


def factor_name(factor: float) -> str:
    """0.5 -> '1/2', 0.7071 -> '1/sqrt2', 1.4142 -> 'sqrt2', 2 -> '2', 4 -> '4'."""
    for text, value in (("1/sqrt2", 1 / math.sqrt(2)), ("sqrt2", math.sqrt(2))):
        if math.isclose(factor, value):
            return text
    if factor < 1:
        return f"1/{round(1 / factor):g}"
    return f"{factor:g}"


def noise_yardstick(train_window_losses: list[float], window_tokens: int, eval_tokens: int) -> float | None:
    """The pilot's noise on the scale of one evaluation's mean loss (None: too few windows to measure)."""
    noise = loss_noise(train_window_losses)
    if noise is None or window_tokens <= 0 or eval_tokens <= 0:
        return None
    return noise * math.sqrt(window_tokens / eval_tokens)


def judge_lr(losses: dict[float, float], yardstick: float) -> dict[str, Any]:
    """The sweep's finding: best factor, whether the recipe is within one grid step of it, the sensitivity."""
    factors = sorted(losses)
    finite = {f: v for f, v in losses.items() if math.isfinite(v)}
    if 1.0 not in losses or not finite:
        raise ValueError("the sweep needs the recipe's own branch (factor 1) and one finite loss")
    best = min(finite, key=lambda f: (finite[f], abs(math.log(f))))
    recipe_loss = losses[1.0]
    gain = recipe_loss - finite[best] if math.isfinite(recipe_loss) else math.inf
    steps_off = abs(factors.index(best) - factors.index(1.0))
    within = steps_off <= 1 or gain <= yardstick
    sensitivity = max(finite.values()) - min(finite.values())
    edge = best in (factors[0], factors[-1]) and best != 1.0
    if within:
        finding, direction = (f"the recipe's learning rates are within one step of the best seen (best "
                              f"{factor_name(best)}x)"), "right"
    else:
        direction = "too high" if best < 1 else "too low"
        finding = (f"the recipe's learning rates look {direction}: {factor_name(best)}x reaches a validation "
                   f"loss {gain:.4g} lower ({gain / yardstick:.1f} x the noise)"
                   + (" at the edge of the sweep: the best may lie further out" if edge else ""))
    return {"best_factor": best, "recipe_loss": recipe_loss, "best_loss": finite[best], "gain": gain,
            "within_one_step": within, "direction": direction, "sensitivity": sensitivity, "edge": edge,
            "yardstick": yardstick,
            "line": f"{finding}; sensitivity (loss spread across the sweep) {sensitivity:.4g}"}


def critical_batch(losses: dict[float, float], yardstick: float) -> dict[str, Any]:
    """From one checkpoint: the largest multiple whose loss keeps up with the best, and its band."""
    finite = {m: v for m, v in losses.items() if math.isfinite(v)}
    if not finite:
        raise ValueError("no finite loss among the batch branches")
    best = min(finite.values())
    keeps_up = sorted(m for m, v in finite.items() if v <= best + yardstick)
    critical = keeps_up[-1]
    above = [m for m in sorted(losses) if m > critical]
    return {"critical": critical, "band": [critical, above[0] if above else None],
            "keeps_up": keeps_up, "best_loss": best}


def judge_batch(points: list[dict[str, Any]], yardstick: float) -> dict[str, Any]:
    """`points`: [{"step": N, "losses": {multiple: val loss}}, ...] in step order. The critical batch over the
    pilot's span (the smallest found, where the recipe's batch has to keep up first) and what it means."""
    if not points:
        raise ValueError("no checkpoint to measure the batch from")
    found = [{"step": p["step"], **critical_batch(p["losses"], yardstick)} for p in points]
    critical = min(f["critical"] for f in found)
    upper = [f["band"][1] for f in found if f["critical"] == critical]
    band = [critical, upper[0]]
    band_text = f"[{factor_name(critical)}x, {factor_name(band[1]) + 'x' if band[1] else 'open above'})"
    if critical < 1.0:
        direction = "too large"
        meaning = (f"the recipe's batch is above the critical batch: {factor_name(critical)}x reaches a "
                   "lower loss on the same tokens; a smaller batch (or more tokens) spends the budget better")
    elif critical > 1.0:
        direction = "could grow"
        meaning = (f"the recipe's batch is below the critical batch: up to {factor_name(critical)}x keeps up "
                   f"on the same tokens, in 1/{factor_name(critical)} of the updates")
    else:
        direction, meaning = "right", "the recipe's batch is at the critical batch"
    per_point = "; ".join(f"step {f['step']}: {factor_name(f['critical'])}x" for f in found)
    return {"critical": critical, "band": band, "direction": direction, "points": found,
            "yardstick": yardstick,
            "line": f"critical batch {factor_name(critical)}x the recipe's, band {band_text} ({per_point}): "
                    f"{meaning}"}


def read_tune_result(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN/tune/tune.json when a check finished and wrote it (written last, atomically), else None."""
    path = Path(run_dir) / TUNE_DIR / TUNE_JSON
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def tune_evidence_lines(run_dir: str | Path) -> list[str]:
    """The verdict's evidence from the checks, one line per check (none when no check has run)."""
    result = read_tune_result(run_dir)
    if result is None:
        return []
    lines = []
    for check in ("lr", "batch"):
        found = result.get(check)
        if isinstance(found, dict) and isinstance(found.get("line"), str):
            steps = [str(s) for s in found.get("from_steps") or []]
            where = " and ".join([", ".join(steps[:-1]), steps[-1]] if len(steps) > 1 else steps)
            lines.append(f"{check} check (from step{'s' if len(steps) > 1 else ''} {where}, "
                         f"{found.get('updates')} updates a branch): {found['line']}")
    return lines
