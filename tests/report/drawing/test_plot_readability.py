"""What each report plot shows a reader, read back from the drawn matplotlib figures: the warm-up windows the
throughput rule leaves out are marked, a QK-Clip tau far above the logits is stated instead of squashing them,
overlapping parameter groups stay apart, the LR plot names its group, and a NO-GO page names each failed
figure under the decision, below the run's identity."""

from __future__ import annotations

import matplotlib.figure
import pytest

from pilotrun.report.drawing.html import write_report
from pilotrun.report.drawing.plots import plot_lr, plot_parameter_groups, plot_qk_max_logit, plot_throughput
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.verdict import judge_summary
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

WARM_UP_LABEL = "session's first window: warm-up, excluded from the rule"


@pytest.fixture
def drawn(monkeypatch):
    """Every figure saved while the test runs (the plot functions draw on their own Figure and save it)."""
    figures: list[matplotlib.figure.Figure] = []
    real_savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        figures.append(self)
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    return figures


def _lines(figure, label_part: str = ""):
    return [line for ax in figure.axes for line in ax.get_lines() if label_part in str(line.get_label())]


def test_throughput_marks_each_sessions_warm_up_window(tmp_path, drawn):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    summary = summarize_run(tmp_path / "r")
    plot_throughput(summary, tmp_path / "throughput.png")
    (marker,) = _lines(drawn[-1], WARM_UP_LABEL)
    # Windows end every 5 updates: s1's first at 5; s2 resumed from checkpoint 20, its first window ends at
    # 25.
    firsts = {}
    for event in summary.kept_events:
        if event["event"] == "train":
            firsts.setdefault(event["session_id"], event["step"])
    assert list(marker.get_xdata()) == [5, 25] == sorted(firsts.values())


def test_a_tau_far_above_the_logits_is_stated_not_drawn(tmp_path, drawn):
    run = crashed_and_resumed(tmp_path / "far")  # logits 20..22, tau 100
    run.write()
    plot_qk_max_logit(summarize_run(tmp_path / "far"), tmp_path / "far.png")
    figure = drawn[-1]
    assert _lines(figure, "QK-Clip tau") == []
    texts = [t.get_text() for ax in figure.axes for t in ax.texts]
    assert any("QK-Clip tau 100 is above this range (largest logit 22" in t for t in texts), texts
    top = figure.axes[0].get_ylim()[1]
    assert top < 30  # the logits fill the axis instead of a band at the bottom of 0..100

    run = crashed_and_resumed(tmp_path / "near")
    run.run["recipe"]["optim"]["qk_clip"]["tau"] = 25.0  # within reach of the logits: drawn as a line
    run.write()
    plot_qk_max_logit(summarize_run(tmp_path / "near"), tmp_path / "near.png")
    (tau_line,) = _lines(drawn[-1], "QK-Clip tau 25")
    assert set(tau_line.get_ydata()) == {25.0}


def _identical_groups(run_dir, names):
    def make(path, **kwargs):
        return SyntheticRun(path, **kwargs)

    run = crashed_and_resumed(run_dir, make_run=make)
    for event in run.events:
        if event["event"] == "train":
            event["optimizer"] = {"weight_rms": dict.fromkeys(names, 0.006),
                                  "update_rms": dict.fromkeys(names, 0.2), "update_rms_step": event["step"]}
    return run


def test_parameter_groups_that_overlap_stay_distinguishable(tmp_path, drawn):
    names = [
        "attention",
        "dense_ffn",
        "embedding",
        "head",
        "norms",
        "routed_experts",
        "router",
        "shared_experts",
    ]
    _identical_groups(tmp_path / "r", names).write()  # the worst case: every group on the same values
    plot_parameter_groups(summarize_run(tmp_path / "r"), tmp_path / "groups.png")
    for ax in drawn[-1].axes:
        lines = {str(line.get_label()): line for line in ax.get_lines() if line.get_label() in names}
        assert sorted(lines) == sorted(names)
        styles = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines.values()}
        assert len(styles) == len(names)
        # Markers are staggered: no two groups put a marker on the same step, so coinciding lines still show
        # every group's marker.
        marked: dict[int, str] = {}
        for name, line in lines.items():
            start, every = line.get_markevery()
            for index in range(start, len(line.get_xdata()), every):
                step = int(line.get_xdata()[index])
                assert step not in marked, (name, marked.get(step), step)
                marked[step] = name
        assert set(marked.values()) == set(names)


def test_lr_plot_names_the_group_whose_rate_it_draws(tmp_path, drawn):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["optimizer"]["groups"] = [{"group": "attention", "optimizer": "muon"},
                                      {"group": "embedding", "optimizer": "adamw"}]
    run.write()
    plot_lr(summarize_run(tmp_path / "r"), tmp_path / "lr.png")
    (ax,) = drawn[-1].axes
    assert ax.get_ylabel() == "learning rate of group 'attention'"
    (line,) = _lines(drawn[-1], "group 'attention'")
    assert (
        "the first of 2" in line.get_label()
        and "the other 1 groups follow the same multiplier" in line.get_label()
    )


@pytest.mark.slow
def test_a_no_go_page_names_each_failed_figure_under_the_decision_below_the_identity(tmp_path):
    def flat(run_dir, **kwargs):
        run = SyntheticRun(run_dir, **kwargs)
        run.loss = lambda step: 3.0
        return run

    run = crashed_and_resumed(tmp_path / "r", make_run=flat)
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    assert verdict.decision == "NO-GO"
    failed = [r for r in verdict.rules if r.status == "FAIL"]
    assert [r.name for r in failed] == ["loss_decreased"]
    page = (write_report(verdict) / "report.html").read_text()
    identity_at = page.index("<table class=\"identity\">")
    decision_at = page.index("<p class=\"decision\">NO-GO</p>")
    item = (
        "<li><b><a href='#plot-loss'>loss_decreased</a></b>: not learning (too small a drop): mean train "
        "loss "
        "3.0000 -&gt; 3.0000"
    )
    assert identity_at < decision_at < page.index(item) < page.index("<h2>Rules</h2>")
    assert "<figure id='plot-loss'>" in page  # the headline's link lands on the plot of that figure


def _ledger_summary(count: int):
    from pilotrun.report.projection.ledger import PARTS
    from pilotrun.report.record_check.summarize import Summary

    sessions = [{"session_id": f"202612{7 + n // 10:02d}-{10 + n:02d}{n:02d}05-{n:08x}", "dead_before": 30.0,
                 "parts": {part: 10.0 * (index + 1) for index, part in enumerate(PARTS)}}
                for n in range(count)]
    ledger = {"sessions": sessions, "goodput": 0.8, "elapsed_seconds": 1000.0 * count}
    return Summary(run_dir="r", run_id="r", valid=True, reasons=[], notes=[], sessions=[], lineage=[],
                   overall={"time_ledger": ledger})


@pytest.mark.parametrize("count", [6, 20])
def test_the_time_ledgers_session_labels_stand_apart_at_6_and_20_sessions(tmp_path, drawn, count):
    """The labels' laid-out boxes (matplotlib's own layout, not the image's pixels): one per bar, at the bar,
    none overlapping another, all inside the figure."""
    from pilotrun.report.drawing.plots import plot_time_ledger

    plot_time_ledger(_ledger_summary(count), tmp_path / "time_ledger.png")
    figure = drawn[-1]
    ax = figure.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()  # the Agg renderer the PNG was laid out with
    labels = [label for label in ax.get_xticklabels() if label.get_text()]
    assert list(ax.get_xticks()) == list(range(count)) and len(labels) == count
    assert labels[0].get_text() == "1: 12-07 10:00" and labels[count - 1].get_text().startswith(f"{count}: ")
    boxes = [label.get_window_extent(renderer) for label in labels]
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [(round(b.x0), round(b.x1)) for b in boxes]
    page = figure.bbox
    assert all(page.x0 <= b.x0 and b.x1 <= page.x1 and page.y0 <= b.y0 for b in boxes)
    bars = sorted({round(patch.get_x() + patch.get_width() / 2, 6) for patch in ax.patches})
    assert bars == list(range(count))  # each label under its own bar
