"""A multiple-choice task made deterministically from the shared FineWeb-Edu documents (../shared/fixtures).

Each example is the opening of a document as the context and, as choices, its true next words against the same
words in shuffled orders: a model that has learned how English words follow each other tells the text from
its shuffles, an untrained one is left to guess (chance 1 / CHOICES). The choices have the same characters, so
acc_norm is acc here. The shuffles are seeded per example (random.Random(seed) is stable across Python
versions): the same fixture gives the same file byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
FINEWEB_JSONL = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"
GPT2_TOKENIZER = FIXTURES / "tokenizers" / "gpt2" / "tokenizer.json"
CHOICES = 4


def require_fixture(path: Path) -> Path:
    if not path.exists():
        pytest.skip(
            f"shared test fixture {path} is absent (expected ../shared/fixtures beside the repository)"
        )
    return path


def fineweb_texts() -> list[str]:
    lines = require_fixture(FINEWEB_JSONL).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def _cut(text: str, start: int, length: int) -> str:
    """`length` characters of `text` from `start`, ended at the next space (whole words)."""
    end = text.find(" ", start + length)
    return text[start:end if end > 0 else len(text)]


def continuation_examples(texts: list[str], count: int, context_chars: int = 160,
                          choice_chars: int = 40) -> list[dict]:
    """`count` examples over the first documents (module docstring); the label walks 0, 1, 2, 3, 0, ..."""
    examples = []
    for index in range(count):
        text = texts[index]
        cut = text.rfind(" ", 0, context_chars)
        context = text[:cut]
        true = _cut(text, cut, choice_chars)
        words = true.split()
        distractors: list[str] = []
        generator = random.Random(index)
        while len(distractors) < CHOICES - 1 and len(words) > 2:
            shuffled = " " + " ".join(generator.sample(words, len(words)))
            if shuffled != true and shuffled not in distractors:
                distractors.append(shuffled)
        label = index % CHOICES
        choices = distractors[:label] + [true] + distractors[label:]
        examples.append({"context": context, "choices": choices, "label": label})
    return examples


def write_task(path: Path, examples: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in examples), encoding="utf-8")
    return path


def fineweb_task(folder: Path, count: int = 40, name: str = "fineweb_next") -> Path:
    """The task file `folder/<name>.jsonl` of `count` examples."""
    return write_task(folder / f"{name}.jsonl", continuation_examples(fineweb_texts(), count))


def prepare_fineweb(out: Path) -> Path:
    """The FineWeb-Edu fixture as a data folder, with a 1,024-token byte-level BPE trained on it (a small
    vocabulary keeps a test's model cheap)."""
    from pilotrun.data.prepare import prepare_corpus

    prepare_corpus(out, source=str(require_fixture(FINEWEB_JSONL)), tokenizer="bpe:1024", progress=False)
    return out


def task_recipe(task: Path, steps: int = 40, every: int = 20, seed: int = 0, extra: tuple[str, ...] = ()):
    """The smoke recipe at a size that learns the task in `steps` updates, scoring it every `every` updates
    and committing a checkpoint at the same steps."""
    from pilotrun.config import load_run_config

    return load_run_config(
        REPO_ROOT / "configs" / "smoke.yaml",
        [
            "train.num_threads=1",
            f"train.max_steps={steps}",
            f"train.checkpoint_every={every}",
            "train.log_every=10",
            "train.eval_every=0",
            "train.keep_checkpoints=5",
            f"train.seed={seed}",
            "train.seq_len=64",
            "train.batch_size=8",
            f"train.downstream_tasks=[{task}]",
            f"train.downstream_every={every}",
            f"optim.schedule.horizon={steps}",
            "optim.muon.lr=0.01",
            "optim.adamw.lr=0.01",
            *extra,
        ],
    )


def train_task_run(data: Path, task: Path, run_dir: Path, **recipe) -> Path:
    import io

    from pilotrun.training.trainer import Trainer

    result = Trainer(task_recipe(task, **recipe), data, run_dir, progress=False, out=io.StringIO()).run()
    assert result.exit_code == 0, result
    return run_dir
