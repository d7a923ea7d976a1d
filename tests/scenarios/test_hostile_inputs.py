"""Property test: generated damage to the files pilotrun reads, run through the real commands (cli.main in
process). Whatever the damage, a command
- never raises (no traceback) and exits with a code its contract allows,
- never exits 0 where the contract says refuse (each target names the damage that must be refused),
- never changes a file outside its own output (the whole sandbox is hashed before and after).

Targets: metadata.json (`data verify`, `inspect-batch`, which opens the data and checks its identity),
run.json (`summarize`, `inspect-batch`, `train --resume`), metrics.jsonl (`summarize`, `verdict`),
COMMITTED.json (`train --resume`) and the YAML recipe (`train`, refused for its missing data folder once the
recipe is accepted, so that a valid recipe costs no training). Damage: truncation, byte flips, inserted
non-UTF-8 bytes, and on the parsed JSON/YAML: type changes, removed keys, extra keys and path-like names.
Every example is counted (`CASES`); the last test checks the count.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pilotrun.commands.cli import main
from pilotrun.common.files import canonical_json
from pilotrun.run.marker import MARKER_NAME, step_folder_name
from pilotrun.training.checkpoint.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
CASES: dict[str, int] = {}
PLANNED = {"metadata": 60, "run_json": 60, "metrics": 60, "verdict": 2, "marker": 12, "config": 80}
PATH_LIKE = ["../../etc/passwd", "/etc/passwd", "..", ".", "", "a/b", "step-00000002/../x", "C:\\x", "\x00",
             "~/.ssh/id_rsa", "COMMITTED.json"]
REPLACEMENTS = st.sampled_from([None, True, -1, 0, 2**63, 1e308, float("nan"), "", "x", [], {}, [1, "a"],
                                {"k": None}] + PATH_LIKE)


def _settings(name: str):
    return settings(max_examples=PLANNED[name], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------ sandbox
def tree_hashes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if any(name == s or name.startswith(s + "/") for s in skip):
            continue
        if path.is_symlink():
            out[name] = "link:" + os.readlink(path)
        elif path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[name] = "dir"
    return out


@pytest.fixture(scope="module")
def sandbox(builtin_data_dir, tmp_path_factory) -> Path:
    """root/data (a copy of the built-in corpus), root/run (4 updates on it, checkpoints at 2 and 4),
    root/recipe.yaml, root/pristine (a copy of everything, to restore after each example)."""
    root = tmp_path_factory.mktemp("hostile")
    shutil.copytree(builtin_data_dir, root / "data")
    shutil.copy(SMOKE, root / "recipe.yaml")
    argv = ["train", "--config", str(root / "recipe.yaml"), "--data", str(root / "data"), "--run-dir",
            str(root / "run"), "--set", "train.num_threads=1", "--set", "train.max_steps=4", "--set",
            "train.checkpoint_every=2", "--set", "train.eval_every=2", "--set", "train.eval_batches=1"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    pristine = root.parent / f"{root.name}-pristine"
    for name in ("data", "run", "recipe.yaml"):
        source = root / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, pristine / name)
    return root


def restore(root: Path, damaged_file: str, written: str | None = None) -> None:
    """Put the pristine bytes of `damaged_file` back, and remove or replace what a command wrote (`written`:
    a folder inside root that the command owns)."""
    pristine = root.parent / f"{root.name}-pristine"
    if written is not None and os.path.lexists(root / written):
        shutil.rmtree(root / written)
        if (pristine / written).exists():
            shutil.copytree(pristine / written, root / written, symlinks=True)
    shutil.copy(pristine / damaged_file, root / damaged_file)


def run_command(argv: list[str]) -> tuple[int, str]:
    """cli.main in process; any exception escaping it is a failure of the contract (a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException as exc:  # noqa: BLE001 - exactly what the property forbids
            pytest.fail(f"{argv[0]} raised {type(exc).__name__}: {exc}")
    text = err.getvalue()
    assert "Traceback" not in text, text
    if code == 2:
        assert text.strip().splitlines()[-1].startswith("pilotrun"), text
    return code, text


def count(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


# ------------------------------------------------------------------------------------------------ damage
def json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += json_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += json_paths(item, prefix + (index,))
    return paths


def _parent(document: Any, path: tuple) -> Any:
    node = document
    for part in path[:-1]:
        node = node[part]
    return node


@st.composite
def damaged(draw, original: bytes, parse, dump) -> tuple[str, bytes]:
    """(kind, damaged bytes) for a file whose pristine bytes are `original`."""
    kind = draw(st.sampled_from(["truncate", "flip", "non-utf8", "type", "remove", "extra", "path-like"]))
    if kind == "truncate":
        return kind, original[:draw(st.integers(0, len(original) - 1))]
    if kind == "flip":
        position = draw(st.integers(0, len(original) - 1))
        flipped = original[position] ^ draw(st.integers(1, 255))
        return kind, original[:position] + bytes([flipped]) + original[position + 1:]
    if kind == "non-utf8":
        position = draw(st.integers(0, len(original)))
        return kind, original[:position] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + \
            original[position:]
    document = copy.deepcopy(parse(original))
    paths = [p for p in json_paths(document) if p]
    path = draw(st.sampled_from(paths))
    parent = _parent(document, path)
    if kind == "type":
        parent[path[-1]] = draw(REPLACEMENTS)
    elif kind == "remove":
        del parent[path[-1]]
    elif kind == "extra":
        target = draw(st.sampled_from([document] + [_parent(document, p + ("",)) for p in paths
                                                    if isinstance(_parent(document, p + ("",)), dict)]))
        target[draw(st.sampled_from(["zz_extra", "../x", "/etc/passwd"]))] = draw(REPLACEMENTS)
    else:  # path-like: a string value (a name, a file, a folder) replaced by a path that leaves its folder
        strings = [p for p in paths if isinstance(_parent(document, p)[p[-1]], str)] or paths
        where = draw(st.sampled_from(strings))
        _parent(document, where)[where[-1]] = draw(st.sampled_from(PATH_LIKE))
    return kind, dump(document)


def _json_dump(document: Any) -> bytes:
    return json.dumps(document, indent=1).encode()


def _parses_as_object(data: bytes) -> Any:
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------------------------------------ targets
@pytest.mark.slow
@_settings("metadata")
@given(st.data())
def test_damaged_metadata_json(sandbox, data):
    path = sandbox / "data" / "metadata.json"
    original = path.read_bytes()
    kind, damage = data.draw(damaged(original, json.loads, _json_dump))
    path.write_bytes(damage)
    try:
        before = tree_hashes(sandbox)
        verify, _ = run_command(["data", "verify", str(sandbox / "data")])
        inspect, _ = run_command(["inspect-batch", str(sandbox / "run"), "--step", "2"])
        assert tree_hashes(sandbox) == before
        assert verify in (0, 1) and inspect in (0, 2)
        parsed = _parses_as_object(damage)
        if parsed is None:
            assert verify == 1
        if parsed is None or canonical_json(parsed) != canonical_json(json.loads(original)):
            assert inspect == 2  # not the data the run read: the identity check refuses it
        count("metadata")
    finally:
        restore(sandbox, "data/metadata.json")


@pytest.mark.slow
@_settings("run_json")
@given(st.data())
def test_damaged_run_json(sandbox, data):
    path = sandbox / "run" / "run.json"
    original = path.read_bytes()
    kind, damage = data.draw(damaged(original, json.loads, _json_dump))
    path.write_bytes(damage)
    try:
        before = tree_hashes(sandbox)
        summarize, _ = run_command(["summarize", str(sandbox / "run"), "--json"])
        inspect, _ = run_command(["inspect-batch", str(sandbox / "run"), "--step", "3"])
        assert tree_hashes(sandbox) == before
        assert summarize in (0, 1, 2) and inspect in (0, 2)
        if _parses_as_object(damage) is None:
            assert summarize == 2 and inspect == 2
        count("run_json")
    finally:
        restore(sandbox, "run/run.json")


def _metrics_damage(draw, original: bytes) -> tuple[str, bytes, bool]:
    """(kind, bytes, must_refuse): refusal is required where a complete line is lost or unreadable."""
    lines = original.split(b"\n")[:-1]
    kind = draw(st.sampled_from(["drop-line", "non-utf8-line", "torn-middle-line", "line-json"]))
    index = draw(st.integers(0, len(lines) - 2))  # not the last line: a torn last line is a crash, tolerated
    if kind == "drop-line":
        event = json.loads(lines[index])
        lines.pop(index)
        # Losing a train/session event breaks the reconciliation of counters; a val/checkpoint line may not.
        return kind, b"\n".join(lines) + b"\n", event["event"] in ("train", "session_start")
    if kind == "non-utf8-line":
        cut = draw(st.integers(0, len(lines[index])))
        lines[index] = lines[index][:cut] + b"\xff" + lines[index][cut:]
        return kind, b"\n".join(lines) + b"\n", True
    if kind == "torn-middle-line":
        lines[index] = lines[index][:draw(st.integers(1, len(lines[index]) - 2))]
        return kind, b"\n".join(lines) + b"\n", True
    _, line = draw(damaged(lines[index], json.loads, lambda d: json.dumps(d).encode()))
    lines[index] = line.replace(b"\n", b" ")
    return kind, b"\n".join(lines) + b"\n", False


@pytest.mark.slow
@_settings("metrics")
@given(st.data())
def test_damaged_metrics_jsonl(sandbox, data):
    path = sandbox / "run" / "metrics.jsonl"
    kind, damage, must_refuse = _metrics_damage(data.draw, path.read_bytes())
    path.write_bytes(damage)
    try:
        before = tree_hashes(sandbox)
        summarize, _ = run_command(["summarize", str(sandbox / "run"), "--json", "--require-step", "4"])
        inspect, _ = run_command(["inspect-batch", str(sandbox / "run"), "--step", "1"])
        assert tree_hashes(sandbox) == before
        assert summarize in (0, 1) and inspect in (0, 2)
        if must_refuse:
            assert summarize == 1, kind
        count("metrics")
    finally:
        restore(sandbox, "run/metrics.jsonl")


@pytest.mark.slow
@_settings("verdict")
@given(st.data())
def test_verdict_on_damaged_metrics_writes_only_its_report(sandbox, data):
    path = sandbox / "run" / "metrics.jsonl"
    kind, damage, must_refuse = _metrics_damage(data.draw, path.read_bytes())
    path.write_bytes(damage)
    try:
        before = tree_hashes(sandbox, skip=("run/report",))
        verdict, _ = run_command(["verdict", str(sandbox / "run"), "--json"])
        assert tree_hashes(sandbox, skip=("run/report",)) == before
        assert verdict in (0, 1)
        if must_refuse:
            assert verdict == 1, kind
        count("verdict")
    finally:
        restore(sandbox, "run/metrics.jsonl", written="run/report")


def _file_table(marker: dict[str, Any]) -> Any:
    files = marker.get("files")
    if not isinstance(files, dict):
        return files
    return {name: (entry.get("sha256"), entry.get("bytes")) if isinstance(entry, dict) else entry
            for name, entry in files.items()}


@pytest.mark.slow
@_settings("marker")
@given(st.data())
def test_damaged_committed_json(sandbox, data):
    newest = Checkpointer(sandbox / "run", keep=2).committed_steps()[-1]
    path = sandbox / "run" / "checkpoints" / step_folder_name(newest) / MARKER_NAME
    original = path.read_bytes()
    kind, damage = data.draw(damaged(original, json.loads, _json_dump))
    path.write_bytes(damage)
    try:
        before = tree_hashes(sandbox, skip=("run",))
        resume, _ = run_command(
            [
                "train",
                "--config",
                str(sandbox / "recipe.yaml"),
                "--data",
                str(sandbox / "data"),
                "--run-dir",
                str(sandbox / "run"),
                "--resume",
                "--set",
                "train.num_threads=1",
                "--set",
                "train.max_steps=4",
                "--set",
                "train.checkpoint_every=2",
                "--set",
                "train.eval_every=2",
                "--set",
                "train.eval_batches=1",
            ]
        )
        assert tree_hashes(sandbox, skip=("run",)) == before  # the run folder is the command's own output
        assert resume in (0, 2)
        parsed = _parses_as_object(damage)
        if parsed is None or "step" not in parsed or _file_table(parsed) != _file_table(json.loads(original)):
            assert resume == 2, kind  # a file named, sized or hashed differently, or the marker unreadable
        count("marker")
    finally:
        restore(sandbox, "run/metrics.jsonl", written="run")  # the whole run folder, the marker included


@pytest.mark.slow
@_settings("config")
@given(st.data())
def test_damaged_recipe(sandbox, data):
    path = sandbox / "recipe.yaml"
    original = path.read_bytes()
    kind, damage = data.draw(damaged(original, yaml.safe_load,
                                     lambda d: yaml.safe_dump(d, allow_unicode=True).encode()))
    path.write_bytes(damage)
    missing_data = sandbox / "no-such-data"
    try:
        before = tree_hashes(sandbox)
        code, err = run_command(["train", "--config", str(path), "--data", str(missing_data), "--run-dir",
                                 str(sandbox / "new-run")])
        assert tree_hashes(sandbox) == before
        # Every case exits 2: a refused recipe names itself, an accepted one gets as far as the missing data.
        assert code == 2
        line = err.strip().splitlines()[-1]
        assert str(path) in line or str(missing_data) in line, line
        if kind == "extra":
            assert "unknown config key" in line, line
        count("config")
    finally:
        restore(sandbox, "recipe.yaml", written="new-run")


@pytest.mark.slow  # counts the cases of the slow hostile-input tests above: runs with them
def test_case_count():
    """Runs last in this module: every target ran close to its planned examples (hypothesis may stop early
    when it has exhausted a strategy, never by more than a fifth here)."""
    total = sum(CASES.values())
    print(f"hostile-input cases run: {total} {dict(sorted(CASES.items()))}")
    for name, planned in PLANNED.items():
        assert CASES.get(name, 0) >= planned * 4 // 5, (name, CASES.get(name, 0), planned)


# ------------------------------------------------------------------------------------------------ edge files
DEEP_JSON = "[" * 200_000 + "]" * 200_000
BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))
BILLION_LAUGHS += "train:\n  seed: *i\n"


def _train_argv(sandbox: Path, *extra: str, config: Path | None = None) -> list[str]:
    return [
        "train",
        "--config",
        str(config or sandbox / "recipe.yaml"),
        "--data",
        str(sandbox / "data"),
        "--run-dir",
        str(sandbox / "run"),
        "--set",
        "train.num_threads=1",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.eval_batches=1",
        *extra,
    ]


EDGE_CASES = {
    # name: (file to damage relative to the sandbox, its new bytes or None, argv builder)
    "deep_marker": (
        "run/checkpoints/step-00000004/COMMITTED.json",
        DEEP_JSON.encode(),
        lambda s: _train_argv(s, "--resume"),
    ),
    "deep_run_json": ("run/run.json", DEEP_JSON.encode(), lambda s: ["summarize", str(s / "run")]),
    "deep_run_json_resume": ("run/run.json", DEEP_JSON.encode(), lambda s: _train_argv(s, "--resume")),
    "deep_metadata": (
        "data/metadata.json",
        DEEP_JSON.encode(),
        lambda s: ["data", "verify", str(s / "data")],
    ),
    "deep_metadata_train": ("data/metadata.json", DEEP_JSON.encode(), lambda s: _train_argv(s, "--resume")),
    "deep_lock": (
        "frozen.lock.json",
        DEEP_JSON.encode(),
        lambda s: [
            "train",
            "--frozen",
            str(s / "frozen.lock.json"),
            "--data",
            str(s / "data"),
            "--run-dir",
            str(s / "long"),
        ],
    ),
    "billion_laughs": (
        "laughs.yaml",
        BILLION_LAUGHS.encode(),
        lambda s: _train_argv(s, config=s / "laughs.yaml"),
    ),
    "deep_yaml": (
        "deep.yaml",
        ("train: " + "[" * 100_000 + "]" * 100_000 + "\n").encode(),
        lambda s: _train_argv(s, config=s / "deep.yaml"),
    ),
    "deep_yaml_block": (
        "deep.yaml",
        "".join(f"{' ' * i}k:\n" for i in range(0, 3000)).encode(),
        lambda s: _train_argv(s, config=s / "deep.yaml"),
    ),
    "long_int_set": (
        None,
        None,
        lambda s: _train_argv(s, "--resume", "--set", "train.max_steps=" + "9" * 10_000),
    ),
    "deep_folder_lock": ("run/run.lock", DEEP_JSON.encode(), lambda s: ["summarize", str(s / "run")]),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_files_are_one_line_and_exit_2(sandbox, name):
    target, content, argv = EDGE_CASES[name]
    created = target is not None and not (sandbox / target).exists()
    original = None if target is None or created else (sandbox / target).read_bytes()
    if target is not None:
        (sandbox / target).write_bytes(content)
    try:
        before = tree_hashes(sandbox, skip=("run", "long"))
        code, err = run_command(argv(sandbox))
        assert tree_hashes(sandbox, skip=("run", "long")) == before
        if name == "deep_folder_lock":
            assert code in (0, 1, 2), err  # no session holds it: the holder line is only read, never trusted
        elif name in ("deep_run_json", "deep_metadata"):
            assert code in (1, 2), err  # summarize / verify: damage is invalid (1) or unreadable (2), named
        else:
            assert code == 2, err
        lines = err.strip().splitlines()
        assert code != 2 or lines, name
        assert all(len(line) < 600 for line in lines), lines[-1][:300]  # never the expanded value or the file
    finally:
        if created:
            (sandbox / target).unlink()
        elif original is not None:
            (sandbox / target).write_bytes(original)
        restore(sandbox, "run/metrics.jsonl", written="run")


def test_a_run_lock_linked_to_a_binary_file_is_refused_and_the_file_unchanged(sandbox, tmp_path):
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 64)
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    lock = sandbox / "run" / "run.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(binary)
    try:
        for argv in (_train_argv(sandbox, "--resume"), ["summarize", str(sandbox / "run")]):
            code, err = run_command(argv)
            assert code in ((2,) if argv[0] == "train" else (0, 1, 2)), err
        assert hashlib.sha256(binary.read_bytes()).hexdigest() == digest
    finally:
        restore(sandbox, "run/metrics.jsonl", written="run")


# ------------------------------------------------------------------------------------------------ forged
# records
def _forged_run(tmp_path: Path, forge) -> Path:
    """A pilot-shaped synthetic record, one event forged by `forge(run)` (which returns nothing) before it is
    written and chained: a forgery that kept the chain whole, so that only the field itself can give it
    away."""
    from tests.report.synthetic import crashed_and_resumed

    run = crashed_and_resumed(tmp_path / "r")
    forge(run)
    return run.write()


def _spike_after(run, **fields):
    window = run.find("train", step=30)
    event = {
        k: window[k]
        for k in ("session_id", "step", "tokens_seen", "updates_attempted", "updates_skipped", "time")
    }
    event.update(
        {
            "event": "spike",
            "spike_step": 30,
            "signals": ["loss"],
            "action": "recorded",
            "cause": None,
            "loss": 5.0,
            "grad_norm": 3.0,
            "bounds": {},
            "batches": [],
            "replay": None,
        },
        **fields,
    )
    run.events.insert(run.events.index(window) + 1, event)


FORGED = {
    "time_missing": (lambda run: run.find("train", step=30).pop("time"), "event lacks time"),
    "time_string": (lambda run: run.find("train", step=30).update(time="soon"), "time is 'soon' (str)"),
    "time_list": (lambda run: run.find("train", step=30).update(time=[1.0]), "time is '[1.0]' (list)"),
    "huge_loss": (lambda run: run.find("train", step=30).update(loss=10**400), "loss: an integer too large"),
    "huge_window": (
        lambda run: run.find("train", step=30)["window"].update(train_seconds=-(10**400)),
        "window.train_seconds: an integer too large",
    ),
    "huge_val_seconds": (
        lambda run: run.find("val", step=30).update(seconds=2**64),
        "seconds: an integer too",
    ),
    "session_id_int": (lambda run: run.find("val", step=30).update(session_id=7), "session_id is '7' (int)"),
    "spike_signals": (lambda run: _spike_after(run, signals=[1]), "spike field signals is list"),
    "spike_replay": (lambda run: _spike_after(run, replay="x"), "spike field replay is str"),
    "spike_step": (lambda run: _spike_after(run, spike_step=[30]), "spike field spike_step is list"),
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_line_is_named_by_summarize_verdict_and_watch_never_a_traceback(tmp_path, name):
    """Each forgery is a line of the record read as damage: summarize and verdict exit 1 with the line named
    among the reasons, watch exits 1 with the chain alert naming it, and the run folder is left as it was (the
    verdict writes only its report)."""
    forge, named = FORGED[name]
    run_dir = _forged_run(tmp_path, forge)
    before = tree_hashes(run_dir)
    for command in ("summarize", "verdict", "watch"):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            code = main([command, str(run_dir)])
        assert code == 1, (command, stdout.getvalue()[-2000:])
        lines = [line for line in stdout.getvalue().splitlines() if named in line]
        assert lines and all("metrics.jsonl line " in line for line in lines), (
            command,
            stdout.getvalue()[-2000:],
        )
    assert tree_hashes(run_dir, skip=("report",)) == before


def test_a_run_json_figure_past_a_floats_range_is_judged_never_a_traceback(tmp_path):
    run_dir = _forged_run(tmp_path, lambda run: run.run["recipe"]["train"].update(memory_budget_gb=10**400))
    for command in ("summarize", "verdict", "watch"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main([command, str(run_dir)]) in (0, 1)


def test_terminal_escapes_in_a_recorded_session_id_are_printed_escaped(tmp_path):
    """A session id carrying ESC sequences (clear the screen, retitle the window) and a bell: printed as their
    escapes by summarize, verdict and watch, never sent raw to the terminal."""
    hostile = "s1\x1b[2J\x1b]0;owned\x07\u202e"

    def forge(run):
        run.run["sessions"][0]["session_id"] = hostile
        for event in run.events:
            if event["session_id"] == "s1":
                event["session_id"] = hostile

    run_dir = _forged_run(tmp_path, forge)
    (run_dir / "metrics.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes() + b"{torn")  # a note too
    for command in ("summarize", "verdict", "watch"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([command, str(run_dir)])
        text = out.getvalue() + err.getvalue()
        assert not any(c in text for c in "\x1b\x07\u202e"), (command, text[-800:])
    # summarize names the session: escaped, but there
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["summarize", str(run_dir)])
    assert "s1\\x1b[2J\\x1b]0;owned\\x07\\u202e" in out.getvalue()


def test_a_skip_range_longer_than_one_pass_is_one_line_exit_2_and_nothing_written(
    builtin_data_dir, tmp_path, capsys
):
    """`train.skip_data` of 10^12 batches would be described in run.json pass by pass (gigabytes): refused."""
    run_dir = tmp_path / "run"
    code = main(["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--run-dir", str(run_dir),
                 "--progress", "none", "--set", "train.num_threads=1", "--set",
                 "train.skip_data=[[0,1000000000000]]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.skip_data range [0, 1000000000000]: 1,000,000,000,000 batches is more than one pass" in err
    assert not run_dir.exists()
    assert main(["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--run-dir", str(run_dir),
                 "--progress", "none", "--set", "train.num_threads=1", "--set", "train.max_steps=1", "--set",
                 "train.eval_every=0", "--set", "train.skip_data=[[0,100]]"]) == 0  # within one pass: trains


def test_a_lock_holding_a_bare_infinity_is_one_line_exit_2_for_watch_and_train(
    builtin_data_dir, tmp_path, capsys
):
    from pilotrun.commands.freeze import freeze_run
    from tests.report.synthetic import crashed_and_resumed

    crashed_and_resumed(tmp_path / "pilot").write()
    assert freeze_run(tmp_path / "pilot", tmp_path / "lock.json", despite_no_go=True)[0] == 0
    lock = json.loads((tmp_path / "lock.json").read_text())
    lock["watch"]["throughput"]["low"] = float("inf")
    (tmp_path / "lock.json").write_text(json.dumps(lock))  # Python writes the bare `Infinity` JSON has not
    capsys.readouterr()
    for argv in (
        ["watch", str(tmp_path / "pilot"), "--against", str(tmp_path / "lock.json")],
        [
            "train",
            "--frozen",
            str(tmp_path / "lock.json"),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(tmp_path / "long"),
            "--progress",
            "none",
        ],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "holds a bare NaN or Infinity" in err, err
    assert not (tmp_path / "long").exists()


def test_resume_auto_on_a_run_whose_metrics_jsonl_was_deleted_is_refused_not_called_complete(builtin_data_dir,
                                                                                            tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "train",
        "--config",
        str(SMOKE),
        "--data",
        str(builtin_data_dir),
        "--run-dir",
        str(run_dir),
        "--progress",
        "none",
        "--resume",
        "auto",
        "--set",
        "train.num_threads=1",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "optim.schedule.horizon=2",
    ]
    assert main(argv) == 0
    (run_dir / "metrics.jsonl").unlink()
    before = tree_hashes(run_dir, skip=("run.lock",))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "metrics.jsonl not found beside its run.json" in err, err
    assert "nothing to do" not in err and tree_hashes(run_dir, skip=("run.lock",)) == before



def test_a_task_choice_longer_than_the_window_is_refused_at_start_by_train_and_evaluate(
    builtin_data_dir, tmp_path, capsys
):
    """A choice of more tokens than model.max_seq_len cannot be scored (its tokens must all be predicted in
    one forward pass): refused in one line, exit 2, before train writes anything, and by evaluate before it
    scores, not a traceback at the first in-loop scoring that every resume would meet again."""
    long_choice = " ".join(["word"] * 400)
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": [long_choice, " b"], "label": 1}) + "\n")
    base = ["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--progress", "none", "--set",
            "train.num_threads=1", "--set", "train.max_steps=1", "--set", "train.eval_every=0", "--set",
            "model.max_seq_len=64"]
    with_task = ["--set", f"train.downstream_tasks=[{task}]", "--set", "train.downstream_every=1"]
    capsys.readouterr()
    assert main([*base, "--run-dir", str(tmp_path / "refused"), *with_task]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "example 1 choice 1 is" in err
        and "longer than the model's window" in err
    )
    assert not (tmp_path / "refused").exists()
    assert main([*base, "--run-dir", str(tmp_path / "run"), "--set", "train.checkpoint_every=1"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--tasks", str(task)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "longer than the model's window (model.max_seq_len" in err, err
    assert not (tmp_path / "run" / "evals").exists()


def test_a_newline_in_a_forged_session_id_never_makes_watch_print_a_line_of_its_own(tmp_path):
    """The last session, killed, carries a newline and a fake status line in its id: watch's alert quotes it
    on its own line, the newline escaped, so no line of the record's making (a fake "healthy" status) is
    printed."""
    hostile = "s2\nstatus: step 60/60, loss 0.1 (completed; 0 alert(s) standing)\t"

    def forge(run):
        run.events = [e for e in run.events if e["event"] != "session_end"]
        run.run["sessions"][-1]["session_id"] = hostile
        for event in run.events:
            if event["session_id"] == "s2":
                event["session_id"] = hostile

    run_dir = _forged_run(tmp_path, forge)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["watch", str(run_dir)]) == 1
    printed = (out.getvalue() + err.getvalue()).splitlines()
    (alert,) = [line for line in printed if line.startswith("ALERT session_end: ")]
    assert (
        "session s2\\nstatus: step 60/60, loss 0.1 (completed; 0 alert(s) standing)\\t ended: killed" in alert
    )
    assert not [line for line in printed if line.startswith("status: step 60/60, loss 0.1")]
