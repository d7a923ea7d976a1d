"""The checkpoint marker's rules, without torch: which step folders count as committed, which marker is
trusted, and the rehash a resume would do before loading."""

import hashlib
import json

from pilotrun.run.marker import (
    MARKER_NAME,
    checkpoint_problems,
    committed_checkpoint_steps,
    marker_files_problem,
    read_marker,
    step_folder,
    step_folder_name,
)


def commit(run_dir, step, files: dict[str, bytes]):
    folder = step_folder(run_dir, step)
    folder.mkdir(parents=True)
    table = {}
    for name, payload in files.items():
        (folder / name).write_bytes(payload)
        table[name] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (folder / MARKER_NAME).write_text(json.dumps({"step": step, "files": table}))
    return folder


def test_step_folders_sort_by_step_and_only_marked_ones_count(tmp_path):
    assert step_folder_name(100) == "step-00000100"
    commit(tmp_path, 20, {"model.pt": b"a"})
    commit(tmp_path, 3, {"model.pt": b"b"})
    step_folder(tmp_path, 40).mkdir()  # written but never committed
    assert committed_checkpoint_steps(tmp_path) == [3, 20]
    assert committed_checkpoint_steps(tmp_path / "nowhere") == []


def test_an_intact_checkpoint_has_no_problems_and_counts_what_it_rehashed(tmp_path):
    commit(tmp_path, 5, {"model.pt": b"weights", "optim.pt": b"state!"})
    assert checkpoint_problems(tmp_path, 5) == ([], 2, len(b"weights") + len(b"state!"))


def test_changed_bytes_of_the_same_size_are_found_by_the_hash(tmp_path):
    folder = commit(tmp_path, 5, {"model.pt": b"weights"})
    (folder / "model.pt").write_bytes(b"WEIGHTS")
    problems, checked, _ = checkpoint_problems(tmp_path, 5)
    assert checked == 1 and problems == [f"{folder / 'model.pt'}: sha256 differs from the marker's"]


def test_a_missing_or_resized_file_is_one_problem_each(tmp_path):
    folder = commit(tmp_path, 5, {"a.pt": b"aaaa", "b.pt": b"bb"})
    (folder / "a.pt").unlink()
    (folder / "b.pt").write_bytes(b"bbb")
    problems, _, _ = checkpoint_problems(tmp_path, 5)
    assert problems == [f"{folder / 'a.pt'}: missing", f"{folder / 'b.pt'}: 3 bytes, the marker records 2"]


def test_a_marker_for_another_step_or_naming_a_file_outside_is_not_trusted(tmp_path):
    folder = commit(tmp_path, 5, {"model.pt": b"x"})
    marker = json.loads((folder / MARKER_NAME).read_text())
    (folder / MARKER_NAME).write_text(json.dumps(dict(marker, step=6)))
    assert read_marker(tmp_path, 5)[1].endswith("lacks 'files' or records another step")
    assert marker_files_problem({"../other-run/model.pt": {"sha256": "0", "bytes": 1}}).startswith("lists")
    assert (
        marker_files_problem({"model.pt": {"sha256": "0"}})
        == "entry 'model.pt' lacks a sha256 string and a byte count"
    )
    assert marker_files_problem({"model.pt": {"sha256": "0", "bytes": 1}}) is None


def test_a_linked_step_folder_is_refused(tmp_path):
    elsewhere = commit(tmp_path / "other", 5, {"model.pt": b"x"})
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    step_folder(tmp_path / "run", 5).symlink_to(elsewhere)
    assert committed_checkpoint_steps(tmp_path / "run") == []
    marker, problem = read_marker(tmp_path / "run", 5)
    assert marker is None and "a symbolic link; refused" in problem
