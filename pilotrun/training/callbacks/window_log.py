"""The loop's record of its own work: the `train` event that closes each window, the progress bar, and the
rare events that follow an update (a data restart, an fp16 overflow, a QK-Clip event).

Every `train.log.every` applied updates a `train` event closes the window; it closes too before every
checkpoint (the window callback comes first), so a checkpoint's counters always coincide with a `train` event,
and at the session's last round, whatever ends it. The window's figures are read off the device here, in the
"other" phase; writing the event is the "report" phase (LoopState.log).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

from pilotrun.common.progress import PlainLine
from pilotrun.model.diagnostics import attention_diagnostics, block_output_rms, moe_diagnostics
from pilotrun.optim.muon_adamw import parameter_rms
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import (
    PRIORITY_RARE_EVENTS,
    PRIORITY_WINDOW,
    Callback,
    LoopState,
    due_on_cadence,
)
from pilotrun.training.environment import memory_snapshot
from pilotrun.training.notices import data_pass_line
from pilotrun.training.timing import throughput
from pilotrun.training.window import Window, WindowFigures, train_event_fields


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class RareEventsCallback(Callback):
    """`data_restart` per exhaustion restart of the training split, `overflow` per skipped update and each
    update hook's events (QK-Clip's `qk_clip`), logged after the update they follow, so their counters include
    it."""

    priority = PRIORITY_RARE_EVENTS
    phase = "other"

    def __init__(self) -> None:
        self.passes_before: list[int] | None = None  # a mixture's restarts by source before the update

    @contextlib.contextmanager
    def around_update(self, loop: LoopState) -> Iterator[None]:
        if loop.session.state.tokens_by_source is not None:
            self.passes_before = source_restarts(loop.session.state)
        yield

    def due(self, loop: LoopState) -> bool:
        update = loop.update
        return update is not None and bool(update.restarted or not update.applied or update.hook_events)

    def after_update(self, loop: LoopState) -> None:
        state, update = loop.session.state, loop.update
        for _ in range(update.restarted):
            state.data_restarts += 1
            loop.log("data_restart", epoch=int(state.loader.epoch), data_restarts=state.data_restarts)
        if update.restarted:
            loop.say(data_pass_line(loop.step, state.tokens_seen, self.passes_begun(loop)))
        outcome = update.outcome
        if not outcome.applied and outcome.reason != "spike":  # a spike's skip is its `spike` event
            loop.log("overflow", reason=outcome.reason, loss_scale_before=outcome.loss_scale_before,
                     loss_scale_after=outcome.loss_scale_after, consecutive_skips=state.consecutive_skips)
        for fields in update.hook_events:
            loop.log("qk_clip", **fields)

    def passes_begun(self, loop: LoopState) -> dict[str, int] | int:
        """The pass that begins: the split's (a data folder), or each restarted source's (a mixture)."""
        state = loop.session.state
        if state.tokens_by_source is None:
            return int(state.loader.epoch) + 1
        now, before = source_restarts(state), self.passes_before or []
        names = loop.session.dataset.names
        return {names[i]: count + 1 for i, count in enumerate(now) if i >= len(before) or count > before[i]}


def source_restarts(state: Any) -> list[int]:
    """A mixture's restarts by source, from its tokens by source (the `train` event's restarts_by_source)."""
    return state.loader.passes([t // state.loader.seq_len for t in state.tokens_by_source])


def eta_text(seconds: float | None) -> str:
    """A remaining time as a person reads it in a log: seconds, minutes or hours; '-' when not known yet."""
    if seconds is None:
        return "-"
    if seconds < 100:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 100 * 60 else f"{seconds / 3600:.1f} h"


class PlainProgress:
    """The progress bar's interface (n, update, set_postfix_str, close) as plain lines (PlainLine), what a log
    file can hold: one line per window (the researcher's own cadence, train.log.every, as the record's `train`
    events), each with an ETA at this session's wall-clock rate (its updates so far over its seconds so far:
    evaluations and checkpoints included, as the remaining updates will have them)."""

    def __init__(self, total: int, initial: int, out: TextIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.n, self.initial = total, initial, initial
        self.clock = clock
        self.started = clock()
        self.line = PlainLine(out, 0.0, clock)

    def update(self, count: int) -> None:
        self.n += count

    def eta_seconds(self, now: float) -> float | None:
        done, elapsed = self.n - self.initial, now - self.started
        return (self.total - self.n) * elapsed / done if done > 0 and elapsed > 0 else None

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        figures = (self.n, text)
        self.line.offer(figures, lambda now: f"train: step {self.n}/{self.total} {text} "
                                             f"ETA {eta_text(self.eta_seconds(now))}")

    def close(self) -> None:
        self.line.close()


class WindowLogCallback(Callback):
    """Closes the window into a `train` event every `log_every` applied updates (`train.log.every`), before
    every checkpoint (`train.checkpoint.every`) and at the last round; on rank 0 with `progress`, a tqdm bar
    on stderr follows it."""

    priority = PRIORITY_WINDOW
    phase = "other"

    def __init__(self, log_every: int, checkpoint_every: int, *, bar: Any = None) -> None:
        self.log_every = log_every
        self.checkpoint_every = checkpoint_every
        self.bar = bar
        self.sources_at_open: list[int] | None = None  # a mixture's tokens per source where the window opened

    @classmethod
    def for_session(cls, loop: LoopState, *, progress: bool | str) -> WindowLogCallback:
        """`progress`: True or "auto" (a redrawn bar on a terminal, plain lines elsewhere), "bar", "plain",
        False or "none"."""
        t = loop.session.config.train
        bar = None
        mode = (
            {True: "auto", False: "none"}.get(progress, progress) if isinstance(progress, bool) else progress
        )
        if mode == "auto":
            # Carriage-return redraws in a log file (nohup, slurm) are one endless line: plain lines there.
            mode = "bar" if sys.stderr.isatty() else "plain"
        if mode == "plain" and loop.is_main:
            bar = PlainProgress(t.max_steps, loop.step, sys.stderr)
        elif mode == "bar" and loop.is_main:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=loop.step, file=sys.stderr, unit="step", dynamic_ncols=True,
                       desc="train", mininterval=0.5)
        return cls(t.log.every, t.checkpoint.every, bar=bar)

    @contextlib.contextmanager
    def around_update(self, loop: LoopState) -> Iterator[None]:
        # The device's own seconds per update, for the training phase's attempts only (not profiled ones).
        timed = not loop.update_profiled
        if self.sources_at_open is None and loop.session.state.tokens_by_source is not None:
            self.sources_at_open = list(loop.session.state.tokens_by_source)  # the session's first window
        if timed:
            loop.window.update_started()
        yield
        if timed:
            loop.window.update_finished()

    def due(self, loop: LoopState) -> bool:
        return (due_on_cadence(loop, self.log_every) or loop.final
                or due_on_cadence(loop, self.checkpoint_every))

    def after_update(self, loop: LoopState) -> None:
        self.close_window(loop)
        loop.window = Window(loop.session.device)

    def reopen(self, loop: LoopState) -> None:
        """A spike's rollback restored the counters: the next window opens from them (a mixture's by source
        too)."""
        loop.window = Window(loop.session.device)
        if loop.session.state.tokens_by_source is not None:
            self.sources_at_open = list(loop.session.state.tokens_by_source)

    def at_end(self, loop: LoopState) -> None:
        if self.bar is not None:
            with loop.account.phase("report"):
                self.bar.close()
            self.bar = None

    def source_fields(self, loop: LoopState) -> dict[str, Any]:
        """A mixture's window by source: `tokens_by_source` (the window's tokens, adding up to its tokens),
        `tokens_seen_by_source` (cumulative, adding up to tokens_seen) and `restarts_by_source`; {} for a
        folder."""
        state = loop.session.state
        if state.tokens_by_source is None:
            return {}
        names = loop.session.dataset.names
        opened = self.sources_at_open or [0] * len(names)
        now = list(state.tokens_by_source)
        self.sources_at_open = now
        restarts = source_restarts(state)
        return {"tokens_by_source": {n: b - a for n, a, b in zip(names, opened, now, strict=True)},
                "tokens_seen_by_source": dict(zip(names, now, strict=True)),
                "restarts_by_source": dict(zip(names, restarts, strict=True))}

    def close_window(self, loop: LoopState) -> None:
        train_seconds, wall_seconds = loop.window_clock.close_window()
        window, session = loop.window, loop.session
        if window.attempted == 0:
            return
        raw, optimizer, clock = session.raw_model, session.optimizer, loop.window_clock
        tokens = window.microbatches * session.tokens_per_microbatch
        profiled_tokens = window.profiled_microbatches * session.tokens_per_microbatch
        local = {
            "loss": _float(window.ce_sum) / window.microbatches,
            "aux": _float(window.aux_sum) / window.microbatches,
        }
        means = dist_utils.mean_across_ranks(session.context, local)
        figures = WindowFigures(
            updates_applied=window.applied,
            updates_attempted=window.attempted,
            updates_skipped=window.skipped,
            clipped=window.clipped,
            microbatches=window.microbatches,
            tokens=tokens,
            train_seconds=train_seconds,
            wall_seconds=wall_seconds,
            cpu_seconds=clock.cpu_seconds,
            loss=means["loss"],
            aux_loss=means["aux"],
            grad_norm=window.grad_norm,
            grad_norm_max=window.grad_norm_max,
            loss_scale=window.loss_scale,
            update_rms=window.update_rms,
            update_rms_step=window.update_rms_step,
            profiled_attempts=window.profiled_attempts,
            profiled_tokens=profiled_tokens,
            profile_seconds=clock.profile_seconds,
            device_seconds=window.device_seconds(),
            involuntary_switches=clock.involuntary_switches,
            other_cpu_seconds=clock.other_cpu_seconds,
        )
        speed = throughput(
            tokens,
            train_seconds,
            wall_seconds,
            session.flops_per_token,
            session.peak_flops_per_s,
            train_tokens=tokens - profiled_tokens,
        )
        group = optimizer.param_groups[0]
        fields = train_event_fields(
            figures,
            lr=float(group["lr"]),
            base_lr=float(group["base_lr"]) if group.get("base_lr") else None,
            epoch=int(session.state.loader.epoch),
            data_restarts=session.state.data_restarts,
            throughput=speed,
            moe=moe_diagnostics(raw, window.tokens_per_expert)
            if window.tokens_per_expert is not None
            else {},
            attention=attention_diagnostics(window.qk_max_logit) if window.qk_max_logit is not None else {},
            hook_metrics={hook.name: hook.window_metrics() for hook in session.state.hooks},
            memory=memory_snapshot(session.device),
            block_output_rms=block_output_rms(raw),
            weight_rms=parameter_rms(optimizer),
        )
        fields.update(self.source_fields(loop))
        loop.log("train", **fields)
        loop.logged_step = loop.step
        if self.bar is not None:
            with loop.account.phase("report"):
                self.bar.update(loop.step - self.bar.n)
                tps = speed["train_tokens_per_s"]
                self.bar.set_postfix_str(f"loss={means['loss']:.4f} train_tok/s={tps:,.0f}" if tps else
                                         f"loss={means['loss']:.4f}", refresh=True)
