"""pilotrun/common/deadline.py: `--stop-by` as a time, a duration or SLURM_JOB_END_TIME, fixed at the
command's start."""

from __future__ import annotations

import datetime

import pytest

from pilotrun.common.deadline import TooLateToStart, check_room, parse_duration, parse_time, resolve_stop_by
from pilotrun.common.stop_signals import TOO_LATE_EXIT_CODE

NOW = 1_800_000_000.0


@pytest.mark.parametrize("text, seconds", [("45s", 45), ("90m", 5400), ("2h30m", 9000), ("1d", 86400),
                                           ("1h0m5s", 3605)])
def test_durations(text, seconds):
    assert parse_duration(text) == float(seconds)


@pytest.mark.parametrize("text", ["", "90", "m", "1.5h", "30m2h", "soon"])
def test_not_durations(text):
    assert parse_duration(text) is None


def test_times_with_and_without_a_zone():
    assert parse_time("@1800000100") == 1_800_000_100.0
    assert (
        parse_time("2027-01-15T06:00:00+00:00")
        == datetime.datetime(2027, 1, 15, 6, tzinfo=datetime.UTC).timestamp()
    )
    local = datetime.datetime(2027, 1, 15, 6).astimezone().timestamp()
    assert parse_time("2027-01-15T06:00") == local  # no zone: the machine's local time
    assert parse_time("@soon") is None and parse_time("tomorrow") is None


def test_the_flag_wins_over_slurm_and_none_disables_it():
    slurm = {"SLURM_JOB_END_TIME": str(int(NOW) + 600)}
    assert resolve_stop_by(None, NOW, slurm) == NOW + 600
    assert resolve_stop_by("90m", NOW, slurm) == NOW + 5400
    assert resolve_stop_by("none", NOW, slurm) is None
    assert resolve_stop_by(None, NOW, {}) is None
    assert resolve_stop_by(None, NOW, {"SLURM_JOB_END_TIME": " "}) is None


@pytest.mark.parametrize("text, environ, named", [
    ("later", {}, "--stop-by 'later': not a time"),
    (f"@{int(NOW)}", {}, "already past"),
    ("0s", {}, "already past"),
    (None, {"SLURM_JOB_END_TIME": "12:00"}, "SLURM_JOB_END_TIME '@12:00': not a time"),
    (None, {"SLURM_JOB_END_TIME": str(int(NOW) - 1)}, "SLURM_JOB_END_TIME"),
])
def test_refusals_name_what_and_where(text, environ, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        resolve_stop_by(text, NOW, environ)


def test_room_for_one_update():
    check_room(NOW + 60, NOW, 59.0)
    check_room(NOW + 60, NOW, None)  # a run without a record yet: nothing to compare
    with pytest.raises(ValueError, match="less than one update"):
        check_room(NOW + 60, NOW, 61.0)


def test_a_start_needs_its_set_up_one_update_and_a_save_before_the_deadline():
    """On an injected clock (NOW): 10 s of set-up, 2 s an update, 5 s the last save need 17 s."""
    costs = {"setup_seconds": 10.0, "save_seconds": 5.0}
    check_room(NOW + 17.0, NOW, 2.0, **costs)
    named = r"16\.9 s remain .* set-up \(10\.0 s.*update \(2\.0 s.*save \(5\.0 s"
    with pytest.raises(TooLateToStart, match=named):
        check_room(NOW + 16.9, NOW, 2.0, **costs)
    check_room(NOW + 12.0, NOW, 2.0, setup_seconds=10.0)  # a run that never saved: no save to count
    with pytest.raises(TooLateToStart, match="not started in this allocation"):
        check_room(NOW + 11.9, NOW, 2.0, setup_seconds=10.0)
    check_room(NOW + 1.0, NOW, None, **costs)  # nothing recorded: nothing to compare


def test_a_start_too_late_has_its_own_exit_code_not_bad_input_s():
    with pytest.raises(TooLateToStart) as refused:
        check_room(NOW + 60, NOW, 61.0)
    assert refused.value.exit_code == TOO_LATE_EXIT_CODE == 79
    assert TOO_LATE_EXIT_CODE not in (0, 1, 2, 75, 124) and not 128 < TOO_LATE_EXIT_CODE < 160
