"""Bad input and a hostile environment through the real command line (in process): one line on stderr, the
contract's exit code, no traceback, and nothing already written changed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
THREADS = ["--set", "train.num_threads=1"]


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file and link under `root` with its content hash (links: their target), folders as markers."""
    out = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            out[name] = "link:" + os.readlink(path)
        elif path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[name] = "dir"
    return out


def tree_state(root: Path) -> dict[str, tuple[str, int]]:
    """tree_hashes with each entry's modification time (ns), the folder itself included: a command that wrote
    a file and put its bytes back still shows, by its time or its folder's."""
    hashes = {".": "dir", **tree_hashes(root)}
    return {name: (kind, os.stat(root / name, follow_symlinks=False).st_mtime_ns)
            for name, kind in hashes.items()}


def run_cli(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


@pytest.fixture(scope="module")
def small_run(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("bad-input") / "run"
    assert (
        main(
            [
                "train",
                "--config",
                SMOKE,
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(run_dir),
                *THREADS,
                "--set",
                "train.max_steps=4",
            ]
        )
        == 0
    )
    return run_dir


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def _damage_run(run_dir: Path, kind: str) -> None:
    if kind == "torn-run-json":
        text = (run_dir / "run.json").read_text()
        (run_dir / "run.json").write_text(text[: len(text) // 2])
    elif kind == "metrics-folder":
        (run_dir / "metrics.jsonl").unlink()
        (run_dir / "metrics.jsonl").mkdir()
    elif kind == "metrics-not-utf8":
        lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
        lines[2] = lines[2][:12] + b"\xff" + lines[2][12:]
        (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines))
    elif kind == "run-json-no-recipe":
        data = json.loads((run_dir / "run.json").read_text())
        del data["recipe"]
        (run_dir / "run.json").write_text(json.dumps(data))
    elif kind == "report-is-a-file":
        (run_dir / "report").write_text("in the way")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,command,expected",
    [
        ("torn-run-json", "resume", 2),
        ("torn-run-json", "inspect", 2),
        ("torn-run-json", "summarize", 2),
        ("metrics-folder", "resume", 2),
        ("metrics-folder", "inspect", 2),
        ("metrics-folder", "summarize", 1),
        ("metrics-folder", "verdict", 1),
        ("metrics-not-utf8", "inspect", 2),
        ("metrics-not-utf8", "summarize", 1),
        ("run-json-no-recipe", "inspect", 2),
        ("report-is-a-file", "verdict", 2),
    ],
)
def test_a_damaged_run_folder_is_refused_in_one_line(
    builtin_data_dir, small_run, tmp_path, capsys, kind, command, expected
):
    run_dir = _copy(small_run, tmp_path)
    _damage_run(run_dir, kind)
    before = tree_hashes(run_dir)
    argv = {
        "resume": [
            "train",
            "--config",
            SMOKE,
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(run_dir),
            *THREADS,
            "--resume",
            "--set",
            "train.max_steps=6",
        ],
        "inspect": ["inspect-batch", str(run_dir), "--step", "2"],
        "summarize": ["summarize", str(run_dir), "--json"],
        "verdict": ["verdict", str(run_dir), "--json"],
    }[command]
    code, err = run_cli(capsys, argv)
    assert code == expected
    if expected == 2:
        assert len(err) == 1 and err[0].startswith("pilotrun")
    after = tree_hashes(run_dir)
    if command == "verdict" and expected == 1:  # verdict's own output is R/report/
        after = {k: v for k, v in after.items() if not k.startswith("report")}
    assert after == before


def test_the_non_utf8_metrics_line_is_named_by_its_number(small_run, tmp_path, capsys):
    run_dir = _copy(small_run, tmp_path)
    _damage_run(run_dir, "metrics-not-utf8")  # the third line
    assert main(["summarize", str(run_dir), "--json"]) == 1
    reasons = json.dumps(json.loads(capsys.readouterr().out))
    assert "metrics.jsonl line 3: not UTF-8" in reasons


def _invalid_byte_on(run_dir: Path, where: str) -> int:
    """An invalid UTF-8 byte inside the middle line or the last one (`last-unterminated`: without its newline,
    where a tear could only have cut a character at the end, never put one in the middle). Its line number."""
    lines = (run_dir / "metrics.jsonl").read_bytes().rstrip(b"\n").split(b"\n")
    index = len(lines) // 2 if where == "middle" else len(lines) - 1
    lines[index] = lines[index][:30] + b"\xff" + lines[index][30:]
    ending = b"" if where == "last-unterminated" else b"\n"
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines) + ending)
    return index + 1


@pytest.mark.slow
@pytest.mark.parametrize("where", ["middle", "last", "last-unterminated"])
@pytest.mark.parametrize("command", ["summarize", "verdict", "watch", "inspect-batch"])
def test_every_reader_names_the_non_utf8_line_by_its_number(small_run, tmp_path, capsys, where, command):
    run_dir = _copy(small_run, tmp_path)
    number = _invalid_byte_on(run_dir, where)
    argv = {
        "summarize": ["summarize", str(run_dir)],
        "verdict": ["verdict", str(run_dir)],
        "watch": ["watch", str(run_dir)],
        "inspect-batch": ["inspect-batch", str(run_dir), "--step", "2"],
    }[command]
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert code == (2 if command == "inspect-batch" else 1)
    said = captured.out + captured.err
    assert f"metrics.jsonl line {number}: not UTF-8 (byte 0xff at column 31)" in said
    assert "torn last line" not in said


@pytest.mark.parametrize("argv_tail,fragment", [
    (["--train-tokens", "inf"], "--train-tokens"), (["--train-tokens", "nan"], "--train-tokens"),
    (["--shard-tokens", "inf"], "--shard-tokens"), (["--shard-tokens", "-inf"], "--shard-tokens"),
])
def test_prepare_refuses_non_finite_counts(tmp_path, capsys, argv_tail, fragment):
    code, err = run_cli(capsys, ["prepare", "--out", str(tmp_path / "out"), *argv_tail])
    assert code == 2 and len(err) == 1 and fragment in err[0]
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_an_unwritable_out_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = run_cli(capsys, ["prepare", "--out", str(blocker / "data")])
    assert code == 2 and len(err) == 1 and str(blocker) in err[0]
    assert blocker.read_text() == "x"


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "shard")


def test_a_full_disk_during_prepare_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("pilotrun.data.shards._HashingFile.write", _no_space)
    code, err = run_cli(capsys, ["prepare", "--out", str(tmp_path / "out"), "--tokenizer", "bpe:300"])
    errors = [line for line in err if "error" in line]  # prepare's progress lines share stderr
    assert code == 2 and errors == err[-1:] and os.strerror(errno.ENOSPC) in err[-1]
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_a_force_replace_keeps_the_old_data(
    builtin_data_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "data"
    shutil.copytree(builtin_data_dir, out)
    before = tree_hashes(out)
    monkeypatch.setattr("pilotrun.data.shards._HashingFile.write", _no_space)
    code, err = run_cli(capsys, ["prepare", "--out", str(out), "--tokenizer", "bpe:300", "--force"])
    errors = [line for line in err if "error" in line]  # prepare's progress lines share stderr
    assert code == 2 and errors == err[-1:] and os.strerror(errno.ENOSPC) in err[-1]
    assert tree_hashes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_config_refusals_are_one_line(builtin_data_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = Path(SMOKE).read_text()
    cases = {
        "not-utf8.yaml": (base.encode() + b"\n# \xff\xfe\n", "not UTF-8"),
        "broken.yaml": (b"model:\n  d_model: [1,\n train: {\n", "at line 4, column 1"),
        "inf-lr.yaml": (base.replace("muon: {lr: 3.0e-3", "muon: {lr: .inf").encode(), "optim.muon.lr"),
        "nan-lr.yaml": (base.replace("adamw: {lr: 3.0e-3", "adamw: {lr: .nan").encode(), "optim.adamw.lr"),
        "number-key.yaml": (b"1: 2\ntrain: {}\n", "unknown config key '1'"),
    }
    for name, (content, fragment) in cases.items():
        (tmp_path / name).write_bytes(content)
        code, err = run_cli(
            capsys,
            [
                "train",
                "--config",
                str(tmp_path / name),
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(run_dir),
            ],
        )
        assert code == 2 and len(err) == 1 and fragment in err[0], (name, err)
        assert not run_dir.exists()
    code, err = run_cli(capsys, ["train", "--config", SMOKE, "--data", str(builtin_data_dir), "--run-dir",
                                 str(run_dir), "--set", "optim.muon.lr=.inf"])
    assert code == 2 and len(err) == 1 and "finite" in err[0]


@pytest.mark.parametrize("argv", [["train", "--config"], ["frobnicate"], ["summarize"], ["inspect-batch", "x",
                                  "--step", "two"], []])
def test_bad_arguments_are_one_line_exit_2(capsys, argv):
    code, err = run_cli(capsys, argv)
    assert code == 2 and len(err) == 1 and "error" in err[0]


@pytest.mark.parametrize(
    "mutation",
    [
        "no-eos",
        "dtype",
        "splits-list",
        "tokenizer-string",
        "shard-not-object",
        "tokens-string",
        "manifest-is-a-folder",
    ],
)
def test_a_mistyped_manifest_is_refused_by_verify_and_train(builtin_data_dir, tmp_path, capsys, mutation):
    data = tmp_path / "data"
    shutil.copytree(builtin_data_dir, data)
    manifest = json.loads((data / "metadata.json").read_text())
    if mutation == "no-eos":
        del manifest["tokenizer"]["eos_id"]
    elif mutation == "dtype":
        manifest["dtype"] = "float99"
    elif mutation == "splits-list":
        manifest["splits"] = [1, 2]
    elif mutation == "tokenizer-string":
        manifest["tokenizer"] = "gpt2"
    elif mutation == "shard-not-object":
        manifest["splits"]["train"]["shards"][0] = "train_00000.npy"
    elif mutation == "tokens-string":
        manifest["splits"]["val"]["tokens"] = "many"
    if mutation == "manifest-is-a-folder":
        (data / "metadata.json").unlink()
        (data / "metadata.json").mkdir()
    else:
        (data / "metadata.json").write_text(json.dumps(manifest))
    code, err = run_cli(capsys, ["data", "verify", str(data)])
    assert code == 1
    code, err = run_cli(
        capsys, ["train", "--config", SMOKE, "--data", str(data), "--run-dir", str(tmp_path / "r")]
    )
    assert code == 2 and len(err) == 1 and "metadata.json" in err[0]
    assert not (tmp_path / "r").exists()


def _read_only(monkeypatch, root: Path) -> None:
    """Make `root` behave like a read-only folder for this process (the tests run as root, where chmod does
    not stop writes): creating a folder or opening a file for writing under it raises EACCES."""
    import builtins
    import io

    real_mkdir, real_open = os.mkdir, builtins.open

    def inside(path) -> bool:
        try:
            return Path(os.path.abspath(os.fspath(path))).is_relative_to(root)
        except TypeError:
            return False

    def mkdir(path, *args, **kwargs):
        if inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+") and not isinstance(file, int) and inside(file):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    real_os_open = os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def os_open(path, flags, *args, **kwargs):  # the writers that refuse links open with os.open (O_NOFOLLOW)
        if flags & writing and inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)


def test_read_only_folders_are_one_line(builtin_data_dir, small_run, tmp_path, capsys, monkeypatch):
    run_dir = _copy(small_run, tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    before = tree_hashes(tmp_path)
    _read_only(monkeypatch, locked)
    # The report is built beside report/ (RUN/.report.tmp-PID) and swapped in: a read-only run folder stops
    # it.
    _read_only_run = run_dir
    cases = [
        (["prepare", "--out", str(locked / "data"), "--tokenizer", "bpe:300"], str(locked)),
        (
            [
                "train",
                "--config",
                SMOKE,
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(locked / "run"),
                *THREADS,
            ],
            str(locked / "run"),
        ),
    ]
    for argv, fragment in cases:
        code, err = run_cli(capsys, argv)
        assert code == 2 and len(err) == 1 and fragment in err[0] and os.strerror(errno.EACCES) in err[0], err
    monkeypatch.undo()
    _read_only(monkeypatch, _read_only_run)
    code, err = run_cli(capsys, ["verdict", str(run_dir), "--json"])
    assert code == 2 and len(err) == 1 and "report" in err[0] and os.strerror(errno.EACCES) in err[0], err
    monkeypatch.undo()
    assert tree_hashes(tmp_path) == before


def test_a_run_folder_path_through_a_file_is_one_line(builtin_data_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = run_cli(capsys, ["train", "--config", SMOKE, "--data", str(builtin_data_dir), "--run-dir",
                                 str(blocker / "run"), *THREADS])
    assert code == 2 and len(err) == 1 and str(blocker) in err[0]
    assert blocker.read_text() == "x"


def test_a_typo_in_an_allow_change_key_is_refused_with_the_nearest_key_and_nothing_changed(
    builtin_data_dir, small_run, tmp_path, capsys
):
    run_dir = _copy(small_run, tmp_path)
    before = tree_hashes(run_dir)
    argv = ["train", "--config", SMOKE, "--data", str(builtin_data_dir), "--run-dir", str(run_dir), *THREADS,
            "--resume", "--set", "train.max_steps=6", "--allow-change", "optim.muon.lrr"]
    code, err = run_cli(capsys, argv)
    assert code == 2 and len(err) == 1
    assert "--allow-change optim.muon.lrr: no such key; did you mean 'optim.muon.lr'?" in err[0]
    assert tree_hashes(run_dir) == before
