"""Harness overhead: the trainer's training-only time per update against a bare loop doing the same work.

Both sides train the same model (the CPU stability recipe's shapes, same seed, so the same initial weights)
with the same combined Muon+AdamW optimizer on the same batches (the same BatchLoader over the built-in
corpus), and both do everything an update needs (docs/MODEL.md, "One optimizer step"): LR from the schedule,
forward, backward, apply_update (clip + step), QK-Clip and the expert-bias update, statistics reset. The bare
loop does nothing else; the trainer adds its counters, window accumulators, signal check and the time
accounting, and its logging, which the time split charges to "other". The figure compared is the trainer's own
training-only seconds (its `train` windows, which sum to session_end's time_split) against the bare loop's
seconds for the same updates, both on the same clock (below).

Rounds alternate trainer / bare so that load drift hits both alike. The trainer logs every WINDOW updates, so
its time split gives the training-only seconds of each window; the bare loop times each of its updates and
sums them over the same windows. Both sides run one intra-op thread and read the same clock: the thread's CPU
time (`time.thread_time`, given to the trainer's TimeAccount as its clock). On a 2-core machine shared with
other work, wall-clock seconds of single updates move between identical runs by far more than the 3% to be
shown; CPU time of the one computing thread does not count the time the thread was pre-empted, which is what
the harness comparison needs. Both sides compute bit-identical updates (same seed, same batches), so window k
of one is paired with window k of the other; the median paired ratio decides. Target: the trainer at most 3%
slower.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "stability.yaml"
WINDOW = 5  # updates per logging window (the recipes log every 5 to 10)
UPDATES = 25
ROUNDS = 8
TARGET = 1.03


def _config(updates: int):
    from pilotrun.config import load_run_config

    return load_run_config(
        RECIPE,
        [
            f"train.max_steps={updates}",
            "train.eval.every=0",
            "train.checkpoint.every=0",
            f"train.log.every={WINDOW}",
            "train.device=cpu",
            "train.num_threads=1",
        ],
    )


def trainer_update_seconds(data_dir: Path, work: Path, updates: int, index: int) -> list[float]:
    import io

    from pilotrun.run.record import read_metrics_strict
    from pilotrun.training.timing import TimeAccount
    from pilotrun.training.trainer import Trainer

    run_dir = work / f"trainer-{index}"
    trainer = Trainer(_config(updates), data_dir, run_dir, progress=False, out=io.StringIO())
    trainer.account = TimeAccount(clock=time.thread_time)  # setup is over; the session is timed from here
    result = trainer.run()
    if result.reason != "completed" or result.step != updates:
        raise RuntimeError(f"benchmark trainer run did not complete: {result}")
    events = read_metrics_strict(run_dir)
    windows = [e["window"] for e in events if e["event"] == "train"]
    assert all(w["updates_applied"] == WINDOW for w in windows) and len(windows) == updates // WINDOW
    end = [e for e in events if e["event"] == "session_end"][-1]
    per_window = [w["train_seconds"] for w in windows]
    # The windows partition the session's training time exactly (the trainer's own accounting).
    assert abs(sum(per_window) - end["time_split"]["train_seconds"]) < 1e-6
    return per_window


def bare_update_seconds(data_dir: Path, updates: int) -> list[float]:
    from pilotrun.config import config_from_dict, config_to_dict
    from pilotrun.data.reader import BatchLoader, open_dataset
    from pilotrun.model.balancing import update_expert_bias
    from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer
    from pilotrun.optim.qk_clip import apply_qk_clip
    from pilotrun.optim.schedule import set_learning_rates
    from pilotrun.training.precision import apply_update, autocast_context, build_grad_scaler

    config = _config(updates)
    dataset = open_dataset(data_dir)
    data = config_to_dict(config)
    data["model"]["vocab_size"] = dataset.vocab_size
    config = config_from_dict(data)
    t = config.train
    torch.manual_seed(t.seed)
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optim)
    scaler = build_grad_scaler(t.precision, "cpu", t.loss_scale_init, t.loss_scale_growth_interval)
    loader = BatchLoader(dataset.split("train"), t.batch_size, t.seq_len, mode=t.data_mode)
    model.train()
    reset_step_statistics(model)
    times = []
    step = 0
    while step < updates:
        started = time.thread_time()
        set_learning_rates(optimizer, step, config.optim.schedule)
        optimizer.zero_grad(set_to_none=True)
        for _ in range(t.gradient_accumulation_steps):
            inputs, targets = loader.next_batch()
            with autocast_context(t.precision, "cpu"):
                output = model(inputs, targets)
            scaler.scale(output.loss / t.gradient_accumulation_steps).backward()
        tokens_per_expert, qk_max_logit = collect_step_statistics(model)
        outcome = apply_update(model, optimizer, scaler, config.optim.grad_clip)
        if outcome.applied:
            apply_qk_clip(model, qk_max_logit, config.optim.qk_clip.tau)
            update_expert_bias(model, tokens_per_expert, config.model.bias_update_speed)
            step += 1
        reset_step_statistics(model)
        times.append(time.thread_time() - started)
    return times


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus

    # One intra-op thread on both sides: on a 2-core machine shared with other work, OpenMP's spinning
    # barriers turn a descheduled second thread into seconds of noise per update; one thread keeps the
    # comparison about the harness, not about the scheduler.
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data_dir = work / "data"
        prepare_corpus(data_dir, source="builtin", tokenizer="bpe:4096", progress=False)
        # Warm-up of both paths (allocator, first-call costs), not measured.
        trainer_update_seconds(data_dir, work, WINDOW, -1)
        bare_update_seconds(data_dir, WINDOW)
        paired: list[float] = []
        trainer_times: list[float] = []
        bare_times: list[float] = []
        rounds = []
        for index in range(ROUNDS):
            # drop each run's first window
            trainer = trainer_update_seconds(data_dir, work, UPDATES, index)[1:]
            bare_updates = bare_update_seconds(data_dir, UPDATES)
            bare = [sum(bare_updates[k:k + WINDOW]) for k in range(0, UPDATES, WINDOW)][1:]
            trainer_times += trainer
            bare_times += bare
            paired += [t / b for t, b in zip(trainer, bare)]
            rounds.append((sum(trainer), sum(bare)))

    ratio = statistics.median(paired)
    # 95% confidence interval of the median from order statistics (distribution-free): ranks n/2 -+ 0.98
    # sqrt(n).
    ordered = sorted(paired)
    half_width = int(math.ceil(0.98 * math.sqrt(len(ordered))))
    low = ordered[max(0, len(ordered) // 2 - half_width)]
    high = ordered[min(len(ordered) - 1, (len(ordered) - 1) // 2 + half_width)]
    met = ratio <= TARGET
    caveat = ("; the interval reaches above the target, so this run cannot exclude an overhead of up to "
              f"{100 * (high - 1):.0f}%")
    total_trainer, total_bare = sum(trainer_times), sum(bare_times)
    lines = [
        "## Trainer harness overhead (training-only time per update vs a bare loop)",
        "",
        "CPU stability recipe shapes (d_model 128, 4 layers, 8 routed experts; batch 8 x 64, fp32), "
        f"{ROUNDS} "
        f"alternating rounds of {UPDATES} updates per side in windows of {WINDOW} (the first window of each "
        "run "
        "dropped), 1 torch thread, CPU seconds of the computing thread. Trainer: training-only seconds of "
        "each "
        f"window from its own time split (log_every {WINDOW}); bare loop: the same update work (schedule, "
        "forward, backward, clip + step, QK-Clip, expert bias) with no counters, logging or accounting, "
        "timed "
        "per update and summed over the same windows.",
        "",
        "| round | trainer s/update | bare loop s/update | ratio |",
        "|---|---|---|---|",
    ]
    n = UPDATES - WINDOW
    for index, (trainer, bare) in enumerate(rounds, start=1):
        lines.append(f"| {index} | {trainer / n:.4f} | {bare / n:.4f} | {trainer / bare:.3f} |")
    lines += [
        f"| all | {total_trainer / (n * ROUNDS):.4f} | {total_bare / (n * ROUNDS):.4f} | "
        f"{total_trainer / total_bare:.3f} |",
        "",
        f"Median of the {len(paired)} paired per-window ratios: {ratio:.3f}, 95% confidence interval "
        f"{low:.3f} "
        f"to {high:.3f} (single windows: 25th-75th percentile {statistics.quantiles(paired, n=4)[0]:.3f} to "
        f"{statistics.quantiles(paired, n=4)[2]:.3f}, the noise of one window on this machine). Target: "
        "trainer "
        f"at most {100 * (TARGET - 1):.0f}% slower (median paired ratio <= {TARGET}): "
        f"{'met' if met else 'NOT met'}"
        f"{'' if high <= TARGET else caveat}.",
        "",
        "Command: `python -m benchmarks.run_all bench_trainer`",
    ]
    return "\n".join(lines) + "\n\n" + spikes_section() + "\n\n" + shard_hashing_section()


# ------------------------------------------------------------------------------------------ spikes
DETECTION_CALLS = 20000
SPIKE_TARGET = 0.001  # detection at most 0.1% of a CPU update of the stability recipe


def detection_seconds(calls: int = DETECTION_CALLS) -> tuple[float, float]:
    """(seconds per update of what spike detection adds, of what it replaces), thread CPU time: the loss added
    up per microbatch, the (norm, loss) pair stacked and brought to the host in place of the norm alone, the
    judge over a full window (spikes.SpikeGate: median and MAD of both signals) and the window's append."""
    from pilotrun.config import SpikeConfig
    from pilotrun.training.spikes.detector import SpikeDetector, SpikeGate, gathered_values

    config = SpikeConfig()
    detector = SpikeDetector(config)
    generator = torch.Generator().manual_seed(0)
    for loss, norm in (3.0 + 0.1 * torch.randn(config.window, 2, generator=generator)).tolist():
        detector.pending = (loss, abs(norm))
        detector.after_update(0, None)
    norm, ce = torch.tensor(1.25), torch.tensor(3.0)
    started = time.thread_time()
    for step in range(calls):
        loss_sum = torch.zeros((), dtype=torch.float64)
        loss_sum += ce
        gate = SpikeGate(detector, step, [step], True)
        grad_norm, *values = gathered_values(norm, loss_sum, 1, None).tolist()
        gate(grad_norm, values)
        detector.after_update(step, None)
    added = (time.thread_time() - started) / calls
    started = time.thread_time()
    for _ in range(calls):
        float(norm)
    replaced = (time.thread_time() - started) / calls
    return added, replaced


def rollback_cost(data_dir: Path, work: Path) -> dict:
    """One rollback in the stability recipe: a poisoned microbatch (the test seam of
    tests/training/spike_faults.py, inlined) at update 27, checkpoints every 20; the figures its record
    gives."""
    import io

    from pilotrun.config import load_run_config
    from pilotrun.data import reader
    from pilotrun.run.record import read_metrics_strict
    from pilotrun.training.timing import TimeAccount
    from pilotrun.training.trainer import Trainer

    original = reader.BatchLoader.next_batch

    def poisoned(self):
        index = self.batch_index
        inputs, targets = original(self)
        if index == 26:
            inputs, targets = torch.full_like(inputs, 7), torch.full_like(targets, 4000)
        return inputs, targets

    config = load_run_config(RECIPE, ["train.max_steps=32", "train.eval.every=0", "train.checkpoint.every=20",
                                      "train.log.every=1", "train.device=cpu", "train.num_threads=1",
                                      "train.spike.policy=rollback", "train.spike.min_history=10",
                                      "train.spike.window=20"])
    reader.BatchLoader.next_batch = poisoned
    try:
        trainer = Trainer(config, data_dir, work / "rollback", progress=False, out=io.StringIO())
        trainer.account = TimeAccount(clock=time.thread_time)
        result = trainer.run()
    finally:
        reader.BatchLoader.next_batch = original
    events = read_metrics_strict(work / "rollback")
    rollbacks = [e for e in events if e["event"] == "rollback"]
    spikes = [e for e in events if e["event"] == "spike"]
    windows = [
        e["window"]["train_seconds"]
        for e in events
        if e["event"] == "train" and e["window"]["updates_applied"]
    ]
    if result.reason != "completed" or len(rollbacks) != 1:
        raise RuntimeError(f"benchmark rollback run: {result}, {len(rollbacks)} rollback(s)")
    per_update = statistics.median(windows)
    rollback, spike = rollbacks[0], spikes[-1]
    return {
        "per_update": per_update,
        "restore": rollback["seconds"],
        "replay": spike["replay"]["seconds"],
        "redo": rollback["redo_updates"],
        "spike_step": rollback["spike_step"],
        "restored_step": rollback["restored_step"],
        "skipped": rollback["skipped"],
        "cause": spike["cause"],
    }


def spikes_section() -> str:
    from pilotrun.data.prepare import prepare_corpus

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_corpus(work / "data", source="builtin", tokenizer="bpe:4096", progress=False)
        bare = statistics.median(bare_update_seconds(work / "data", 12)[2:])
        added, replaced = detection_seconds()
        cost = rollback_cost(work / "data", work)
    share = (added - replaced) / bare
    spent = cost["restore"] + cost["replay"] + cost["redo"] * cost["per_update"]
    return "\n".join(
        [
            "### Spike detection and rollback cost",
            "",
            f"Detection adds {1e6 * added:.1f} us per update and replaces {1e6 * replaced:.1f} us (the norm "
            "brought to the "
            f"host alone), thread CPU time over {DETECTION_CALLS} calls with a full window of {50} applied "
            "updates: "
            f"{1e6 * (added - replaced):.1f} us net, {100 * share:.4f}% of a CPU update of the stability "
            "recipe "
            f"({bare:.4f} s, the bare loop's median, 1 thread). Target < {100 * SPIKE_TARGET:.1f}%: "
            f"{'met' if share < SPIKE_TARGET else 'NOT met'}. No host synchronisation is added: the loss "
            "rides in the "
            "transfer of the norm (one `.tolist()` in place of one `float()`).",
            "",
            f"One rollback (stability recipe, poisoned microbatch at update {cost['spike_step']}, "
            "checkpoints every 20, "
            f"cause found by replay: {cost['cause']}): back to step {cost['restored_step']}, {cost['redo']} "
            "updates "
            f"redone, {cost['skipped']['batches']} batches ({cost['skipped']['tokens']:,} tokens) skipped; "
            "the replay "
            f"(same batch, then the next) {cost['replay']:.3f} s, the restore {cost['restore']:.3f} s, the "
            "redone "
            f"updates {cost['redo']} x {cost['per_update']:.3f} s; in all {spent:.2f} s, "
            f"{spent / cost['per_update']:.1f} updates' worth. A rollback costs the updates since the last "
            "checkpoint: "
            "checkpoint_every bounds it.",
            "",
            "Command: `python -m benchmarks.bench_trainer --spikes` (this section alone; `python -m "
            "benchmarks.run_all "
            "bench_trainer` runs both)",
        ]
    )


# ------------------------------------------------------------------------------------------ shard hashing
HASH_TARGET = 0.01  # the background check at most 1% of a CPU update of the stability recipe
HASH_ROUNDS = 6
BIG_SHARD_TOKENS = 1 << 24  # prepare's default shard_tokens: a 32 MiB uint16 shard
FIRST_SHARD_TOKENS = 3000  # read by the first window (dropped): the big shard is first read in the second


def big_shard_data(source: Path, out: Path) -> None:
    """The prepared builtin folder with its train split as a small shard then one of the default size (the
    corpus tiled to BIG_SHARD_TOKENS ids), manifest rewritten to match: every `on` session hashes a full-size
    shard while its second window trains."""
    import json
    import shutil

    import numpy as np

    from pilotrun.common.files import sha256_of_file

    shutil.copytree(source, out)
    manifest = json.loads((out / "metadata.json").read_text())
    split = manifest["splits"]["train"]
    tokens = np.concatenate([np.load(out / shard["file"]) for shard in split["shards"]])
    for shard in split["shards"]:
        (out / shard["file"]).unlink()
    big = np.resize(tokens[FIRST_SHARD_TOKENS:], BIG_SHARD_TOKENS)
    split["shards"] = []
    for index, piece in enumerate((tokens[:FIRST_SHARD_TOKENS], big)):
        file = f"train_{index:05d}.npy"
        np.save(out / file, piece)
        split["shards"].append({"file": file, "tokens": int(len(piece)), "sha256": sha256_of_file(out / file),
                                "max_token_id": int(piece.max())})
    split["tokens"] = FIRST_SHARD_TOKENS + BIG_SHARD_TOKENS
    split["documents"] = int((big == manifest["tokenizer"]["eos_id"]).sum()
                             + (tokens[:FIRST_SHARD_TOKENS] == manifest["tokenizer"]["eos_id"]).sum())
    (out / "metadata.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def hashing_session(data_dir: Path, work: Path, index: int, hashing: bool) -> tuple[list[float], list[dict]]:
    """(training-only CPU seconds per window, shard_check events) of one trainer session, the background
    check on or off (off: the trainer's callbacks without ShardCheckCallback)."""
    import io

    from pilotrun.run.record import read_metrics_strict
    from pilotrun.training.callbacks.shard_check import ShardCheckCallback
    from pilotrun.training.timing import TimeAccount
    from pilotrun.training.trainer import Trainer

    class Unchecked(Trainer):
        def callbacks(self, loop):
            return [c for c in super().callbacks(loop) if not isinstance(c, ShardCheckCallback)]

    run_dir = work / f"{'on' if hashing else 'off'}-{index}"
    trainer = (Trainer if hashing else Unchecked)(_config(UPDATES), data_dir, run_dir, progress=False,
                                                  out=io.StringIO())
    trainer.account = TimeAccount(clock=time.thread_time)
    result = trainer.run()
    if result.reason != "completed":
        raise RuntimeError(f"benchmark hashing run did not complete: {result}")
    events = read_metrics_strict(run_dir)
    checks = [e for e in events if e["event"] == "shard_check"]
    if hashing and not any(e["matched"] and e["bytes"] > 2 * BIG_SHARD_TOKENS - 1 for e in checks):
        raise RuntimeError(f"the big shard was not checked: {checks}")
    return [e["window"]["train_seconds"] for e in events if e["event"] == "train"], checks


def shard_hashing_section() -> str:
    from pilotrun.data.prepare import prepare_corpus

    torch.set_num_threads(1)
    on: list[list[float]] = []
    off: list[list[float]] = []
    hash_cpu: list[float] = []
    hash_wall: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare_corpus(work / "builtin", source="builtin", tokenizer="bpe:4096", progress=False)
        big_shard_data(work / "builtin", work / "data")
        hashing_session(work / "data", work, -1, True)  # warm-up of both paths, not measured
        hashing_session(work / "data", work, -2, False)
        for index in range(HASH_ROUNDS):
            # alternate which side goes first
            for hashing in (True, False) if index % 2 == 0 else (False, True):
                windows, checks = hashing_session(work / "data", work, index, hashing)
                # the first window (warm-up, small shard) dropped
                (on if hashing else off).append(windows[1:])
                big = [e for e in checks if e["bytes"] > 2 * BIG_SHARD_TOKENS - 1]
                hash_cpu += [e["cpu_seconds"] for e in big]
                hash_wall += [e["seconds"] for e in big]
    n = UPDATES - WINDOW
    per_round = [sum(a) / sum(b) for a, b in zip(on, off, strict=True)]
    ratio = statistics.median(per_round)
    hashed_window = statistics.median(a[0] / b[0] for a, b in zip(on, off, strict=True))
    quiet_windows = statistics.median(
        x / y for a, b in zip(on, off, strict=True) for x, y in zip(a[1:], b[1:])
    )
    update = statistics.median(sum(b) / n for b in off)
    cpu = statistics.median(hash_cpu)
    updates_per_shard = BIG_SHARD_TOKENS // (8 * 64)
    bound_session = cpu / (n * update)
    bound_amortized = cpu / (updates_per_shard * update)
    # The side-by-side ratio's round-to-round spread on a shared 2-core machine is several percent, more than
    # the 1% to be shown; the hashing thread's own CPU time is an upper bound on what it can take from
    # training (GIL waits and a shared core included), so the target is judged on that bound.
    met = bound_session < HASH_TARGET
    lines = [
        "### Background shard hashing: cost to a CPU update of the stability recipe",
        "",
        f"Trainer sessions of {UPDATES} updates, the shard check on (the real trainer) and off (the same "
        "callbacks "
        f"without ShardCheckCallback), {HASH_ROUNDS} rounds alternating which side runs first, 1 torch "
        "thread, "
        "training-only CPU seconds of the computing thread per window of "
        f"{WINDOW} (the first window dropped). Data: the builtin corpus with its train split cut into a "
        f"{FIRST_SHARD_TOKENS:,}-token shard and one of prepare's default size ({BIG_SHARD_TOKENS:,} tokens, "
        f"{2 * BIG_SHARD_TOKENS / 2**20:.0f} MiB), first read at update {FIRST_SHARD_TOKENS // 512 + 1}, so "
        "that "
        "every `on` session hashes a full-size shard while its second window trains.",
        "",
        "| round | on s/update | off s/update | on / off |",
        "|---|---|---|---|",
    ]
    for index, (a, b) in enumerate(zip(on, off, strict=True), start=1):
        lines.append(f"| {index} | {sum(a) / n:.4f} | {sum(b) / n:.4f} | {sum(a) / sum(b):.3f} |")
    lines += [
        "",
        f"Median per-session ratio on / off: {ratio:.3f} (rounds {min(per_round):.3f} to "
        f"{max(per_round):.3f}: "
        "this machine's noise, wider than the 1% to be shown); the window during which the "
        f"{2 * BIG_SHARD_TOKENS / 2**20:.0f} MiB shard was hashed: {hashed_window:.3f}; the windows after "
        "it: "
        f"{quiet_windows:.3f} (paired medians). "
        f"The hashing thread spent {cpu:.3f} s CPU ({statistics.median(hash_wall):.3f} s wall) per full-size "
        f"shard, median of {len(hash_cpu)}. Were it to take all of that from the training core (no spare "
        "core), "
        f"it would cost **{100 * bound_session:.2f}%** of each of these {n} updates ({update:.4f} s each), "
        "and "
        f"{100 * bound_amortized:.4f}% amortized over the {updates_per_shard:,} updates of 512 tokens that "
        "read "
        f"one such shard. The training thread's CPU time does not count time it waits for the GIL or a core; "
        "the hashing thread's own CPU time bounds both. Target: < "
        f"{100 * HASH_TARGET:.0f}% of an update, judged on that bound over the session's updates: "
        f"{'met' if met else 'NOT met'}.",
        "",
        "Command: `python -m benchmarks.bench_trainer --shard-hashing` (this section alone; `python -m "
        "benchmarks.run_all bench_trainer` runs all three)",
    ]
    return "\n".join(lines)

if __name__ == "__main__":
    import sys

    if "--shard-hashing" in sys.argv:
        print(shard_hashing_section())
    else:
        print(spikes_section() if "--spikes" in sys.argv else run())
