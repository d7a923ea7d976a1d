"""May this checkpoint be resumed by this run? Every difference found, classified, before anything is
restored.

The checkpoint's meta and the resuming run's meta are compared section by section:

- `recipe` (the effective {model, optim, train} config): every flattened key. Keys in RESUME_FREE_KEYS (a
  longer max_steps, log/eval/checkpoint cadence) change freely; any other difference (model config, optimizer
  hyperparameters, batch/sequence/accumulation, precision, seed, ...) is refused unless named in `allowed`
  (the CLI's --allow-change KEY), and then returned so that run.json records it.
- `world_size` (training geometry), `data.metadata_sha256` (the dataset's identity), a mixture's
  `data.mixture.weights` and `data.mixture.seed` (data/mixture.py) and `optimizer.partition` (which parameters
  each optimizer owns; their hyperparameters are recipe keys): refused unless allowed, like recipe keys.
- `software` versions that change numerics (torch, CUDA, cuDNN, NumPy, Python), the `hardware` device and the
  intra-op thread count: a warning, because the run can continue but exact continuation can no longer be
  promised; each is also returned (`not_exact`) so that run.json records the update from which it is not. The
  thread count splits the work of a kernel among threads, and on some CPUs the split decides the order of a
  reduction's additions (a matmul's, a norm's), so another count may change the last bit of a sum.

All refused differences are reported together in one CheckpointError, so a user fixes them in one go. Model
keys that change tensor shapes cannot be allowed: the saved weights would not fit the new model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import CheckpointError
from pilotrun.config import RESUME_FREE_KEYS, current_key, current_recipe, flatten

ABSENT = "<absent>"
# Software whose version changes floating-point results or random streams (a warning on change).
NUMERICS_SOFTWARE_KEYS = ("torch", "cuda", "cudnn", "numpy", "python")
HARDWARE_KEYS = ("device", "device_name", "torch_threads")
# Model keys that change the shape (or number) of saved tensors: allowing them could never load.
SHAPE_MODEL_KEYS = frozenset(
    f"recipe.model.{name}" for name in (
        "vocab_size", "d_model", "n_layers", "n_dense_layers", "n_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
        "moe_hidden", "dense_hidden",
    )
)
PARTITION_KEY = "optimizer.partition"
# Which parameters each optimizer owns. Hyperparameters (lr, weight_decay) are compared as recipe keys
# (optim.*), so that allowing `optim.adamw.lr` does not also require allowing the partition.
PARTITION_COLUMNS = ("optimizer", "count", "parameters")
DATA_KEY = "data.metadata_sha256"
WORLD_SIZE_KEY = "world_size"


@dataclass
class ResumeCompatibility:
    """What a permitted resume changed: `free_changes` and `allowed_changes` are [{key, old, new}],
    `warnings` are one-line messages (exactness not promised, an --allow-change that matched nothing);
    `not_exact` [{key, old, new}] the software and hardware changes across which exactness is not promised."""

    free_changes: list[dict[str, Any]] = field(default_factory=list)
    allowed_changes: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    not_exact: list[dict[str, Any]] = field(default_factory=list)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:16] + "..." + text[-8:]


def _normalise_key(key: str) -> str:
    """`--allow-change train.batch_size` and `--allow-change recipe.train.batch_size` mean the same; a key
    under its earlier flat name (`train.eval_every`) means today's (`train.eval.every`)."""
    if key.split(".", 1)[0] in ("model", "optim", "train"):
        return f"recipe.{current_key(key)}"
    return current_key(key)


def _display_key(key: str) -> str:
    return key[len("recipe."):] if key.startswith("recipe.") else key


def _partition_rows(meta: dict[str, Any]) -> dict[str, Any]:
    rows = meta.get("optimizer", {}).get("partition") if isinstance(meta.get("optimizer"), dict) else None
    if rows is None:
        rows = meta.get("partition")
    if not isinstance(rows, list):
        return {}
    # Keyed by group name so that a reordering is not reported as every group changing; a row that is not
    # an object (a damaged marker) is an empty group of its own, so the difference is refused, not raised.
    return {str(row.get("group", index)) if isinstance(row, dict) else f"#{index} (damaged)":
            row if isinstance(row, dict) else {} for index, row in enumerate(rows)}


def _compared_values(meta: dict[str, Any]) -> dict[str, Any]:
    """The refusable facts of one meta, flattened to `key: value`."""
    values: dict[str, Any] = {}
    recipe = current_recipe(meta.get("recipe"))  # a checkpoint's of any recipe format, in today's names
    if isinstance(recipe, dict):
        values.update(flatten(recipe, "recipe"))
    data = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    values[DATA_KEY] = data.get("metadata_sha256", data.get("train", {}).get("metadata_sha256")
                                if isinstance(data.get("train"), dict) else None)
    # a mixture's weights and seed: recipe decisions, compared as such
    if isinstance(data.get("mixture"), dict):
        values.update(flatten(data["mixture"], "data.mixture"))
    values[WORLD_SIZE_KEY] = meta.get("world_size")
    return {k: v for k, v in values.items() if v is not None}


def _partition_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    old_rows, new_rows = _partition_rows(saved), _partition_rows(current)
    if not old_rows and not new_rows:
        return []
    details = []
    for group in sorted(set(old_rows) | set(new_rows)):
        old, new = old_rows.get(group), new_rows.get(group)
        if old is None or new is None:
            details.append(f"group {group} {'added' if old is None else 'removed'}")
            continue
        for column in PARTITION_COLUMNS:
            if old.get(column) != new.get(column):
                what = ("parameters" if column == "parameters" else
                        f"{column} {_short(old.get(column, ABSENT))} -> {_short(new.get(column, ABSENT))}")
                details.append(f"group {group} {what}")
    return details


def check_resume_compatibility(saved_meta: dict[str, Any], current_meta: dict[str, Any],
                               allowed: list[str] | tuple[str, ...] = ()) -> ResumeCompatibility:
    """Compare a checkpoint's meta with the resuming run's; raise CheckpointError listing every refused
    difference, else return the free and allowed changes and the warnings."""
    allowed_keys = {_normalise_key(k) for k in allowed}
    free_keys = {f"recipe.{k}" for k in RESUME_FREE_KEYS}
    report = ResumeCompatibility()
    refused: list[str] = []
    matched_allowed: set[str] = set()

    old_values, new_values = _compared_values(saved_meta), _compared_values(current_meta)
    for key in sorted(set(old_values) | set(new_values)):
        old, new = old_values.get(key, ABSENT), new_values.get(key, ABSENT)
        if old == new:
            continue
        change = {"key": _display_key(key), "old": old, "new": new}
        line = f"{_display_key(key)}: {_short(old)} -> {_short(new)}"
        if key in free_keys:
            report.free_changes.append(change)
        elif key in allowed_keys and key in SHAPE_MODEL_KEYS:
            refused.append(f"{line} (cannot be allowed: the saved weights have other shapes)")
            matched_allowed.add(key)
        elif key in allowed_keys:
            report.allowed_changes.append(change)
            matched_allowed.add(key)
        else:
            refused.append(line)

    partition_details = _partition_differences(saved_meta, current_meta)
    if partition_details:
        change = {"key": PARTITION_KEY, "old": list(_partition_rows(saved_meta).values()),
                  "new": list(_partition_rows(current_meta).values())}
        if PARTITION_KEY in allowed_keys:
            report.allowed_changes.append(change)
            matched_allowed.add(PARTITION_KEY)
        else:
            refused.append(f"{PARTITION_KEY}: {'; '.join(partition_details)}")

    for section, keys, why in (("software", NUMERICS_SOFTWARE_KEYS, "software version"),
                               ("hardware", HARDWARE_KEYS, "hardware")):
        old_section = saved_meta.get(section) if isinstance(saved_meta.get(section), dict) else {}
        new_section = current_meta.get(section) if isinstance(current_meta.get(section), dict) else {}
        for name in keys:
            old, new = old_section.get(name), new_section.get(name)
            if name == "torch_threads" and old is None:
                continue  # a checkpoint written before the thread count was part of its meta: unknown
            if old != new and not (old is None and new is None):
                report.not_exact.append({"key": f"{section}.{name}", "old": old, "new": new})
                report.warnings.append(
                    f"{why} {section}.{name} changed ({_short(old)} -> {_short(new)}): the "
                    "run continues, but bit-exact continuation cannot be promised"
                )

    if refused:
        refused_keys = [_normalise_key(line.split(":", 1)[0]) for line in refused]
        shape_changed = any(k in SHAPE_MODEL_KEYS for k in refused_keys)
        # Suggest --allow-change only for a key that can be allowed (a partition difference that follows
        # from a shape change cannot be fixed by allowing it).
        allowable = [
            k
            for k in refused_keys
            if k not in SHAPE_MODEL_KEYS and not (shape_changed and k == PARTITION_KEY)
        ]
        hint = (f"; accept a named difference with --allow-change KEY (e.g. --allow-change "
                f"{_display_key(allowable[0])})") if allowable else ""
        if DATA_KEY in refused_keys:
            # Other data under the same run is most often the wrong --run-dir or --data (or another lock's
            # run): asked, not offered as a change to allow, which would resume the run on that data.
            hint = ("; the data is not the one this run was trained on: is this the right run folder, and "
                    "--data (or the lock) the one it was started with? A new run on this data needs a new "
                    "--run-dir")
        raise CheckpointError(
            f"cannot resume: {len(refused)} incompatible difference(s) from the checkpoint: "
            + "; ".join(refused)
            + hint
        )
    for key in sorted(allowed_keys - matched_allowed):
        report.warnings.append(f"--allow-change {_display_key(key)}: no such difference, nothing to allow")
    return report


def reconcile_world_size(saved_meta: dict[str, Any], current_meta: dict[str, Any],
                         allowed: list[str] | tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """The documented rule for resuming a checkpoint on another number of ranks, applied before the general
    compatibility check (check_resume_compatibility, which compares `world_size` like a recipe key).

    - Same world size: nothing to do; the continuation is exact, bit for bit.
    - Another world size, not allowed: refused, with the reason and the way to continue.
    - Another world size with `--allow-change world_size`: accepted only when the global microbatch
      (train.batch_size * world_size) is unchanged. The data cursor is global (reader.py: a global batch is
      the same windows whatever the world size), so the run reads exactly the tokens it would have read,
      and the restored weights and optimizer state are exact; the per-rank batch_size is the one that
      changes, and is taken from this run. The losses after the resume are not bit-identical to an
      uninterrupted run, because the gradient is summed over ranks in another order: a returned note says so,
      and run.json records the allowed change.

    Returns (the saved meta to compare against, notes). Raises CheckpointError for a refused change.
    """
    old_world, new_world = saved_meta.get("world_size"), current_meta.get("world_size")
    if old_world is None or new_world is None or old_world == new_world:
        return saved_meta, []
    old_batch = saved_meta.get("recipe", {}).get("train", {}).get("batch_size")
    new_batch = current_meta.get("recipe", {}).get("train", {}).get("batch_size")
    global_batch = old_batch * old_world if isinstance(old_batch, int) else None
    allowed_keys = {key.split(".")[-1] if key.startswith("recipe.") else key for key in allowed}
    if "world_size" not in allowed_keys:
        if global_batch is not None and global_batch % new_world == 0:
            how = (
                "to continue anyway with the same global batch, set "
                f"train.batch_size={global_batch // new_world} "
                f"(so batch_size * world_size stays {global_batch}) and pass --allow-change world_size: the "
                "data "
                "continues exactly from the global cursor, but the losses will differ from an uninterrupted "
                "run by rounding (the gradient is reduced in another order)"
            )
        else:
            how = (
                f"the global batch of {global_batch} sequences cannot be split evenly over {new_world} "
                "ranks, "
                f"so resume on {old_world} rank(s)"
            )
        raise CheckpointError(
            f"cannot resume: the checkpoint was written by {old_world} rank(s), this run has "
            f"{new_world}; bit-exact continuation needs the same world size; {how}"
        )
    if not isinstance(new_batch, int) or new_batch * new_world != global_batch:
        raise CheckpointError(
            f"cannot resume on {new_world} rank(s) with train.batch_size={new_batch}: the checkpoint's "
            "global "
            f"batch is {old_batch} x {old_world} = {global_batch} sequences and a world-size change must "
            "keep it "
            f"(the data cursor counts global batches); set train.batch_size="
            + (
                f"{global_batch // new_world}"
                if global_batch is not None and global_batch % new_world == 0
                else "<none fits>"
            )
        )
    adjusted = dict(saved_meta)
    recipe = {section: dict(values) for section, values in saved_meta.get("recipe", {}).items()}
    recipe["train"]["batch_size"] = new_batch
    adjusted["recipe"] = recipe
    note = (
        f"world size changed {old_world} -> {new_world} (allowed): train.batch_size {old_batch} -> "
        f"{new_batch} "
        f"keeps the global batch at {global_batch} sequences and the data stream continues exactly; the "
        "losses "
        "are not bit-identical to an uninterrupted run (the gradient is reduced in another order)"
    )
    return adjusted, [note]
