"""One-line notices a person sees when a training session starts, resumes or is interrupted.

Each is a plain function of facts the trainer already holds, so the trainer calls it in one line and tests
check the facts, not the wording: `restored_state_line` (what a resume restored) and
`interrupt_acknowledgement` (the answer to Ctrl-C).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pilotrun.data.reader import val_split_warnings
from pilotrun.run.changes import RecipeChange


def restored_state_line(checkpoint: Path, trainer_state: dict[str, Any], rng_notes: list[str],
                        scaler_state: dict[str, Any]) -> str:
    """What a resume restored, in one line: the checkpoint, counters, RNG, data cursor and loss scaler."""
    loader = trainer_state.get("train_loader", {})
    scale = scaler_state.get("scale") if scaler_state else None
    scaler = f"loss scale {float(scale):g}" if scale is not None else "no loss scaler (fp32/bf16)"
    rng = "all generators" if not rng_notes else f"generators with {len(rng_notes)} note(s)"
    return (
        f"restored {checkpoint}: step {int(trainer_state['step']):,}, tokens_seen "
        f"{int(trainer_state['tokens_seen']):,}, updates attempted "
        f"{int(trainer_state['updates_attempted']):,} "
        f"(skipped {int(trainer_state['updates_skipped']):,}), RNG {rng}, data cursor batch "
        f"{int(loader.get('batch_index', 0)):,} epoch {int(loader.get('epoch', 0))}, {scaler}, model and "
        "optimizer state"
    )


def recipe_change_lines(free_changes: list[dict[str, Any]], allowed_changes: list[dict[str, Any]],
                        step: int) -> list[str]:
    """One line per recipe value a resume changed, said where the session starts (the record keeps them in
    run.json's allowed_changes and free_changes, the plots mark them): the key, old -> new, the first update
    that uses the new value, and why it was accepted."""
    lines = []
    for changes, why in ((allowed_changes, "allowed by --allow-change"),
                         (free_changes, "a key a resume may change freely")):
        for change in changes:
            described = RecipeChange(key=str(change["key"]), old=change["old"], new=change["new"],
                                     session_id="", from_update=step + 1).describe()
            lines.append(f"recipe change at resume: {described} ({why})")
    return lines


def data_pass_line(step: int, tokens_seen: int, passes: dict[str, int] | int) -> str:
    """The training split read again from its start: the loss from here on is partly measured on tokens the
    model has already trained on (a drop there is the data, not the recipe). `passes`: the pass that begins
    (2 at the first re-read) for a data folder, or {source: the pass it begins} for the sources of a mixture
    that restarted."""
    if isinstance(passes, int):
        what = f"the training split's pass {passes} begins"
    else:
        named = ", ".join(f"'{name}' (pass {number})" for name, number in passes.items()) or "a source"
        what = f"the mixture reads {named} again from its start"
    return (f"data: {what} at step {step:,} (tokens_seen {tokens_seen:,}); the training loss from here is "
            "partly on tokens already trained on")


def interrupt_acknowledgement(signal_name: str, step: int, max_steps: int) -> str:
    """Printed the moment the first SIGINT/SIGTERM arrives, before the update and checkpoint finish."""
    update = min(step + 1, max_steps)
    key = "Ctrl-C" if signal_name == "SIGINT" else signal_name
    heard = "Ctrl-C (SIGINT)" if signal_name == "SIGINT" else signal_name
    return (f"{heard} received: finishing update {update:,}, then saving a checkpoint; {key} again stops now "
            f"without one")


def startup_warnings(config: Any, val_tokens: int, world_size: int) -> list[str]:
    """Everything a session warns about before its first update: the LR schedule against train.max_steps, the
    val split against one evaluation (when evaluation is on) and task files no cadence scores."""
    from pilotrun.optim.schedule import schedule_warnings

    t = config.train
    small_val = val_split_warnings(val_tokens, t.batch_size, t.seq_len, t.eval.batches, world_size) \
        if t.eval.every > 0 else []
    return schedule_warnings(config) + small_val + unscored_tasks_warnings(t)


def unscored_tasks_warnings(train: Any) -> list[str]:
    """Task files named with no cadence to score them: said, since the run would otherwise go on without a
    word and its record would hold no downstream figure the recipe seemed to ask for."""
    if not train.downstream.tasks or train.downstream.every > 0:
        return []
    return [
        f"warning: train.downstream.tasks names {len(train.downstream.tasks)} task file(s) but "
        "train.downstream.every is 0: they are never scored in this run (set train.downstream.every, the "
        "updates "
        "between scorings, or `pilotrun evaluate` a checkpoint)"
    ]
