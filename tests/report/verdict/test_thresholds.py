"""thresholds.py: every threshold has its default and meaning; overrides are typed and checked."""

import dataclasses

import pytest

from pilotrun.report.verdict.thresholds import (
    THRESHOLD_FIELDS,
    ThresholdError,
    Thresholds,
    parse_thresholds,
    threshold_meaning,
)


def test_threshold_overrides_are_typed_and_checked():
    t = parse_thresholds(["max_grad_spikes=3", "spike_factor=2.5", "resume_required=false"])
    assert (t.max_grad_spikes, t.spike_factor, t.resume_required) == (3, 2.5, False)
    with pytest.raises(ThresholdError, match="unknown name 'nope'"):
        parse_thresholds(["nope=1"])
    with pytest.raises(ThresholdError, match="max_grad_spikes: 'x' is not a valid int"):
        parse_thresholds(["max_grad_spikes=x"])
    with pytest.raises(ThresholdError, match="expects NAME=VALUE"):
        parse_thresholds(["max_grad_spikes"])


def test_every_field_is_declared_with_its_default_and_meaning():
    defaults = Thresholds()
    for f in THRESHOLD_FIELDS:
        assert getattr(defaults, f.name) == f.default
        assert threshold_meaning(f.name) == f.metadata["meaning"] and threshold_meaning(f.name)
    assert dataclasses.asdict(defaults)["min_loss_drop"] == 0.05  # the verdict's JSON keeps its plain values


def test_an_override_keeps_the_base_and_refuses_a_non_finite_number():
    base = Thresholds(resume_required=False)
    t = parse_thresholds(["min_loss_drop=0.1"], base)
    assert (t.min_loss_drop, t.resume_required, base.min_loss_drop) == (0.1, False, 0.05)
    with pytest.raises(ThresholdError, match="not a finite number"):
        parse_thresholds(["max_clip_rate=nan"])
    with pytest.raises(ThresholdError, match="resume_required: 'maybe' is not a valid bool"):
        parse_thresholds(["resume_required=maybe"])
