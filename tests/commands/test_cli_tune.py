"""`pilotrun tune`'s arguments: the defaults handed to the command, and a path of the wrong kind refused."""

from __future__ import annotations

from pilotrun.commands import tune as tune_module
from pilotrun.commands.cli import build_parser, main


def test_the_defaults_check_both_within_three_times_the_pilot():
    args = build_parser().parse_args(["tune", "runs/pilot"])
    assert (args.check, args.updates, args.budget, args.data, args.nproc_per_node, args.allow_overrun) == (
        "lr,batch", None, 3.0, None, None, False)


def test_the_arguments_reach_the_command(monkeypatch, tmp_path):
    seen = {}

    def fake_tune(run_dir, checks, **options):
        seen.update(run_dir=run_dir, checks=checks, **options)
        return {}

    monkeypatch.setattr(tune_module, "tune", fake_tune)
    assert main(["tune", str(tmp_path), "--check", "batch", "--updates", "8", "--budget", "2",
                 "--allow-overrun"]) == 0
    assert seen == {"run_dir": str(tmp_path), "checks": ("batch",), "updates": 8, "budget": 2.0, "data": None,
                    "nproc": None, "allow_overrun": True}


def test_a_file_given_as_the_run_folder_is_refused_in_one_line(tmp_path, capsys):
    afile = tmp_path / "run.json"
    afile.write_text("{}")
    assert main(["tune", str(afile)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
