"""The session header on the shared fixtures (tests/conftest.py): which collected tests need
../shared/fixtures, said right after collection, so that a clone without them learns it before the run, not
from the skips at its end."""

from types import SimpleNamespace

from tests.conftest import SHARED_FIXTURE_USERS, needs_shared_fixtures, shared_fixtures_line


def _item(fixtures=(), marks=()):
    return SimpleNamespace(fixturenames=list(fixtures),
                           get_closest_marker=lambda name: name if name in marks else None)


ITEMS = [_item(["tmp_path", "mixture_sources"]), _item(["task_run"]), _item(["corpus", "fineweb_jsonl"]),
         _item(["tmp_path"], marks=("shared_fixtures",)), _item(["tmp_path"]), _item(["builtin_data_dir"]),
         _item([], marks=("slow",))]


def test_a_test_needs_the_fixtures_through_a_fixture_that_reads_them_or_the_mark():
    assert [needs_shared_fixtures(item) for item in ITEMS] == [True, True, True, True, False, False, False]


def test_a_missing_folder_is_said_with_how_many_of_the_collected_tests_need_it(tmp_path):
    missing = tmp_path / "shared" / "fixtures"
    assert shared_fixtures_line(ITEMS, missing) == (
        f"shared fixtures: MISSING {missing} (../shared/fixtures beside the clone): 4 of the 7 collected "
        "tests need it and will skip")
    missing.mkdir(parents=True)
    assert shared_fixtures_line(ITEMS, missing) == (
        f"shared fixtures: {missing} is present (4 of the 7 collected tests use it)")


def test_each_fixture_counted_as_a_reader_is_a_fixture_of_the_suite():
    import tests.conftest
    import tests.data.conftest

    for name in SHARED_FIXTURE_USERS:
        assert hasattr(tests.conftest, name) or hasattr(tests.data.conftest, name), name
