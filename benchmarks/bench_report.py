"""How long the evidence takes: summarize, verdict and the drawn report on run records of three sizes.

The records are synthetic (tests/report/synthetic.py: the trainer's counters, windows, overflow skips,
checkpoints, one SIGKILL and a resume, with 8 experts in 3 MoE layers and 4 attention layers, like
configs/stability.yaml) at the sizes that matter: the CPU pilot (240 updates, a window every 5), a GPU pilot
(2,000 updates, every 10) and a long run (20,000 updates, every 10). Side by side in one run, each stage
timed separately (best of 3): summarize (read + validate + reconcile), verdict (the rules), report (7 PNGs +
summary.json + report.html).

Target: the whole evidence stage of the CPU pilot's record takes <= 30 s, 5% of the 10-minute budget of
`make pilot` on 2 cores (a target this project set; the 10 minutes are the whole pilot's).
`python -m benchmarks.run_all bench_report`
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

REPEATS = 3
TARGET_SECONDS = 30.0
ROOT = Path(__file__).resolve().parent.parent
SIZES = (("CPU pilot", 240, 5, 40), ("GPU pilot", 2000, 10, 250), ("long run", 20000, 10, 1000))


def _build(run_dir: Path, max_steps: int, log_every: int, every: int):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.report.synthetic import SyntheticRun

    run = SyntheticRun(
        run_dir,
        max_steps=max_steps,
        log_every=log_every,
        eval_every=every,
        checkpoint_every=every,
        moe_layers=3,
        experts=8,
        attn_layers=4,
        heads=4,
        train_split_tokens=400_000,
    )
    run.start_session()
    run.train_until(max_steps // 2 + log_every + 3)  # killed a few updates past a logged window
    run.kill()
    run.resume()
    run.train_until(max_steps)
    run.end_session()
    run.write()
    return run


def _best(fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(REPEATS):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def run() -> str:
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.record_check.summarize import summarize_run
    from pilotrun.report.verdict.verdict import judge_summary

    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        for name, max_steps, log_every, every in SIZES:
            run_dir = work / name.replace(" ", "-")
            _build(run_dir, max_steps, log_every, every)
            lines = sum(1 for _ in open(run_dir / "metrics.jsonl"))
            size_mb = (run_dir / "metrics.jsonl").stat().st_size / 2**20
            t_sum, summary = _best(
                lambda run_dir=run_dir, steps=max_steps: summarize_run(run_dir, require_step=steps)
            )
            assert summary.valid, summary.reasons
            t_verdict, verdict = _best(lambda summary=summary: judge_summary(summary))
            t_report, _ = _best(lambda verdict=verdict: write_report(verdict))
            rows.append((name, max_steps, lines, size_mb, t_sum, t_verdict, t_report))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu_total = sum(rows[0][4:7])
    met = cpu_total <= TARGET_SECONDS
    table = [
        "| record | updates | events | metrics.jsonl MB | summarize s | verdict s | report s | total s | "
        "summarize events/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, steps, lines, mb, ts, tv, tr in rows:
        table.append(f"| {name} | {steps:,} | {lines:,} | {mb:.2f} | {ts:.3f} | {tv:.4f} | {tr:.2f} | "
                     f"{ts + tv + tr:.2f} | {lines / ts:,.0f} |")
    return "\n".join(
        [
            "## Evidence stage: summarize, verdict and report",
            "",
            "Synthetic records with one kill and one resume (see the module docstring); best of "
            f"{REPEATS} per stage.",
            "",
            *table,
            "",
            f"Target: the CPU pilot's evidence stage <= {TARGET_SECONDS:.0f} s (5% of the 10-minute `make "
            "pilot` budget): "
            f"measured {cpu_total:.2f} s, {cpu_total / 600:.1%} of 600 s: **{'met' if met else 'NOT met'}**. "
            f"The report (7 PNGs) dominates; summarize grows with the number of events.",
            "",
            "`python -m benchmarks.run_all bench_report`",
        ]
    )
