"""The real runs bench_forecast.py grades forecasts on: pilots and their 10x long runs of the tiniest recipe
that learns (configs/smoke.yaml's model on the built-in corpus), trained by `pilotrun train` in child
processes, two at a time with one thread each (the machine has 2 cores).

A case is a pilot of PILOT_STEPS updates on a schedule kind and seed, its long run LONG_FACTOR x longer with
the same kind over its own horizon, and for a broken case the change made to the long run part way (`broken`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "smoke.yaml"
PILOT_STEPS = 100
LONG_FACTOR = 10
WARMUP = 10
# The pilot evaluates often (the fit's points); the long run as a long run would, at a coarser cadence.
PILOT_EVAL_EVERY, LONG_EVAL_EVERY = 10, 25


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    seed: int
    lr: float = 3.0e-3
    broken: str | None = None  # what a resume at BREAK_SHARE changes with --allow-change (breakage())
    mixture: bool = False  # trained on prepare_mixture's two sources instead of the built-in corpus alone
    extra: tuple[str, ...] = field(default=())


BREAK_SHARE = 0.1
MIXTURE_DROPPED = 0.001
# Cooldown branches from the pilot's mid checkpoint (train.checkpoint_every = PILOT_STEPS // 2): (at, length).
BRANCHES = ((50, 10), (50, 25))
BRANCH_EVAL_EVERY = 5


def healthy_cases() -> list[Case]:
    cases = [
        Case(f"{kind}-s{seed}", kind, seed) for kind in ("cosine", "wsd", "constant") for seed in (0, 1, 2)
    ]
    return cases + [
        Case("cosine-lr6e-3-s0", "cosine", 0, lr=6.0e-3),
        Case("mixture-cosine-s0", "cosine", 0, mixture=True),
        # a second mixture seed: the per-source rise check's false alerts are judged on more than one run
        Case("mixture-cosine-s1", "cosine", 1, mixture=True),
    ]


def broken_cases() -> list[Case]:
    return [
        Case("cosine-s0-lr_x2", "cosine", 0, broken="lr_x2"),
        Case("wsd-s1-lr_x2", "wsd", 1, broken="lr_x2"),
        Case("cosine-s1-lr_x10", "cosine", 1, broken="lr_x10"),
        Case("constant-s2-lr_x10", "constant", 2, broken="lr_x10"),
        Case("fp16-cosine-s2-skips", "cosine", 2, broken="fp16_skips", extra=("train.precision=fp16",)),
        Case("mixture-cosine-s0-drop_code", "cosine", 0, broken="drop_code", mixture=True),
    ]


def _sets(case: Case, steps: int, eval_every: int) -> list[str]:
    sets = [
        f"train.max_steps={steps}",
        f"optim.schedule.horizon={steps}",
        f"optim.schedule.kind={case.kind}",
        f"optim.schedule.warmup_steps={WARMUP}",
        f"train.eval_every={eval_every}",
        "train.log_every=10",
        f"train.checkpoint_every={steps // 2 if steps == PILOT_STEPS else steps // 10}",
        "train.eval_batches=8",
        f"train.seed={case.seed}",
        f"optim.muon.lr={case.lr}",
        f"optim.adamw.lr={case.lr}",
        "train.num_threads=1",
        "train.device=cpu",
        *case.extra,
    ]
    return [part for s in sets for part in ("--set", s)]


def _train(args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "a") as out:
        done = subprocess.run(
            [sys.executable, "-m", "pilotrun", "train", *args], stdout=out, stderr=out, env=env, cwd=ROOT
        )
    if done.returncode != 0:
        raise RuntimeError(f"pilotrun train {' '.join(args)} exited {done.returncode}; see {log}")


def prepare(work: Path) -> Path:
    data = work / "data"
    if not (data / "metadata.json").is_file():
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run(
            [sys.executable, "-m", "pilotrun", "prepare", "--out", str(data)],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
    return data


def _pilot_dir(work: Path, case: Case) -> Path:
    return work / "runs" / f"{case.name}-pilot"


CODE_CHARACTERS = 1_400_000  # about the built-in corpus's size


def _stdlib_code(out: Path) -> None:
    """A second source unlike the built-in corpus (the standard library's docstrings and pydoc topics): the
    code of the standard library's modules with their docstrings taken out, one text file a module."""
    import ast
    import sysconfig

    out.mkdir(parents=True, exist_ok=True)
    chars = 0
    for module in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(module.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)
            if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        text = ast.unparse(tree)
        (out / f"{module.stem}.txt").write_text(text)
        chars += len(text)
        if chars > CODE_CHARACTERS:
            break


def prepare_mixture(work: Path, data: Path) -> tuple[Path, Path]:
    """(the mixture file, the same sources with the code dropped): the built-in corpus and the standard
    library's code (prepared with the built-in corpus's tokenizer) at equal weights; dropped, the code's
    weight is MIXTURE_DROPPED, which gives it no row of a batch (weights must stay positive)."""
    code = work / "data-code"
    if not (code / "metadata.json").is_file():
        _stdlib_code(work / "code-texts")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run(
            [sys.executable, "-m", "pilotrun", "prepare", "--out", str(code), "--progress", "none",
             "--source", str(work / "code-texts" / "*.txt"), "--tokenizer", str(data / "tokenizer.json"),
             "--val-fraction", "0.06"],
            check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT,
        )
    files = []
    for name, weight in (("mixture.yaml", 0.5), ("mixture-dropped.yaml", MIXTURE_DROPPED)):
        path = work / name
        path.write_text(
            f"mixture:\n  - {{path: {data}, weight: 0.5, name: builtin}}\n"
            f"  - {{path: {code}, weight: {weight}, name: code}}\nseed: 0\n"
        )
        files.append(path)
    return files[0], files[1]


def _data_of(work: Path, data: Path, case: Case, dropped: bool = False) -> Path:
    return prepare_mixture(work, data)[dropped] if case.mixture else data


def train_pilot(work: Path, data: Path, case: Case) -> Path:
    data = _data_of(work, data, case)
    run_dir = _pilot_dir(work, case)
    if not (run_dir / "metrics.jsonl").is_file():
        _train(
            [
                "--config",
                str(RECIPE),
                "--data",
                str(data),
                "--run-dir",
                str(run_dir),
                *_sets(case, PILOT_STEPS, PILOT_EVAL_EVERY),
            ],
            work / f"{case.name}-pilot.log",
        )
    return run_dir


def train_long(work: Path, data: Path, case: Case) -> Path:
    """The long run; a broken one trains to BREAK_SHARE of its updates, then resumes with its change."""
    steps = PILOT_STEPS * LONG_FACTOR
    run_dir = work / "runs" / f"{case.name}-long"
    if (run_dir / "metrics.jsonl").is_file():
        return run_dir
    base = ["--config", str(RECIPE), "--data", str(_data_of(work, data, case)), "--run-dir", str(run_dir)]
    log = work / f"{case.name}-long.log"
    if case.broken is None:
        _train(base + _sets(case, steps, LONG_EVAL_EVERY), log)
        return run_dir
    at = int(steps * BREAK_SHARE)
    _train(base + _sets(case, steps, LONG_EVAL_EVERY) + ["--set", f"train.max_steps={at}"], log)
    if case.broken == "drop_code":
        base[3] = str(_data_of(work, data, case, dropped=True))
    _train(base + ["--resume"] + _sets(case, steps, LONG_EVAL_EVERY) + breakage(case), log)
    return run_dir


def breakage(case: Case) -> list[str]:
    """The resume's change: "lr_xK" the LR times K; "fp16_skips" (an fp16 recipe) its loss scale doubled after
    every good update, so that about every other update overflows and is skipped. (Switching an fp32 run to
    fp16 on
    a resume fails in GradScaler.load_state_dict: the checkpoint holds no scaler state.) "drop_code": the
    mixture's code source given no row (train_long resumes on prepare_mixture's second file)."""
    if case.broken == "drop_code":
        return ["--allow-change", "data.mixture.weights"]
    if case.broken == "fp16_skips":
        changes = {"train.loss_scale_growth_interval": 1}
    else:
        changed = int(str(case.broken).removeprefix("lr_x")) * case.lr
        changes = {"optim.muon.lr": changed, "optim.adamw.lr": changed}
    return [
        part for key, value in changes.items() for part in ("--allow-change", key, "--set", f"{key}={value}")
    ]


def cooldown_schedule(pilot: dict, at: int, length: int) -> dict:
    """The branch's schedule: WSD over a horizon of at + length whose linear decay passes through the pilot's
    own LR multiplier at `at` (pilot: its schedule's fields) and reaches the floor `length` updates later: the
    LR goes on from where the pilot left it, down to the floor quickly. A pilot at its peak LR (WSD's stable
    phase, constant) decays from `at`; a cosine pilot part way down from the point before `at` where a line
    through its LR at `at` leaves the peak."""
    from pilotrun.report.projection.forecast import multipliers

    floor = float(pilot.get("min_lr_ratio") or 0.0)
    now = float(multipliers(pilot, at + 1)[at])
    share = min(max((1.0 - now) / (1.0 - floor), 0.0), 0.9) if floor < 1 else 0.0
    start = max(int(pilot.get("warmup_steps") or 0), round(at - share * length / (1.0 - share)))
    horizon = at + length
    return {"kind": "wsd", "horizon": horizon, "decay_fraction": (horizon - start) / horizon}


def train_branch(work: Path, data: Path, case: Case, pilot: Path, at: int, length: int) -> Path:
    """A cooldown branch of the pilot: its folder copied without later checkpoints, resumed from its committed
    checkpoint at `at` (`--resume --from-step`, a rollback on the chain: the branch is the pilot's run, the
    same run_id, to `at`) with the schedule changed to cooldown_schedule (--allow-change) and trained `length`
    updates, evaluated every BRANCH_EVAL_EVERY."""
    run_dir = work / "runs" / f"{case.name}-pilot-cool{at}+{length}"
    if (run_dir / "metrics.jsonl").is_file():
        return run_dir
    import json

    from pilotrun.commands.tune_branch import make_branch_folder

    make_branch_folder(pilot, run_dir, at)  # the folder `pilotrun tune` gives each of its branches

    schedule = json.loads((pilot / "run.json").read_text())["recipe"]["optim"]["schedule"]
    changes = {f"optim.schedule.{k}": v for k, v in cooldown_schedule(schedule, at, length).items()}
    args = ["--config", str(RECIPE), "--data", str(_data_of(work, data, case)), "--run-dir", str(run_dir)]
    args.append("--resume")
    args += ["--from-step", str(at), *_sets(case, PILOT_STEPS, PILOT_EVAL_EVERY)]
    args += ["--set", f"train.max_steps={at + length}", "--set", f"train.eval_every={BRANCH_EVAL_EVERY}"]
    args += ["--set", f"train.checkpoint_every={length}"]
    args += [
        part for key, value in changes.items() for part in ("--allow-change", key, "--set", f"{key}={value}")
    ]
    _train(args, work / f"{case.name}-pilot-cool{at}+{length}.log")
    return run_dir


# Annealed points (benchmarks/forecast_anneal.py): the pilot's model cooled down from each of its checkpoints
# from the mid one to its last, ANNEAL_EVERY apart, ANNEAL_LENGTH updates each (ANNEAL_LONG from the last).
# The pilot commits a checkpoint only every PILOT_STEPS // 2; the ones between come from a replay of it.
ANNEAL_EVERY, ANNEAL_LENGTH, ANNEAL_LONG = 10, 10, 25


def anneal_points() -> list[tuple[int, int]]:
    """(the checkpoint a cooldown starts from, its length) of every annealed point."""
    at = range(PILOT_STEPS // 2, PILOT_STEPS + 1, ANNEAL_EVERY)
    return [(a, ANNEAL_LENGTH) for a in at] + [(PILOT_STEPS, ANNEAL_LONG)]


def train_replay(work: Path, data: Path, case: Case, pilot: Path) -> Path:
    """The pilot resumed from its mid checkpoint to its end with a checkpoint every ANNEAL_EVERY updates and
    none deleted: the same updates bit for bit (an exact resume), so its checkpoints are the pilot's model at
    those steps."""
    at = PILOT_STEPS // 2
    run_dir = work / "runs" / f"{case.name}-pilot-replay"
    if (run_dir / "checkpoints" / f"step-{PILOT_STEPS:08d}").is_dir():
        return run_dir
    if run_dir.exists():  # an interrupted replay: trained again from the pilot's checkpoint
        import shutil

        shutil.rmtree(run_dir)
    from pilotrun.commands.tune_branch import make_branch_folder

    make_branch_folder(pilot, run_dir, at)
    args = ["--config", str(RECIPE), "--data", str(_data_of(work, data, case)), "--run-dir", str(run_dir)]
    args += ["--resume", "--from-step", str(at), *_sets(case, PILOT_STEPS, PILOT_EVAL_EVERY)]
    args += ["--set", f"train.checkpoint_every={ANNEAL_EVERY}"]
    args += ["--set", f"train.keep_checkpoints={PILOT_STEPS}"]
    _train(args, work / f"{case.name}-pilot-replay.log")
    return run_dir


def generate_anneal(work: Path, cases: list[Case], workers: int = 2) -> dict[str, list[Path]]:
    """Each case's annealed points (anneal_points): cooldown branches from the pilot's own checkpoints (its
    mid and last) and from its replay's between, two cases at a time."""
    data = prepare(work)

    def one(case: Case) -> list[Path]:
        pilot = _pilot_dir(work, case)
        kept = {PILOT_STEPS // 2, PILOT_STEPS}
        replay = None if all(a in kept for a, _ in anneal_points()) else train_replay(work, data, case, pilot)
        return [
            train_branch(work, data, case, pilot if at in kept else replay, at, length)
            for at, length in anneal_points()
        ]

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip([c.name for c in cases], pool.map(one, cases), strict=True))


def generate(work: Path, cases: list[Case], workers: int = 2) -> dict[str, tuple[Path, Path]]:
    """(pilot, long run) folder per case, trained two at a time: pilots first (every forecast needs one)."""
    data = prepare(work)
    with ThreadPoolExecutor(workers) as pool:
        pilots = dict(
            zip([c.name for c in cases], pool.map(lambda c: train_pilot(work, data, c), cases), strict=True)
        )
        longs = dict(
            zip([c.name for c in cases], pool.map(lambda c: train_long(work, data, c), cases), strict=True)
        )
    return {name: (pilots[name], longs[name]) for name in pilots}


def generate_branches(work: Path, cases: list[Case], workers: int = 2) -> dict[str, list[Path]]:
    """Each case's cooldown branches (BRANCHES) from its trained pilot, two at a time."""
    data = prepare(work)
    jobs = [(c, at, length) for c in cases for at, length in BRANCHES]
    with ThreadPoolExecutor(workers) as pool:
        done = list(
            pool.map(lambda job: train_branch(work, data, job[0], _pilot_dir(work, job[0]), *job[1:]), jobs)
        )
    out: dict[str, list[Path]] = {c.name: [] for c in cases}
    for (case, _, _), path in zip(jobs, done, strict=True):
        out[case.name].append(path)
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, (pilot, long) in generate(out, healthy_cases() + broken_cases()).items():
        print(name, pilot, long)
