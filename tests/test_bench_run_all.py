"""benchmarks/run_all.py's partial update of BENCHMARKS.md: one section replaced, the rest kept byte for byte,
and the header naming every section measured apart from the full run."""

from types import SimpleNamespace

import pytest

from benchmarks import nanochat_adapter, run_all
from benchmarks.run_all import replace_sections, section_footer, split_arguments

FULL = ("# Benchmarks\n\nWritten by make bench.\n\n"
        "## Optimizer\n\nold optim figures\n\n### detail\n\nmore\n\n_bench_optim took 11 s._\n\n"
        "## Data\n\nold data figures\n\n_bench_data took 22 s._\n")


def test_update_replaces_only_the_named_section_and_records_it_in_the_header():
    new_optim = "## Optimizer\n\nnew optim figures\n\n_bench_optim took 9 s._\n"
    updated = replace_sections(FULL, {"bench_optim": new_optim})
    assert (
        "old optim figures" not in updated and "### detail" not in updated and "new optim figures" in updated
    )
    assert updated.endswith("## Data\n\nold data figures\n\n_bench_data took 22 s._\n")
    assert "after the full run (`python -m benchmarks.run_all --update NAME`): bench_optim.\n" in updated
    again = replace_sections(updated, {"bench_data": "## Data\n\nnew data\n\n_bench_data took 5 s._\n"})
    assert (
        "): bench_data, bench_optim.\n" in again and "new optim figures" in again and "old data" not in again
    )
    assert replace_sections(again, {"bench_data": "## Data\n\nnew data\n\n_bench_data took 5 s._\n"}) == again


def test_footer_gives_the_load_average_before_and_after():
    footer = section_footer("bench_x", 12.4, (3.25, 2.0, 1.0), (4.0, 2.5, 1.25))
    assert footer.startswith(
        "_bench_x took 12 s; load average (1/5/15 min) 3.2/2.0/1.0 before, 4.0/2.5/1.2 after"
    )


def test_arguments_name_sections_the_update_and_a_nanochat_checkout():
    assert split_arguments(["bench_update", "--update", "--nanochat", "/src/nanochat"]) == (
        ["bench_update"], True, "/src/nanochat")
    assert split_arguments(["--nanochat=/n"]) == ([], False, "/n")
    assert split_arguments(["bench_data"]) == (["bench_data"], False, None)


def test_a_nanochat_checkout_reaches_only_the_benchmarks_that_take_one(monkeypatch, capsys):
    checkout = object()
    given = {}
    modules = {
        "benchmarks.bench_a": SimpleNamespace(
            run=lambda nanochat=None: given.setdefault("a", nanochat) and "## A"
        ),
        "benchmarks.bench_b": SimpleNamespace(run=lambda: "## B"),
    }
    monkeypatch.setattr(run_all.importlib, "import_module", modules.__getitem__)
    monkeypatch.setattr(nanochat_adapter, "load", lambda path: checkout if path == "/n" else None)
    assert run_all.main(["bench_a", "bench_b", "--nanochat", "/n"]) == 0
    assert given == {"a": checkout}
    assert "## A" in capsys.readouterr().out


def test_a_path_that_is_not_a_nanochat_checkout_is_refused_before_anything_runs(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(run_all.importlib, "import_module", lambda name: pytest.fail(f"{name} was run"))
    assert run_all.main(["bench_update", "--nanochat", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err
        == f"run_all: --nanochat {tmp_path}: not a nanochat checkout (no nanochat/gpt.py in it)\n"
    )
