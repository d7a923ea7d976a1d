"""Downstream evaluation in the loop: the multiple-choice tasks of `train.downstream.tasks` scored every
`train.downstream.every` applied updates, logged as a `downstream` event; the "eval" phase.

Each task's figures (training/multiple_choice.py: acc, acc_norm, chance, acc_above_chance, the examples
scored, the task file's sha256) go under `tasks.<name>` of one event, so every tracker shows them as
`downstream/tasks/<name>/acc`, the report plots them and watch follows them. The scoring is the one `pilotrun
evaluate` runs on a committed checkpoint: a callback at the same step as a checkpoint (priority after the val
loss, before the checkpoint) gives the figures `evaluate` gives for that checkpoint, bit for bit.

Like the val loss, it leaves the training exactly as it was: eval mode and back, no gradient, no random draw,
the training loader untouched. Every rank scores (an FSDP model's forward needs them all); rank 0 logs. The
task files are read and checked when the trainer is built, before anything is written.
"""

from __future__ import annotations

import time

from pilotrun.config import DownstreamConfig
from pilotrun.data.choice_tasks import ChoiceTask, read_choice_tasks
from pilotrun.data.tokenizer import plain
from pilotrun.training.callbacks.base import PRIORITY_EVAL, Callback, LoopState, due_on_cadence
from pilotrun.training.multiple_choice import Scorer, score_task
from pilotrun.training.session import Session

PRIORITY_DOWNSTREAM = PRIORITY_EVAL + 5  # after the val loss, before the checkpoint of the same step


def session_scorer(session: Session) -> Scorer:
    """The scorer of a training session: its model (unwrapped), its data's tokenizer, its precision."""
    config = session.config
    return Scorer(session.raw_model, plain(session.dataset.load_tokenizer()), session.dataset.eos_id,
                  config.model.max_seq_len, config.train.precision, session.device)


class DownstreamEvalCallback(Callback):
    """Scores every task after every `every`-th applied update (0, or no task: never); built from its section,
    `train.downstream`."""

    priority = PRIORITY_DOWNSTREAM
    phase = "eval"

    def __init__(self, section: DownstreamConfig, tasks: list[ChoiceTask] | None = None) -> None:
        self.section = section
        self.tasks = tasks if tasks is not None else read_choice_tasks(section.tasks)
        self._scorer: Scorer | None = None

    def due(self, loop: LoopState) -> bool:
        return bool(self.tasks) and due_on_cadence(loop, self.section.every)

    def after_update(self, loop: LoopState) -> None:
        if self._scorer is None:
            self._scorer = session_scorer(loop.session)
        started = time.perf_counter()
        figures = {}
        for task in self.tasks:
            result = score_task(self._scorer, task, self.section.limit)
            figures[result.pop("task")] = result
        loop.log("downstream", tasks=figures, limit=self.section.limit,
                 seconds=time.perf_counter() - started)
