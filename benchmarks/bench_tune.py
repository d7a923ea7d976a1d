"""The learning-rate and batch checks (`pilotrun tune`) on mis-set candidates: does each check name a mis-set
recipe with the right direction and leave a right one alone, and what does it cost against the pilot?

Pilots of a tiny model (configs/smoke.yaml's shapes, batch 8 x 64, 96 updates at a constant LR after 4 of
warm-up, a checkpoint every 8) on the built-in corpus (5% of it for validation), each followed by `tune`
within its default budget (3x the pilot's updates):
- LR: the recipe's learning rates set right (Muon 0.02, AdamW 0.004), 4x too high and 4x too low; the LR
  check on each. "Right" was measured while building this check, with this benchmark's own pilots: from step
  40 of a pilot at Muon 0.005 / AdamW 0.001 the sweep's losses fell monotonically to its 2x edge (5.90 at
  1/2x to 5.72 at 2x, the noise 0.023: "too low"), and the pilot at 4x that, 0.02 / 0.004, reached 5.50 with
  its own 1x the best of its sweep. A shorter horizon prefers a smaller rate (28-update branches from step
  32 of a 64-update pilot had 1/4 of 0.02 best): the check answers for the pilot's own span;
- batch: a global batch far below (1 sequence) and far above (64 sequences) the recipe's 8; the batch check on
  each, and on the right recipe.
Per case: the finding, whether it names the mis-set one with the right direction (and makes no complaint about
the right one), the checks' updates against the pilot's, their wall seconds against the pilot's (the
branches in one shared process), and the seconds the check projected before it ran against the pilot's
record.
`python -m benchmarks.run_all bench_tune`
"""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from pathlib import Path

RIGHT = {"optim.muon.lr": 0.02, "optim.adamw.lr": 0.004}
RECIPE = {
    "model": {"d_model": 64, "n_layers": 2, "n_dense_layers": 1, "n_heads": 4, "q_lora_rank": 0,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "moe_hidden": 64,
              "dense_hidden": 192},
    "optim": {"muon": {"lr": RIGHT["optim.muon.lr"], "weight_decay": 0.1},
              "adamw": {"lr": RIGHT["optim.adamw.lr"], "weight_decay": 0.1},
              "schedule": {"kind": "constant", "warmup_steps": 4, "horizon": 96}},
    "train": {"batch_size": 8, "seq_len": 64, "max_steps": 96, "num_threads": 1, "log": {"every": 2},
              "eval": {"every": 8, "batches": 8}, "checkpoint": {"every": 8, "keep": 12}},
}
# (name, --set overrides, check, the direction a right check names)
CASES = (
    ("LR right", {}, "lr", "right"),
    ("LR 4x too high", {k: v * 4 for k, v in RIGHT.items()}, "lr", "too high"),
    ("LR 4x too low", {k: v / 4 for k, v in RIGHT.items()}, "lr", "too low"),
    ("batch 8 (the recipe's)", {}, "batch", None),
    ("batch 1: far below", {"train.batch_size": 1, "train.eval.batches": 64}, "batch", "could grow"),
    ("batch 64: far above", {"train.batch_size": 64, "train.eval.batches": 1}, "batch", "too large"),
)


def _pilot(work: Path, data: Path, name: str, overrides: dict) -> tuple[Path, float]:
    import yaml

    from pilotrun.commands.cli import main

    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    run_dir = work / name.split(":")[0].replace(" ", "-").replace("(", "").replace(")", "").replace("'", "")
    words = ["train", "--config", str(recipe), "--data", str(data), "--run-dir", str(run_dir), "--progress",
             "none"]
    for key, value in overrides.items():
        words += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    assert main(words) == 0, name
    return run_dir, time.perf_counter() - started


def _case(work: Path, data: Path, name: str, overrides: dict, check: str, expected: str | None) -> list[str]:
    from pilotrun.commands.tune import tune

    run_dir, pilot_seconds = _pilot(work, data, name, overrides)
    started = time.perf_counter()
    # --allow-overrun: the tiny pilots' checks may not fit 3x their seconds; the row shows by how much
    result = tune(run_dir, (check,), allow_overrun=True, out=io.StringIO())
    seconds = time.perf_counter() - started
    found = result[check]
    if expected is None:
        verdict = "(reference)"
    else:
        verdict = "yes" if found["direction"] == expected else f"NO (said {found['direction']})"
    cost = result["cost"]
    projected = cost["seconds"]
    return [name, check, found["line"].replace("|", "/"), verdict,
            f"{cost['updates']} / {cost['pilot_updates']} = {cost['updates'] / cost['pilot_updates']:.2f}x",
            f"{seconds:.0f} / {pilot_seconds:.0f} = {seconds / pilot_seconds:.1f}x",
            f"{projected:.0f} / {cost['pilot_seconds']:.0f} = {projected / cost['pilot_seconds']:.1f}x"
            + (" (over)" if cost["overrun"] else ""),
            f"{result['yardstick']:.3g}"]


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus

    work = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    try:
        data = work / "data"
        # 5% of the documents for validation: 8 batches of 8 x 64 tokens evaluated, the same for every case
        prepare_corpus(data, source="builtin", tokenizer="bpe:1024", progress=False, val_fraction=0.05)
        rows = [_case(work, data, *case) for case in CASES]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = ["| candidate | check | finding | right direction | updates: checks / pilot "
             "| wall s: checks / pilot | projected s: checks / pilot's record | yardstick |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    named = sum(row[3] == "yes" for row in rows)
    expected = sum(case[3] is not None for case in CASES)
    return (
        "## Tune: the learning-rate and batch checks on mis-set candidates (bench_tune)\n\n"
        "`python -m benchmarks.run_all bench_tune`: pilots of a tiny model (smoke shapes, batch 8 x 64, 96 "
        "updates, constant LR after 4 of warm-up) on the built-in corpus (5% for validation), each followed "
        "by `pilotrun tune` at its default budget (3x the pilot's updates). Learning rates set right (Muon "
        "0.02, AdamW 0.004), 4x too high and 4x too low; a global batch far below (1 sequence) and far "
        "above (64) the recipe's 8. "
        f"{named} of {expected} candidates named with the direction expected. The branches share one "
        "process (the launch paid once); each still pays its session's start-up. Wall seconds are measured "
        "around the pilot's and the checks' calls; projected seconds are the cost the check stated before it "
        "ran, against the pilot's wall seconds in its record (run with --allow-overrun: over means it would "
        "have been refused at the default budget). The measured wall also holds what the projection leaves "
        "out: the launch probe before the plan (one more interpreter launch and import), assembling the "
        "branch folders, the plots and tune.json.\n\n" + "\n".join(table) + "\n"
    )
