"""The experts' orthogonalisation, cheaper: what each `optim.muon.ns_variant` / `ns_steps` choice costs in
update time and what it does to the loss, at the pilot's length.

- Update time: the whole Muon+AdamW step of the stability recipe's model (the `cpu` preset, 4,096-token
  vocabulary) on fixed gradients from one real forward/backward of its 8 x 64 microbatch, one torch thread,
  the choices interleaved round by round in one process (median of ROUNDS). Newton-Schulz is the only thing
  that differs between them.
- Loss parity: the stability recipe (`configs/stability.yaml`: 240 updates, the CPU pilot's length) on the
  built-in corpus, once per choice and seed (SEEDS), one thread, no checkpoints; the validation loss at the
  last update (the recipe's own `val` event, 3 batches of 8 x 64) and the last logged training loss.

`python -m benchmarks.run_all bench_ns_variants`
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHOICES = (("quintic", 5), ("polar_express", 5), ("polar_express", 4))
SEEDS = (0, 1, 2)
ROUNDS = 15


def _step_seconds() -> dict[tuple[str, int], float]:
    from pilotrun.config import OptimConfig
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer

    torch.manual_seed(0)
    config = model_preset("cpu", vocab_size=4096)
    model = build_model(config)
    tokens = torch.randint(0, config.vocab_size, (8, 64))
    model(tokens, tokens).loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizers = {}
    for variant, steps in CHOICES:
        muon = OptimConfig().muon.__class__(ns_variant=variant, ns_steps=steps)
        optimizers[(variant, steps)] = build_optimizer(model, OptimConfig(muon=muon))
    found: dict[tuple[str, int], list[float]] = {choice: [] for choice in CHOICES}
    with torch.no_grad():
        initial = {name: p.clone() for name, p in model.named_parameters()}
    for round_index in range(ROUNDS + 1):
        for choice, optimizer in optimizers.items():
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(initial[name])
                    p.grad = gradients.get(name)
            started = time.perf_counter()
            optimizer.step()
            if round_index:  # the first round warms every path up
                found[choice].append(time.perf_counter() - started)
    return {choice: statistics.median(values) for choice, values in found.items()}


def _losses(data: Path, work: Path, variant: str, steps: int, seed: int) -> tuple[float, float]:
    from pilotrun.config import load_run_config
    from pilotrun.training.trainer import Trainer

    config = load_run_config(ROOT / "configs" / "stability.yaml", [
        f"optim.muon.ns_variant={variant}", f"optim.muon.ns_steps={steps}", f"train.seed={seed}",
        "train.num_threads=1", "train.checkpoint.every=0",
    ])
    run_dir = work / f"{variant}-{steps}-{seed}"
    Trainer(config, data, run_dir, progress=False, out=io.StringIO()).run()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    val = [e for e in events if e["event"] == "val"][-1]
    train = [e for e in events if e["event"] == "train"][-1]
    return float(val["loss"]), float(train["loss"])


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench_ns_variants_"))
    try:
        seconds = _step_seconds()
        data = work / "data"
        prepare_corpus(data, source="builtin", tokenizer="bpe:4096", progress=False)
        losses = {choice: [_losses(data, work, *choice, seed) for seed in SEEDS] for choice in CHOICES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(previous)
    return "\n".join(_report(seconds, losses, load_before, os.getloadavg()[0]))


def _report(seconds: dict, losses: dict, load_before: float, load_after: float) -> list[str]:
    base = CHOICES[0]
    lines = [
        "## Newton-Schulz choices: update time and loss at the pilot's length",
        "",
        f"The stability recipe (240 updates, 8 x 64 tokens, the `cpu` preset) on the built-in corpus, seeds "
        f"{', '.join(map(str, SEEDS))}, one torch thread; the Muon+AdamW step on fixed gradients, median of "
        f"{ROUNDS} interleaved rounds. {os.cpu_count()} CPU cores, 1-minute load average {load_before:.1f} "
        f"before and {load_after:.1f} after.",
        "",
        "| `optim.muon.ns_variant`, `ns_steps` | step s | vs default | val loss per seed | mean val loss | "
        "vs default | last train loss (mean) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    base_val = statistics.mean(v for v, _ in losses[base])
    for choice in CHOICES:
        vals = [v for v, _ in losses[choice]]
        mean_val, mean_train = statistics.mean(vals), statistics.mean(t for _, t in losses[choice])
        lines.append(
            f"| {choice[0]}, {choice[1]}{' (default)' if choice == base else ''} | {seconds[choice]:.4f} | "
            f"{seconds[choice] / seconds[base]:.2f}x | {', '.join(f'{v:.4f}' for v in vals)} | "
            f"{mean_val:.4f} | {mean_val - base_val:+.4f} | {mean_train:.4f} |"
        )
    lines += ["", "Command: `python -m benchmarks.run_all bench_ns_variants`", ""]
    return lines


if __name__ == "__main__":
    print(run())
