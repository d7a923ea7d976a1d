"""The GPU checks and timings, prepared as one script for the few minutes a session is lent a GPU.

The test suite runs on the CPU and reaches none of pilotrun's CUDA paths (grouped_mm on sm90, sdpa with the
chunked max-logit tracker, bf16 autocast, Muon's bf16 Newton-Schulz, torch.compile with inductor, the trainer
and the pilot on CUDA). This script runs each as its own section: a failing section records its error and the
next one still runs, and everything is written to `--out` as it goes (results.json and results.md), so a run
cut short by the device's time limit still returns what it measured.

On the device machine (its python3 holds a CUDA torch; pilotrun's other dependencies are there too):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.device_check --out $OUT --budget-s 480
Here, to check the script itself on the CPU with small shapes (no timings worth reading):
    .venv/bin/python -m benchmarks.device_check --out /tmp/device-check --cpu-dry-run

Timings use CUDA events around repeated fwd+bwd after warm-up (median of `--repeats`); ratios are measured
side by side in this one process. Paste results.md into BENCHMARKS.md under "GPU".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch


class Recorder:
    """Section results, rewritten to disk after every section (the device may stop the script at any time)."""

    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self.started = time.perf_counter()
        self.budget_s = budget_s

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def section(self, name: str, function, *args) -> None:
        if self.left_s() <= 0:
            self.results[name] = {"status": "skipped", "why": "time budget spent"}
        else:
            began = time.perf_counter()
            try:
                self.results[name] = {"status": "ok", **function(*args)}
            except Exception as error:  # a broken path is a finding: record it and go on
                self.results[name] = {"status": "error", "error": f"{type(error).__name__}: {error}",
                                      "traceback": traceback.format_exc()[-3000:]}
            self.results[name]["seconds"] = round(time.perf_counter() - began, 1)
        print(f"[device_check] {name}: {self.results[name]['status']} "
              f"({self.results[name].get('seconds', 0)} s)", flush=True)
        self.write()

    def write(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        lines = ["# device_check results", ""]
        for name, result in self.results.items():
            lines.append(f"## {name}: {result['status']}")
            for key, value in result.items():
                if key not in ("status", "traceback"):
                    lines.append(f"- {key}: {value}")
            lines.append("")
        (self.out / "results.md").write_text("\n".join(lines))


def timed(device: torch.device, function, repeats: int) -> float:
    """Median seconds of `function()` after two warm-up calls: CUDA events on a GPU, perf_counter on the
    CPU."""
    for _ in range(2):
        function()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        else:
            began = time.perf_counter()
            function()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def environment(device: torch.device) -> dict:
    figures = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        figures.update(name=properties.name, capability=f"{properties.major}.{properties.minor}",
                       memory_gb=round(properties.total_memory / 2**30, 1), cuda=torch.version.cuda,
                       bf16=torch.cuda.is_bf16_supported())
    return figures


def moe_layer(device: torch.device, tokens: int, repeats: int, shapes: dict) -> dict:
    """gpu-100m's MoE layer (grouped and sorted dispatch) against a dense SwiGLU of the same active width,
    bf16 autocast, forward + backward; the grouped_mm probe; grouped vs sorted outputs."""
    from pilotrun.model.moe import MoE, SwiGLU, grouped_matmul_works

    figures = {"grouped_mm_works_bf16": grouped_matmul_works(device, torch.bfloat16),
               "grouped_mm_works_fp32": grouped_matmul_works(device, torch.float32), "tokens": tokens}
    d, hidden, experts, shared, top_k = (shapes[k] for k in ("d_model", "moe_hidden", "n_routed_experts",
                                                              "n_shared_experts", "top_k"))
    torch.manual_seed(0)
    layers = {"dense": SwiGLU(d, (top_k + shared) * hidden)}
    for impl in ("grouped", "sorted"):
        torch.manual_seed(0)
        layers[impl] = MoE(d, hidden, experts, shared, top_k, moe_impl=impl)
    for layer in layers.values():
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.normal_(0, 0.02)
        layer.to(device).train()
    x = torch.randn(tokens // 1024 or 1, min(tokens, 1024), d, device=device, requires_grad=True)
    upstream = torch.randn_like(x)

    def step(layer):
        def run():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                output = layer(x)
            output = output[0] if isinstance(output, tuple) else output
            output.float().backward(upstream)
        return run

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        grouped_out, sorted_out = layers["grouped"](x)[0].float(), layers["sorted"](x)[0].float()
    figures["grouped_vs_sorted_max_abs_diff"] = float((grouped_out - sorted_out).abs().max())
    figures["grouped_vs_sorted_equal"] = bool(torch.equal(grouped_out, sorted_out))
    times = {name: timed(device, step(layer), repeats) for name, layer in layers.items()}
    figures.update({f"{name}_ms": round(t * 1e3, 3) for name, t in times.items()})
    figures.update(
        {f"{name}_vs_dense": round(times[name] / times["dense"], 3) for name in ("grouped", "sorted")}
    )
    return figures


def attention(device: torch.device, batch: int, seq: int, repeats: int) -> dict:
    """MLA with sdpa (flash on sm90) and the chunked max-logit tracker against eager attention: outputs, the
    tracked maxima bit for bit, and the tracker's cost."""
    from pilotrun.model.mla import MLA
    from pilotrun.model.rope import build_rope_table

    torch.manual_seed(0)
    mla = MLA(512, 8, 0, 128, 64, 32, 64).to(device)
    cos, sin = (t.to(device) for t in build_rope_table(32, seq, 10000.0))
    x = torch.randn(batch, seq, 512, device=device) * 0.5
    outputs, maxima = {}, {}
    for impl in ("sdpa", "eager"):
        mla.attn_impl = impl
        mla.qk_max_logit.fill_(float("-inf"))
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            outputs[impl] = mla(x, cos, sin).float()
        maxima[impl] = mla.qk_max_logit.clone()
    figures = {"sdpa_vs_eager_output_max_abs_diff": float((outputs["sdpa"] - outputs["eager"]).abs().max()),
               "tracked_max_logit_sdpa": [round(v, 4) for v in maxima["sdpa"].tolist()],
               "tracked_max_logit_equal": bool(torch.equal(maxima["sdpa"], maxima["eager"]))}
    upstream = torch.randn(batch, seq, 512, device=device)

    def run(training: bool):
        def go():
            mla.attn_impl = "sdpa"
            mla.train(training)
            mla.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                output = mla(x, cos, sin)
            output.float().backward(upstream)
        return go

    with_tracker, without = timed(device, run(True), repeats), timed(device, run(False), repeats)
    figures.update(
        sdpa_with_tracker_ms=round(with_tracker * 1e3, 3),
        sdpa_without_tracker_ms=round(without * 1e3, 3),
        tracker_overhead=round(with_tracker / without - 1, 3),
    )
    return figures


def model_step(device: torch.device, preset: str, batch: int, seq: int, repeats: int, vocab: int,
               recompute: bool, compile_mode: str) -> dict:
    """One training update of a preset (bf16 autocast forward + backward + MuonAdamW step): time, tokens/s,
    achieved FLOP/s and MFU against the device's dense bf16 peak, peak memory."""
    from pilotrun.config import OptimConfig
    from pilotrun.model.accounting import flops_per_token
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model, compile_blocks_and_output
    from pilotrun.optim.muon_adamw import build_optimizer
    from pilotrun.training.environment import device_peak_flops

    cfg = model_preset(preset, vocab_size=vocab, max_seq_len=seq, activation_checkpointing=recompute)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    optimizer = build_optimizer(model, OptimConfig())
    compile_seconds = None
    if compile_mode != "none":
        compile_blocks_and_output(model, compile_mode)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)

    def update():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()

    if compile_mode != "none":
        began = time.perf_counter()
        update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_seconds = round(time.perf_counter() - began, 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(device, update, repeats)
    per_token = flops_per_token(cfg, seq)
    achieved = per_token * batch * seq / seconds
    figures = {
        "preset": preset,
        "batch_x_seq": f"{batch}x{seq}",
        "activation_checkpointing": recompute,
        "compile": compile_mode,
        "compile_seconds": compile_seconds,
        "step_ms": round(seconds * 1e3, 2),
        "tokens_per_s": round(batch * seq / seconds),
        "achieved_tflops": round(achieved / 1e12, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        peak, basis = device_peak_flops(torch.cuda.get_device_name(device), "bf16")
        figures.update(mfu=round(achieved / peak, 4) if peak else None, peak_basis=basis,
                       peak_memory_gb=round(torch.cuda.max_memory_allocated(device) / 2**30, 2))
    return figures


def _subprocess_limit(budget_left_s: float, floor_s: float) -> float | None:
    """A subprocess timeout from what is left of the budget; none at all under an unlimited budget (inf)."""
    return max(budget_left_s, floor_s) if math.isfinite(budget_left_s) else None


def run_command(command: list[str], timeout_s: float) -> dict:
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=_subprocess_limit(timeout_s, 1))
    return {
        "command": " ".join(command),
        "exit_code": result.returncode,
        "seconds": round(time.perf_counter() - began, 1),
        "output_tail": (result.stdout + result.stderr)[-2500:],
    }


def pilot(out: Path, config: str, sets: list[str], timeout_s: float) -> dict:
    """The whole pilot (prepare, train, kill, resume, summarize, verdict) with a recipe on this device."""
    command = [
        sys.executable,
        "-m",
        "pilotrun",
        "pilot",
        "--workdir",
        str(out / "pilot-work"),
        "--config",
        config,
    ]
    for item in sets:
        command += ["--set", item]
    figures = run_command(command, timeout_s)
    if figures["exit_code"] not in (0, 1):
        raise RuntimeError(f"pilot exited {figures['exit_code']}: {figures['output_tail'][-800:]}")
    # What this section checks is the machinery on the device (a valid record, an exact resume); a smoke
    # recipe of a few updates is expected to fail learning rules such as loss_decreased or clip_rate. The
    # rules are read from `pilotrun verdict --json` on the pilot's run folder, never from the pilot's printed
    # text.
    judged = subprocess.run(
        [sys.executable, "-m", "pilotrun", "verdict", str(out / "pilot-work" / "run"), "--json"],
        capture_output=True,
        text=True,
        timeout=_subprocess_limit(timeout_s, 60),
    )
    if judged.returncode not in (0, 1):
        raise RuntimeError(f"verdict --json exited {judged.returncode}: {judged.stderr[-800:]}")
    verdict = json.loads(judged.stdout)
    figures["verdict"] = verdict["decision"]
    for rule in verdict["rules"]:
        if rule["name"] in ("record_valid", "resumed", "throughput_steady"):
            figures[rule["name"]] = f"{rule['status']} {rule['figure']}"
    # On CUDA every train window should carry the device seconds of its updates (CUDA timing events): the
    # verdict's contention check reads them. Report how many windows have them and their share of the train
    # time.
    from pilotrun.run.record import read_metrics_strict

    windows = [e["window"] for e in read_metrics_strict(out / "pilot-work" / "run") if e["event"] == "train"]
    timed = [w for w in windows if isinstance(w.get("device_seconds"), int | float)]
    figures["windows_with_device_seconds"] = f"{len(timed)} of {len(windows)}"
    if timed:
        figures["device_over_train_seconds"] = round(sum(w["device_seconds"] for w in timed)
                                                     / max(sum(w["train_seconds"] for w in timed), 1e-12), 3)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="stop starting sections after this long"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="run every section on the CPU with small shapes"
    )
    args = parser.parse_args(argv)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(
            "device_check: no CUDA device (use --cpu-dry-run to check the script on a CPU)", file=sys.stderr
        )
        return 2
    device = torch.device("cpu" if dry else "cuda")
    recorder = Recorder(args.out, args.budget_s)
    repeats = 2 if dry else args.repeats
    from pilotrun.model.presets import MODEL_PRESETS

    big = dict(MODEL_PRESETS["tiny" if dry else "gpu-100m"])
    recorder.section("environment", environment, device)
    recorder.section("moe_layer", moe_layer, device, 256 if dry else 8192, repeats, big)
    recorder.section("attention", attention, device, 1 if dry else 4, 64 if dry else 2048, repeats)
    preset, batch, seq, vocab = ("tiny", 2, 32, 256) if dry else ("gpu-100m", 8, 1024, 32768)
    for label, recompute, compile_mode in (
        ("model_step", False, "none"),
        ("model_step_recompute", True, "none"),
        ("model_step_compiled", False, "eager" if dry else "inductor"),
    ):
        recorder.section(
            label, model_step, device, preset, batch, seq, repeats, vocab, recompute, compile_mode
        )
    config = "configs/smoke.yaml" if dry else "configs/gpu/smoke.yaml"
    sets = ["train.max_steps=6", "train.checkpoint.every=2"] if dry else ["train.device=cuda"]
    recorder.section("pilot", pilot, args.out, config, sets, max(recorder.left_s(), 30))
    failed = [name for name, result in recorder.results.items() if result["status"] == "error"]
    print(
        f"[device_check] wrote {args.out / 'results.md'}; errors in: {', '.join(failed) or 'none'}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
