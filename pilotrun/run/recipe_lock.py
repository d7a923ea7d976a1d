"""The frozen candidate's lock: its format, how it is read and checked, and how a run is compared with it.

`pilotrun freeze` (commands/freeze.py) writes the lock of a judged pilot: its effective recipe, the changes
made on resume, the data identity, the code identity, the verdict with every rule's figure, and `sha256`, the
sha256 of the canonical JSON of everything else (pilotrun.common.files.canonical_json), so the lock identifies
itself and an edited lock is detected when it is loaded.

`pilotrun train --frozen LOCK` takes its recipe from the lock (`--set` may change it); every difference
between the resulting recipe or the data's metadata_sha256 and the lock must be named with `--allow-change
KEY`, else it is refused with the list (`lock_differences`, `check_against_lock`). The run's run.json then
holds a `frozen` section (`frozen_run_facts`): the lock's sha256 and path, the lock's recipe and data
identity, and the accepted differences. `frozen_candidate_status` reads it back for summarize and verdict:
which candidate the run runs, and whether it still matches (a later resume may have changed the recipe; the
lock file may have been edited or removed).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import canonical_sha256, refuse_link, remove_stale_temps, write_text_atomic
from pilotrun.common.parsing import read_json_file
from pilotrun.config import MACHINE_KEYS, current_key, current_recipe, flatten
from pilotrun.run.values import first_field

LOCK_FORMAT = "pilotrun.recipe-lock/1"
DATA_KEY = "data.metadata_sha256"
# The code identity (commit and the diff of the code that runs, pilotrun.training.environment.git_state): a
# long run on other code than its pilot's is another candidate unless `--allow-change code` says it is meant.
CODE_KEY = "code"


class FreezeError(PilotrunError):
    """A bad lock, a bad --out, or a frozen run that differs from its lock without --allow-change (exit 2)."""


def nonfinite_field(value: Any, where: str = "") -> str | None:
    """The dotted name (under `where`) of the first figure in `value` that JSON cannot hold (an infinite or
    NaN float), or None."""
    return first_field(value, lambda v: isinstance(v, float) and not math.isfinite(v), where)


def write_lock(out: str | Path, lock: dict[str, Any]) -> list[str]:
    """The lock as indented JSON with sorted keys, written atomically (its sha256 is over the canonical form).
    A link at --out is refused; the temps of this lock a killed freeze left are removed first (the lines
    returned name them). A non-finite figure is refused by its field, before anything is touched: no lock
    section takes one from a measurement (the recipe and thresholds are checked finite when loaded, the
    pilot's figures are its finite ones, the tuning's are kept as strings, a projection past a float's range
    is refused by its options), so one here is pilotrun's bug, not a figure to carry as "Infinity"."""
    out = Path(out)
    where = nonfinite_field(lock)
    if where is not None:
        raise FreezeError(f"--out {out}: the lock's {where} is NaN or infinite, which a lock (strict JSON) "
                          "cannot hold (a figure pilotrun should have kept finite: a bug); nothing written")
    refuse_link(out)
    cleaned = remove_stale_temps(out.parent, out.name)
    write_text_atomic(out, json.dumps(lock, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return cleaned


def load_lock(path: str | Path) -> dict[str, Any]:
    """A lock file, checked: readable, the right format, a recipe, and a sha256 that matches its content."""
    path = Path(path)
    lock = read_json_file(path, f"--frozen {path}", FreezeError)
    if not isinstance(lock, dict) or lock.get("format") != LOCK_FORMAT:
        raise FreezeError(f"--frozen {path}: not a recipe lock (expected format '{LOCK_FORMAT}')")
    if not isinstance(lock.get("recipe"), dict) or not isinstance(
        (lock.get("data") or {}).get("metadata_sha256"), str
    ):
        raise FreezeError(f"--frozen {path}: the lock lacks its recipe or data.metadata_sha256")
    body = {k: v for k, v in lock.items() if k != "sha256"}
    try:
        digest = canonical_sha256(body)
    except ValueError:  # a bare NaN or Infinity: no JSON figure, and never in a lock `freeze` wrote
        raise FreezeError(
            f"--frozen {path}: it holds a bare NaN or Infinity, which no lock freeze writes (the lock "
            "was edited)"
        ) from None
    if lock.get("sha256") != digest:
        raise FreezeError(f"--frozen {path}: its sha256 does not match its content (the lock was edited)")
    return lock


def describe_code(code: Any) -> str:
    """'commit 1a2b3c4d5e6f clean', 'commit 1a2b3c4d5e6f dirty (diff 9f8e7d6c)', or 'no git checkout'."""
    if not isinstance(code, dict) or not code.get("commit"):
        return "no git checkout"
    state = f"dirty (diff {str(code.get('diff_sha256'))[:8]})" if code.get("dirty") else "clean"
    return f"commit {str(code['commit'])[:12]} {state}"


def same_code(a: Any, b: Any) -> bool:
    """The same commit and, where either is dirty, the same uncommitted diff."""
    a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
    if a.get("commit") != b.get("commit") or bool(a.get("dirty")) != bool(b.get("dirty")):
        return False
    return not a.get("dirty") or a.get("diff_sha256") == b.get("diff_sha256")


def lock_differences(lock_recipe: dict[str, Any], lock_data_sha256: str, recipe: dict[str, Any],
                     data_sha256: str, lock_code: Any = None, code: Any = None, lock_mixture: Any = None,
                     mixture: Any = None) -> list[dict[str, Any]]:
    """Every config key (dotted), the data identity, a data mixture's weights and seed (`data.mixture.*`) and
    (when `code` is given) the code identity where the run differs from the lock, sorted by key; each as
    {"key", "lock", "run"} (a key absent on one side shows as None; code shows as describe_code's words)."""
    # of any recipe format
    frozen, now = flatten(current_recipe(lock_recipe)), flatten(current_recipe(recipe))
    differences = [{"key": key, "lock": frozen.get(key), "run": now.get(key)}
                   for key in sorted(set(frozen) | set(now))
                   if frozen.get(key) != now.get(key) and key not in MACHINE_KEYS]
    if lock_data_sha256 != data_sha256:
        differences.append({"key": DATA_KEY, "lock": lock_data_sha256, "run": data_sha256})
    old = flatten(lock_mixture, "data.mixture") if isinstance(lock_mixture, dict) else {}
    new = flatten(mixture, "data.mixture") if isinstance(mixture, dict) else {}
    differences += [
        {"key": key, "lock": old.get(key), "run": new.get(key)}
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    # A lock without a code identity (written before code was recorded) holds nothing to compare with.
    if code is not None and lock_code is not None and not same_code(lock_code, code):
        differences.append({"key": CODE_KEY, "lock": describe_code(lock_code), "run": describe_code(code)})
    return differences


def _normalise(key: str) -> str:
    """An --allow-change key without `recipe.`, in today's name (a key under its earlier flat name too)."""
    return current_key(key[len("recipe."):] if key.startswith("recipe.") else key)


def check_against_lock(lock: dict[str, Any], recipe: dict[str, Any], data_sha256: str,
                       allowed: list[str] | tuple[str, ...], code: Any = None, mixture: Any = None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(accepted, refused): the differences from the lock named with --allow-change, and the others. `code` is
    the run's code identity (git_state); None leaves code out of the comparison."""
    allowed_keys = {_normalise(k) for k in allowed}
    differences = lock_differences(lock["recipe"], lock["data"]["metadata_sha256"], recipe, data_sha256,
                                   lock.get("code"), code, lock["data"].get("mixture"), mixture)
    accepted = [d for d in differences if d["key"] in allowed_keys]
    refused = [d for d in differences if d["key"] not in allowed_keys]
    return accepted, refused


def describe_difference(d: dict[str, Any]) -> str:
    return f"{d['key']} (lock {json.dumps(d['lock'])}, run {json.dumps(d['run'])})"


def frozen_run_facts(
    lock: dict[str, Any],
    lock_path: str | Path,
    recipe: dict[str, Any],
    data_sha256: str,
    allowed: list[str] | tuple[str, ...],
    code: Any = None,
    mixture: Any = None,
) -> dict[str, Any]:
    """run.json's `frozen` section for a run started from `lock`; refuses (FreezeError) every difference
    not named in `allowed`, listing them all on one line. With `code` (the run's git_state) the code
    identity is compared too, and the lock's is kept so that later sessions can be compared with it."""
    accepted, refused = check_against_lock(lock, recipe, data_sha256, allowed, code, mixture)
    if refused:
        # other data than the pilot's is most often the wrong --data (or lock): asked before it is allowed
        question = ("; the data is not the one the pilot was frozen on: is --data the right folder, and this "
                    "the right lock?") if any(d["key"] == DATA_KEY for d in refused) else ""
        raise FreezeError(
            f"--frozen {lock_path}: {len(refused)} difference(s) from the frozen candidate not named "
            f"with --allow-change: {'; '.join(describe_difference(d) for d in refused)}{question}"
        )
    return {"lock_sha256": lock["sha256"], "lock_path": str(Path(lock_path).resolve()),
            "pilot_run_id": (lock.get("pilot") or {}).get("run_id"), "lock_decision": lock.get("decision"),
            "lock_despite_no_go": lock.get("despite_no_go"), "lock_recipe": copy.deepcopy(lock["recipe"]),
            "lock_data_metadata_sha256": lock["data"]["metadata_sha256"], "lock_code": lock.get("code"),
            **({"lock_data_mixture": lock["data"]["mixture"]} if lock["data"].get("mixture") else {}),
            "allowed": sorted({_normalise(k) for k in allowed}), "differences": accepted,
            # What the lock projected, kept with the run so that summarize compares even after the lock moved.
            "lock_projection": lock.get(PROJECTION_KEY),
            # and what it forecast (its validation loss), for summarize to grade and watch to hold it to.
            **({"lock_forecast": lock[FORECAST_KEY]} if isinstance(lock.get(FORECAST_KEY), dict) else {})}


def _recorded_frozen(run_dir: str | Path) -> tuple[bool, Any]:
    """(whether the folder holds a readable run.json, its `frozen`): nothing to check where it holds no run
    yet (`--resume auto` starts it) or a damaged one (the resume itself refuses it, naming the damage)."""
    from pilotrun.run.record import RUN_JSON, read_run_json

    if not (Path(run_dir) / RUN_JSON).is_file():
        return False, None
    try:
        return True, read_run_json(run_dir).get("frozen")
    except PilotrunError:
        return False, None


def check_resumed_lock(lock: dict[str, Any], lock_path: str | Path, run_dir: str | Path) -> None:
    """A frozen run is resumed under the lock it was started from (run.json's `frozen.lock_sha256`): another
    lock, or a run folder not started from a lock, is the wrong folder or the wrong lock, asked as such
    (FreezeError) before any difference could be offered to --allow-change. Nothing to check where the folder
    holds no run yet (`--resume auto` starts it)."""
    readable, frozen = _recorded_frozen(run_dir)
    if not readable or isinstance(frozen, dict) and frozen.get("lock_sha256") == lock.get("sha256"):
        return
    started = (f"from another lock (sha256 {str(frozen.get('lock_sha256'))[:16]}, {frozen.get('lock_path')})"
               if isinstance(frozen, dict) else "from a recipe (--config), not from a lock")
    raise FreezeError(
        f"--frozen {lock_path} (sha256 {str(lock.get('sha256'))[:16]}): run folder {run_dir} was started "
        f"{started}: is {run_dir} the right run folder, and this the right lock? Resume a run with the lock "
        "it started from; this lock's long run needs a new --run-dir"
    )


def check_resumed_recipe(config_path: str | Path, run_dir: str | Path) -> None:
    """The other side of check_resumed_lock: a run started from a lock, resumed with `--config` (a recipe, not
    its lock), would go on without the lock's checks while its record still names the lock: the wrong folder
    or the wrong command, asked as such (FreezeError), naming the lock to resume it with."""
    readable, frozen = _recorded_frozen(run_dir)
    if not readable or not isinstance(frozen, dict):
        return
    raise FreezeError(
        f"--config {config_path}: run folder {run_dir} was started from the lock {frozen.get('lock_path')} "
        f"(sha256 {str(frozen.get('lock_sha256'))[:16]}), not from a recipe: is {run_dir} the right run "
        f"folder, and this the right recipe? Resume a long run with the lock it started from (--frozen "
        f"{frozen.get('lock_path')}); this recipe's run needs a new --run-dir"
    )


def frozen_candidate_status(run: dict[str, Any]) -> dict[str, Any] | None:
    """Which frozen candidate a run runs and whether it still matches; None for a run not started frozen.

    It matches while its recipe and data differ from the lock only in the keys allowed at its start, and
    while the lock file (where it is still found) hashes to the recorded sha256."""
    frozen = run.get("frozen")
    if not isinstance(frozen, dict):
        return None
    recipe = run.get("recipe") if isinstance(run.get("recipe"), dict) else {}
    data_sha = ((run.get("data") or {}).get("train") or {}).get("metadata_sha256")
    differences = lock_differences(frozen.get("lock_recipe") or {}, frozen.get("lock_data_metadata_sha256"),
                                   recipe, data_sha, lock_mixture=frozen.get("lock_data_mixture"),
                                   mixture=(run.get("data") or {}).get("mixture"))
    allowed = {_normalise(str(key)) for key in frozen.get("allowed") or []}
    if frozen.get("lock_code") is not None:  # else the lock had no code identity to hold sessions to
        differences += code_differences(frozen["lock_code"], run)
    drift = [d for d in differences if d["key"] not in allowed]
    lock_path = Path(str(frozen.get("lock_path")))
    lock_file = "missing"
    if lock_path.is_file():
        try:
            on_disk = read_json_file(lock_path, str(lock_path), FreezeError)
            body = {k: v for k, v in on_disk.items() if k != "sha256"} if isinstance(on_disk, dict) else None
            same = body is not None and canonical_sha256(body) == frozen.get("lock_sha256") \
                and on_disk.get("sha256") == frozen.get("lock_sha256")
        except (FreezeError, ValueError):  # unreadable now, or content canonical JSON cannot hash
            same = False
        lock_file = "unchanged" if same else "changed"
    return {"lock_sha256": frozen.get("lock_sha256"), "lock_path": str(lock_path),
            "pilot_run_id": frozen.get("pilot_run_id"), "matches": not drift and lock_file != "changed",
            "allowed_differences": [d for d in differences if d["key"] in allowed], "drift": drift,
            "lock_file": lock_file}


def code_differences(lock_code: Any, run: dict[str, Any]) -> list[dict[str, Any]]:
    """One difference per session of the run whose code is not the lock's, naming the session."""
    found = []
    for session in run.get("sessions") or []:
        if isinstance(session, dict) and "git" in session and not same_code(lock_code, session.get("git")):
            found.append(
                {
                    "key": CODE_KEY,
                    "lock": describe_code(lock_code),
                    "run": f"{describe_code(session.get('git'))} in session {session.get('session_id')}",
                }
            )
    return found


def describe_frozen_status(status: dict[str, Any]) -> str:
    head = f"frozen candidate {str(status['lock_sha256'])[:16]} (pilot {status['pilot_run_id']})"
    allowed = "; ".join(describe_difference(d) for d in status["allowed_differences"]) or "none"
    if status["matches"]:
        return f"{head}: still matches (allowed differences: {allowed}; lock file {status['lock_file']})"
    drift = "; ".join(describe_difference(d) for d in status["drift"]) or "none"
    return (f"{head}: NO LONGER MATCHES: differences not allowed at its start: {drift}; lock file "
            f"{status['lock_file']}")


# ---------------------------------------------------------------------------------------------- projection
# `freeze --target-steps N` adds two sections to the lock (pilotrun/report/projection/long_run.py computes
# them from the pilot's own record): `projection`, what the pilot's measurements predict for a long run of N
# updates, and `watch`, the pilot's figures `pilotrun watch` holds a long run to (throughput band, loss
# envelope, skip and clip bounds, window interval). Both are inside the lock's sha256 like everything else.
PROJECTION_KEY = "projection"
WATCH_KEY = "watch"
# With --target-steps also `forecast` (pilotrun/report/projection/forecast_record.py): the long run's
# validation loss.
FORECAST_KEY = "forecast"


def lock_projection_of(run: dict[str, Any]) -> dict[str, Any] | None:
    """The projection of the lock a run was started from: run.json's copy (`frozen.lock_projection`), else the
    lock file itself while it still hashes to the recorded sha256; None for a run not started frozen, or from
    a lock without a projection."""
    frozen = run.get("frozen")
    if not isinstance(frozen, dict):
        return None
    if isinstance(frozen.get("lock_projection"), dict):
        return frozen["lock_projection"]
    path = Path(str(frozen.get("lock_path")))
    if not path.is_file():
        return None
    try:
        lock = load_lock(path)
    except (FreezeError, OSError):
        return None
    if lock.get("sha256") != frozen.get("lock_sha256"):
        return None
    return lock.get(PROJECTION_KEY) if isinstance(lock.get(PROJECTION_KEY), dict) else None


def lock_forecast_of(run: dict[str, Any]) -> dict[str, Any] | None:
    """The forecast of the lock a run was started from (run.json's copy, else the lock file while it still
    hashes to the recorded sha256), as lock_projection_of; None for a run not started frozen or a lock without
    one."""
    frozen = run.get("frozen")
    if not isinstance(frozen, dict):
        return None
    if isinstance(frozen.get("lock_forecast"), dict):
        return frozen["lock_forecast"]
    path = Path(str(frozen.get("lock_path")))
    try:
        lock = load_lock(path) if path.is_file() else None
    except (FreezeError, OSError):
        return None
    if lock is None or lock.get("sha256") != frozen.get("lock_sha256"):
        return None
    return lock.get(FORECAST_KEY) if isinstance(lock.get(FORECAST_KEY), dict) else None


def allow_changes_beyond_the_lock(
    allow_change: list[str],
    resumed_run_dir: str | Path | None,
    data: str | Path,
    recipe: dict[str, Any],
    lock_differences: list[dict],
) -> list[str]:
    """The --allow-change keys the resume check is given on a frozen run (`resumed_run_dir`: None for a new
    run): a key that only names a difference from the lock, which the run already has (its record holds the
    same value), is the lock's business; handed to the checkpoint's comparison too, it would be noted as 'no
    such difference' on every resume of the same command."""
    from pilotrun.data.mixed_reader import data_identity
    from pilotrun.run.record import read_run_json

    if resumed_run_dir is None:
        return list(allow_change)
    try:
        run = read_run_json(resumed_run_dir)
    except PilotrunError:
        return list(allow_change)
    recorded = flatten(current_recipe(run.get("recipe") or {}))
    recorded["data.metadata_sha256"] = (run.get("data") or {}).get("metadata_sha256")
    now = {**flatten(recipe), "data.metadata_sha256": data_identity(data)[0]}
    from_lock = {d["key"] for d in lock_differences}
    kept = []
    for key in allow_change:
        name = _normalise(key)
        if name not in from_lock or (name in now and now[name] != recorded.get(name)):
            # the code identity is the lock's alone: the checkpoint's comparison has no such key
            kept.append(key)
    return kept
