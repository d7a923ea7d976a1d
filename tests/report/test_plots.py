"""plots: every PNG is written, is a real PNG and is non-empty, also when the record lacks a figure."""

from pilotrun.report.plots import PLOT_NAMES, write_plots
from pilotrun.report.summarize import summarize_run
from tests.report.synthetic import crashed_and_resumed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_plot_is_a_nonempty_png(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.overflow_at = {45}
    run.clip_head(40, 1, 0, 250.0, first_time=True)  # a first and hard QK-Clip, marked on its plot
    run.write()
    paths = write_plots(summarize_run(tmp_path / "r"), tmp_path / "plots")
    assert list(paths) == list(PLOT_NAMES)
    for name, path in paths.items():
        data = path.read_bytes()
        assert path.name == f"{name}.png"
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


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
