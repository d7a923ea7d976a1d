"""The mutation checker's own rules: a mutation applies only where its text occurs exactly once, and every
planted bug names a real file and tests that exist (so `make mutation` cannot report a kill by accident)."""

from pathlib import Path

from benchmarks.mutation_check import apply_mutation, copy_tracked_files, stale_mutations
from benchmarks.mutations import Mutation

ROOT = Path(__file__).resolve().parents[1]


def test_a_mutation_applies_once_or_is_reported_stale(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nb = 2\n")
    once = Mutation("once", "m.py", "a = 1\n", "a = 2\n", ("t",), "")
    twice = Mutation("twice", "m.py", "b = 2\n", "b = 3\n", ("t",), "")
    missing = Mutation("missing", "nope.py", "x", "y", ("t",), "")
    assert apply_mutation(tmp_path, once) is None
    assert (tmp_path / "m.py").read_text() == "a = 2\nb = 2\nb = 2\n"
    assert "2 times" in apply_mutation(tmp_path, twice)
    assert "does not exist" in apply_mutation(tmp_path, missing)


def test_a_stale_mutation_is_named_with_its_reason(tmp_path):
    """The on-demand check `make mutation` starts with (`--stale-only`): it names each mutation that no longer
    applies, and why, without running a test. (The real mutations are not checked here: they pin exact source
    lines, and a test that fails whenever one of those lines is reworded would block every refactoring.)"""
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nb = 2\n")
    (tmp_path / "test_m.py").write_text("")
    mutations = (
        Mutation("good", "m.py", "a = 1\n", "a = 2\n", ("test_m.py::test_x",), ""),
        Mutation("twice", "m.py", "b = 2\n", "b = 3\n", ("test_m.py",), ""),
        Mutation("no_file", "gone.py", "x", "y", ("test_m.py",), ""),
        Mutation("no_test", "m.py", "a = 1\n", "a = 3\n", ("test_gone.py",), ""),
        Mutation("no_change", "m.py", "a = 1\n", "a = 1\n", ("test_m.py",), ""),
        Mutation("good", "m.py", "a = 1\n", "a = 4\n", ("test_m.py",), ""),
    )
    problems = stale_mutations(tmp_path, mutations)
    assert set(problems) == {"twice", "no_file", "no_test", "no_change", "good"}
    assert "2 times" in problems["twice"]
    assert "does not exist" in problems["no_file"]
    assert "test_gone.py" in problems["no_test"]
    assert "changes nothing" in problems["no_change"]
    assert "another mutation" in problems["good"]
    assert (tmp_path / "m.py").read_text() == "a = 1\nb = 2\nb = 2\n"  # the checkout itself is never edited


def test_the_scratch_copy_keeps_tracked_links_so_the_tests_find_their_recipes(tmp_path):
    # The trainer tests load configs/smoke.yaml; configs/ is a tracked link to pilotrun/configs. A copy
    # without it fails every baseline, and `make mutation` then kills nothing.
    copy_tracked_files(tmp_path)
    assert (tmp_path / "configs").is_symlink()
    assert (tmp_path / "configs" / "smoke.yaml").resolve().is_relative_to(tmp_path.resolve())
    assert (tmp_path / "configs" / "smoke.yaml").read_bytes() == (
        ROOT / "configs" / "smoke.yaml"
    ).read_bytes()
