"""The `train` event is a pure function of a closed window's figures: every field, without training."""

from __future__ import annotations

import math

from pilotrun.training.window import WindowFigures, train_event_fields


def _figures(**changes) -> WindowFigures:
    values = dict(
        updates_applied=3,
        updates_attempted=4,
        updates_skipped=1,
        clipped=2,
        microbatches=8,
        tokens=512,
        train_seconds=1.5,
        wall_seconds=2.0,
        cpu_seconds=1.25,
        loss=3.25,
        aux_loss=0.01,
        grad_norm=0.7,
        grad_norm_max=1.2,
        loss_scale=1024.0,
        update_rms={"attention": 0.2},
        update_rms_step=4,
        profiled_attempts=1,
        profiled_tokens=128,
        profile_seconds=0.25,
        device_seconds=1.5,
        involuntary_switches=40,
        other_cpu_seconds=0.75,
    )
    values.update(changes)
    return WindowFigures(**values)


def _event(figures: WindowFigures, **changes):
    arguments = dict(
        lr=0.003,
        base_lr=0.006,
        epoch=1,
        data_restarts=2,
        throughput={"train_tokens_per_s": 10.0},
        moe={"load_cv": 0.5},
        attention={"max_logit": 9.0, "max_logit_per_head": [[9.0]]},
        hook_metrics={"qk_clip": {"heads_clipped": 1, "min_gamma": 0.8}, "moe": {"bias_update_speed": 1e-3}},
        memory={"allocated": 1},
        block_output_rms=[1.0, None],
        weight_rms={"attention": 0.05},
    )
    arguments.update(changes)
    return train_event_fields(figures, **arguments)


def test_every_field_of_a_train_event():
    assert _event(_figures()) == {
        "window": {
            "updates_applied": 3,
            "updates_attempted": 4,
            "updates_skipped": 1,
            "clipped": 2,
            "microbatches": 8,
            "tokens": 512,
            "train_seconds": 1.5,
            "wall_seconds": 2.0,
            "cpu_seconds": 1.25,
            "profiled_attempts": 1,
            "profiled_tokens": 128,
            "profile_seconds": 0.25,
            "device_seconds": 1.5,
            "involuntary_switches": 40,
            "other_cpu_seconds": 0.75,
        },
        "loss": 3.25,
        "aux_loss": 0.01,
        "lr": 0.003,
        "lr_multiplier": 0.5,
        "grad_norm": 0.7,
        "grad_norm_max": 1.2,
        "loss_scale": 1024.0,
        "epoch": 1,
        "data_restarts": 2,
        "throughput": {"train_tokens_per_s": 10.0},
        "moe": {"load_cv": 0.5, "bias_update_speed": 1e-3},
        "qk_clip": {"max_logit": 9.0, "max_logit_per_head": [[9.0]], "heads_clipped": 1, "min_gamma": 0.8},
        "memory": {"allocated": 1},
        "activations": {"block_output_rms": [1.0, None]},
        "optimizer": {
            "weight_rms": {"attention": 0.05},
            "update_rms": {"attention": 0.2},
            "update_rms_step": 4,
        },
    }


def test_a_window_of_skipped_updates_has_no_max_grad_norm():
    event = _event(_figures(updates_applied=0, updates_skipped=4, grad_norm=None, grad_norm_max=-math.inf))
    assert event["grad_norm_max"] is None and event["grad_norm"] is None


def test_no_base_lr_no_multiplier_and_a_dense_model_has_no_moe_section():
    event = _event(_figures(), base_lr=None, moe={}, attention={}, hook_metrics={})
    assert event["lr_multiplier"] is None
    assert event["moe"] == {}  # the expert-bias speed needs MoE layers to mean anything
    assert event["qk_clip"] == {"max_logit": None, "max_logit_per_head": None}


def test_a_window_without_profiled_attempts_says_so():
    fields = dict(
        updates_applied=3,
        updates_attempted=3,
        updates_skipped=0,
        clipped=0,
        microbatches=3,
        tokens=384,
        train_seconds=1.5,
        wall_seconds=2.0,
        cpu_seconds=1.25,
        loss=3.25,
        aux_loss=0.01,
        grad_norm=0.7,
        grad_norm_max=1.2,
        loss_scale=1.0,
    )
    window = _event(WindowFigures(**fields))["window"]
    assert (window["profiled_attempts"], window["profiled_tokens"], window["profile_seconds"]) == (0, 0, 0.0)
    assert window["device_seconds"] is None  # recorded on CUDA only


def test_off_cuda_a_window_times_no_device_work():
    import torch

    from pilotrun.training.window import Window

    window = Window(torch.device("cpu"))
    window.update_started()
    window.update_finished()
    assert window.device_seconds() is None
