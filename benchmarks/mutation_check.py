"""Plant realistic bugs one at a time and check that the test suite kills each: `make mutation`.

A passing suite says little if the bugs that matter would also pass it. Each mutation below is a one-line
slip someone could plausibly make in the named file (a counter moved on a skipped update, a file not synced,
a figure computed from the wrong clock), paired with the tests that are meant to catch it. For each one the
checker copies the tracked files of this checkout into a scratch folder, applies the edit there (the checkout
itself is never touched), runs those tests against the copy and calls the mutant killed when they fail.

A mutation whose `old` text no longer occurs exactly once is reported as stale (the code moved on and the
mutation must be rewritten), never counted as killed. The unmutated copy must pass the same tests first, so a
broken test cannot pass for a kill. The mutations pin exact source lines, so they go stale whenever the code
they name is refactored: that is checked here, on demand (`--stale-only` in seconds, before every full run),
not by the test suite, which must not fail because a line was reworded.

    .venv/bin/python -m benchmarks.mutation_check            # every mutation, a table and the kill rate
    .venv/bin/python -m benchmarks.mutation_check --json     # the same as JSON
    .venv/bin/python -m benchmarks.mutation_check --only bias_on_skipped_update
    .venv/bin/python -m benchmarks.mutation_check --stale-only   # mutations that no longer apply (no tests)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[1]


def copy_tracked_files(destination: Path) -> None:
    """The checkout's tracked files (and untracked, not ignored ones): what CI would test. A tracked symbolic
    link (configs/ -> pilotrun/configs) is copied as the link itself, so it resolves inside the copy; skipping
    it would leave the tests without the recipes they load through it."""
    listed = (
        subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for relative in filter(None, listed):
        source = ROOT / relative
        target = destination / relative
        if source.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), target)
        elif source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply_mutation(tree: Path, mutation: Mutation) -> str | None:
    """Edit the copy; returns None when applied, or why the mutation is stale."""
    path = tree / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    text = path.read_text(encoding="utf-8")
    count = text.count(mutation.old)
    if count != 1:
        return f"the text to replace occurs {count} times in {mutation.file}"
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
    return None


def stale_mutations(root: Path, mutations: tuple[Mutation, ...]) -> dict[str, str]:
    """{name: why} for each mutation that cannot be checked against the checkout at `root`: a name used
    twice, an edit that changes nothing, a text that does not occur exactly once in its file, or a named test
    file that does not exist. Each edit is applied to a scratch copy of its one file only, so this takes
    seconds and the checkout is never touched."""
    problems: dict[str, str] = {}
    seen: set[str] = set()
    for mutation in mutations:
        if mutation.name in seen:
            problems[mutation.name] = "the name is used by another mutation"
            continue
        seen.add(mutation.name)
        missing = [test for test in mutation.tests if not (root / test.split("::")[0]).is_file()]
        if mutation.old == mutation.new:
            problems[mutation.name] = "the edit changes nothing"
        elif missing:
            problems[mutation.name] = f"named test file(s) do not exist: {', '.join(missing)}"
        elif (root / mutation.file).is_file():
            with tempfile.TemporaryDirectory(prefix="pilotrun-stale-") as scratch:
                target = Path(scratch) / mutation.file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / mutation.file, target)
                why = apply_mutation(Path(scratch), mutation)
            if why is not None:
                problems[mutation.name] = why
        else:
            problems[mutation.name] = f"{mutation.file} does not exist"
    return problems


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[bool, str]:
    """(passed, last lines of output) of the named tests run against the copy."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s"
    tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])
    return result.returncode == 0, tail


def check_mutation(mutation: Mutation, timeout_s: float, baselines: dict[tuple[str, ...], tuple[bool, str]]
                   ) -> dict[str, object]:
    """Killed, survived, stale, or baseline failed (the unmutated copy already fails those tests; checked once
    per distinct set of tests)."""
    with tempfile.TemporaryDirectory(prefix="pilotrun-mutant-") as scratch:
        tree = Path(scratch)
        copy_tracked_files(tree)
        if mutation.tests not in baselines:
            baselines[mutation.tests] = run_tests(tree, mutation.tests, timeout_s)
        baseline_passed, baseline_tail = baselines[mutation.tests]
        if not baseline_passed:
            return {"name": mutation.name, "status": "baseline failed", "detail": baseline_tail}
        stale = apply_mutation(tree, mutation)
        if stale is not None:
            return {"name": mutation.name, "status": "stale", "detail": stale}
        passed, tail = run_tests(tree, mutation.tests, timeout_s)
        return {"name": mutation.name, "status": "survived" if passed else "killed", "detail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--only", nargs="*", default=None, help="names of the mutations to check (default: all)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="limit for one run of a mutation's tests"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--stale-only",
        action="store_true",
        help="only list the mutations that no longer apply to this checkout (no tests run); exit 1 "
        "when any does",
    )
    args = parser.parse_args(argv)
    if args.stale_only:
        problems = stale_mutations(ROOT, MUTATIONS)
        if args.json:
            print(json.dumps({"mutations": len(MUTATIONS), "stale": problems}, indent=2))
        else:
            print(f"{len(MUTATIONS) - len(problems)} of {len(MUTATIONS)} mutations apply to this checkout"
                  + "".join(f"\n  stale: {name} ({why})" for name, why in problems.items()))
        return 1 if problems else 0
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"mutation_check: unknown mutation(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    results = []
    baselines: dict[tuple[str, ...], tuple[bool, str]] = {}
    for index, mutation in enumerate(chosen, start=1):
        result = check_mutation(mutation, args.timeout_s, baselines)
        results.append({**result, "file": mutation.file, "why": mutation.why})
        if not args.json:
            print(
                f"[{index}/{len(chosen)}] {result['status']:>15}  {mutation.name}: {mutation.why}", flush=True
            )
    killed = sum(r["status"] == "killed" for r in results)
    summary = {"mutations": len(results), "killed": killed,
               "kill_rate": killed / len(results) if results else None, "results": results}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"killed {killed} of {len(results)} planted bugs"
            + "".join(
                f"\n  {r['status']}: {r['name']} ({r['detail']})" for r in results if r["status"] != "killed"
            )
        )
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
