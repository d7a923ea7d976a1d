"""pilotrun/training/loop.py on real tiny sessions: one update, then the callbacks' round; the last round, the
stop decisions and the time phases, with callbacks that only record what they were shown."""

from __future__ import annotations

import io
import signal
import threading
import types
from pathlib import Path

import pytest
import torch

import pilotrun.training.loop as loop_module
from pilotrun.config import load_run_config
from pilotrun.training.callbacks.base import Callback, LoopState, UpdateResult
from pilotrun.training.loop import finished_anyway, stop_requested, train_loop
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount
from pilotrun.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def session_of(data_dir, run_dir, *overrides: str):
    config = load_run_config(
        ROOT / "configs" / "smoke.yaml",
        [
            "train.num_threads=1",
            "train.max_steps=4",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            *overrides,
        ],
    )
    return Trainer(config, data_dir, run_dir, progress=False, out=io.StringIO()).session


class Watcher(Callback):
    """Due every round; records (step, applied, final, the phase it ran in) and its at_end."""

    priority = 0
    phase = "eval"

    def __init__(self):
        self.rounds, self.ended = [], 0

    def due(self, loop):
        return True

    def after_update(self, loop):
        self.rounds.append((loop.step, loop.applied, loop.final, loop.account.current_phase))

    def at_end(self, loop):
        self.ended += 1


@pytest.fixture
def session(builtin_data_dir, tmp_path):
    session = session_of(builtin_data_dir, tmp_path / "run")
    yield session
    session.metrics.close()
    session.release_lock()


def new_loop(session, signals=None) -> LoopState:
    return LoopState(session, TimeAccount(), signals or StopSignals(), io.StringIO())


@pytest.mark.slow
def test_one_round_of_callbacks_per_update_and_the_last_one_final(session):
    watcher = Watcher()
    loop = new_loop(session)
    ending = train_loop(loop, [watcher])
    assert (ending.reason, ending.exit_code, ending.message) == ("completed", 0, "reached max_steps=4")
    assert watcher.rounds == [(1, True, False, "eval"), (2, True, False, "eval"), (3, True, False, "eval"),
                              (4, True, True, "eval")]
    assert watcher.ended == 1 and session.state.tokens_seen == 4 * 128
    # Training stopped for good before the last round: no second of it after the final update.
    split = loop.account.time_split()
    assert split["train_seconds"] > 0 and loop.account.current_phase == "other"


@pytest.mark.slow
def test_a_session_at_max_steps_has_one_final_round_without_an_update(session):
    session.state.step = 4
    watcher = Watcher()
    train_loop(new_loop(session), [watcher])
    assert watcher.rounds == [(4, False, True, "eval")] and session.state.updates_attempted == 0


@pytest.mark.slow
def test_a_stop_request_ends_after_the_update_in_flight_with_the_signal_code(session):
    class StopAtTwo(Watcher):
        def after_update(self, loop):
            super().after_update(loop)
            if loop.step == 2:
                loop.signals.request(signal.SIGINT)

    watcher = StopAtTwo()
    ending = train_loop(new_loop(session), [watcher])
    assert (ending.reason, ending.exit_code) == ("interrupted", 130) and "SIGINT received" in ending.message
    assert [r[:3] for r in watcher.rounds] == [(1, True, False), (2, True, False), (3, True, True)]


@pytest.mark.slow
def test_a_second_signal_stops_at_once(session):
    class SecondAtTwo(Watcher):
        def after_update(self, loop):
            super().after_update(loop)
            if loop.step == 2:
                loop.signals.request(signal.SIGTERM)
                loop.signals.request(signal.SIGTERM)

    watcher = SecondAtTwo()
    ending = train_loop(new_loop(session), [watcher])
    assert (ending.reason, ending.exit_code) == ("interrupted", 143)
    assert ending.message == "second SIGTERM: stopped at once, no checkpoint for step 2"
    assert len(watcher.rounds) == 2 and watcher.ended == 1


@pytest.mark.slow
def test_too_many_skipped_updates_in_a_row_stop_the_session(session):
    loop = new_loop(session)
    loop.update = UpdateResult(_outcome("overflow"))
    session.state.consecutive_skips = session.config.train.max_consecutive_skips
    ending = stop_requested(loop)
    assert (ending.reason, ending.exit_code) == ("stopped", 1) and "last reason: overflow" in ending.message
    session.state.consecutive_skips -= 1
    assert stop_requested(loop) is None


@pytest.mark.slow
def test_a_callbacks_stop_request_ends_the_session_after_its_update_with_a_last_round(session):
    from pilotrun.training.callbacks.base import Ending

    class StopAtTwo(Watcher):
        def stop_request(self, loop):
            return Ending("stopped", 1, f"asked at step {loop.step}") if loop.step == 2 else None

    watcher = StopAtTwo()
    ending = train_loop(new_loop(session), [watcher])
    assert (ending.reason, ending.exit_code, ending.message) == ("stopped", 1, "asked at step 2")
    assert [r[:3] for r in watcher.rounds] == [(1, True, False), (2, True, True)] and watcher.ended == 1
    loop = new_loop(session)
    loop.signals.received = signal.SIGINT  # a signal outranks a callback's request
    assert stop_requested(loop, [StopAtTwo()]).exit_code == 130


def test_a_deadline_or_a_signal_on_the_last_update_is_a_completed_run_a_spikes_stop_is_not():
    from pilotrun.training.callbacks.base import Ending

    deadline, signal_stop = Ending("deadline", 75, "deadline in 3 s"), Ending("interrupted", 130, "SIGINT")
    spike = Ending("stopped", 1, "spike at update 4")
    for asked in (deadline, signal_stop):
        assert finished_anyway(asked, 3, 4) is asked  # before the last update: it stops the run
        ending = finished_anyway(asked, 4, 4)
        assert (ending.reason, ending.exit_code) == ("completed", 0)
        assert (
            ending.message
            == f"reached max_steps=4 ({asked.reason} asked for at the last update: nothing left to stop)"
        )
    assert finished_anyway(spike, 4, 4) is spike and finished_anyway(None, 4, 4) is None


@pytest.mark.slow
def test_a_deadline_asked_at_the_last_update_ends_the_session_completed(session):
    from pilotrun.training.callbacks.base import Ending

    class DeadlineAtFour(Watcher):
        def stop_request(self, loop):
            return Ending("deadline", 75, "deadline in 1 s") if loop.step == 4 else None

    watcher = DeadlineAtFour()
    ending = train_loop(new_loop(session), [watcher])
    assert (ending.reason, ending.exit_code) == ("completed", 0)
    assert [r[:3] for r in watcher.rounds][-1] == (4, True, True) and watcher.ended == 1


@pytest.mark.slow
def test_an_error_runs_every_at_end_and_propagates(session, monkeypatch):
    def failing_update(loop):
        raise RuntimeError("planted")

    monkeypatch.setattr(loop_module, "train_one_update", failing_update)
    watcher = Watcher()
    with pytest.raises(RuntimeError, match="planted"):
        train_loop(new_loop(session), [watcher])
    assert watcher.rounds == [] and watcher.ended == 1


@pytest.mark.slow
def test_around_update_wraps_each_attempt(session):
    import contextlib

    seen = []

    class Around(Callback):
        @contextlib.contextmanager
        def around_update(self, loop):
            seen.append(("before", loop.step))
            yield
            seen.append(("after", loop.step))

    train_loop(new_loop(session), [Around()])
    assert seen[:4] == [("before", 0), ("after", 1), ("before", 1), ("after", 2)] and len(seen) == 8


def _outcome(reason: str):
    from pilotrun.training.precision import UpdateOutcome

    return UpdateOutcome(False, reason, float("inf"), False, 1.0, 0.5)


class TwoRankGroup:
    """Two ranks as two threads in step, standing in for the process group: each collective waits for both
    ranks' values, as gloo's would, so `stop_requested` takes its decision exactly as under torchrun."""

    def __init__(self) -> None:
        self.barrier, self.values, self.local = (
            threading.Barrier(2, timeout=30),
            [None, None],
            threading.local(),
        )

    def exchange(self, value):
        self.values[self.local.rank] = value
        self.barrier.wait()
        seen = list(self.values)
        self.barrier.wait()
        return seen

    def all_reduce(self, flat, op):
        flat.copy_(torch.stack(self.exchange(flat.clone())).amax(0))  # the agreement's only reduction: max

    def all_gather_object(self, out, value):
        out[:] = self.exchange(value)


def deadline_rank(group: TwoRankGroup, rank: int, offset: float, stop_by: float, decided: dict) -> None:
    """One rank's session on its own injected clock (`offset` seconds ahead of the other's): 0.5 s updates and
    0.1 s rounds, a deadline callback asked after each update, until the agreed stop."""
    from pilotrun.training.callbacks.deadline_stop import DeadlineCallback
    from pilotrun.training.distributed import DistributedContext

    group.local.rank = rank
    now = [1000.0 + offset]
    state = types.SimpleNamespace(step=0, consecutive_skips=0)
    session = types.SimpleNamespace(
        context=DistributedContext(rank=rank, world_size=2, backend="gloo"),
        state=state,
        config=types.SimpleNamespace(train=types.SimpleNamespace(max_consecutive_skips=9)),
    )
    loop = types.SimpleNamespace(
        session=session, signals=StopSignals(), update=None, last_save_seconds=2.0, step=0
    )
    callback = DeadlineCallback(stop_by, setup_seconds=3.0, clock=lambda: now[0])
    while True:
        with callback.around_update(loop):
            now[0] += 0.5
        state.step = loop.step = state.step + 1
        asked_here = callback.stop_request(loop)
        ending = stop_requested(loop, [callback])
        if ending is not None:
            decided[rank] = (ending, asked_here is not None, now[0], callback.margin(loop))
            return
        now[0] += 0.1


def test_two_ranks_stop_for_a_deadline_at_the_same_update_in_the_first_asking_rank_s_words(monkeypatch):
    """The decision the two-rank deadline run takes, on injected clocks (rank 1's 0.4 s ahead of rank 0's):
    the rank whose clock first sees the margin reach the deadline stops both at that update, in its words, and
    the last round with its save lands before the deadline on either clock."""
    import pilotrun.training.distributed as distributed

    group, decided = TwoRankGroup(), {}
    monkeypatch.setattr(distributed.dist, "all_reduce", group.all_reduce)
    monkeypatch.setattr(distributed.dist, "all_gather_object", group.all_gather_object)
    ranks = [threading.Thread(target=deadline_rank, args=(group, rank, 0.4 * rank, 1030.2, decided))
             for rank in (0, 1)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=60)
    (ending0, asked0, now0, margin0), (ending1, asked1, now1, margin1) = decided[0], decided[1]
    assert ending0 == ending1 and (ending0.reason, ending0.exit_code) == ("deadline", 75)
    assert asked1 and not asked0  # rank 0's clock alone would have gone on: the agreement stopped it
    assert "checkpoint step 45" in ending0.message and ending0.message.startswith("deadline in 2.9 s")
    # the last round and the save, on either clock
    assert now1 + 0.1 + 2.0 < 1030.2 and now0 + 0.1 + 2.0 < 1030.2
    assert now1 + margin1 >= 1030.2 > now0 + margin0
