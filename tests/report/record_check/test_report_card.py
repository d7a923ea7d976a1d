"""pilotrun/report/record_check/report_card.py: RUN/report.md, written by summarize and again by evaluate; its
figures are the summary's, each naming where it comes from; a run with no evaluation, or no lock, says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pilotrun.commands.card import NOT_WRITTEN_INVALID
from pilotrun.commands.cli import main
from pilotrun.report.record_check.report_card import CARD_NAME, report_card
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import crashed_and_resumed

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "configs" / "smoke.yaml"


def rows(card: str) -> dict[str, tuple[str, str]]:
    """The card's table rows `| what | value | from |`: {what: (value, from)}."""
    found = {}
    for line in card.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0]:
            found[cells[0]] = (cells[1], cells[2])
    return found


def section(card: str, title: str) -> str:
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_cards_figures_are_the_summarys_and_a_run_without_evaluation_or_lock_says_so(tmp_path, capsys):
    crashed_and_resumed(tmp_path / "r").write()
    assert main(["summarize", str(tmp_path / "r")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"report card: {tmp_path / 'r' / CARD_NAME}"
    card = (tmp_path / "r" / CARD_NAME).read_text()
    summary = summarize_run(tmp_path / "r")
    assert card == report_card(summary)
    o, table = summary.overall, rows(card)
    run = summary.run
    assert table["parameters"] == (f"{run['model']['parameters']:,}", "run.json model.parameters")
    assert table["tokens seen"][0] == (f"{o['tokens_seen']:,} of {o['tokens_planned']:,} planned "
                                       f"({100 * o['tokens_fraction_of_plan']:.1f}%)")
    assert table["passes over the training split"][0] == f"{o['passes_over_train_split']:.3g}"
    assert table["goodput"] == (f"{100 * o['goodput']:.1f}%",
                                "summarize overall.goodput (productive / elapsed)")
    assert table["elapsed"][0] == f"{o['time_ledger']['elapsed_seconds']:.4g} s"
    for part, seconds in o["time_ledger"]["parts"].items():
        assert table[part][0].startswith(f"{seconds:.4g} s (")
        assert table[part][1] == f"summarize overall.time_ledger.parts.{part}"
    vals = [e for e in summary.kept_events if e["event"] == "val"]
    best = min(vals, key=lambda e: e["loss"])
    assert table["best validation loss"] == (f"{best['loss']:.4g} at step {best['step']:,}",
                                             f"metrics.jsonl line {best['_line']} (the lowest of {len(vals)} "
                                             "kept val events)")
    assert table["final validation loss"][0] == f"{vals[-1]['loss']:.4g} at step {vals[-1]['step']:,}"
    assert "No evaluation on the record" in section(card, "Evaluations")
    assert section(card, "Lock").startswith("Not started from a lock")
    sessions = section(card, "Sessions and interruptions")
    assert f"{len(summary.sessions)} session(s), 1 resume(s)" in sessions
    assert "| killed |" in sessions and "| completed |" in sessions
    assert "The record is VALID" in section(card, "Validity of the record")
    # --json, the scripts' reading, prints one JSON document and writes nothing
    os.remove(tmp_path / "r" / CARD_NAME)
    assert main(["summarize", str(tmp_path / "r"), "--json"]) == 0
    json.loads(capsys.readouterr().out)
    assert not (tmp_path / "r" / CARD_NAME).exists()


def test_an_invalid_record_gets_no_card_and_a_link_where_the_card_goes_is_refused(tmp_path, capsys):
    crashed_and_resumed(tmp_path / "r").write()
    metrics = tmp_path / "r" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    edited = json.loads(lines[3])
    edited["tokens_seen"] += 1  # an edited line: the hash chain and the counters name it
    lines[3] = json.dumps(edited) + "\n"
    metrics.write_text("".join(lines))
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert main(["summarize", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == NOT_WRITTEN_INVALID
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before  # a damaged record is left as found
    summary = summarize_run(tmp_path / "r")
    validity = section(report_card(summary), "Validity of the record")
    assert validity.startswith(f"The record is INVALID: summarize lists {len(summary.reasons)} problem(s):")
    assert f"- {summary.reasons[0]}" in validity

    crashed_and_resumed(tmp_path / "v").write()
    os.symlink(tmp_path / "elsewhere.md", tmp_path / "v" / CARD_NAME)
    assert main(["summarize", str(tmp_path / "v")]) == 0  # the summary's own outcome stands
    err = capsys.readouterr().err
    assert "report card not written:" in err and "symbolic link" in err, err
    assert not (tmp_path / "elsewhere.md").exists()


def _train(data, run_dir, *args):
    return main(["train", "--data", str(data), "--run-dir", str(run_dir), "--progress", "none", *args])


@pytest.mark.slow
def test_a_frozen_run_with_a_resume_and_an_evaluation(builtin_data_dir, tmp_path, capsys):
    common = ["--set", "train.num_threads=1", "--set", "train.checkpoint.every=2"]
    assert _train(builtin_data_dir, tmp_path / "pilot", "--config", str(SMOKE), *common) == 0
    lock = tmp_path / "lock.json"
    assert main(["freeze", str(tmp_path / "pilot"), "--out", str(lock), "--despite-no-go"]) in (0, 1)
    assert lock.is_file()
    long = tmp_path / "long"
    assert _train(builtin_data_dir, long, "--frozen", str(lock), *common, "--set", "train.max_steps=4",
                  "--allow-change", "train.max_steps") == 0
    assert _train(builtin_data_dir, long, "--frozen", str(lock), *common, "--resume") == 0
    task = tmp_path / "rivers.jsonl"
    task.write_text("".join(json.dumps({"context": f"The river number {i}", "choices": [" flows.", " sings."],
                                        "label": i % 2}) + "\n" for i in range(6)))
    capsys.readouterr()
    assert main(["evaluate", str(long), "--tasks", str(task)]) == 0
    assert f"report card: {long / CARD_NAME}" in capsys.readouterr().out
    card = (long / CARD_NAME).read_text()
    summary = summarize_run(long)
    assert summary.valid, summary.reasons
    assert card == report_card(summary, "pilotrun evaluate")
    entry = summary.overall["evaluations"][0]
    figures = entry["tasks"]["rivers"]
    assert figures["chance"] == 0.5
    row = next(line for line in section(card, "Evaluations").splitlines() if line.startswith("| rivers |"))
    assert row.startswith(f"| rivers | {figures['acc']:.4g} | {figures['acc_norm']:.4g} | 0.5 | 6 | "
                          f"{entry['step']:,} | {entry['marker_sha256'][:12]} | pilotrun ")
    table = rows(card)
    frozen = summary.run["frozen"]
    assert table["lock sha256"][0] == frozen["lock_sha256"]
    assert table["allowed to change"] == ("train.max_steps", "run.json frozen.allowed")
    assert table["runs the frozen candidate"][0] == "yes"
    assert table["differences accepted at the start"] == ("train.max_steps (lock 6, run 4)",
                                                          "run.json frozen.differences")
    assert table["unallowed differences now"][0] == "none"
    assert table["free changes on resume"][0].startswith("train.max_steps 4 -> 6 from update 5")
    sessions = section(card, "Sessions and interruptions")
    assert "2 session(s), 1 resume(s)" in sessions
    # the resumed session's plan named the lock and what it accepted
    plan = summary.run["plan"]
    assert plan["session_id"] == summary.lineage[-1] and plan["start_step"] == 4
    assert plan["lock"] == {"lock_sha256": frozen["lock_sha256"], "pilot_run_id": frozen["pilot_run_id"],
                            "allowed": ["train.max_steps"], "differences": frozen["differences"]}
    # summarize writes the same card but for who wrote it
    assert main(["summarize", str(long)]) == 0
    assert (long / CARD_NAME).read_text() == report_card(summary)


def test_the_in_loop_tasks_are_shown_from_the_last_kept_downstream_event(tmp_path):
    crashed_and_resumed(tmp_path / "r").write()
    summary = summarize_run(tmp_path / "r")
    task = {"acc": 0.375, "acc_norm": 0.25, "chance": 0.25, "examples": 8, "sha256": "ab" * 32}
    earlier = {"event": "downstream", "step": 40, "_line": 77, "tasks": {"t": {**task, "acc": 0.5}}}
    summary.kept_events += [earlier, {"event": "downstream", "step": 60, "_line": 99, "tasks": {"t": task}}]
    evaluations = section(report_card(summary), "Evaluations")
    assert evaluations.startswith("No evaluation on the record")
    assert ("the last kept `downstream` event, metrics.jsonl line 99 at step 60, bound to no checkpoint"
            in evaluations)
    assert "| t | 0.375 | 0.25 | 0.25 | 8 |" in evaluations.splitlines()
    # a recorded name cannot end a cell or start a line of its own making
    summary.kept_events[-1]["tasks"] = {"a|b\n| fake | 1.0 |": task}
    lines = section(report_card(summary), "Evaluations").splitlines()
    assert "| a\\|b\\n\\| fake \\| 1.0 \\| | 0.375 | 0.25 | 0.25 | 8 |" in lines
    assert not any(line.startswith("| fake") for line in lines)


@pytest.mark.slow
def test_a_mixtures_card_gives_each_sources_weight_tokens_and_passes_as_the_summary_does(mixture_sources,
                                                                                         tmp_path, capsys):
    from pilotrun.report.record_check.mixture_account import source_passes
    from tests.conftest import write_mixture

    mixture = write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.7),
                                                    (mixture_sources["builtin"], 0.3)])
    run_dir = tmp_path / "run"
    assert _train(mixture, run_dir, "--config", str(SMOKE), "--set", "train.num_threads=1", "--set",
                  "train.max_steps=4") == 0
    assert main(["summarize", str(run_dir)]) == 0
    card = (run_dir / CARD_NAME).read_text()
    summary = summarize_run(run_dir)
    assert card == report_card(summary)
    passes = {r["name"]: r["passes"] for r in source_passes(summary.run, summary.kept_events, 32)}
    table = section(card, "Tokens and passes").splitlines()
    for row in summary.overall["mixture"]["sources"]:
        assert (f"| {row['name']} | {row['weight']:.4g} | {row['tokens_seen']:,} | "
                f"{100 * row['share_seen']:.1f}% | {passes[row['name']]:.3g} | "
                f"{row['val_loss']:.4g} |") in table
