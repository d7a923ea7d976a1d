"""The training loop: one honest update after another; everything else is a callback (callbacks/base.py).

One update (docs/MODEL.md, "one optimizer step"), `train_one_update`:

    set_learning_rates(step)                       # the LR is a function of applied updates only
    for each of A microbatches: forward under autocast, scaler.scale(loss / A).backward()
                                tokens_seen += tokens_per_microbatch        # work done, applied or not
    all-reduce the step statistics (expert counts SUM, max logits MAX)
    apply_update: unscale, global norm, clip, step, scaler update            # may skip (overflow, spike)
    if applied: the update hooks (QK-Clip, expert-bias update), step += 1
    else:       updates_skipped += 1

Nothing else moves `step`: an fp16 overflow must move neither the step nor the schedule, so that a resumed run
and an uninterrupted one agree. Counters are global (all ranks together). After each update the loop decides
whether the session stops (a stop signal on any rank, too many skipped updates in a row, max_steps reached),
then every due callback acts in its own time phase; on the last round the loop leaves the training phase for
good first, so that the session's training seconds are exactly the sum of its windows'. The hot loop does no
host synchronisation beyond the one the skip decision needs: the spike judge (spikes/detector.py) reads the
update's loss in that same transfer. The skipped ranges (`train.skip_data` and the rollbacks') are stepped
over before each microbatch.

Before each update the ids of its batches are looked at (every rank's rows, so all ranks agree). A damaged
shard can hold an id outside the vocabulary although its manifest did not; found there, at an update boundary,
the last applied state is whole: the callbacks' last round closes its window and checkpoints it, and the
TokenIdError (one line naming shard and offset, exit 2) ends the session as an error. Found inside an update
by the reader's own guard, half an update would be lost with no checkpoint of the state before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from pilotrun.common.stop_signals import signal_name
from pilotrun.data.reader import TokenIdError
from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
from pilotrun.optim.schedule import set_learning_rates
from pilotrun.optim.update_hooks import StepStatistics
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import (
    Callback,
    Ending,
    LoopState,
    UpdateResult,
    in_order,
    run_at_end,
    run_due,
)
from pilotrun.training.precision import apply_update, autocast_context
from pilotrun.training.replay import replay_spike
from pilotrun.training.signals import SecondSignal
from pilotrun.training.spikes.detector import SpikeGate, gathered_values, skip_ahead, upcoming_batches
from pilotrun.training.spikes.restore_point import model_state_restore_point


def train_loop(loop: LoopState, callbacks: Sequence[Callback]) -> Ending:
    """Train to `train.max_steps` or until stopped; returns how the session ended (errors propagate, after
    every callback's `at_end`). A second stop signal ends it at once, without the checkpoint the first waits
    for."""
    session, account, state = loop.session, loop.account, loop.session.state
    t = session.config.train
    callbacks = in_order(callbacks)
    session.raw_model.train()
    reset_step_statistics(session.raw_model)
    try:
        account.switch("train")
        while not loop.final:
            loop.update = None
            if state.step < t.max_steps:
                state.loader.batch_index = skip_ahead(state.loader.batch_index, skip_ranges(loop))
                try:
                    session.state.loader.check_upcoming_batches(t.gradient_accumulation_steps)
                except TokenIdError:
                    loop.final = True  # the last round closes the window and checkpoints the state before
                    account.switch("other")
                    run_due(loop, callbacks)
                    raise
                with contextlib.ExitStack() as around:
                    for callback in callbacks:
                        around.enter_context(callback.around_update(loop))
                    loop.update = train_one_update(loop)
                loop.ending = finished_anyway(stop_requested(loop, callbacks), state.step, t.max_steps)
            loop.final = loop.ending is not None or state.step >= t.max_steps
            if loop.final:
                account.switch("other")  # for good: the session's training seconds end with its last window
            run_due(loop, callbacks)
            reset_step_statistics(session.raw_model)
    except SecondSignal as second:
        loop.ending = Ending(
            "interrupted",
            loop.signals.exit_code(second.signum),
            f"second {signal_name(second.signum)}: stopped at once, no checkpoint for step {state.step}",
        )
    except BaseException:
        account.switch("other")
        run_at_end(loop, callbacks, failing=True)
        raise
    account.switch("other")
    run_at_end(loop, callbacks)
    return loop.ending or Ending("completed", 0, f"reached max_steps={t.max_steps}")


def finished_anyway(asked: Ending | None, step: int, max_steps: int) -> Ending | None:
    """A deadline or a stop signal that lands on the last update stops nothing: the run is complete, and
    saying `deadline` (75) or `interrupted` would have a scheduler start it again only to be told there is
    nothing to do. A spike's or the skips' stop (exit 1) stays what it is: that update's outcome still needs a
    look."""
    if asked is None or step < max_steps or asked.reason not in ("deadline", "interrupted"):
        return asked
    return Ending(
        "completed",
        0,
        f"reached max_steps={max_steps} ({asked.reason} asked for at the last update: nothing left to stop)",
    )


def stop_requested(loop: LoopState, callbacks: Sequence[Callback] = ()) -> Ending | None:
    """A stop signal or a callback's stop request on any rank (after the update in flight), told alike on
    every rank in the first asking rank's words; else a spike policy's stop or too many skipped updates in a
    row."""
    session, state = loop.session, loop.session.state
    t = session.config.train
    asked = None
    if loop.signals.received is not None:
        signum = loop.signals.received
        asked = Ending(
            "interrupted",
            loop.signals.exit_code(signum),
            f"{signal_name(signum)} received: finished the update, saved checkpoint step {state.step}",
        )
    for callback in callbacks:
        asked = asked or callback.stop_request(loop)
    asked = dist_utils.first_across_ranks(session.context, asked)
    if asked is not None:
        return asked
    spike = loop.update.spike if loop.update is not None else None
    if spike is not None and spike.action == "stopped":
        return Ending("stopped", 1, f"spike at update {spike.step} (loss {spike.loss:.4g}, grad norm "
                      f"{spike.grad_norm:.4g}) after {state_rollbacks(loop)} rollback(s): {spike.note}")
    too_many_skips = state.consecutive_skips >= t.max_consecutive_skips
    if too_many_skips:
        return Ending(
            "stopped",
            1,
            f"{state.consecutive_skips} consecutive skipped updates "
            f"(train.max_consecutive_skips={t.max_consecutive_skips}); last reason: "
            f"{loop.update.outcome.reason}",
        )
    return None


def state_rollbacks(loop: LoopState) -> int:
    return loop.hook("spike").rollbacks


def skip_ranges(loop: LoopState) -> list[list[int]]:
    """The global batch ranges the loader steps over: the recipe's and the rollbacks'
    (detector.SpikeDetector)."""
    return loop.hook("spike").skip_ranges(loop.session.config.train.skip_data)


def train_one_update(loop: LoopState) -> UpdateResult:
    """One update: microbatches, agreed statistics, the update, and what follows only when applied. Logging
    what it did is left to the callbacks, outside the timed training region."""
    session, window, state = loop.session, loop.window, loop.session.state
    cfg, t = session.config, session.config.train
    model, optimizer, scaler, loader = session.model, session.optimizer, session.scaler, state.loader
    device, accumulation = session.device, t.gradient_accumulation_steps
    set_learning_rates(optimizer, state.step, cfg.optim.schedule)
    # The update that should close a window also measures the update RMS per group, once a window.
    measure_rms = (state.step + 1) % t.log.every == 0 or state.step + 1 >= t.max_steps
    optimizer.zero_grad(set_to_none=True)
    restarted = 0
    # the update's own loss, for the spike judge
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches = []
    for micro in range(accumulation):
        loader.batch_index = skip_ahead(loader.batch_index, skip_ranges(loop))
        batches.append(loader.batch_index)
        inputs, targets = loader.next_batch()
        restarted += loader.last_batch_restarted
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with dist_utils.gradient_sync(model, micro == accumulation - 1):
            with autocast_context(t.precision, device.type):
                output = model(inputs, targets)
            scaler.scale(output.loss / accumulation).backward()
        window.ce_sum += output.ce_loss.detach()
        window.aux_sum += output.aux_loss.detach()
        loss_sum += output.ce_loss.detach()
        state.tokens_seen += session.tokens_per_microbatch
        state.count_sources()
        window.microbatches += 1
    state.updates_attempted += 1
    window.attempted += 1
    statistics = StepStatistics(*dist_utils.all_reduce_step_statistics(
        session.context, *collect_step_statistics(session.raw_model)))
    gate = spike_gate(loop, batches)
    outcome = apply_update(
        model,
        optimizer,
        scaler,
        cfg.optim.grad_clip,
        measure_update_rms=measure_rms,
        alongside=lambda norm: gathered_values(norm, loss_sum, accumulation, session.context),
        gate=gate,
    )
    hook_events: list[dict] = []
    if outcome.applied:
        for hook in state.hooks:
            hook_events += hook.after_update(state.step, statistics)
        if measure_rms:
            window.update_rms, window.update_rms_step = optimizer.last_update_rms, state.step + 1
        state.step += 1
        state.consecutive_skips = 0
        window.applied += 1
        window.clipped += int(outcome.clipped)
        window.grad_norm = outcome.grad_norm
        window.grad_norm_max = max(window.grad_norm_max, outcome.grad_norm)
    else:
        state.updates_skipped += 1
        state.consecutive_skips += 1
        window.skipped += 1
    window.loss_scale = outcome.loss_scale_after
    window.add_statistics(statistics.tokens_per_expert, statistics.qk_max_logit)
    return UpdateResult(outcome, restarted, hook_events, spike=gate.verdict)


def spike_gate(loop: LoopState, batches: list[int]) -> SpikeGate:
    """The spike judge of this attempt (spikes/detector.py), with its replay (replay.py) when
    `train.spike.replay`, and the restore point a rollback on a `model_state` cause takes
    (spikes/restore_point.py)."""
    session, state = loop.session, loop.session.state
    t = session.config.train
    detector = loop.hook("spike")
    replay = None
    if t.spike.replay:
        def replay(verdict):
            following = upcoming_batches(
                state.loader.batch_index, t.gradient_accumulation_steps, skip_ranges(loop)
            )
            return replay_spike(loop, verdict, detector, following)

    def restore_point(verdict):
        # rank 0's choice on every rank: a background save committing meanwhile may prune an older checkpoint
        # that another rank's read of the folder still lists
        found = model_state_restore_point(session, loop.last_checkpoint_step, verdict.batches)
        return dist_utils.broadcast_object(session.context, found)

    return SpikeGate(detector, state.step + 1, batches, loop.last_checkpoint_step is not None, replay,
                     restore_point)
