"""The verdict's judges of what the run costs its machine: steady training-only throughput (a busier machine
told apart from a slower recipe) and memory within its budget, without a leak. Each returns a Finding; the
rule table (rules.py) names it and says what it means.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pilotrun.report.record_check.time_split import window_profiled
from pilotrun.report.verdict.evidence import lacks, recipe_value, train_events, window_of
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Finding, Thresholds
from pilotrun.run.record import is_finite_number

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary


def _session_devices(summary: Summary) -> set[str]:
    kept = set(summary.lineage)
    return {str((s.get("hardware") or {}).get("device")) for s in summary.run.get("sessions") or []
            if isinstance(s, dict) and str(s.get("session_id")) in kept}


@dataclass
class _SteadyWindows:
    """Per train window past each session's first, profiled ones counted and left out: training-only tokens/s
    and, None where a window does not record it, tokens per process CPU second, per device second, the CPUs
    other processes used and this run's involuntary switches, each per wall second."""

    rates: list[float] = field(default_factory=list)
    cpu_rates: list[float | None] = field(default_factory=list)
    device_rates: list[float | None] = field(default_factory=list)
    others: list[float | None] = field(default_factory=list)
    switches: list[float | None] = field(default_factory=list)
    profiled: int = 0


def _steady_windows(summary: Summary) -> _SteadyWindows:
    windows = _SteadyWindows()
    seen_sessions = set()
    for e in train_events(summary):
        w = window_of(e)
        first_of_session = e["session_id"] not in seen_sessions
        seen_sessions.add(e["session_id"])
        if first_of_session:
            continue  # warm-up: allocator, caches, first-touch of the data
        if window_profiled(w):
            # torch.profiler slows what it records and the updates around it (its start, its trace): such a
            # window says nothing about the recipe's steady speed.
            windows.profiled += 1
            continue
        if (
            is_finite_number(w.get("tokens"))
            and is_finite_number(w.get("train_seconds"))
            and w["train_seconds"] > 0
        ):
            windows.rates.append(w["tokens"] / w["train_seconds"])
            cpu = w.get("cpu_seconds")
            windows.cpu_rates.append(w["tokens"] / cpu if is_finite_number(cpu) and cpu > 0 else None)
            device = w.get("device_seconds")
            windows.device_rates.append(
                w["tokens"] / device if is_finite_number(device) and device > 0 else None
            )
            wall = (
                w.get("wall_seconds")
                if is_finite_number(w.get("wall_seconds")) and w["wall_seconds"] > 0
                else None
            )
            other, switched = w.get("other_cpu_seconds"), w.get("involuntary_switches")
            windows.others.append(other / wall if wall and is_finite_number(other) else None)
            windows.switches.append(switched / wall if wall and is_finite_number(switched) else None)
    return windows


def _throughput_threshold(t: Thresholds) -> str:
    return (
        f"last-third / first-third median of training-only tok/s >= {t.min_throughput_ratio} (tok per "
        "process CPU second on a CPU, per device second on CUDA, held to the same bound separates a busier "
        "machine, and so does, on a CPU, the process's share of the CPU falling below "
        f"{t.min_cpu_share_ratio} "
        "of what it was)"
    )


class _PerCpuSecond(NamedTuple):
    """Tokens per process CPU second, first third -> last, and the CPU seconds per training second."""

    first: float
    last: float
    ratio: float
    share_first: float
    share_last: float


def _per_cpu_second(windows: _SteadyWindows, third: int) -> _PerCpuSecond | None:
    """None where a window lacks its CPU seconds."""
    rates, cpu_rates = windows.rates, windows.cpu_rates
    if not all(r is not None for r in cpu_rates):
        return None
    cpu_first = statistics.median(cpu_rates[:third])
    cpu_last = statistics.median(cpu_rates[-third:])
    cpu_ratio = cpu_last / cpu_first
    share_first = statistics.median(c / r for c, r in zip(rates[:third], cpu_rates[:third], strict=True))
    share_last = statistics.median(c / r for c, r in zip(rates[-third:], cpu_rates[-third:], strict=True))
    return _PerCpuSecond(cpu_first, cpu_last, cpu_ratio, share_first, share_last)


def judge_throughput_steady(summary: Summary, t: Thresholds) -> Finding:
    windows = _steady_windows(summary)
    rates = windows.rates
    threshold = _throughput_threshold(t)
    evidence = f"training-only tokens/s of {len(rates)} train windows (each session's first left out"
    evidence += f", and {windows.profiled} with profiled updates)" if windows.profiled else ")"
    if len(rates) < 6:
        return Finding(WARN, f"only {len(rates)} windows to compare", threshold, evidence)
    third = len(rates) // 3
    first, last = statistics.median(rates[:third]), statistics.median(rates[-third:])
    ratio = last / first
    figure = f"median {first:.1f} -> {last:.1f} tok/s (ratio {ratio:.2f})"
    cpu = _per_cpu_second(windows, third)
    if cpu is not None:
        figure += (
            f"; per process CPU second {cpu.first:.1f} -> {cpu.last:.1f} tok (ratio {cpu.ratio:.2f}), CPU "
            f"seconds per training second {cpu.share_first:.2f} -> {cpu.share_last:.2f}"
        )
        evidence += "; window.cpu_seconds"
    device_ratio = None
    if all(r is not None for r in windows.device_rates):
        device_first = statistics.median(windows.device_rates[:third])
        device_last = statistics.median(windows.device_rates[-third:])
        device_ratio = device_last / device_first
        figure += (
            f"; per device second {device_first:.1f} -> {device_last:.1f} tok (ratio {device_ratio:.2f})"
        )
        evidence += "; window.device_seconds (CUDA timing events)"
    machine = _lost_to_other_work(windows.others, windows.switches, third, t)
    if machine is not None:
        figure += f"; {machine[0]}"
        evidence += "; window.other_cpu_seconds and window.involuntary_switches"
    if ratio >= t.min_throughput_ratio:
        return Finding(PASS, figure, threshold, evidence)
    return _slower_finding(summary, t, (figure, threshold, evidence), machine, cpu, device_ratio)


def _slower_finding(summary: Summary, t: Thresholds, said: tuple[str, str, str],
                    machine: tuple[str, bool] | None, cpu: _PerCpuSecond | None,
                    device_ratio: float | None) -> Finding:
    """A slower last third: a busier machine (WARN) where the measures tell it apart, else the run (FAIL)."""
    figure, threshold, evidence = said
    devices = _session_devices(summary)
    if machine is not None and machine[1] and devices == {"cpu"}:
        # Before the work per token is looked at: threads that lose their time slices to other processes spin
        # while they wait for each other (OpenMP), so each token costs more CPU on a busy machine too, and
        # that rise says nothing about the recipe.
        return Finding(
            WARN,
            f"the machine got busier, not the recipe slower: {figure}: this run's threads lost "
            "CPU to other processes; judge the recipe's own speed on a quiet machine (or with fewer "
            "threads, train.num_threads)",
            threshold,
            evidence,
        )
    on_cuda = bool(devices) and all(d.startswith("cuda") for d in devices)
    if (cpu is not None and devices == {"cpu"} and cpu.ratio >= t.min_throughput_ratio) or \
            (device_ratio is not None and on_cuda and device_ratio >= t.min_throughput_ratio):
        what = "process CPU second" if devices == {"cpu"} else "device second"
        return Finding(WARN, f"the machine got busier: {figure}; the work per token (tokens "
                       f"per {what}) held, so the slowdown is other load on the machine, not the recipe",
                       threshold, evidence)
    if cpu is not None and devices == {"cpu"} and cpu.share_last / cpu.share_first < t.min_cpu_share_ratio:
        # The process got much less of the CPU per training second than before: other load took it. Sharing a
        # core also makes each token cost more CPU time (every switch to another task evicts the trainer's
        # caches), so the work per CPU second cannot acquit the recipe either way; the slowdown is reported,
        # and the recipe's own speed left to a quiet run.
        return Finding(
            WARN,
            f"the machine got busier: {figure}; the process got "
            f"{cpu.share_last / cpu.share_first:.2f} of its share of the CPU, so other load took it; "
            "its work per CPU second fell too (sharing a core evicts its caches), so judge the recipe's own "
            "speed on a quiet machine",
            threshold,
            evidence,
        )
    if on_cuda and device_ratio is None:
        figure += "; device time not recorded, so contention cannot be told apart"
    elif not on_cuda and cpu is None:
        figure += "; CPU time not recorded, so contention cannot be told apart"
    elif devices != {"cpu"} and not on_cuda:
        figure += f"; devices {', '.join(sorted(devices))}: no one measure of the work per token"
    else:
        figure += "; the work per token grew too: the run itself slowed"
    return Finding(FAIL, figure, threshold, evidence)


def _lost_to_other_work(others: list[float | None], switches: list[float | None], third: int,
                        t: Thresholds) -> tuple[str, bool] | None:
    """(the figures, whether they show the run's threads losing CPU to other processes: the rest of the
    machine using at least min_other_cpus_rise more CPUs, or the threads descheduled min_switch_ratio times as
    often, in the last third as in the first); None where the windows do not record them."""
    if any(v is None for v in others + switches):
        return None
    other_first, other_last = statistics.median(others[:third]), statistics.median(others[-third:])
    switch_first, switch_last = statistics.median(switches[:third]), statistics.median(switches[-third:])
    lost = (other_last - other_first >= t.min_other_cpus_rise
            or switch_last / max(switch_first, 1.0) >= t.min_switch_ratio)
    return (
        f"other processes used {other_first:.2f} -> {other_last:.2f} CPUs, this run's threads descheduled "
        f"for them {switch_first:.0f} -> {switch_last:.0f} times per second",
        lost,
    )


def judge_memory(summary: Summary, t: Thresholds) -> Finding:
    recipe_budget = recipe_value(summary, "train.memory_budget_gb")
    if not is_finite_number(recipe_budget):
        return lacks("train.memory_budget_gb", f"RSS growth within a session <= {t.max_memory_growth}x")
    budget_gb = t.memory_budget_gb or float(recipe_budget)
    peaks, growth = [], []
    by_session: dict[str, list[float]] = {}
    for e in train_events(summary):
        memory = e.get("memory") if isinstance(e.get("memory"), dict) else {}
        cuda = memory.get("cuda_max_allocated_mb")
        peak = cuda if is_finite_number(cuda) and cuda > 0 else memory.get("peak_rss_mb")
        if is_finite_number(peak):
            peaks.append(float(peak))
        if is_finite_number(memory.get("rss_mb")):
            by_session.setdefault(e["session_id"], []).append(float(memory["rss_mb"]))
    for sid, values in by_session.items():
        if len(values) >= 3 and values[0] > 0:
            growth.append((values[-1] / values[0], sid))
    budget_text = (
        f"peak <= {budget_gb:g} GB" if budget_gb > 0 else "no budget set (train.memory_budget_gb = 0)"
    )
    threshold = f"{budget_text}; RSS growth within a session <= {t.max_memory_growth}x"
    if not peaks:
        return Finding(FAIL, "memory not recorded: the record lacks this rule's evidence", threshold,
                       "train windows")
    peak = max(peaks)
    worst = max(growth) if growth else (1.0, "-")
    figure = f"peak {peak:.0f} MB; worst RSS growth {worst[0]:.2f}x (session {worst[1]})"
    over = budget_gb > 0 and peak > budget_gb * 1024
    status = FAIL if over or worst[0] > t.max_memory_growth else PASS
    return Finding(status, figure, threshold, f"memory of {len(peaks)} train windows")


