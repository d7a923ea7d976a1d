"""plots: every PNG is written, is a real PNG and is non-empty, also when the record lacks a figure."""

import matplotlib.axes
import pytest

from pilotrun.report.drawing.plots import PLOT_NAMES, write_plots
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_with_an_overflow(run_dir, **kwargs):
    run = SyntheticRun(run_dir, **kwargs)
    run.overflow_at = {45}  # set before any event is written, so the record really holds the skipped update
    return run


@pytest.mark.slow
def test_every_plot_is_a_nonempty_png_and_the_overflow_is_drawn(tmp_path, monkeypatch):
    run = crashed_and_resumed(tmp_path / "r", make_run=_run_with_an_overflow)
    run.clip_head(40, 1, 0, 250.0, first_time=True)  # a first and hard QK-Clip, marked on its plot
    run.write()
    summary = summarize_run(tmp_path / "r")
    (overflow,) = [e for e in summary.kept_events if e["event"] == "overflow"]
    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def recording_plot(self, *args, **kwargs):
        drawn.append((kwargs.get("label") or "", [float(x) for x in args[0]] if args else []))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    paths = write_plots(summary, tmp_path / "plots")
    assert list(paths) == list(PLOT_NAMES)
    for name, path in paths.items():
        data = path.read_bytes()
        assert path.name == f"{name}.png"
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    marked = [xs for label, xs in drawn if "skipped update" in label]
    assert marked == [[float(overflow["step"])]]


@pytest.mark.slow
def test_plots_are_written_when_figures_are_missing(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    for event in run.events:
        event.pop("moe", None)
        event.pop("qk_clip", None)
        event.pop("optimizer", None)
        event.pop("activations", None)
    run.write()
    paths = write_plots(summarize_run(tmp_path / "r"), tmp_path / "plots")
    for path in paths.values():
        assert path.read_bytes().startswith(PNG_MAGIC)


def test_a_session_id_with_terminal_escapes_is_drawn_escaped_with_no_missing_glyph(tmp_path, monkeypatch):
    """A recorded session id holding ESC and BEL, and a parameter group named with dollar signs and a control
    character: the plots draw them as the text output prints them (\\x1b), so matplotlib warns of no missing
    glyph and no name switches a label into math mode."""
    import warnings

    from pilotrun.report.drawing import plots

    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(10)
    run.end_session()
    odd_id, odd_group = "s\x1b[31m1\x07", "attn$x$\x1b"
    for record in run.events + run.run["sessions"]:
        record["session_id"] = odd_id
        if record.get("event") == "train":
            record["optimizer"]["weight_rms"][odd_group] = record["optimizer"]["weight_rms"].pop("attention")
    run.run["optimizer"]["groups"] = [{"group": odd_group}]
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    texts: list[str] = []
    real_save = plots._save

    def saving(fig, ax, path):
        done = real_save(fig, ax, path)
        legend = ax.get_legend()
        texts.extend([t.get_text() for t in ax.get_xticklabels()] + [ax.get_ylabel()]
                     + ([t.get_text() for t in legend.get_texts()] if legend else []))
        return done

    monkeypatch.setattr(plots, "_save", saving)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plots.plot_time_ledger(summary, tmp_path / "ledger.png")
        plots.plot_lr(summary, tmp_path / "lr.png")
        plots.plot_parameter_groups(summary, tmp_path / "groups.png")
    assert [str(w.message) for w in caught if "Glyph" in str(w.message)] == []
    # the time ledger's bar, named by its number and (an id not of the stamp's form) the id as summarize
    # prints it
    assert "1: s\\x1b[31m1\\x07" in texts
    assert any("attn\\$x\\$\\x1b" in text for text in texts)  # the LR plot's label of the first group
    assert not any("\x1b" in text or "\x07" in text for text in texts)
