"""The run's loud moments marked on the plots, from the record's events: where each mark goes and what it
says, and that the loss, LR and gradient-norm plots draw the ones they show at those steps."""

from __future__ import annotations

from matplotlib.figure import Figure

from pilotrun.report.drawing.marks import Mark, draw_marks, run_marks
from pilotrun.report.record_check.summarize import Summary


def _event(kind: str, step: int, line: int, **fields) -> dict:
    return {"event": kind, "step": step, "updates_attempted": step, "tokens_seen": 32 * step, "_line": line,
            **fields}


def _summary(kept: list[dict], rolled: list[dict] = (), run: dict | None = None,
             lineage: tuple[str, ...] = ("s1", "s2")) -> Summary:
    return Summary(run_dir="r", run_id="r", valid=True, reasons=[], notes=[], sessions=[],
                   lineage=list(lineage), overall={}, kept_events=list(kept),
                   rolled_back_events=list(rolled), run=run or {})


def test_each_pass_boundary_spike_rollback_and_recipe_change_is_a_mark_at_its_step():
    spike = _event("spike", 11, 5, spike_step=12, batches=[12], action="rollback")
    rollback = _event("rollback", 8, 6, restored_step=8, spike_step=12, skipped={"first_batch": 12})
    kept = [_event("train", 5, 1), _event("data_restart", 6, 2, epoch=1, data_restarts=1),
            _event("data_restart", 6, 3, epoch=1, data_restarts=2),  # two ranks' worth: one boundary
            _event("train", 10, 4), rollback,
            _event("spike", 30, 8, spike_step=31, batches=[31], action="skip"),
            _event("data_restart", 40, 9, epoch=2, data_restarts=3)]
    run = {"sessions": [{"session_id": "s1", "start_step": 0}, {"session_id": "s2", "start_step": 20},
                        {"session_id": "gone", "start_step": 25}],
           "allowed_changes": [{"session_id": "s2", "key": "optim.muon.lr", "old": 0.02, "new": 0.01},
                               {"session_id": "gone", "key": "optim.grad_clip", "old": 1.0, "new": 0.5}],
           "free_changes": [{"session_id": "s2", "key": "train.max_steps", "old": 40, "new": 80}]}
    # the spike that was rolled back is on the rolled-back side, and again once more (a redone attempt)
    marks = run_marks(_summary(kept, rolled=[spike, dict(spike, _line=7)], run=run))
    assert marks == [
        Mark("pass", 6, "pass 2"),
        Mark("rollback", 8, "rollback to 8", end=12),
        Mark("spike", 12, "spike (rollback)"),
        # the session outside the lineage changed nothing that counts
        Mark("recipe_change", 20, "changed optim.muon.lr, train.max_steps"),
        Mark("spike", 31, "spike (skip)"),
        Mark("pass", 40, "pass 3"),
    ]


def test_a_mixtures_boundary_names_the_sources_that_were_read_again():
    kept = [_event("train", 4, 1, restarts_by_source={"edu": 0, "tiny": 1}),
            _event("data_restart", 6, 2, epoch=2, data_restarts=2),
            _event("train", 8, 3, restarts_by_source={"edu": 0, "tiny": 2}),
            _event("data_restart", 9, 4, epoch=2, data_restarts=4),
            _event("train", 12, 5, restarts_by_source={"edu": 1, "tiny": 3})]
    assert run_marks(_summary(kept)) == [Mark("pass", 6, "source tiny again"),
                                         Mark("pass", 9, "source edu, tiny again")]


def test_a_run_without_loud_moments_has_no_mark():
    assert run_marks(_summary([_event("train", 5, 1), _event("val", 5, 2, loss=3.0)])) == []


def _drawn(marks: list[Mark], kinds=None):
    ax = Figure().subplots()
    ax.plot([0, 50], [1, 2], label="curve")
    before = len(ax.lines)
    draw_marks(ax, marks) if kinds is None else draw_marks(ax, marks, kinds)
    lines = [line.get_xdata()[0] for line in ax.lines[before:]]
    spans = [(round(patch.get_x(), 6), round(patch.get_x() + patch.get_width(), 6)) for patch in ax.patches]
    legend = ax.get_legend_handles_labels()[1][1:]  # after the curve's own entry
    return lines, spans, [(t.get_position()[0], t.get_text()) for t in ax.texts], legend


MARKS = [Mark("pass", 6, "pass 2"), Mark("rollback", 8, "rollback to 8", end=12), Mark("spike", 12, "spike"),
         Mark("recipe_change", 20, "changed optim.muon.lr"), Mark("pass", 40, "source $x$ again")]


def test_the_marks_are_drawn_at_their_steps_one_legend_entry_per_kind_labels_along_the_top():
    lines, spans, texts, legend = _drawn(MARKS)
    assert lines == [6, 12, 20, 40] and spans == [(8, 12)]
    # one entry per kind, the second pass boundary none of its own
    assert sorted(legend) == ["data pass boundary", "recipe change at resume",
                              "rolled back (undone and redone)", "spike"]
    assert texts == [(6, "pass 2"), (8, "rollback to 8"), (12, "spike"), (20, "changed optim.muon.lr"),
                     (40, r"source \$x\$ again")]  # a source's name never turns a label into math


def test_a_plot_draws_only_the_kinds_it_shows():
    lines, spans, texts, legend = _drawn(MARKS, ("spike", "rollback"))
    assert lines == [12] and spans == [(8, 12)] and [x for x, _ in texts] == [8, 12]
    assert sorted(legend) == ["rolled back (undone and redone)", "spike"]


def test_the_loss_lr_and_grad_norm_plots_draw_the_marks_they_show(tmp_path, monkeypatch):
    import matplotlib.figure

    from pilotrun.report.drawing.plots import plot_grad_norm, plot_loss, plot_lr

    saved = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (saved.append(self), real(self, *a, **k))[1])
    kept = [_event("train", 5, 1, loss=3.0, lr=0.01, grad_norm=1.0),
            _event("data_restart", 6, 2, epoch=1, data_restarts=1),
            _event("rollback", 8, 3, restored_step=8, spike_step=12),
            _event("spike", 11, 4, spike_step=12, batches=[12], action="rollback"),
            _event("train", 20, 5, loss=2.5, lr=0.01, grad_norm=1.0)]
    run = {"sessions": [{"session_id": "s1", "start_step": 0}, {"session_id": "s2", "start_step": 15}],
           "allowed_changes": [{"session_id": "s2", "key": "optim.muon.lr", "old": 0.02, "new": 0.01}]}
    summary = _summary(kept, run=run)
    for plot in (plot_loss, plot_lr, plot_grad_norm):
        plot(summary, tmp_path / f"{plot.__name__}.png")
    labels = [sorted((round(t.get_position()[0]), t.get_text()) for t in figure.axes[0].texts)
              for figure in saved]
    assert labels == [
        [(6, "pass 2"), (8, "rollback to 8"), (12, "spike (rollback)"), (15, "changed optim.muon.lr")],
        [(8, "rollback to 8"), (15, "changed optim.muon.lr")],
        [(8, "rollback to 8"), (12, "spike (rollback)")],
    ]
