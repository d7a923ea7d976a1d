"""inspect-batch's arithmetic: which attempt made an update, which global microbatches it read, and the
refusals where the record cannot say (an edited log, a step the run never reached, a changed geometry).
The end-to-end decode of a real run's rows is in tests/training/test_trainer_signals.py."""

import json

import pytest

from pilotrun.commands.inspect_batch import attempt_batches, attempt_for_step, microbatches_for_step
from pilotrun.common.errors import ConfigError
from pilotrun.run.record import RecordError
from tests.report.synthetic import SyntheticRun


def test_skipped_attempts_push_an_update_to_a_later_attempt():
    assert [attempt_for_step(step, set()) for step in (1, 2, 3)] == [1, 2, 3]
    # Attempts 2 and 3 overflowed: update 2 is attempt 4, update 3 attempt 5.
    assert [attempt_for_step(step, {2, 3}) for step in (1, 2, 3)] == [1, 4, 5]
    with pytest.raises(ConfigError, match="--step must be >= 1"):
        attempt_for_step(0, set())


def test_an_update_reads_its_attempts_accumulated_microbatches(tmp_path):
    run = SyntheticRun(tmp_path / "r", grad_accum=2, max_steps=12)
    run.overflow_at = {3}  # the third attempt overflows: update 3 is attempt 4
    run.start_session()
    run.train_until(12)
    run.end_session()
    run.write()
    assert microbatches_for_step(tmp_path / "r", 2)[0] == [2, 3]
    assert microbatches_for_step(tmp_path / "r", 3)[0] == [6, 7]


def test_refusals_name_what_the_record_cannot_say(tmp_path):
    with pytest.raises(ConfigError, match="is .* a run folder"):
        microbatches_for_step(tmp_path, 1)
    run = SyntheticRun(tmp_path / "r", max_steps=10)
    run.start_session()
    run.train_until(10)
    run.end_session()
    run.write()
    with pytest.raises(ConfigError, match="reaches step 10 only"):
        microbatches_for_step(tmp_path / "r", 11)
    run.run["allowed_changes"] = [{"session_id": "s1", "key": "train.batch_size", "old": 2, "new": 4}]
    run.write()
    with pytest.raises(ConfigError, match="batch geometry changed"):
        microbatches_for_step(tmp_path / "r", 2)


def test_an_edited_log_is_refused_naming_its_line(tmp_path):
    run = SyntheticRun(tmp_path / "r", max_steps=10)
    run.start_session()
    run.train_until(10)
    run.end_session()
    run.write()
    path = tmp_path / "r" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    edited = json.loads(lines[1])
    edited["loss"] = 0.1  # the chain value no longer matches the line
    lines[1] = json.dumps(edited)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordError, match="damaged record"):
        microbatches_for_step(tmp_path / "r", 2)


def test_an_update_after_skipped_data_and_a_skipped_spike_names_the_batches_it_read(tmp_path):
    """The loader stepped over batches 4..6 (run.json's skip_data, as a recipe range or a rollback leaves it)
    and attempt 3 was a spike skipped by policy: update 3 is attempt 4, and it read batches 9 and 10, not 6
    and 7."""
    run = SyntheticRun(tmp_path / "r", grad_accum=2, max_steps=12)
    run.overflow_at = {3}
    run.start_session()
    run.train_until(12)
    run.end_session()
    skipped = run.find("overflow")
    skipped["event"], skipped["action"], skipped["spike_step"] = "spike", "skipped", 3
    run.run["skip_data"] = [{"origin": "recipe", "first_batch": 4, "batches": 3}]
    run.write()
    assert microbatches_for_step(tmp_path / "r", 2)[0] == [2, 3]  # attempt 2: before the range
    assert microbatches_for_step(tmp_path / "r", 3)[0] == [9, 10]  # attempt 3 read 7, 8; attempt 4 9, 10
    assert attempt_batches(4, 2, []) == [6, 7]  # what the plain arithmetic would have named
