"""Small synthetic run records for the report tests, written the way docs/RUN_RECORD.md describes.

`SyntheticRun` simulates the trainer's bookkeeping (counters, windows, overflow skips, checkpoints, a kill
and a resume from the newest checkpoint) without any model. Every per-window figure comes from a plain
function of the step that a test can replace (`run.loss = lambda step: ...`) to build a PASS or a FAIL
case, or a test can edit `run.events` before `write()` to inject an inconsistency.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.thresholds import Thresholds
from pilotrun.report.verdict.verdict import judge_summary
from pilotrun.run.record import RUN_JSON_DIGEST_KEY, chain_genesis, chained_line, run_json_digests


class SyntheticRun:
    def __init__(self, run_dir: Path, *, batch_size: int = 2, seq_len: int = 8, grad_accum: int = 2,
                 max_steps: int = 60, log_every: int = 5, eval_every: int = 10, checkpoint_every: int = 20,
                 moe_layers: int = 2, experts: int = 4, attn_layers: int = 3, heads: int = 2,
                 train_split_tokens: int = 5000, grad_clip: float = 1.0, memory_budget_gb: float = 0.0):
        self.run_dir = Path(run_dir)
        self.tokens_per_microbatch = batch_size * seq_len
        self.grad_accum = grad_accum
        self.tokens_per_update = self.tokens_per_microbatch * grad_accum
        self.max_steps, self.log_every = max_steps, log_every
        self.eval_every, self.checkpoint_every = eval_every, checkpoint_every
        self.moe_layers, self.experts, self.attn_layers, self.heads = moe_layers, experts, attn_layers, heads
        self.run: dict[str, Any] = {
            "run_id": "synthetic-run",
            "tokens_per_update": self.tokens_per_update,
            "model": {
                "parameters": 1000,
                "active_parameters": 800,
                "flops_per_token": 6000,
                "config": {"n_layers": attn_layers, "n_dense_layers": attn_layers - moe_layers},
            },
            "optimizer": {"groups": []},
            "recipe": {
                "train": {
                    "max_steps": max_steps,
                    "batch_size": batch_size,
                    "seq_len": seq_len,
                    "gradient_accumulation_steps": grad_accum,
                    "memory_budget_gb": memory_budget_gb,
                },
                "optim": {"grad_clip": grad_clip, "qk_clip": {"enabled": True, "tau": 100.0}},
                "model": {},
            },
            "data": {
                "train": {"tokens": train_split_tokens, "metadata_sha256": "0" * 64},
                "val": {"tokens": 500},
            },
            "allowed_changes": [],
            "sessions": [],
        }
        self.events: list[dict[str, Any]] = []
        self.counters = {"step": 0, "tokens_seen": 0, "updates_attempted": 0, "updates_skipped": 0}
        self.qk_cumulative = 0  # QK-Clip's cumulative updates_with_clip, restored with each checkpoint
        self.checkpoints: dict[int, dict[str, int]] = {}
        self.clock = 1_700_000_000.0
        self.session_id: str | None = None
        self.session_index = 0
        # attempt numbers (updates_attempted after the attempt) that overflow
        self.overflow_at: set[int] = set()
        # Per-window figures, each a function of the step at the end of the window; tests replace them.
        self.loss = lambda step: 2.0 + 5.0 * math.exp(-step / 20.0)
        self.val_loss = lambda step: 2.1 + 5.0 * math.exp(-step / 20.0)
        self.grad_norm = lambda step: 1.0 + 0.5 * math.exp(-step / 10.0)
        self.clipped = lambda step: step <= 10  # clipped updates during warm-up only
        self.train_seconds_per_update = lambda step: 0.5
        # Host work between updates (logging, the loop itself): in every window's wall time, never in its
        # training time, so that a figure computed from the wrong one of the two cannot pass a test.
        self.host_seconds_per_update = lambda step: 0.125
        self.cpu_seconds_per_update = lambda step: 0.45  # the process's CPU seconds of that training time
        self.eval_seconds = lambda step: 0.2  # each evaluation's, and each checkpoint save's, seconds
        self.checkpoint_seconds = lambda step: 0.3
        # Seconds from a session's start to its first update (loading, building), by session (1, 2, ...).
        self.startup_seconds = lambda session: 0.0
        # What other processes did meanwhile, per update: None leaves them out of the windows (a record from
        # before they were kept); a test sets both to a function of the step.
        self.other_cpu_seconds_per_update: Callable[[int], float] | None = None
        self.involuntary_switches_per_update: Callable[[int], int] | None = None
        self.rss_mb = lambda step: 500.0
        self.tokens_per_expert = lambda step, layer: [
            100.0 + 5 * ((e + layer) % 2) for e in range(self.experts)
        ]
        self.qk_clip_updates = lambda step: 0
        self.max_logit = lambda step, layer: 20.0 + layer
        self.loss_scale = 65536.0
        self._window: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------------------- sessions
    def _emit(self, event: str, **fields: Any) -> dict[str, Any]:
        self.clock += 0.01
        record = {
            "event": event,
            "time": self.clock,
            "session_id": self.session_id,
            **self.counters,
            **fields,
        }
        self.events.append(record)
        return record

    def start_session(self, resumed_from: int | None = None) -> None:
        self.session_index += 1
        self.session_id = f"s{self.session_index}"
        self.run["sessions"].append(
            {
                "session_id": self.session_id,
                "start_step": self.counters["step"],
                "start_tokens_seen": self.counters["tokens_seen"],
                "resumed_from": resumed_from,
                "git": {"commit": "0" * 40, "dirty": False, "diff_sha256": None},
                "command": ["pilotrun", "train"],
                "hardware": {"world_size": 1, "device": "cpu"},
                "software": {},
                "started_at": self.clock,
            }
        )
        self._session_clock_start = self.clock
        self._time_split = {"train_seconds": 0.0, "eval_seconds": 0.0, "checkpoint_seconds": 0.0}
        self._emit(
            "session_start",
            resumed_from=resumed_from,
            world_size=1,
            tokens_per_update=self.tokens_per_update,
            max_steps=self.max_steps,
            tokens_per_microbatch=self.tokens_per_microbatch,
        )
        self.clock += self.startup_seconds(self.session_index)
        self._reset_window()

    def _reset_window(self) -> None:
        self._window = {"updates_applied": 0, "updates_attempted": 0, "updates_skipped": 0, "clipped": 0,
                        "microbatches": 0, "tokens": 0, "train_seconds": 0.0, "wall_seconds": 0.0,
                        "cpu_seconds": 0.0, "qk_updates": 0}

    def _flush_window(self) -> None:
        w, step = self._window, self.counters["step"]
        if w["updates_attempted"] == 0:
            return
        self.qk_cumulative += w.pop("qk_updates")
        norm = self.grad_norm(step)
        self._emit(
            "train",
            window=dict(w),
            loss=self.loss(step),
            aux_loss=0.001,
            lr=1e-3,
            grad_norm=norm,
            grad_norm_max=norm,
            loss_scale=self.loss_scale,
            epoch=0,
            data_restarts=0,
            throughput={
                "train_tokens_per_s": w["tokens"] / w["train_seconds"],
                "wall_tokens_per_s": w["tokens"] / w["wall_seconds"],
                "achieved_flops_per_s": 1.0,
                "mfu": "unknown",
            },
            moe={
                "tokens_per_expert": [
                    self.tokens_per_expert(step, layer) for layer in range(self.moe_layers)
                ],
                "imbalance": [1.0] * self.moe_layers,
                "max_imbalance": 1.0,
                "dead_experts": 0,
                "router_entropy": [0.9] * self.moe_layers,
                "bias_abs_max": 0.01,
            },
            qk_clip={
                "max_logit": [self.max_logit(step, layer) for layer in range(self.attn_layers)],
                "heads_clipped": 0,
                "first_clipped": [],
                "updates_with_clip": self.qk_cumulative,
                "cumulative_interventions": self.qk_cumulative,
            },
            memory={
                "rss_mb": self.rss_mb(step),
                "peak_rss_mb": self.rss_mb(step),
                "cuda_max_allocated_mb": 0.0,
            },
            activations={
                "block_output_rms": [0.5 + 0.01 * step * (layer + 1) for layer in range(self.attn_layers)]
            },
            optimizer={
                "weight_rms": {"attention": 0.02 + 1e-4 * step, "embedding": 0.006},
                "update_rms": {"attention": 0.2, "embedding": 0.5 * math.exp(-step / 30.0)},
                "update_rms_step": step,
            },
        )
        self._reset_window()

    def train_until(self, target_step: int) -> None:
        """Attempt updates until `step` reaches target_step, logging, evaluating and checkpointing on
        schedule."""
        while self.counters["step"] < target_step:
            c, w = self.counters, self._window
            c["updates_attempted"] += 1
            c["tokens_seen"] += self.tokens_per_update
            seconds = self.train_seconds_per_update(c["step"] + 1)
            host_seconds = self.host_seconds_per_update(c["step"] + 1)
            self.clock += seconds + host_seconds
            self._time_split["train_seconds"] += seconds
            w["updates_attempted"] += 1
            w["microbatches"] += self.grad_accum
            w["tokens"] += self.tokens_per_update
            w["train_seconds"] += seconds
            w["wall_seconds"] += seconds + host_seconds
            w["cpu_seconds"] += self.cpu_seconds_per_update(c["step"] + 1)
            if self.other_cpu_seconds_per_update is not None:
                w["other_cpu_seconds"] = w.get("other_cpu_seconds", 0.0) + self.other_cpu_seconds_per_update(
                    c["step"] + 1
                )
                w["involuntary_switches"] = (w.get("involuntary_switches", 0)
                                             + self.involuntary_switches_per_update(c["step"] + 1))
            if c["updates_attempted"] in self.overflow_at:
                c["updates_skipped"] += 1
                w["updates_skipped"] += 1
                self._emit("overflow", reason="overflow", loss_scale_before=self.loss_scale,
                           loss_scale_after=self.loss_scale / 2, consecutive_skips=1)
                self.loss_scale /= 2
                continue
            c["step"] += 1
            w["updates_applied"] += 1
            w["clipped"] += int(bool(self.clipped(c["step"])))
            w["qk_updates"] += int(self.qk_clip_updates(c["step"]))
            step = c["step"]
            if step % self.log_every == 0:
                self._flush_window()
                if self.eval_every and step % self.eval_every == 0:
                    seconds = self.eval_seconds(step)
                    self._time_split["eval_seconds"] += seconds
                    self.clock += seconds
                    self._emit("val", loss=self.val_loss(step), batches=2, tokens=32, seconds=seconds)
                if self.checkpoint_every and step % self.checkpoint_every == 0:
                    self.save_checkpoint()

    def save_checkpoint(self) -> None:
        step = self.counters["step"]
        self.checkpoints[step] = dict(self.counters, qk_cumulative=self.qk_cumulative)
        seconds = self.checkpoint_seconds(step)
        self._time_split["checkpoint_seconds"] += seconds
        self.clock += seconds
        self._emit("checkpoint", path=f"checkpoints/step-{step:08d}", seconds=seconds, bytes=12345)

    def end_session(self, reason: str = "completed") -> None:
        self._flush_window()
        wall = self.clock + 0.01 - self._session_clock_start
        split = dict(self._time_split)
        split["other_seconds"] = wall - sum(split.values())
        split["wall_seconds"] = wall
        self._emit("session_end", reason=reason, message="", time_split=split)

    def kill(self) -> None:
        """A SIGKILL: the session simply stops writing (its partial window is lost)."""
        self._reset_window()

    def pause(self, seconds: float) -> None:
        """Time with no session running (a crash noticed late, a queue): the clock moves, nothing is
        written."""
        self.clock += seconds

    def resume(self, from_step: int | None = None) -> None:
        step = max(self.checkpoints) if from_step is None else from_step
        saved = dict(self.checkpoints[step])
        self.qk_cumulative = saved.pop("qk_cumulative")
        self.counters = saved
        self.start_session(resumed_from=step)

    # ---------------------------------------------------------------------------------------------- output
    def write(self, torn_tail: str = "") -> Path:
        """run.json, metrics.jsonl and the checkpoints, hash-chained as the real writer chains them
        (record.py): each line's chain value, each session's chain_start / chain_end, the digests of run.json
        in the latest session_start and each checkpoint marker's chain head, computed over the events as they
        are now (a test may have edited them)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        entries = {entry["session_id"]: entry for entry in self.run["sessions"]}
        starts = [e for e in self.events if e["event"] == "session_start"]
        head, lines, seen = chain_genesis(self.run["run_id"]), [], set()
        self.chain_heads: dict[int, str] = {}
        for event in self.events:
            entry = entries.get(event["session_id"])
            if entry is not None and event["session_id"] not in seen:
                entry["chain_start"] = head
            seen.add(event["session_id"])
            if starts and event is starts[-1]:
                event[RUN_JSON_DIGEST_KEY] = run_json_digests(self.run)
            if event["event"] == "checkpoint":
                self.chain_heads[event["step"]] = head  # the trainer saves before logging the checkpoint line
            line, head = chained_line(head, event)
            lines.append(line)
            if event["event"] == "session_end" and entry is not None:
                entry.update(chain_end=head, end_reason=event.get("reason"))
        (self.run_dir / "run.json").write_text(json.dumps(self.run, indent=2))
        (self.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + torn_tail)
        for step, counters in self.checkpoints.items():
            self.write_checkpoint(step, counters)
        return self.run_dir

    def write_checkpoint(self, step: int, counters: dict[str, int]) -> Path:
        """A committed checkpoint folder as the checkpointer leaves it: one file and the marker with its
        sha256."""
        folder = self.run_dir / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"synthetic_state": counters}).encode()
        (folder / "state.pt").write_bytes(payload)
        marker = {"step": step, "files": {"state.pt": {"sha256": hashlib.sha256(payload).hexdigest(),
                                                      "bytes": len(payload)}},
                  "meta": {"counters": {k: counters[k] for k in self.counters},
                           "metrics_chain_head": getattr(self, "chain_heads", {}).get(step)}}
        (folder / "COMMITTED.json").write_text(json.dumps(marker))
        return folder

    def find(self, event: str, session: str | None = None, step: int | None = None) -> dict[str, Any]:
        """The first event of that kind (optionally in a session, at a step), for tests to edit."""
        for record in self.events:
            if (
                record["event"] == event
                and session in (None, record["session_id"])
                and step in (None, record["step"])
            ):
                return record
        raise KeyError((event, session, step))

    def clip_head(self, step: int, layer: int, head: int, logit: float, first_time: bool) -> dict[str, Any]:
        """Insert a `qk_clip` event where the trainer writes it: after the update it follows, here the
        last update of the train window ending at `step`, with the synthetic recipe's tau = 100; a first-time
        clip also enters that window's qk_clip.first_clipped. Returns the event for a test to edit."""
        window_end = self.find("train", step=step)
        event = {key: window_end[key] for key in ("session_id", "step", "tokens_seen", "updates_attempted",
                                                  "updates_skipped")}
        gamma = 100.0 / logit
        event.update(
            event="qk_clip",
            time=window_end["time"] - 0.001,
            layer=layer,
            head=head,
            max_logit=logit,
            gamma=gamma,
            first_time=first_time,
            hard=gamma < 0.5,
        )
        self.events.insert(self.events.index(window_end), event)
        if first_time:
            window_end["qk_clip"]["first_clipped"].append([layer, head])
        return event

    def copy(self) -> SyntheticRun:
        return copy.deepcopy(self)


def crashed_and_resumed(run_dir: Path, make_run: Callable[..., SyntheticRun] = SyntheticRun,
                        **kwargs: Any) -> SyntheticRun:
    """The pilot's shape: train to 33 (checkpoint at 20), SIGKILL, resume from 20, finish at max_steps.
    `make_run` builds the run (a test may set its figures there before any event is written)."""
    run = make_run(run_dir, **kwargs)
    run.start_session()
    run.train_until(33)
    run.kill()
    run.resume()
    run.train_until(run.max_steps)
    run.end_session()
    return run


def verdict_of(tmp_path, change=None, thresholds=None, build=crashed_and_resumed, **kwargs):
    """Build a pilot-shaped synthetic run after `change(run)` set its figures; judge it."""
    holder = {}

    def builder(run_dir, **kw):
        run = SyntheticRun(run_dir, **kw)
        if change is not None:
            change(run)
        holder["run"] = run
        return run

    if build is crashed_and_resumed:
        run = crashed_and_resumed(tmp_path / "r", make_run=builder, **kwargs)
    else:
        run = build(builder, tmp_path / "r", **kwargs)
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"), thresholds or Thresholds())
    return verdict, {r.name: r for r in verdict.rules}


def busier_machine(run):
    """Training seconds per update quadruple from update 40 on while the process's CPU seconds stay."""
    run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5


def changed(run, change):
    """`run` after `change(run)`: a make_run for crashed_and_resumed."""
    change(run)
    return run
