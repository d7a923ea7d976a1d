"""The planted bugs of `benchmarks/mutation_check.py`: each a plausible one-line slip and the tests that must
catch it. When the code moves on, a mutation turns stale and is rewritten against the new text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or paths meant to kill it
    why: str  # the bug, in words


GUARDS = "tests/training/test_trainer_guards.py"
RESUME = "tests/training/test_resume.py"
SUMMARIZE = "tests/report/record_check/test_summarize.py"
OBSERVERS = "tests/training/test_trainer_observers.py"
INTEGRITY = "tests/run/test_record_integrity.py"
SPIKES = "tests/training/spikes/test_rollback.py"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="checkpoint_files_not_fsynced",
        file="pilotrun/training/checkpoint/single_file.py",
        old="            os.fsync(handle.fileno())\n",
        new="",
        tests=(f"{GUARDS}::test_every_checkpoint_file_is_fsynced_before_the_marker_is_renamed_into_place",),
        why="a checkpoint file is not fsynced before the marker commits it",
    ),
    Mutation(
        name="session_throughput_from_wall_time",
        file="pilotrun/report/record_check/sessions.py",
        old='        train_tokens_per_s=(sums["tokens"] - sums["profiled_tokens"]) / sums["train_seconds"]\n '
            '       if sums["train_seconds"] > 0\n',
        new='        train_tokens_per_s=(sums["tokens"] - sums["profiled_tokens"]) / sums["wall_seconds"]\n  '
            '      if sums["wall_seconds"] > 0\n',
        tests=(SUMMARIZE,),
        why="a session's training-only throughput divides by its wall time",
    ),
    Mutation(
        name="checkpoint_hash_not_compared",
        file="pilotrun/training/checkpoint/checkpointer.py",
        old='            if digests[file_name] != files[file_name]["sha256"]:\n',
        new='            if False and digests[file_name] != files[file_name]["sha256"]:\n',
        tests=("tests/training/checkpoint/test_checkpointer.py",),
        why="a checkpoint file whose bytes changed (same size) is loaded",
    ),
    Mutation(
        name="clip_never_scales",
        file="pilotrun/training/precision.py",
        old="                grad.mul_(coefficient)\n",
        new="                pass\n",
        tests=("tests/training/test_precision.py",),
        why="gradient clipping reports a clip but leaves the gradients as they were",
    ),
    Mutation(
        name="warmup_starts_at_zero",
        file="pilotrun/optim/lr_shape.py",
        old="        return (step + 1) / warmup\n",
        new="        return step / warmup\n",
        tests=("tests/optim/test_schedule.py",),
        why="the first warm-up update runs at learning rate 0",
    ),
    Mutation(
        name="qk_clip_same_scale_for_rotary_part",
        file="pilotrun/optim/qk_clip.py",
        old="            query_scale[head, d_n:] = g        # q^R: gamma (the shared k^R in wkv_a is not "
            "touched)\n",
        new="            query_scale[head, d_n:] = root\n",
        tests=("tests/optim/test_qk_clip.py",),
        why="QK-Clip scales the rotary query part by sqrt(gamma) although the shared rotary key is untouched",
    ),
    Mutation(
        name="torn_tail_not_repaired",
        file="pilotrun/run/writer.py",
        old="        self.repaired_bytes = repair_torn_tail(self.path) if enabled else 0\n",
        new="        self.repaired_bytes = 0\n",
        tests=(RESUME, "tests/run/test_writer.py", INTEGRITY),
        why="a resumed session appends after a torn last line without cutting it",
    ),
    # The loop's and the session build's own slips.
    Mutation(
        name="bias_on_skipped_update",
        file="pilotrun/training/loop.py",
        old="    hook_events: list[dict] = []\n    if outcome.applied:\n",
        new=(
            '    hook_events: list[dict] = []\n    for hook in state.hooks:\n        if hook.name == "moe" '
            'and not outcome.applied:\n            hook.after_update(state.step, statistics)\n    if '
            'outcome.applied:\n'
        ),
        tests=(f"{GUARDS}::test_skipped_updates_move_neither_the_expert_bias_nor_qk_clip",),
        why="the expert bias moves on an update that was skipped",
    ),
    Mutation(
        name="qk_clip_on_skipped_update",
        file="pilotrun/training/loop.py",
        old="    hook_events: list[dict] = []\n    if outcome.applied:\n",
        new=(
            '    hook_events: list[dict] = []\n    for hook in state.hooks:\n        if hook.name == '
            '"qk_clip" and not outcome.applied:\n            hook_events += hook.after_update(state.step, '
            'statistics)\n    if outcome.applied:\n'
        ),
        tests=(f"{GUARDS}::test_skipped_updates_move_neither_the_expert_bias_nor_qk_clip",),
        why="QK-Clip rescales weights after a skipped update",
    ),
    Mutation(
        name="consecutive_skips_never_stop",
        file="pilotrun/training/loop.py",
        old="    too_many_skips = state.consecutive_skips >= t.max_consecutive_skips\n",
        new="    too_many_skips = False\n",
        tests=(f"{GUARDS}::test_too_many_consecutive_skips_stop_the_run_with_exit_1_and_a_checkpoint",),
        why="train.max_consecutive_skips never stops the run",
    ),
    Mutation(
        name="evaluation_draws_training_rng",
        file="pilotrun/training/callbacks/evaluation.py",
        old="    session.raw_model.eval()\n    try:\n",
        new="    session.raw_model.eval()\n    torch.rand(1)  # e.g. a sampled evaluation batch\n    try:\n",
        tests=(f"{GUARDS}::test_evaluation_leaves_every_random_generator_and_the_training_cursor_untouched",),
        why="evaluation draws from the training generators",
    ),
    Mutation(
        name="step_moves_on_a_skipped_update",
        file="pilotrun/training/loop.py",
        old="        state.updates_skipped += 1\n        state.consecutive_skips += 1\n",
        new="        state.updates_skipped += 1\n        state.step += 1\n        state.consecutive_skips += "
            "1\n",
        tests=(GUARDS,),
        why="a skipped update advances step",
    ),
    Mutation(
        name="rng_not_restored_on_resume",
        file="pilotrun/training/session.py",
        old='    rng_notes = restore_rng_state(restored["rng"])\n',
        new="    rng_notes = []\n",
        tests=(RESUME,),
        why="a resume does not restore the random generators",
    ),
    Mutation(
        name="scaler_not_restored_on_resume",
        file="pilotrun/training/session.py",
        old='    if not restore_grad_scaler(scaler, restored["scaler"]):\n',
        new="    if False:\n",
        tests=(RESUME,),
        why="a resume starts the fp16 loss scale afresh",
    ),
    Mutation(
        name="allowed_change_not_applied",
        file="pilotrun/training/session.py",
        old="    restore_group_settings(optimizer, settings)\n",
        new="",
        tests=("tests/training/test_resume_changes.py",),
        why="a learning rate allowed to change on resume is recorded but the checkpoint's is trained with",
    ),
    Mutation(
        name="profiled_attempts_charged_to_training",
        file="pilotrun/training/callbacks/profiling.py",
        old='            return\n        with loop.account.phase("profile"):\n            '
            'self.window.before_update(next_step)\n',
        new="            return\n        with contextlib.nullcontext():\n            "
            "self.window.before_update(next_step)\n",
        tests=(
            f"{OBSERVERS}::test_profiled_attempts_are_the_profile_phase_and_the_phases_add_up_to_the_wall_clock",
        ),
        why="the updates run under the profiler count as training time",
    ),
    Mutation(
        name="profiled_windows_in_the_throughput_rule",
        file="pilotrun/report/verdict/resources.py",
        old="        if window_profiled(w):\n",
        new="        if False and window_profiled(w):\n",
        tests=(f"{OBSERVERS}::test_throughput_rule_leaves_the_profiled_windows_out",),
        why="the throughput rule compares windows the profiler slowed",
    ),
    Mutation(
        name="time_split_sum_not_checked",
        file="pilotrun/report/record_check/sessions.py",
        old="    if split_problem:\n",
        new="    if False:\n",
        tests=("tests/report/record_check/test_time_split.py",),
        why="a session_end whose phases do not add up to its wall clock is accepted",
    ),
    Mutation(
        name="chain_link_not_compared",
        file="pilotrun/run/record.py",
        old="        if chain_link(previous, body) != value:\n",
        new="        if False and chain_link(previous, body) != value:\n",
        tests=(INTEGRITY,),
        why="a loss edited in metrics.jsonl after the fact passes summarize",
    ),
    Mutation(
        name="run_json_digests_not_compared",
        file="pilotrun/run/record.py",
        old="            if changed:\n",
        new="            if False:\n",
        tests=(INTEGRITY,),
        why="a recipe rewritten in run.json after the run passes summarize",
    ),
    Mutation(
        name="run_folder_not_locked",
        file="pilotrun/run/folder_lock.py",
        old="            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        new="            pass\n",
        tests=(
            "tests/run/test_folder_lock.py::test_lock_in_process_refuses_a_second_holder_and_is_free_after_release",
            "tests/run/test_folder_lock.py::test_a_second_writer_is_refused_naming_the_holder_and_the_first_record_stays_valid",
        ),
        why="two sessions write into one run folder at once",
    ),
    Mutation(
        name="require_step_accepts_any_end",
        file="pilotrun/report/record_check/summarize.py",
        old='    elif ends[-1].get("reason") != "completed":\n',
        new="    elif False:\n",
        tests=(f"{INTEGRITY}::test_require_step_refuses_a_session_that_ended_in_error_without_a_checkpoint",),
        why="--require-step accepts a session that ended in an error",
    ),
    Mutation(
        name="final_checkpoint_not_rehashed",
        file="pilotrun/run/marker.py",
        old='        elif sha256_of_file(path) != expected["sha256"]:\n',
        new="        elif False:\n",
        tests=(f"{INTEGRITY}::test_require_step_needs_a_completed_end_and_an_intact_final_checkpoint",),
        why="a final checkpoint whose bytes changed (same size) counts as intact",
    ),
    Mutation(
        name="damaged_ids_found_only_inside_an_update",
        file="pilotrun/training/loop.py",
        old="                    "
            "session.state.loader.check_upcoming_batches(t.gradient_accumulation_steps)\n",
        new="                    pass\n",
        tests=("tests/data/test_data_fits_recipe.py",),
        why="a damaged token id stops the run mid-update with no checkpoint of the last applied state",
    ),
    Mutation(
        name="holder_line_read_once",
        file="pilotrun/run/folder_lock.py",
        old="        if holder is not None or time.monotonic() >= deadline:\n",
        new="        if True:\n",
        tests=(
            "tests/run/test_folder_lock.py::test_a_holder_line_written_just_after_the_lock_is_still_named",
        ),
        why="a process refused just after the holder's flock cannot name the holder",
    ),
    Mutation(
        name="pilot_kill_decided_from_outside_only",
        file="pilotrun/commands/pilot.py",
        old="        _train_args(config_path, data_dir, run_dir, overrides, resume=False, "
            "stop_past_step=point),\n",
        new="        _train_args(config_path, data_dir, run_dir, overrides, resume=False, "
            "stop_past_step=None),\n",
        tests=(
            "tests/commands/test_pilot.py::test_the_kill_lands_at_the_first_logged_step_past_the_midpoint_however_fast_the_updates",
        ),
        why="fast updates outrun the pilot's kill to the final checkpoint, and the resume has nothing to do",
    ),
    Mutation(
        name="skipped_spike_moves_the_step",
        file="pilotrun/training/precision.py",
        old="    applied = math.isfinite(grad_norm) and held is None\n",
        new="    applied = math.isfinite(grad_norm)\n",
        tests=(f"{SPIKES}::test_skip_counts_one_skipped_update_with_reason_spike",),
        why="an update the spike policy skipped is applied anyway: step and schedule move",
    ),
    Mutation(
        name="rollback_forgets_its_skip_range",
        file="pilotrun/training/spikes/detector.py",
        old='        return [*recipe, *([int(r["first_batch"]), int(r["batches"])] for r in '
            'self.skip_data)]\n',
        new="        return list(recipe)\n",
        tests=(f"{SPIKES}::test_rollback_continues_exactly_as_a_run_told_to_skip_the_same_data",),
        why="a rollback names the data it skips, but the range is not kept: the loader reads it again",
    ),
    Mutation(
        name="cpu_share_not_read",
        file="pilotrun/report/verdict/resources.py",
        old='    if cpu is not None and devices == {"cpu"} and cpu.share_last / cpu.share_first '
            '< t.min_cpu_share_ratio:\n',
        new="    if False:\n",
        tests=(
            "tests/report/verdict/test_resources.py::test_throughput_warns_when_the_process_lost_its_cpu_share_even_if_each_token_cost_more",
        ),
        why="a pilot that lost two thirds of its CPU to other load is NO-GO because each token also cost "
            "more CPU",
    ),
    Mutation(
        name="loss_rise_comparison_inverted",
        file="pilotrun/report/verdict/stability.py",
        old="    if rise > 0 and sigmas > t.loss_rise_sigmas and share > t.min_loss_rise:\n",
        new="    if rise > 0 and sigmas < t.loss_rise_sigmas and share > t.min_loss_rise:\n",
        tests=(
            "tests/report/verdict/test_stability.py::test_loss_rise_at_end_fails_a_loss_that_falls_then_climbs_back",
        ),
        why="a loss that falls and then climbs far beyond its noise passes, while a rise within the noise "
            "FAILs",
    ),
    Mutation(
        name="data_pass_is_the_whole_split",
        file="pilotrun/report/verdict/evidence.py",
        old='    return batches * per_batch, (f"one pass = {batches} global batches of {per_batch} tokens of '
            'the split\'s "\n',
        new='    return split_tokens, (f"one pass = {batches} global batches of {per_batch} tokens of the '
            'split\'s "\n',
        tests=(
            "tests/report/verdict/test_evidence.py::test_data_passes_counts_the_pass_the_loader_reads_not_the_whole_split",
        ),
        why="passes are counted over the whole split, whose tail the loader never reads: a fifth pass reads "
            "as 4.8",
    ),
    Mutation(
        name="fit_starts_past_the_warm_up_whatever_the_weighting",
        file="pilotrun/report/projection/forecast.py",
        old="    return max(warmup + 1, FIT_FROM_WARMUPS.get(weighting, 0) * warmup)\n",
        new="    return warmup + 1\n",
        tests=(
            "tests/report/projection/test_forecast.py::"
            "test_evaluations_before_twice_the_warm_up_change_nothing_in_the_default_forecast",
            "tests/report/projection/test_forecast.py::"
            "test_the_default_forecast_of_one_pilot_does_not_move_with_its_evaluation_cadence",
        ),
        why="the default fits from the first evaluation past the warm-up again: where the cadence puts it "
            "weighs the steepest fall, and the same pilot evaluated every 5 instead of 10 is forecast "
            "2.5-3.2% lower",
    ),
    Mutation(
        name="rise_refit_follows_the_default_weighting",
        file="pilotrun/report/projection/forecast.py",
        old="    fit = fit_law(law, x, y, s1, s2, RISE_WEIGHTING)\n",
        new="    fit = fit_law(law, x, y, s1, s2, DEFAULT_WEIGHTING)\n",
        tests=(
            "tests/report/watch/test_forecast_watch.py::"
            "test_a_lock_fitted_with_equal_weights_or_none_recorded_is_graded_and_watched_as_before",
        ),
        why="the rise check's refit weighs per e-fold once that is the fit's default: a lock written before "
            "is watched against another course than it was, at a share measured with equal weights",
    ),
)
