"""The Python API for notebooks and scripts: the commands as functions that return objects, not exit codes.

    import pilotrun pilotrun.prepare("data/edu", source="builtin", tokenizer="bpe:1024") result =
    pilotrun.train("configs/smoke.yaml", data="data/edu", run_dir="runs/a", overrides=["train.max_steps=4"])
    summary = pilotrun.summarize("runs/a")          # .valid, .reasons, .overall
    verdict = pilotrun.verdict("runs/a")            # .decision "GO" / "NO-GO", .rules; writes runs/a/report/
    model = pilotrun.load_model("runs/a")           # the newest checkpoint's model, eval mode, CPU
    pilotrun.export("runs/a", "hf/a")               # a transformers DeepSeek-V3 folder

Each function is a thin call into the package, like the command it mirrors; bad input raises
`pilotrun.common.errors.PilotrunError` (the CLI's exit 2) with the command's one-line message in this API's
words: a message that says "pass --force" to a person at a shell says "pass force=True" to a Python caller.
`import pilotrun` stays cheap: these names are resolved on first use (see `pilotrun/__init__.py`), and torch
is imported only then.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pilotrun.common.errors import PilotrunError

F = TypeVar("F", bound=Callable[..., Any])

# What each command-line option is called in this API, per function (an option the API does not have keeps
# its command-line spelling, which is then still the honest name of the thing).
API_WORDS: dict[str, dict[str, str]] = {
    "prepare": {
        "--force": "force=True",
        "--out": "out",
        "--source": "source=",
        "--tokenizer": "tokenizer=",
        "--train-tokens": "train_tokens=",
        "--val-fraction": "val_fraction=",
        "--shard-tokens": "shard_tokens=",
        "--shuffle-buffer": "shuffle_buffer=",
        "--workers": "workers=",
        "--eos": "eos=",
        "--text-field": "text_field=",
        "--seed": "seed=",
    },
    "train": {
        "--resume": "resume=True",
        "--allow-change": "allow_changes=[...]",
        "--from-step": "from_step=",
        "--set": "overrides=",
        "--config": "config",
        "--run-dir": "run_dir",
        "--data": "data=",
    },
    "summarize": {"--require-step": "require_step=", "--require-eval": "require_eval=[...]"},
    "verdict": {"--threshold": "thresholds={...}", "--no-resume-required": "resume_required=False"},
    "export": {"--out": "out", "--step": "step=", "--data": "data="},
    "load_model": {"--step": "step="},
}


def in_api_words(function_name: str, message: str) -> str:
    """`message` with each command-line option of `function_name`'s command replaced by its keyword here."""
    words = API_WORDS.get(function_name, {})
    return re.sub(r"--[a-z][a-z-]*", lambda m: words.get(m.group(0), m.group(0)), message)


def speaks_api(function: F) -> F:
    """Re-raise a PilotrunError of the call as the same error type in this API's words."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except PilotrunError as error:
            reworded = in_api_words(function.__name__, str(error))
            if reworded == str(error):
                raise
            raise type(error)(reworded) from error

    return wrapper  # type: ignore[return-value]


@speaks_api
def prepare(
    out: str | Path, source: str = "builtin", tokenizer: str = "bpe:4096", **options: Any
) -> dict[str, Any]:
    """`pilotrun prepare`: write a data folder; returns its manifest (metadata.json). `options` are
    prepare_corpus's keywords (train_tokens, val_fraction, shard_tokens, seed, shuffle_buffer, workers, eos,
    text_field, force, progress)."""
    from pilotrun.data.prepare import prepare_corpus

    options.setdefault("progress", False)
    return prepare_corpus(out, source=source, tokenizer=tokenizer, **options)


def _run_config(config: Any, overrides: Sequence[str] | Mapping[str, Any]):
    from pilotrun.config import RunConfig, config_to_dict, load_run_config

    if isinstance(overrides, Mapping):
        overrides = [f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                     for key, value in overrides.items()]
    if isinstance(config, RunConfig):
        from pilotrun.config import apply_overrides, loaded_recipe

        return loaded_recipe(apply_overrides(config_to_dict(config), list(overrides)))
    return load_run_config(config, list(overrides))


@speaks_api
def train(config: str | Path | Any = None, *, data: str | Path, run_dir: str | Path, resume: bool = False,
          from_step: int | None = None, overrides: Sequence[str] | Mapping[str, Any] = (),
          allow_changes: Sequence[str] = (), progress: bool = False, sinks: Sequence[Any] = ()):
    """`pilotrun train` in this process (one process, no torchrun). `config`: a YAML path, a RunConfig or None
    (the defaults); `overrides`: ["train.max_steps=200", ...] or {"train.max_steps": 200}. `sinks`: trackers
    that receive every event as it is recorded (`pilotrun.run.sinks.MetricsSink`: `write(event)`,
    `close()`; a failing one warns once and is switched off, the run and metrics.jsonl go on untouched).
    Returns the TrainResult (reason, exit_code, step, tokens_seen, ...)."""
    from pilotrun.training.trainer import Trainer

    run_config = _run_config(config, overrides)
    trainer = Trainer(
        run_config,
        data,
        run_dir,
        resume=resume,
        from_step=from_step,
        allow_changes=list(allow_changes),
        command=["pilotrun.train", str(config)],
        progress=progress,
        sinks=list(sinks),
    )
    return trainer.run()


@speaks_api
def summarize(run_dir: str | Path, require_step: int | None = None, require_eval: Sequence[str] = ()):
    """`pilotrun summarize`: the validated, reconciled Summary (.valid, .reasons, .overall, .sessions)."""
    from pilotrun.report.record_check.summarize import summarize_run

    return summarize_run(run_dir, require_step=require_step, require_eval=list(require_eval))


@speaks_api
def verdict(run_dir: str | Path, thresholds: Mapping[str, Any] | None = None, resume_required: bool = True,
            write_report: bool = True):
    """`pilotrun verdict`: the Verdict (.decision is "GO" or "NO-GO", .rules the evidence). `thresholds`
    overrides rule thresholds by name ({"min_loss_drop": 0.1}); writes RUN/report/ unless told not to."""
    from pilotrun.report.verdict.thresholds import Thresholds, parse_thresholds
    from pilotrun.report.verdict.verdict import judge

    base = Thresholds(resume_required=resume_required)
    chosen = parse_thresholds([f"{k}={v}" for k, v in (thresholds or {}).items()], base)
    result = judge(run_dir, chosen)
    if write_report:
        from pilotrun.report.drawing.html import write_report as write

        write(result)
    return result


@speaks_api
def load_model(run_dir: str | Path, step: int | None = None):
    """The model of a committed checkpoint (the newest, or `step`), files rehashed first, in eval mode on the
    CPU in fp32; `model(tokens).logits` gives [B, T, V]. Its recipe is `model.cfg`."""
    from pilotrun.commands.export import load_checkpoint_model

    model, *_ = load_checkpoint_model(run_dir, step)
    return model


@speaks_api
def export(run_dir: str | Path, out: str | Path, step: int | None = None, data: str | Path | None = None
           ) -> dict[str, Any]:
    """`pilotrun export`: a Hugging Face DeepSeek-V3 folder (safetensors, config.json, tokenizer)."""
    from pilotrun.commands.export import export_run

    return export_run(run_dir, out, step=step, data_dir=data)
