"""pilotrun/training/multiple_choice.py: a choice's score is the sum of its tokens' log-probabilities after
the context; acc and acc_norm as the harness defines them; the training left as it was."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pilotrun.config import ModelConfig
from pilotrun.data.choice_tasks import read_choice_task
from pilotrun.model.transformer import build_model
from pilotrun.training.multiple_choice import Scorer, first_best, score_task


class Letters:
    """A tokenizer whose ids are the letters' codes modulo 60 (enough to score with a tiny model)."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return self._Encoding([ord(c) % 60 for c in text])


def tiny_model(max_seq_len: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_dense_layers=1, n_heads=2, q_lora_rank=0,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, dense_hidden=64,
                      max_seq_len=max_seq_len)
    return build_model(cfg)


def test_a_choice_scores_the_sum_of_its_tokens_log_probabilities_after_eos_and_context():
    model = tiny_model()
    scorer = Scorer(model, Letters(), eos_id=63, max_seq_len=16)
    with torch.no_grad():
        score, greedy = scorer.loglikelihood([1, 2, 3], [4, 5])
        logits = model(torch.tensor([[63, 1, 2, 3, 4]])).logits[0].float()
    expected = F.log_softmax(logits, dim=-1)
    by_hand = float(expected[3, 4].double() + expected[4, 5].double())
    assert score == by_hand
    assert greedy == bool(expected[3].argmax() == 4 and expected[4].argmax() == 5)
    with pytest.raises(ValueError):
        scorer.loglikelihood([1], [])


def test_a_long_example_keeps_its_last_tokens():
    model = tiny_model(max_seq_len=4)
    scorer = Scorer(model, Letters(), eos_id=63, max_seq_len=4)
    with torch.no_grad():
        long, _ = scorer.loglikelihood(list(range(1, 20)), [7, 8])
        cut, _ = scorer.loglikelihood([17, 18, 19], [7, 8])
    assert long == cut  # eos, 1..16 dropped: the window is the last 5 tokens either way


def test_first_best_takes_the_first_of_equals_and_never_a_nan():
    assert first_best([1.0, 3.0, 3.0]) == 1
    assert first_best([float("nan"), -2.0, -1.0]) == 2


def test_acc_and_acc_norm_over_examples_and_the_model_is_left_training(tmp_path):
    lines = [{"context": "ab", "choices": [" c", " dd d", " e"], "label": i % 3} for i in range(6)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    task = read_choice_task(path)
    model = tiny_model()
    model.train()
    scorer = Scorer(model, Letters(), eos_id=63, max_seq_len=16)
    seen = []
    result = score_task(scorer, task, on_example=lambda i, scores: seen.append(scores))
    assert model.training and all(p.grad is None for p in model.parameters())
    picks = [first_best(s) for s in seen]
    norm_picks = [first_best([v / len(c) for v, c in zip(s, (" c", " dd d", " e"))]) for s in seen]
    assert result["acc"] == sum(p == i % 3 for i, p in enumerate(picks)) / 6
    assert result["acc_norm"] == sum(p == i % 3 for i, p in enumerate(norm_picks)) / 6
    assert result["chance"] == 1 / 3 and result["acc_above_chance"] == result["acc"] - 1 / 3
    assert (result["task"], result["sha256"], result["examples"]) == ("t", task.sha256, 6)
    assert score_task(scorer, task, limit=2)["examples"] == 2
    assert score_task(scorer, task) == result  # nothing random: the same figures again


@pytest.mark.slow
def test_a_trained_model_beats_chance_where_an_untrained_one_does_not(task_run):
    from pilotrun.commands.export import load_checkpoint_model
    from pilotrun.data.reader import open_dataset
    from pilotrun.data.tokenizer import plain

    data, task_path, run_dir = task_run
    task = read_choice_task(task_path)
    trained, config, *_ = load_checkpoint_model(run_dir, 40)
    dataset = open_dataset(data)
    tokenizer = plain(dataset.load_tokenizer())
    torch.manual_seed(config.train.seed)
    untrained = build_model(config.model)
    figures = {name: score_task(Scorer(model, tokenizer, dataset.eos_id, config.model.max_seq_len), task)
               for name, model in (("trained", trained), ("untrained", untrained))}
    assert figures["trained"]["chance"] == 0.25
    assert figures["trained"]["acc"] >= 0.5, figures  # measured 0.55 (22 of 40) at step 40
    assert figures["untrained"]["acc"] <= 0.35, figures
