"""`make bench`: run every benchmarks/bench_*.py side by side in one process and write BENCHMARKS.md.

Each benchmark module has `run() -> str`, returning a Markdown section (heading `## ...`) with the ratios
it measured and the command that reproduces it. `python -m benchmarks.run_all bench_data` runs one.
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def discover() -> list[str]:
    package_dir = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(package_dir)]) if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    names = argv or discover()
    sections = []
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        started = time.perf_counter()
        section = module.run()
        print(section, flush=True)
        sections.append(section.rstrip() + f"\n\n_{name} took {time.perf_counter() - started:.0f} s._\n")
    if argv:  # a partial run prints only; BENCHMARKS.md always holds one complete side-by-side run
        return 0
    header = (
        "# Benchmarks\n\n"
        "Written by `make bench` (`python -m benchmarks.run_all`) in one run on one machine; every ratio is\n"
        "measured side by side in that run. Do not edit by hand: rerun the command.\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, Python {platform.python_version()},"
        f" torch {torch.__version__}, {platform.platform()}.\n\n"
    )
    (ROOT / "BENCHMARKS.md").write_text(header + "\n".join(sections))
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
