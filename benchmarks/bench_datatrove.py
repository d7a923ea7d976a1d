"""The datatrove route against `pilotrun prepare`, measured side by side in one run.

Tokens/s of the whole command (read, split, tokenize, write and hash shards, manifest; the datatrove route
also hashes its input files in the tasks, starts its executor and merges the task folders) and peak memory,
for `pilotrun prepare` with threads (--workers 0) and with 2 tokenizing processes (--workers 2), and for
`prepare --engine datatrove` with 1 and 2 local workers over the same 8 tasks. Corpus: the FineWeb-Edu fixture
documents repeated (each copy with a distinct first line) into 8 jsonl files; GPT-2 tokenizer. Each run is a
fresh Python process (so a peak is that route's own), rounds interleaved so that other load on the machine
falls on every route alike; the two datatrove runs must give the same metadata_sha256.

Run: `python -m benchmarks.run_all --update bench_datatrove` (its duration: BENCHMARKS.md, the section's last
line).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("PILOTRUN_FIXTURES", ROOT.parent / "shared" / "fixtures"))
FINEWEB_JSONL = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"
GPT2 = FIXTURES / "tokenizers" / "gpt2" / "tokenizer.json"
FILES = 8
COPIES = 16  # ~6.6M characters, ~1.5M GPT-2 tokens: a few seconds per route on 2 cores
ROUNDS = 2
ROUTES = (("pilotrun prepare (threads, --workers 0)", "pilotrun", 0),
          ("pilotrun prepare --workers 2 (processes)", "pilotrun", 2),
          ("prepare --engine datatrove, 8 tasks, --workers 1", "datatrove", 1),
          ("prepare --engine datatrove, 8 tasks, --workers 2", "datatrove", 2))

# One route in a fresh process: seconds, tokens, identity, this process's peak and the largest descendant's.
CHILD = """
import json, resource, sys, time
from pilotrun.data.prepare_state import peak_resident_mb
from pilotrun.data.shards import metadata_sha256
engine, workers, out, source, tokenizer = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
started = time.perf_counter()
if engine == "pilotrun":
    from pilotrun.data.prepare import prepare_corpus
    manifest = prepare_corpus(out, source, tokenizer, workers=workers, progress=False)
else:
    from pilotrun.data.datatrove_prepare import prepare_with_datatrove
    manifest = prepare_with_datatrove(out, source, tokenizer, tasks=8, workers=workers)
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "metadata_sha256": metadata_sha256(manifest),
                  "tokens": sum(manifest["splits"][s]["tokens"] for s in ("train", "val")),
                  "peak_mb": peak_resident_mb(),
                  "children_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _corpus(work: Path) -> tuple[str, int, int]:
    with open(FINEWEB_JSONL, encoding="utf-8") as handle:
        base = [json.loads(line)["text"] for line in handle if line.strip()]
    rows = [
        f"copy {copy} of document {index}\n{text}"
        for copy in range(COPIES)
        for index, text in enumerate(base)
    ]
    folder = work / "corpus"
    folder.mkdir()
    for part in range(FILES):
        with open(folder / f"part-{part:02d}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": text}) + "\n" for text in rows[part::FILES])
    return str(folder / "*.jsonl"), len(rows), sum(len(text) for text in rows)


def _measure(work: Path, source: str) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name, _, _ in ROUTES}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for round_index in range(ROUNDS):
        for index, (name, engine, workers) in enumerate(ROUTES):
            out = work / f"out-{round_index}-{index}"
            done = subprocess.run(
                [sys.executable, "-c", CHILD, engine, str(workers), str(out), source, str(GPT2)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{name}: {done.stderr.strip()[-2000:]}")
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(f"{out}.logs", ignore_errors=True)
    return results


def run() -> str:
    if not (FINEWEB_JSONL.exists() and GPT2.exists()):
        return ("## Data: the datatrove route against pilotrun prepare\n\nSkipped: the shared fixtures are "
                "absent.")
    work = Path(tempfile.mkdtemp(prefix="bench-datatrove-"))
    try:
        source, documents, characters = _corpus(work)
        results = _measure(work, source)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    datatrove = [runs[0]["metadata_sha256"] for name, runs in results.items() if "datatrove" in name]
    same = len(set(datatrove)) == 1
    base = statistics.median(r["seconds"] for r in results[ROUTES[0][0]])
    rows = []
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        tokens = runs[0]["tokens"]
        rounds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        rows.append(f"| {name} | {tokens:,} | {tokens / seconds:,.0f} | {base / seconds:.2f} | "
                    f"{rounds} | {max(r['peak_mb'] for r in runs):.0f} MiB | "
                    f"{max(r['children_peak_mb'] for r in runs):.0f} MiB |")
    return "\n".join(
        [
            "## Data: the datatrove route against pilotrun prepare",
            "",
            f"Corpus: the 150 FineWeb-Edu fixture documents x {COPIES} (distinct first lines), {documents:,} "
            "documents, "
            f"{characters:,} characters in {FILES} jsonl files; GPT-2 tokenizer; val_fraction 0.01, default "
            "shard size. "
            f"{os.cpu_count()} cores. Each run a fresh process; median of {ROUNDS} interleaved rounds. "
            "tokens/s is the "
            "whole command's wall clock (the datatrove route includes its executor's start, the per-task "
            "hashing of the "
            "input files and the merge, which rereads every shard). Peak: VmHWM of the command's own "
            "process; "
            "largest descendant: RUSAGE_CHILDREN's ru_maxrss (prepare's tokenizing processes; for datatrove "
            "its "
            "manager and forkserver: the pool workers are the forkserver's children, so their peak may be "
            "missing "
            "from it, and the --workers 2 figure is a lower bound for a task's memory; with --workers 1 the "
            "tasks run "
            "in the command's own process, its peak RSS).",
            "",
            "| route | tokens | tokens/s | speed vs threads | seconds per round | peak RSS | largest "
            "descendant |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "The datatrove route with --workers 1 and --workers 2 gave the same metadata_sha256: "
            f"**{'yes' if same else 'NO'}**. "
            "On 2 shared cores the datatrove route pays for what it adds (a manager and forkserver process, "
            "per-task "
            "interpreters importing datatrove, hashing inputs, the merge's reread); it is built for many "
            "cores and many "
            "machines, where its tasks need no coordination beyond the final merge.",
        ]
    )
