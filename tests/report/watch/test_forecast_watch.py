"""watch against the lock's forecast, on synthetic long runs whose validation losses follow the pilot's law,
go wrong
part way, or belong to another recipe (tests/report/projection/test_forecast_record.py builds them)."""

from __future__ import annotations

import copy

import pytest

from pilotrun.report.projection import forecast_record as fr
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.watch.alerts import Watcher
from tests.report.projection.test_forecast_record import resumed_with, synthetic


@pytest.fixture(scope="module")
def pilot_dir(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("pilot") / "r", 200, 10).run_dir


@pytest.fixture(scope="module")
def lock(pilot_dir):
    summary = summarize_run(pilot_dir)
    return {
        "recipe": summary.run["recipe"],
        "data": {"metadata_sha256": "0" * 64},
        "forecast": fr.lock_forecast(summary, 2000),
    }


def watched(run_dir, lock):
    watcher = Watcher(run_dir, lock=lock, holder=lambda path: None)
    watcher.check(final=True)
    return watcher, [a for a in watcher.raised if a.kind == "forecast"], watcher.new_notes()


def test_a_healthy_long_run_raises_no_forecast_alert(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100)
    _, alerts, notes = watched(run.run_dir, lock)
    assert alerts == [] and not [n for n in notes if "forecast" in n]


def test_a_run_leaving_the_band_past_the_pilots_reach_is_alerted_after_two_evaluations(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    _, alerts, _ = watched(run.run_dir, lock)
    assert len(alerts) == 1
    assert (
        alerts[0].step == 500
        and alerts[0].extra == {"first": 400}
        and "above the forecast's band" in alerts[0].message
    )
    assert alerts[0].figure > alerts[0].bound


def test_one_evaluation_outside_is_not_an_alert(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step == 600 else 0.0)
    assert watched(run.run_dir, lock)[1] == []


def test_a_run_the_forecast_does_not_apply_to_hears_it_once_and_is_not_held_to_it(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, kind="wsd", shift=lambda step: 0.4)
    _, alerts, notes = watched(run.run_dir, lock)
    said = [n for n in notes if "forecast does not apply" in n]
    assert alerts == [] and len(said) == 1 and "schedule family optim.schedule.kind" in said[0]


def test_a_lock_without_a_forecast_is_watched_as_before(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    older = copy.deepcopy(lock)
    del older["forecast"]
    _, alerts, notes = watched(run.run_dir, older)
    assert alerts == [] and not [n for n in notes if "forecast" in n]
    unavailable = {
        **older,
        "forecast": {"unavailable": "no forecast: the pilot has 3 validation evaluation(s)"},
    }
    assert watched(run.run_dir, unavailable)[1] == []


def test_a_run_rising_above_its_own_course_is_alerted_before_the_band_is_held(tmp_path, lock):
    # +5% from step 300 on: inside the forecast's band (at least +-8%, held from twice the pilot's 200
    # updates), above the law refitted to the pilot's and the run's own evaluations (held from the pilot's
    # reach on).
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0)
    _, alerts, _ = watched(run.run_dir, lock)
    assert len(alerts) == 1 and alerts[0].step == 400 and alerts[0].extra == {"first": 300}
    assert "above" in alerts[0].message and "refitted to the pilot's and this run's own" in alerts[0].message
    assert alerts[0].figure > alerts[0].bound


def test_a_lock_from_before_the_rise_check_is_watched_as_before(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0)
    older = copy.deepcopy(lock)
    del older["forecast"]["rise"]
    assert watched(run.run_dir, older)[1] == []  # +5% is inside the band: no alert, as before the rise check
    leaving = synthetic(tmp_path / "leaving", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    _, alerts, _ = watched(leaving.run_dir, older)
    assert [(a.step, a.extra) for a in alerts] == [(500, {"first": 400})]
    assert "above the forecast's band" in alerts[0].message


def test_a_lock_written_at_the_earlier_drift_weight_is_graded_and_watched_by_its_own_numbers(
    tmp_path, lock, pilot_dir, monkeypatch
):
    """Before the 90% interval's drift weight was chosen held out, freeze wrote it at 0.5: such a lock is
    graded by the interval it holds (never recomputed at today's weight) and watched as today (the band's
    weight did not change). A final loss between today's upper edge and the earlier one is inside the earlier
    lock's interval and outside today's."""
    from pilotrun.report.projection import forecast as fc_module
    from tests.report.projection.test_forecast_record import law_loss

    monkeypatch.setitem(fc_module.WIDEN, fc_module.LEVEL, 0.5)
    older = {**lock, "forecast": fr.lock_forecast(summarize_run(pilot_dir), 2000)}
    monkeypatch.undo()
    old_high, new_high = older["forecast"]["final"]["high"], lock["forecast"]["final"]["high"]
    assert old_high > new_high and older["forecast"]["curve"] != lock["forecast"]["curve"]
    between = (old_high + new_high) / 2 - law_loss(2000, 0.004)(2000)
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: between if step == 2000 else 0.0)
    summary = summarize_run(run.run_dir)
    graded_old, graded_new = (
        fr.against(lk["forecast"], lk["recipe"], "0" * 64, run.run, summary.kept_events)
        for lk in (older, lock)
    )
    assert graded_old["inside"] and not graded_new["inside"]
    assert graded_old["low"] == older["forecast"]["final"]["low"] and graded_old["high"] == old_high
    bands = [[row[4:] for row in lk["forecast"]["curve"]] for lk in (older, lock)]
    assert bands[0] == bands[1]  # the band watch holds a run to is the same at either weight
    leaving = synthetic(tmp_path / "leaving", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    for lk in (older, lock):
        _, alerts, _ = watched(leaving.run_dir, lk)
        assert [(a.step, a.extra) for a in alerts] == [(500, {"first": 400})]


def test_a_lock_fitted_with_equal_weights_or_none_recorded_is_graded_and_watched_as_before(
    tmp_path, pilot_dir, monkeypatch
):
    """Before the fit weighed the pilot's evaluations per e-fold of updates, freeze weighed them alike (and
    before that recorded no weighting): such a lock is graded by the numbers it holds and watched as it was
    then, whatever today's default (the rise check's refit weighs alike under either)."""
    from pilotrun.report.projection import forecast as fc_module

    monkeypatch.setattr(fc_module, "DEFAULT_WEIGHTING", "equal")
    summary = summarize_run(pilot_dir)
    equal = {"recipe": summary.run["recipe"], "data": {"metadata_sha256": "0" * 64}}
    equal["forecast"] = fr.lock_forecast(summary, 2000)
    unrecorded = copy.deepcopy(equal)
    del unrecorded["forecast"]["fitted_on"]["weighting"]
    runs = [
        synthetic(tmp_path / "healthy", 2000, 100),
        synthetic(tmp_path / "rising", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0),
        synthetic(tmp_path / "leaving", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0),
    ]

    def seen():
        out = []
        for lk in (equal, unrecorded):
            for run in runs:
                events = summarize_run(run.run_dir).kept_events
                graded = fr.against(lk["forecast"], lk["recipe"], "0" * 64, run.run, events)
                raised = watched(run.run_dir, lk)[1]
                alerts = [(a.step, a.extra, a.message, a.figure, a.bound) for a in raised]
                out.append((graded, alerts))
        return out

    then = seen()
    monkeypatch.undo()
    assert fc_module.DEFAULT_WEIGHTING == "log-updates-from-2x-warmup"
    assert equal["forecast"]["fitted_on"]["weighting"] == "equal"
    today = fr.lock_forecast(summary, 2000)  # today's lock weighs per e-fold: another fit
    assert today["fitted_on"]["weighting"] == "log-updates-from-2x-warmup"
    assert today["parameters"] != equal["forecast"]["parameters"]
    assert seen() == then
    # the healthy run is left alone, the rising one caught by the refit, the leaving one by the band
    expected = [[], [(400, {"first": 300})], [(500, {"first": 400})]]
    assert [[a[:2] for a in alerts] for _, alerts in then[:3]] == expected
    assert then[0][0]["predicted"] == equal["forecast"]["final"]["value"] and then[0][0]["inside"]


def mixture(
    run_dir, steps: int, eval_every: int, code_shift=lambda step: 0.0, dropped_from: int | None = None
):
    """A synthetic mixture run (tests/report/projection/test_forecast_record.py's law): its val events hold
    each source's own loss ("easy" the law, "code" 0.5 above it, plus `code_shift`), and its `loss` is their
    mean under the weights in force: half each, the easy source's alone once the code is dropped (from
    `dropped_from` on), so that the mean falls when the harder source leaves the batches."""
    run = synthetic(run_dir, steps, eval_every)
    for event in run.events:
        if event["event"] == "val":
            easy = event["loss"]
            code = easy + 0.5 + code_shift(event["step"])
            event["loss_by_source"] = {"easy": easy, "code": code}
            dropped = dropped_from is not None and event["step"] >= dropped_from
            event["loss"] = easy if dropped else (easy + code) / 2
    run.write()
    return run


def code_rises_from_300(step):
    return 0.4 if step >= 300 else 0.0


def lock_of(pilot):
    """The lock a mixture pilot's summary gives for a long run of 2000 updates (its recipe, a fixed data
    identity, its forecast)."""
    summary = summarize_run(pilot.run_dir)
    return {
        "recipe": summary.run["recipe"],
        "data": {"metadata_sha256": "0" * 64},
        "forecast": fr.lock_forecast(summary, 2000),
    }


@pytest.fixture(scope="module")
def mixture_lock(tmp_path_factory):
    return lock_of(mixture(tmp_path_factory.mktemp("mixture-pilot") / "r", 200, 10))


def test_a_mixture_pilots_lock_holds_each_sources_own_evaluations_for_its_rise_check(mixture_lock):
    by_source = mixture_lock["forecast"]["rise"]["by_source"]
    assert sorted(by_source) == ["code", "easy"]
    assert [s for s, _ in by_source["code"]] == list(range(20, 201, 10))  # past the warm-up of 10
    assert by_source["code"][0][1] - by_source["easy"][0][1] == pytest.approx(0.5)


def test_a_dropped_source_whose_own_loss_rises_is_alerted_though_the_mean_falls(tmp_path, mixture_lock):
    # From step 300 the code source gets no rows: the mean (the easy source's alone) falls by 0.25, while the
    # code's own loss rises 0.4 (about 6%) above its course.
    run = mixture(tmp_path / "long", 2000, 100, code_shift=code_rises_from_300, dropped_from=300)
    _, alerts, _ = watched(run.run_dir, mixture_lock)
    assert [(a.step, a.extra) for a in alerts] == [(400, {"first": 300})]
    assert "val loss of source 'code'" in alerts[0].message and alerts[0].figure > alerts[0].bound
    summary = summarize_run(run.run_dir)
    graded = fr.against(
        mixture_lock["forecast"], mixture_lock["recipe"], "0" * 64, run.run, summary.kept_events
    )
    assert graded["left_band_at"] == 300
    healthy = mixture(tmp_path / "healthy", 2000, 100)
    assert watched(healthy.run_dir, mixture_lock)[1] == []


def test_a_lock_from_before_the_per_source_check_is_held_to_the_mean_alone(tmp_path, mixture_lock):
    older = copy.deepcopy(mixture_lock)
    del older["forecast"]["rise"]["by_source"]
    run = mixture(tmp_path / "long", 2000, 100, code_shift=code_rises_from_300, dropped_from=300)
    assert watched(run.run_dir, older)[1] == []  # the mean fell: nothing the lock's checks see, as before
    summary = summarize_run(run.run_dir)
    assert fr.against(older["forecast"], older["recipe"], "0" * 64, run.run, summary.kept_events)[
        "left_band_at"
    ] is None


@pytest.fixture(scope="module")
def noisy_mixture_lock(tmp_path_factory):
    """A mixture pilot whose pooled loss is too noisy to forecast (+-0.4 every other evaluation, against a
    fall of about 1.3), its sources' own losses clean."""
    pilot = mixture(tmp_path_factory.mktemp("noisy-mixture-pilot") / "r", 200, 10)
    for event in pilot.events:
        if event["event"] == "val":
            event["loss"] += 0.4 if event["step"] % 20 else -0.4
    pilot.write()
    return lock_of(pilot)


def test_a_pilot_refused_as_too_noisy_still_locks_its_rise_check_and_never_a_number(noisy_mixture_lock):
    fc = noisy_mixture_lock["forecast"]
    assert fc["unavailable"].startswith("no forecast: the pilot's validation loss is too noisy to fit")
    assert not {"final", "curve", "parameters", "law", "fitted_on"} & set(fc)
    rise = fc["rise"]
    assert rise["share"] == fr.RISE_SHARE and rise["from_step"] == 200 and sorted(rise["by_source"]) == [
        "code",
        "easy",
    ]
    assert [s for s, _ in rise["points"]] == list(range(20, 201, 10))  # the mean's, past the warm-up
    assert fr.format_forecast(fc) == (
        f"forecast: {fc['unavailable']}; watch still holds the long run to its own course (a rise of more "
        "than 3.5% above the law refitted to the pilot's and the run's evaluations)"
    )


def test_a_dropped_source_is_alerted_under_a_lock_refused_a_forecast_as_too_noisy(
    tmp_path, noisy_mixture_lock
):
    run = mixture(tmp_path / "long", 2000, 100, code_shift=code_rises_from_300, dropped_from=300)
    _, alerts, notes = watched(run.run_dir, noisy_mixture_lock)
    assert [(a.step, a.extra) for a in alerts] == [(400, {"first": 300})]
    assert "val loss of source 'code'" in alerts[0].message and alerts[0].figure > alerts[0].bound
    assert not [n for n in notes if "forecast does not apply" in n]
    healthy = mixture(tmp_path / "healthy", 2000, 100)
    assert watched(healthy.run_dir, noisy_mixture_lock)[1] == []
    # summarize says the lock has no forecast, as before: no made-up number to grade
    summary = summarize_run(run.run_dir)
    graded = fr.against(
        noisy_mixture_lock["forecast"], noisy_mixture_lock["recipe"], "0" * 64, run.run, summary.kept_events
    )
    assert graded == {"unavailable": noisy_mixture_lock["forecast"]["unavailable"]}


def test_a_refused_lock_without_a_rise_check_is_watched_as_before(tmp_path, noisy_mixture_lock):
    older = copy.deepcopy(noisy_mixture_lock)  # refused before the rise check was kept for it
    del older["forecast"]["rise"]
    run = mixture(tmp_path / "long", 2000, 100, code_shift=code_rises_from_300, dropped_from=300)
    _, alerts, notes = watched(run.run_dir, older)
    assert alerts == [] and not [n for n in notes if "forecast" in n]


def test_a_run_rising_above_its_own_course_is_alerted_under_a_refused_lock_and_cleared(
    tmp_path, noisy_mixture_lock
):
    from pilotrun.report.watch.forecast_watch import ForecastWatch

    # the mean's own course: +0.6 at steps 300 and 400 (the code source +1.2), back on course after
    run = mixture(tmp_path / "long", 2000, 100, code_shift=lambda step: 1.2 if 300 <= step <= 400 else 0.0)
    held = ForecastWatch(noisy_mixture_lock, run.run)
    said = {
        e["step"]: held.judge(run.run, {"step": e["step"], "loss": e["loss"]})  # the mean alone
        for e in run.events
        if e["event"] == "val"
    }
    assert said[300] is None and said[400]["first"] == 300 and "the run is leaving its own course" in (
        said[400]["outside"]
    )
    assert said[600] == {"inside": True}  # an evaluation back on course clears it (no band to be inside)


def changes_said(run_dir, lock):
    watcher, alerts, _ = watched(run_dir, lock)
    return watcher, alerts, [a for a in watcher.raised if a.kind == "forecast_change"]


def test_a_change_on_resume_that_leaves_the_forecasts_assumptions_is_said_once_naming_it(tmp_path, lock):
    run = resumed_with(tmp_path / "long", [("allowed", "optim.grad_clip", 1.0, 0.5)])
    watcher, alerts, said = changes_said(run.run_dir, lock)
    assert alerts == []  # the losses are the healthy run's: nothing in the loss shows the change
    assert len(said) == 1 and said[0].step == 600 and said[0].extra["from_step"] == 501
    assert said[0].key == "forecast_change:s2" and said[0].figure == ["optim.grad_clip 1.0 -> 0.5"]
    assert "optim.grad_clip 1.0 -> 0.5 from update 501 (session s2)" in said[0].message
    assert "from step 501 its band is a reference, not a prediction" in said[0].message
    assert "forecast_change:s2" in watcher.active  # it stands: the run is on the changed recipe from then
    watcher.check(final=True)
    assert [a.kind for a in watcher.raised].count("forecast_change") == 1


def test_a_change_repeated_by_a_later_resume_from_the_same_update_is_said_once(tmp_path, lock):
    run = resumed_with(tmp_path / "long", [("allowed", "optim.grad_clip", 1.0, 0.5)], kill_at=650)
    _, _, said = changes_said(run.run_dir, lock)
    assert [(a.step, a.key) for a in said] == [(600, "forecast_change:s2")]


def test_a_mixtures_weights_are_named_and_cadences_or_machine_keys_are_not(tmp_path, lock):
    run = resumed_with(
        tmp_path / "long",
        [
            ("allowed", "data.mixture.weights", [0.5, 0.5], [0.5, 0.001]),
            ("free", "train.eval.every", 100, 50),
            ("free", "train.num_threads", 1, 2),
            ("free", "train.max_steps", 2000, 2500),
        ],
    )
    _, _, said = changes_said(run.run_dir, lock)
    assert len(said) == 1 and said[0].figure == ["data.mixture.weights [0.5, 0.5] -> [0.5, 0.001]"]
    only_cadences = resumed_with(
        tmp_path / "cadences", [("free", "train.eval.every", 100, 50), ("free", "train.num_threads", 1, 2)]
    )
    assert changes_said(only_cadences.run_dir, lock)[2] == []


def test_a_changed_run_that_also_leaves_the_band_is_held_to_it_as_before(tmp_path, lock):
    run = resumed_with(
        tmp_path / "long",
        [("allowed", "optim.grad_clip", 1.0, 0.5)],
        shift=lambda step: 0.6 if step > 300 else 0.0,
    )
    _, alerts, said = changes_said(run.run_dir, lock)
    assert [(a.step, a.extra) for a in alerts] == [(500, {"first": 400})] and len(said) == 1


def test_no_change_or_a_lock_without_a_forecast_is_watched_as_before(tmp_path, lock):
    healthy = synthetic(tmp_path / "healthy", 2000, 100)
    assert changes_said(healthy.run_dir, lock)[2] == []
    resumed = resumed_with(tmp_path / "resumed", [])
    assert changes_said(resumed.run_dir, lock)[2] == []
    changed = resumed_with(tmp_path / "changed", [("allowed", "optim.grad_clip", 1.0, 0.5)])
    older = copy.deepcopy(lock)
    del older["forecast"]
    assert changes_said(changed.run_dir, older)[2] == []
    refused = "no forecast: the pilot has 3 validation evaluation(s)"
    unavailable = {**older, "forecast": {"unavailable": refused}}
    assert changes_said(changed.run_dir, unavailable)[2] == []


def test_a_change_under_a_lock_refused_as_too_noisy_names_the_rise_checks_course(
    tmp_path, noisy_mixture_lock
):
    run = resumed_with(tmp_path / "long", [("allowed", "data.mixture.weights", [0.5, 0.5], [0.5, 0.001])])
    said = changes_said(run.run_dir, noisy_mixture_lock)[2]
    assert len(said) == 1 and "the course the lock's rise check holds the run to is a reference" in (
        said[0].message
    )


def test_a_change_is_said_at_its_first_evaluation_when_one_look_reads_the_resume_and_it(tmp_path, lock):
    """watch opened the run before the resume (run.json without the change); the resume rewrote run.json
    before its first line, and one look reads its start and its first evaluation together."""
    import json
    import os

    run = resumed_with(tmp_path / "long", [("allowed", "optim.grad_clip", 1.0, 0.5)])
    path = run.run_dir / "run.json"
    full = json.loads(path.read_text())
    before = {**full, "allowed_changes": [], "sessions": full["sessions"][:1]}
    path.write_text(json.dumps(before))
    watcher = Watcher(run.run_dir, lock=lock, holder=lambda path: None)
    (run.run_dir / "run.json.new").write_text(json.dumps(full))
    os.replace(run.run_dir / "run.json.new", path)  # as the writer replaces it
    watcher.check(final=True)
    said = [a for a in watcher.raised if a.kind == "forecast_change"]
    assert [(a.step, a.extra["from_step"]) for a in said] == [(600, 501)]


def undone_change_run(run_dir, again: bool, kill_at: int = 650):
    """s2 halves the grad clip on resume from 500 and is killed at `kill_at` (past its first evaluation, at
    600, by default); s3 resumes from the same checkpoint at 500, on the lock's recipe (`again`: with the same
    change made again)."""
    return resumed_with(run_dir, [("allowed", "optim.grad_clip", 1.0, 0.5)], kill_at=kill_at, again=again)


def test_a_change_whose_session_was_rolled_back_before_its_first_evaluation_is_not_said(tmp_path, lock):
    """A resume that changed the recipe, killed before any evaluation, and a later resume from the same
    checkpoint without the change: no update of the kept history ran on the changed recipe, so neither watch
    nor summarize's grade names it."""
    run = undone_change_run(tmp_path / "long", again=False, kill_at=550)  # s2 killed before its first at 600
    _, alerts, said = changes_said(run.run_dir, lock)
    assert alerts == [] and said == []
    kept = summarize_run(run.run_dir).kept_events
    assert fr.against(lock["forecast"], lock["recipe"], "0" * 64, run.run, kept)["changes"] == []


def test_a_change_whose_session_a_later_resume_redoes_clears_and_the_same_change_made_again_stands(
    tmp_path, lock
):
    from pilotrun.report.watch.forecast_watch import ForecastWatch

    undone = undone_change_run(tmp_path / "undone", again=False)
    held, said, cleared = ForecastWatch(lock, undone.run), [], []
    for event in undone.events:  # as a live watch reads them, one at a time
        if event["event"] == "session_start":
            held.restart(event["session_id"], event.get("resumed_from"))
        elif event["event"] == "val":
            held.judge(undone.run, event)
            said += [(event["step"], c["session_id"]) for c in held.changes]
            cleared += [(event["step"], sid) for sid in held.undone]
            held.changes, held.undone = [], []
    # said at s2's first evaluation; cleared at s3's, which redid s2's updates on the lock's recipe
    assert said == [(600, "s2")] and cleared == [(600, "s2")]
    watcher, alerts, raised = changes_said(undone.run_dir, lock)  # one look at the finished run
    assert alerts == [] and raised == [] and not any(k.startswith("forecast_change") for k in watcher.active)
    again = undone_change_run(tmp_path / "again", again=True)
    watcher, _, raised = changes_said(again.run_dir, lock)
    assert [(a.step, a.key) for a in raised] == [(600, "forecast_change:s2")]  # the same change: said once
    assert "forecast_change:s2" in watcher.active  # and it stands: s3 keeps it
