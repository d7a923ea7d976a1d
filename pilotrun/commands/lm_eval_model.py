"""EleutherAI's lm-evaluation-harness (the `lm-eval` package, the `eval` extra) on a pilotrun checkpoint.

The harness asks a model for the log-likelihood of continuations; `PilotrunLM` answers with pilotrun's own
scorer (training/multiple_choice.py), the model loaded from the committed checkpoint in pilotrun's own module:
the forward is the one training ran, not a re-implementation in another library, so the logits are the trained
model's exactly, and the harness's accuracy on a task equals pilotrun's own scoring of the same examples
(tests/commands/test_lm_eval_model.py checks it example by example). Only log-likelihood requests are
answered: multiple-choice tasks (HellaSwag, ARC, PIQA, ...). A generative task is refused with one line.

Tasks are named as the harness names them (it downloads their data when online), or given as local pilotrun
task files (data/choice_tasks.py), which are handed to the harness as a task of its own format: the file's
examples as a JSON dataset, the context as the prompt, the choices as the continuations with no delimiter
added, the label as the target, acc and acc_norm as the metrics. Whatever the harness reads or caches for a
local task stays in a temporary folder removed afterwards.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError, PilotrunError
from pilotrun.data.choice_tasks import ChoiceTask
from pilotrun.training.multiple_choice import Scorer

EXTRA_HINT = "pip install 'pilotrun[eval]'"


def import_lm_eval():
    """The lm_eval module, or ConfigError naming the extra."""
    try:
        import lm_eval
        from lm_eval.api.model import LM  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--harness lm-eval needs EleutherAI's lm-evaluation-harness: {EXTRA_HINT}"
        ) from None
    return lm_eval


def harness_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def pilotrun_lm(scorer: Scorer):
    """An instance of the harness's LM answering with `scorer` (the class is made here, where lm_eval is
    importable, so that importing this module never needs the extra)."""
    from lm_eval.api.model import LM

    class PilotrunLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            model = scorer.model
            was_training = model.training
            model.eval()
            try:
                import torch

                with torch.no_grad():
                    return [scorer.text_loglikelihood(*request.args) for request in requests]
            finally:
                model.train(was_training)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            raise PilotrunError(
                "pilotrun's harness model answers multiple-choice (log-likelihood) tasks only; a "
                "perplexity task was requested"
            )

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            raise PilotrunError(
                "pilotrun's harness model answers multiple-choice (log-likelihood) tasks only; a "
                "generative task was requested"
            )

    return PilotrunLM()


def local_task_config(task: ChoiceTask, cache_dir: Path) -> dict[str, Any]:
    """The harness task config of a local task file (module docstring)."""
    metric = {"aggregation": "mean", "higher_is_better": True}
    return {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(Path(task.path).resolve())},
            "cache_dir": str(cache_dir),
        },
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc", **metric}, {"metric": "acc_norm", **metric}],
        "metadata": {"version": 1.0, "sha256": task.sha256},
    }


def run_harness(scorer: Scorer, names: list[str], files: list[ChoiceTask], *, shots: int, limit: int,
                seed: int) -> dict[str, Any]:
    """Run the harness on harness task `names` and local task `files`; returns {"tasks": {name: figures},
    "output": the harness's results (JSON-safe, samples left out), "samples": {name: [per-example
    log-likelihoods]}}. Figures: acc, acc_norm, examples, version, data sha256, shots."""
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="pilotrun-lm-eval-") as temp:
        folder = Path(temp)
        for task in files:
            (folder / f"{task.name}.yaml").write_text(json.dumps(local_task_config(task, folder / "cache")))
        manager = TaskManager(include_path=str(folder)) if files else TaskManager()
        unknown = [name for name in names if name not in manager.all_tasks]
        if unknown:
            raise PilotrunError(
                f"--tasks: unknown task {', '.join(unknown)}: neither a task file (.jsonl) nor "
                "a task of the evaluation harness"
            )
        try:
            out = lm_eval.simple_evaluate(
                model=pilotrun_lm(scorer),
                tasks=[*names, *(t.name for t in files)],
                num_fewshot=shots,
                limit=limit or None,
                bootstrap_iters=0,
                log_samples=True,
                task_manager=manager,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        except OSError as exc:  # ConnectionError included: a harness task's data is downloaded from the hub
            raise PilotrunError(
                f"--tasks: the harness could not load a task's data ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); its own tasks are downloaded from the "
                "Hugging Face hub, which needs the network"
            ) from None
    hashes = out.get("task_hashes") or {}
    file_hash = {t.name: t.sha256 for t in files}
    tasks, samples = {}, {}
    for name, metrics in (out.get("results") or {}).items():
        rows = sorted((out.get("samples") or {}).get(name) or [], key=lambda row: row.get("doc_id", 0))
        samples[name] = [[float(r[0]) for r in row.get("filtered_resps") or row.get("resps")] for row in rows]
        tasks[name] = {
            "acc": metrics.get("acc,none"),
            "acc_norm": metrics.get("acc_norm,none"),
            "examples": (out.get("n-samples") or {}).get(name, {}).get("effective", len(rows)),
            "version": (out.get("versions") or {}).get(name),
            "sha256": file_hash.get(name, hashes.get(name)),
            "shots": (out.get("n-shot") or {}).get(name),
            # guessing's accuracy, from each scored example's number of choices (data/choice_tasks.py)
            "chance": sum(1.0 / len(row) for row in samples[name]) / len(samples[name])
            if samples[name] and all(samples[name]) else None,
        }
    output = {k: out.get(k) for k in ("results", "versions", "n-shot", "n-samples", "configs", "task_hashes")}
    return {"tasks": tasks, "output": json.loads(json.dumps(output, default=str)), "samples": samples}
