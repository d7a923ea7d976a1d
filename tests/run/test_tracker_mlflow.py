"""pilotrun/run/tracker_mlflow.py on a local SQLite store, read back with MlflowClient: metrics equal
metrics.jsonl's values exactly (float64), the identity as tags and params, one MLflow run for all sessions;
after a resume the kept value is each rolled-back step's latest point; export-metrics sends each step once,
with the verdict and the report as artifacts."""

from __future__ import annotations

import pytest

from pilotrun.commands.cli import main
from tests.run.tracker_runs import (
    ROLLED_BACK,
    crashed_run,
    expected,
    identity,
    live_run,
    mirror_session_by_session,
    same,
    write_verdict,
)

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")


@pytest.fixture(autouse=True)
def local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def the_run(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pilotrun")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def metrics(client, run, latest_per_step: bool = False) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for key in run.data.metrics:
        points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        if latest_per_step:
            points = list({m.step: m for m in points}.values())
        out[key] = [(m.step, m.value) for m in points]
    return out


def step_order(points):
    return {tag: sorted(values, key=lambda p: p[0]) for tag, values in points.items()}


@pytest.mark.slow
def test_live_run_reads_back_exactly_with_the_identity(builtin_data_dir, tmp_path):
    run_dir = live_run(builtin_data_dir, tmp_path / "run", ["mlflow"])
    client, run = the_run(run_dir)
    assert same(metrics(client, run), step_order(expected(run_dir)))
    assert [s for s, _ in metrics(client, run)["train/loss"]] == [1, 2, 3, 4]
    for key, value in identity(run_dir).items():
        assert run.data.tags[f"pilotrun.{key}"] == value and run.data.params[key] == value
    assert run.info.status == "FINISHED" and run.info.run_name == identity(run_dir)["run_id"]
    assert not list((tmp_path).glob("mlruns")) and (run_dir / "mlflow.db").is_file()


@pytest.mark.slow
def test_sessions_are_one_run_and_the_kept_value_is_each_steps_latest(tmp_path):
    run_dir = crashed_run(tmp_path / "run")
    mirror_session_by_session(run_dir, ["mlflow"])
    client, run = the_run(run_dir)  # one MLflow run for both sessions
    assert run.data.tags["pilotrun.resumed_at_steps"] == "20"
    assert same(metrics(client, run), step_order(expected(run_dir, kept=False)))  # MLflow keeps every point
    assert same(metrics(client, run, latest_per_step=True), step_order(expected(run_dir)))
    assert set(ROLLED_BACK) & {s for s, _ in metrics(client, run)["train/loss"]}


@pytest.mark.slow
def test_export_metrics_sends_each_step_once_with_the_verdict_and_the_report(tmp_path):
    run_dir = crashed_run(tmp_path / "run")
    write_verdict(run_dir)
    assert main(["export-metrics", str(run_dir), "--to", "mlflow"]) == 0
    client, run = the_run(run_dir)
    got = metrics(client, run)
    assert got.pop("verdict/go") == [(60, 1.0)] and got.pop("verdict/loss_decreasing/figure") == [(60, 0.25)]
    assert got.pop("verdict/loss_decreasing/threshold") == [(60, 0.05)]
    assert same(got, step_order(expected(run_dir)))
    assert run.data.tags["pilotrun.verdict"] == "GO"
    assert run.data.tags["pilotrun.verdict/loss_decreasing/status"] == "PASS"
    assert sorted(f.path for f in client.list_artifacts(run.info.run_id, "report")) == [
        "report/loss.png", "report/report.html", "report/summary.json"]
    assert (run_dir / "mlflow-artifacts").is_dir()


@pytest.mark.slow
def test_exporting_onto_a_full_disk_exits_2_and_leaves_the_local_store_as_it_was(
    tmp_path, capsys, monkeypatch
):
    """ENOSPC at MLflow's write midway through the export: exit 2, one line naming the tracker and
    RUN/mlflow.db; no store left where the export made it, and an earlier export's store byte for byte (the
    database written back from its copy, the artifacts the failed export added removed)."""
    from pilotrun.run.tracker_mlflow import MlflowSink
    from tests.run.tracker_runs import full_disk_after, tree

    run_dir = crashed_run(tmp_path / "run")
    write_verdict(run_dir)
    with monkeypatch.context() as patch:
        full_disk_after(MlflowSink, "log", 10, patch)
        assert main(["export-metrics", str(run_dir), "--to", "mlflow"]) == 2
    # MLflow's own
    err = [line for line in capsys.readouterr().err.splitlines() if "mlflow.store" not in line]
    assert len(err) == 1 and err[0].startswith(f"pilotrun: error: export-metrics --to mlflow: writing "
                                               f"{run_dir / 'mlflow.db'} failed (No space left on device); "
                                               "nothing of this export was kept"), err
    assert not (run_dir / "mlflow.db").exists() and not (run_dir / "mlflow-artifacts").exists()
    assert main(["export-metrics", str(run_dir), "--to", "mlflow"]) == 0
    before = tree(run_dir)
    assert not [name for name in before if ".tmp-" in name]  # the copy aside goes once the export succeeded
    with monkeypatch.context() as patch:
        full_disk_after(MlflowSink, "log", 10, patch)  # the same MLflow run found again, ten batches appended
        assert main(["export-metrics", str(run_dir), "--to", "mlflow"]) == 2
    assert tree(run_dir) == before
