"""Everything a resume decides, decided in one place before anything is touched: `plan_resume` -> ResumePlan.

A session starts fresh or from a committed checkpoint. On resume the checkpoint's recipe is authoritative and
every difference from the resuming run is classified (compatibility.py): free (RESUME_FREE_KEYS: cadence, a
longer max_steps), allowed (named with --allow-change), or refused (one CheckpointError listing them all).
Another world size is reconciled first (compat.reconcile_world_size: allowed only when the global batch is
unchanged). The plan then carries the effective recipe (the checkpoint's, with the free and allowed changes
applied), which checkpoint to restore, and the notes to print and record.

`checkpoint_meta` builds the facts a checkpoint records about its run (recipe, data identity, world size,
software, hardware, optimizer partition); the resume compares the saved meta with the meta this run would
write, so both sides are built by the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import CheckpointError, ConfigError
from pilotrun.config import (
    RECIPE_FORMAT,
    RECIPE_FORMAT_KEY,
    RunConfig,
    config_from_dict,
    config_to_dict,
    current_recipe,
    validate_run_config,
)
from pilotrun.training.checkpoint.compatibility import check_resume_compatibility, reconcile_world_size

HARDWARE_META_KEYS = ("device", "device_name", "world_size", "torch_threads")


@dataclass
class ResumePlan:
    """What a session does about the past: start fresh (`checkpoint_step` None) or restore that checkpoint,
    with `config` the effective recipe either way."""

    config: RunConfig
    checkpoint_step: int | None = None
    free_changes: list[dict[str, Any]] = field(default_factory=list)
    allowed_changes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    not_exact: list[dict[str, Any]] = field(default_factory=list)  # compatibility.py: exactness not promised

    restart: bool = False  # --resume with no committed checkpoint: a new session from step 0 in the same run

    @property
    def resuming(self) -> bool:
        return self.checkpoint_step is not None


def checkpoint_meta(
    config: RunConfig,
    *,
    data_sha256: str,
    data_dir: str,
    world_size: int,
    software: dict[str, Any],
    hardware: dict[str, Any],
    partition: list[dict[str, Any]],
    progress: dict[str, Any] | None = None,
    mixture: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The facts a checkpoint records about its run. `progress` (counters, session_id, run_id,
    tokens_per_update) is added when a checkpoint is written; a resume compares the rest. `mixture` (a data
    mixture's weights and schedule seed) joins the data section, compared as `data.mixture.*` keys."""
    data = {"metadata_sha256": data_sha256, "dir": data_dir, **({"mixture": mixture} if mixture else {})}
    meta = {"recipe": config_to_dict(config), RECIPE_FORMAT_KEY: RECIPE_FORMAT, "data": data,
            "world_size": world_size, "software": software,
            "hardware": {k: hardware.get(k) for k in HARDWARE_META_KEYS},
            "optimizer": {"partition": partition}}
    if progress is not None:
        meta.update(progress)
    return meta


def choose_checkpoint(committed_steps: list[int], from_step: int | None, root: str) -> int:
    """The latest committed checkpoint, or the one --from-step names (which must be committed)."""
    if not committed_steps:
        raise CheckpointError(f"--resume: no committed checkpoint in {root}")
    chosen = from_step if from_step is not None else committed_steps[-1]
    if chosen not in committed_steps:
        raise CheckpointError(f"--from-step {chosen}: no committed checkpoint at that step in {root} "
                              f"(committed: {committed_steps})")
    return chosen


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `model.x` / `recipe.train.y` in a nested recipe dict; a key that is not a recipe key (world size,
    data identity, partition) or that the recipe lacks is left alone."""
    parts = key.split(".")
    if parts[0] == "recipe":
        parts = parts[1:]
    node = data
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], dict):
            return
        node = node[part]
    if parts[-1] in node:
        node[parts[-1]] = value


def plan_fresh(from_step: int | None, config: RunConfig) -> ResumePlan:
    if from_step is not None:
        raise ConfigError("--from-step needs --resume")
    return ResumePlan(config=config)


def check_run_identity(saved_meta: dict[str, Any], run_id: str | None, checkpoint_step: int) -> list[str]:
    """A checkpoint of another run (its meta's run_id is not run.json's) is refused, whatever --allow-change
    says: a sibling run's weights under this run's record would make every figure of the record a lie.
    A checkpoint written before checkpoints carried a run_id is accepted with a note (returned)."""
    theirs = saved_meta.get("run_id")
    if run_id is None:
        return []
    if not isinstance(theirs, str):
        return [
            f"checkpoint step {checkpoint_step} records no run_id (written before checkpoints named their "
            f"run); accepted as run {run_id}'s own"
        ]
    if theirs != run_id:
        raise CheckpointError(
            f"--resume: checkpoint step {checkpoint_step} belongs to run {theirs}, not to this "
            f"run folder's run {run_id} (run.json); a checkpoint of another run is never "
            "resumed (no --allow-change admits it); start a new --run-dir from it instead"
        )
    return []


def plan_resume(config: RunConfig, *, checkpoint_step: int, saved_meta: dict[str, Any],
                current_meta: dict[str, Any], allow_changes: list[str] | tuple[str, ...],
                run_id: str | None = None) -> ResumePlan:
    """Compare the chosen checkpoint's meta with the meta this run would write (`checkpoint_meta` of the
    requested config) and return the plan, or raise CheckpointError listing every refused difference.
    `run_id` (run.json's) must be the checkpoint's run, before anything else is compared."""
    identity_notes = check_run_identity(saved_meta, run_id, checkpoint_step)
    saved_meta = {**saved_meta, "recipe": current_recipe(saved_meta["recipe"])}  # of any recipe format
    allowed = list(allow_changes)
    saved_meta, notes = reconcile_world_size(saved_meta, current_meta, allowed)
    report = check_resume_compatibility(saved_meta, current_meta, allowed)
    restored = config_to_dict(config_from_dict(saved_meta["recipe"]))
    report.free_changes = kept_skip_ranges(report.free_changes)
    for change in report.free_changes + report.allowed_changes:
        set_dotted(restored, change["key"], change["new"])
    effective = config_from_dict(restored)
    validate_run_config(effective)
    return ResumePlan(config=effective, checkpoint_step=checkpoint_step, free_changes=report.free_changes,
                      allowed_changes=report.allowed_changes, notes=identity_notes + notes + report.warnings,
                      not_exact=report.not_exact)


def kept_skip_ranges(changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checkpoint's `train.skip_data` ranges stay in force on resume, whatever the command's recipe names
    (it may add ranges): a run's recorded skips are stepped over as it recorded them. (Runs from before
    rollbacks kept their own records hold them there, a checkpoint before them included.) A change adding
    nothing goes."""
    out = []
    for change in changes:
        if (
            change["key"] == "train.skip_data"
            and isinstance(change["old"], list)
            and isinstance(change["new"], list)
        ):
            merged = [*change["old"], *(r for r in change["new"] if r not in change["old"])]
            if merged == change["old"]:
                continue
            change = dict(change, new=merged)
        out.append(change)
    return out


def plan_restart(config: RunConfig, *, recorded: dict[str, Any], current_meta: dict[str, Any],
                 allow_changes: list[str] | tuple[str, ...], root: str) -> ResumePlan:
    """--resume of a run killed before its first committed checkpoint: there is no state to restore, so the
    session starts again at step 0, a new session of the same run (its record names the updates lost). The
    recipe and data are still held to the run's own (run.json's), as a resume holds them to a checkpoint's,
    so that a restart never turns into another run under the same record."""
    recipe = current_recipe(recorded.get("recipe"))  # run.json's, of any recipe format
    data_sha = (recorded.get("data") or {}).get("metadata_sha256")
    if not isinstance(recipe, dict) or not isinstance(data_sha, str):
        raise CheckpointError(
            f"--resume: no committed checkpoint in {root}, and run.json records no recipe or data "
            "identity to start again from; start a new --run-dir"
        )
    saved_data = dict(current_meta["data"], metadata_sha256=data_sha)
    if isinstance((recorded.get("data") or {}).get("mixture"), dict):
        saved_data["mixture"] = recorded["data"]["mixture"]
    saved = dict(current_meta, recipe=recipe, data=saved_data)
    report = check_resume_compatibility(saved, current_meta, list(allow_changes))
    restored = config_to_dict(config_from_dict(recipe))
    for change in report.free_changes + report.allowed_changes:
        set_dotted(restored, change["key"], change["new"])
    effective = config_from_dict(restored)
    validate_run_config(effective)
    note = (
        f"--resume: no committed checkpoint in {root}: nothing to restore, so this session starts again from "
        "step 0; the earlier sessions' updates are lost (the record counts them as rolled back)"
    )
    return ResumePlan(
        config=effective,
        free_changes=report.free_changes,
        allowed_changes=report.allowed_changes,
        notes=[note, *report.warnings],
        restart=True,
    )


def choose_verified(steps: list[int], verify: Callable[[int], Any], root: str) -> tuple[int, list[str]]:
    """`--resume auto`: the newest committed checkpoint whose files verify, and a note naming each newer one
    passed over with its damage. None verifying is refused with every one named: a run that has checkpoints
    is never started again at step 0 behind the user's back (the run would silently lose all its work)."""
    passed: list[str] = []
    for step in reversed(steps):
        try:
            verify(step)
        except CheckpointError as exc:
            passed.append(f"step {step} ({exc})")
            continue
        notes = [f"--resume auto: passed over the newest committed checkpoint(s) that do not verify: "
                 f"{'; '.join(passed)}; continuing from step {step}"] if passed else []
        return step, notes
    raise CheckpointError(
        f"--resume auto: none of the {len(steps)} committed checkpoint(s) in {root} verifies, "
        f"so there is nothing exact to continue from and the run is not started again at step 0: "
        f"{'; '.join(passed)}"
    )


def plan_session(
    config: RunConfig,
    *,
    resume: bool,
    from_step: int | None,
    committed_steps: Callable[[], list[int]],
    read_meta: Callable[[int], dict[str, Any]],
    current_meta: Callable[[], dict[str, Any]],
    allow_changes: list[str] | tuple[str, ...],
    root: str,
    agree: Callable[[int], int] = lambda step: step,
    run_id: str | None = None,
    recorded: dict[str, Any] | None = None,
    verify: Callable[[int], Any] | None = None,
) -> ResumePlan:
    """The plan for a fresh or a resumed session. `agree` makes every rank use rank 0's choice of
    checkpoint (a broadcast under torchrun); `run_id` is run.json's, which the checkpoint must belong to.
    `recorded` (run.json) lets a --resume with no committed checkpoint start again from step 0 (plan_restart).
    `verify` (`--resume auto`; called alike on every rank) rehashes checkpoints, newest first, to pass over a
    damaged newest one (choose_verified)."""
    if not resume:
        return plan_fresh(from_step, config)
    steps = committed_steps()
    if not steps and from_step is None and recorded:
        return plan_restart(
            config, recorded=recorded, current_meta=current_meta(), allow_changes=allow_changes, root=root
        )
    notes: list[str] = []
    if verify is not None and from_step is None and steps:
        from_step, notes = choose_verified(steps, verify, root)
    chosen = agree(choose_checkpoint(steps, from_step, root))
    if chosen not in steps:
        raise CheckpointError(f"--from-step {chosen}: no committed checkpoint at that step in {root}")
    plan = plan_resume(
        config,
        checkpoint_step=chosen,
        saved_meta=read_meta(chosen),
        current_meta=current_meta(),
        allow_changes=allow_changes,
        run_id=run_id,
    )
    plan.notes[:0] = notes
    return plan
