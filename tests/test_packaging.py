"""A built wheel works on its own: installed into a fresh virtual environment it has the recipes, and
`pilotrun pilot --help` and `pilotrun config --config stability` run from a folder that is not the
checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps` from a clean copy of the sources (no build/ or egg-info left in the checkout)."""
    source = out / "src"
    shutil.copytree(ROOT / "pilotrun", source / "pilotrun", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out / "dist"),
                             str(source)], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"cannot build a wheel here (pip needs setuptools>=68 from an index): {tail}")
    (wheel,) = (out / "dist").glob("pilotrun-*.whl")
    return wheel


def fresh_venv_seeing_current_packages(folder: Path) -> Path:
    """A new venv whose own site-packages comes first, then this interpreter's (torch, numpy, ...) through a
    .pth file; `--system-site-packages` would not see packages installed in this interpreter's venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], *[p for p in sys.path if p.endswith("site-packages")]}
    (Path(site) / "_current_packages.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


@pytest.mark.slow
def test_wheel_installs_with_recipes_and_runs_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for recipe in ("stability", "smoke", "overfit", "acceptance"):
        assert f"pilotrun/configs/{recipe}.yaml" in names
        assert f"pilotrun/configs/gpu/{recipe}.yaml" in names
    python = fresh_venv_seeing_current_packages(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import pilotrun; print(pilotrun.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv")  # the wheel's copy, not the checkout
    script = tmp_path / "venv" / "bin" / "pilotrun"
    assert (
        subprocess.run([str(script), "pilot", "--help"], cwd=elsewhere, capture_output=True).returncode == 0
    )
    shown = subprocess.run([str(script), "config", "--config", "stability", "--json"], cwd=elsewhere,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    rows = {r["key"]: r["value"] for r in json.loads(shown.stdout)}
    assert rows["train.max_steps"] == 240 and rows["optim.schedule.horizon"] == 240
    recipe_dir = subprocess.run(
        [str(python), "-c", "from pilotrun.commands.pilot import configs_dir; print(configs_dir())"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(recipe_dir.stdout.strip()).is_relative_to(tmp_path / "venv")


def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_extras_are_split_by_feature_and_dev_is_what_the_tests_need():
    extras = _extras()
    assert set(extras["dev"]) == (set(extras["test"]) | set(extras["export"]) | set(extras["trackers"])
                                  | set(extras["eval"]) | set(extras["datatrove"]))
    assert set(extras["trackers"]) == set().union(
        *(extras[t] for t in ("tensorboard", "wandb", "mlflow", "trackio"))
    )
    assert extras["hf"] == extras["export"]  # the older name of the export extra
    for heavy in (
        "transformers",
        "tensorboard",
        "wandb",
        "mlflow-skinny",
        "sqlalchemy",
        "alembic",
        "trackio",
    ):
        assert not any(r.startswith(heavy) for r in extras["test"]), heavy


def test_make_pilot_installs_the_base_alone_and_make_test_the_dev_extra():
    import importlib.util

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    spec = importlib.util.spec_from_file_location("describe_extras", ROOT / "scripts" / "describe_extras.py")
    describe_extras = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(describe_extras)
    # `make -n` prints the commands without running them: nothing is installed here.
    pilot = subprocess.run(
        ["make", "-n", "-B", "pilot"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert 'pip install -q -e "."' in pilot and "scripts/describe_extras.py \"base\"" in pilot
    assert "touch .venv/.installed-base" in pilot
    test = subprocess.run(
        ["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert 'pip install -q -e ".[dev]"' in test and "touch .venv/.installed-dev" in test
    said = describe_extras.describe("base")
    assert said == ["[make] 4/5 installing pilotrun (editable), no extra",
                    "[make]   base: torch, numpy, tokenizers, pyarrow, pyyaml, matplotlib, tqdm, ninja"]
    assert describe_extras.describe("dev,hub")[-1] == "[make]   [hub]: datasets, huggingface_hub"
    assert "transformers" in describe_extras.describe("export")[-1]


def test_the_readme_says_what_make_test_installs_lm_eval_and_its_dependencies_included():
    """`make test` installs `dev`; the README's install text names every extra that `dev` is made of and says
    that lm-eval brings its own dependencies, naming them (a few hundred MB a reader would otherwise meet
    unannounced)."""
    extras = _extras()
    readme = " ".join((ROOT / "README.md").read_text().split())
    start = readme.index("`make test` installs the `dev` extra")
    said = readme[start:readme.index("Other extras", start)]
    parts = [name for name in ("test", "export", "trackers", "datatrove", "eval", "hub")
             if set(extras[name]) <= set(extras["dev"])]
    assert parts == ["test", "export", "trackers", "datatrove", "eval"]
    for name in parts:
        assert f"`{name}`" in said, name
    assert "lm-eval" in said and "brings its own dependencies" in said
    for dependency in ("datasets", "evaluate", "scikit-learn", "sacrebleu", "rouge-score"):
        assert dependency in said, dependency
