"""The mutation checker's own rules: a mutation applies only where its text occurs exactly once, and every
planted bug names a real file and tests that exist (so `make mutation` cannot report a kill by accident)."""

from pathlib import Path

from benchmarks.mutation_check import apply_mutation, copy_tracked_files
from benchmarks.mutations import MUTATIONS, Mutation

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


def test_every_planted_bug_applies_to_this_checkout_and_names_existing_tests(tmp_path):
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    for mutation in MUTATIONS:
        target = tmp_path / mutation.name / mutation.file
        target.parent.mkdir(parents=True)
        target.write_text((ROOT / mutation.file).read_text())
        assert apply_mutation(tmp_path / mutation.name, mutation) is None, mutation.name
        assert mutation.old != mutation.new
        for test in mutation.tests:
            assert (ROOT / test.split("::")[0]).is_file(), test


def test_the_scratch_copy_keeps_tracked_links_so_the_tests_find_their_recipes(tmp_path):
    # The trainer tests load configs/smoke.yaml; configs/ is a tracked link to pilotrun/configs. A copy without
    # it fails every baseline, and `make mutation` then kills nothing.
    copy_tracked_files(tmp_path)
    assert (tmp_path / "configs").is_symlink()
    assert (tmp_path / "configs" / "smoke.yaml").resolve().is_relative_to(tmp_path.resolve())
    assert (tmp_path / "configs" / "smoke.yaml").read_bytes() == (ROOT / "configs" / "smoke.yaml").read_bytes()
