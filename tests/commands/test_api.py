"""pilotrun/commands/api.py: the Python example of docs/USING.md runs as written, and `import pilotrun` does
not import torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_python_example() -> str:
    text = (ROOT / "docs" / "USING.md").read_text()
    section = text.split("## Python API", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "docs/USING.md's Python API section has no python block"
    return match.group(1)


@pytest.mark.slow
def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_python_example(), "docs/USING.md", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()[-4:]  # after the trainer's plan and session_end lines
    assert out[0] == "completed 4" and out[1] == "True"
    assert out[2].split()[0] in ("GO", "NO-GO")
    assert out[3] == "torch.Size([1, 3, 512])"
    assert namespace["summary"].valid and (tmp_path / "runs" / "demo" / "report" / "report.html").is_file()
    assert namespace["model"].cfg.vocab_size == 512 and not namespace["model"].training


@pytest.mark.slow
def test_import_pilotrun_stays_torch_free():
    code = ("import sys, pilotrun; assert 'torch' not in sys.modules; pilotrun.train; pilotrun.summarize; "
            "assert 'torch' not in sys.modules; print(sorted(pilotrun.API))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(
        sorted(["prepare", "train", "summarize", "verdict", "load_model", "export"])
    )


def test_train_is_the_api_function_even_after_the_training_modules_load():
    """The training subpackage is `pilotrun.training`, so importing its modules binds that name, and
    `pilotrun.train` stays the API function (once the subpackage was also `train` and had to be callable)."""
    import pilotrun
    import pilotrun.training.timing  # noqa: F401
    from pilotrun.commands.api import train

    assert pilotrun.train is train and pilotrun.training.__name__ == "pilotrun.training"


def test_overrides_as_mapping_and_run_config_object():
    from pilotrun.commands.api import _run_config
    from pilotrun.config import RunConfig

    config = _run_config(None, {"train.max_steps": 7, "train.precision": "bf16", "model.route_norm": False})
    assert (config.train.max_steps, config.train.precision, config.model.route_norm) == (7, "bf16", False)
    again = _run_config(RunConfig(), ["train.max_steps=9"])
    assert again.train.max_steps == 9


def test_errors_speak_the_api_not_the_command_line(tmp_path):
    """A refusal names the keyword a Python caller passes, not the shell option; the error type is kept."""
    import pilotrun
    from pilotrun.common.errors import DataError

    out = tmp_path / "data"
    pilotrun.prepare(out, tokenizer="bpe:300", train_tokens=3000, shard_tokens=4096)
    with pytest.raises(DataError) as refused:
        pilotrun.prepare(out, tokenizer="bpe:300", train_tokens=3000)
    message = str(refused.value)
    assert "force=True" in message and "--force" not in message
    # The command line keeps its own words for the same refusal.
    from pilotrun.commands.api import in_api_words

    assert in_api_words("train", "pass --resume to continue it") == "pass resume=True to continue it"
    assert in_api_words("summarize", "see --help") == "see --help"  # no API name for it: left as it is
