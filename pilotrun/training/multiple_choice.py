"""Multiple-choice scoring by log-likelihood: the one definition the in-loop callback, `pilotrun evaluate` and
its lm-eval model class share, so that their figures for the same checkpoint and task are the same numbers.

A choice's score is the sum, over the choice's tokens, of the log-probability the model gives each token after
the context and the choice's tokens before it. The context is encoded on its own and the choice on its own
(plainly: a literal special-token string is text, as in the data), then joined, and the end-of-document id is
put before them: every document the model trained on followed one, so an example starts where a document
does. A sequence longer than the model's `max_seq_len` + 1 keeps its last tokens (the choice, and the end of
the context). Each (context, choice) pair is one forward pass of its own, batch 1, no padding: a pair's
score does not depend on what else is scored with it, which keeps the figures exact across callers.

Two accuracies are reported, as the evaluation harness reports them:
  acc       the choice with the highest summed log-likelihood (ties: the first);
  acc_norm  the highest log-likelihood per character of the choice's text (long choices are not penalised
            for their length); at equal lengths it is acc.
`chance` is the mean of 1 / choices over the examples, and `acc_above_chance` = acc - chance: what the model
knows beyond guessing. At pilot scale both hover near chance and move by a few examples; they are
evidence of learning, never of a model's quality.

The model is put in eval mode and back, nothing keeps a gradient, nothing draws from a random generator: a
scoring leaves the training exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pilotrun.common.errors import ConfigError, PilotrunError
from pilotrun.data.choice_tasks import ChoiceTask, chance_accuracy
from pilotrun.training.precision import autocast_context


@dataclass
class Scorer:
    """How to turn text into scores: the model, its tokenizer (`tokenizers.Tokenizer`, encoding plainly), the
    end-of-document id, the longest input and the forward's precision and device."""

    model: torch.nn.Module
    tokenizer: Any
    eos_id: int
    max_seq_len: int
    precision: str = "fp32"
    device: torch.device | None = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else []

    def loglikelihood(
        self, context_ids: Sequence[int], continuation_ids: Sequence[int]
    ) -> tuple[float, bool]:
        """(sum of the continuation's token log-probabilities, whether each was the model's greedy choice)."""
        if not continuation_ids:
            raise ValueError("an empty continuation has no likelihood to score")
        tokens = [self.eos_id, *context_ids, *continuation_ids][-(self.max_seq_len + 1):]
        device = self.device if self.device is not None else next(self.model.parameters()).device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        with autocast_context(self.precision, device.type):
            logits = self.model(ids[None, :-1]).logits[0]
        count = len(continuation_ids)
        logprobs = F.log_softmax(logits[-count:].float(), dim=-1)
        targets = ids[-count:]
        picked = logprobs.gather(-1, targets[:, None])[:, 0]
        greedy = bool((logprobs.argmax(dim=-1) == targets).all().item())
        return float(picked.double().sum().item()), greedy

    def text_loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        return self.loglikelihood(self.encode(context), self.encode(continuation))


def first_best(values: Sequence[float]) -> int:
    """The index of the largest value, the first among equals (NaN never wins)."""
    best = 0
    for index, value in enumerate(values):
        if not math.isnan(value) and (math.isnan(values[best]) or value > values[best]):
            best = index
    return best


def choice_beyond_window(encode: Callable[[str], list[int]], tasks: Sequence[ChoiceTask], max_seq_len: int,
                         limit: int = 0) -> str | None:
    """Why these tasks cannot be scored by a model of `max_seq_len`, or None: the first choice longer than the
    window (its log-likelihood needs every one of its tokens predicted in one forward pass; a longer context
    is cut from the front, a choice cannot be). Checked before a run or an evaluation starts, not at its first
    scoring."""
    for task in tasks:
        for index, example in enumerate(task.first(limit)):
            for number, choice in enumerate(example.choices):
                length = len(encode(choice))
                if length > max_seq_len:
                    return (
                        f"task {task.name!r} ({task.path}) example {index + 1} choice {number + 1} is "
                        f"{length} "
                        f"tokens, longer than the model's window (model.max_seq_len {max_seq_len}): it "
                        "cannot "
                        "be scored; shorten or drop it"
                    )
    return None


def check_downstream_fits(config: Any, data_dir: Any, tasks: Sequence[ChoiceTask]) -> None:
    """The in-loop downstream tasks can be scored by this model: a choice longer than its window is refused as
    the trainer is built, before anything is written, not by a traceback at the first scoring that every
    resume would meet again. Data that cannot be opened is left to the session's set-up, which names what is
    wrong."""
    t = config.train
    if not tasks or t.downstream.every <= 0:
        return
    from pilotrun.data.mixed_reader import open_data
    from pilotrun.data.tokenizer import plain

    try:
        tokenizer = plain(open_data(data_dir).load_tokenizer())
    except PilotrunError:
        return
    beyond = choice_beyond_window(
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids if text else [],
        tasks,
        config.model.max_seq_len,
        t.downstream.limit,
    )
    if beyond is not None:
        raise ConfigError(f"train.downstream.tasks: {beyond}")


def score_task(scorer: Scorer, task: ChoiceTask, limit: int = 0,
               on_example: Callable[[int, list[float]], None] | None = None) -> dict[str, Any]:
    """The figures of one task over its first `limit` examples (0: all): task, sha256, examples, acc,
    acc_norm, chance, acc_above_chance. `on_example(index, loglikelihoods)` sees every example's scores."""
    examples = task.first(limit)
    model = scorer.model
    was_training = model.training
    model.eval()
    right = right_norm = 0
    try:
        with torch.no_grad():
            for index, example in enumerate(examples):
                context_ids = scorer.encode(example.context)
                scores = [
                    scorer.loglikelihood(context_ids, scorer.encode(choice))[0] for choice in example.choices
                ]
                per_char = [s / max(1, len(c)) for s, c in zip(scores, example.choices)]
                right += first_best(scores) == example.label
                right_norm += first_best(per_char) == example.label
                if on_example is not None:
                    on_example(index, scores)
    finally:
        model.train(was_training)
    chance = chance_accuracy(examples)
    acc = right / len(examples)
    return {**task.identity(limit), "acc": acc, "acc_norm": right_norm / len(examples), "chance": chance,
            "acc_above_chance": acc - chance, "correct": right}
