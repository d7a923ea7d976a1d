"""`make bench`: run every benchmarks/bench_*.py side by side in one process and write BENCHMARKS.md.

Each benchmark module has `run() -> str`, returning a Markdown section (heading `## ...`) with the ratios it
measured and the command that reproduces it. `python -m benchmarks.run_all bench_data` runs one (printed only;
with `--update`, its section in BENCHMARKS.md is replaced and the header names it as measured apart from the
full run). Every section ends with its duration and the machine's load average before and after it, since
these figures are measured on shared machines. `--nanochat PATH` (`make bench NANOCHAT=PATH`) hands a checkout
of nanochat to the benchmarks that compare with it (a `run` with a `nanochat` parameter); without it nothing
of nanochat is imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
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


def section_footer(name: str, seconds: float, load_before: tuple, load_after: tuple) -> str:
    """How long a section took and how busy the machine was around it: the 1-, 5- and 15-minute load averages
    (runnable processes, all users) before and after, against the core count. A figure measured while the load
    exceeded the cores competed with other work for them."""
    def load(figures: tuple) -> str:
        return "/".join(f"{value:.1f}" for value in figures)

    return (f"_{name} took {seconds:.0f} s; load average (1/5/15 min) {load(load_before)} before, "
            f"{load(load_after)} after, on {os.cpu_count()} cores._\n")


def replace_sections(text: str, measured: dict[str, str]) -> str:
    """BENCHMARKS.md with each named module's section replaced by a new measurement (a section runs from its
    `## ` heading to the next one; it is the module's by its `_bench_x took` footer), and a header line that
    says which sections were measured after the full run, so no reader takes them for one side-by-side run."""
    head, *parts = text.split("\n## ")
    parts = ["## " + part for part in parts]
    for name, section in measured.items():
        owned = [index for index, part in enumerate(parts) if f"_{name} took" in part]
        if owned:
            parts[owned[0]] = section
        else:
            parts.append(section)
    marker = (
        "Sections measured on their own after the full run (`python -m benchmarks.run_all --update NAME`): "
    )
    earlier = {name.strip() for line in head.splitlines() if line.startswith(marker)
               for name in line[len(marker):].rstrip(".").split(",")}
    note = marker + ", ".join(sorted(earlier | set(measured))) + "."
    lines = [line for line in head.splitlines() if not line.startswith(marker)]
    return (
        "\n".join(lines).rstrip() + "\n\n" + note + "\n\n" + "\n".join(part.rstrip() + "\n" for part in parts)
    )


def split_arguments(argv: list[str]) -> tuple[list[str], bool, str | None]:
    """The section names given, whether to --update, and the --nanochat PATH (None without one)."""
    names, update, nanochat, words = [], False, None, iter(argv)
    for word in words:
        if word == "--update":
            update = True
        elif word == "--nanochat" or word.startswith("--nanochat="):
            nanochat = word.partition("=")[2] or next(words, "")
        else:
            names.append(word)
    return names, update, nanochat


def main(argv: list[str]) -> int:
    argv, update, nanochat_path = split_arguments(argv)
    names = argv or discover()
    nanochat = None
    if nanochat_path is not None:  # refused in one line before anything is measured
        from benchmarks import nanochat_adapter
        try:
            nanochat = nanochat_adapter.load(nanochat_path)
        except nanochat_adapter.NanochatError as error:
            print(f"run_all: {error}", file=sys.stderr)
            return 2
    sections = []
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        takes_nanochat = nanochat is not None and "nanochat" in inspect.signature(module.run).parameters
        load_before = os.getloadavg()
        started = time.perf_counter()
        section = module.run(nanochat=nanochat) if takes_nanochat else module.run()
        seconds = time.perf_counter() - started
        section = section.rstrip() + "\n\n" + section_footer(name, seconds, load_before, os.getloadavg())
        print(section, flush=True)
        sections.append(section)
    if update and argv:
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_sections(path.read_text(), dict(zip(names, sections, strict=True))))
        print(f"updated {', '.join(names)} in {path}")
        return 0
    if argv:  # a partial run prints only; BENCHMARKS.md holds one complete side-by-side run unless --update
        return 0
    header = (
        "# Benchmarks\n\n"
        "Written by `make bench` (`python -m benchmarks.run_all`) in one run on one machine; every ratio is\n"
        "measured side by side in that run. Do not edit by hand: rerun the command.\n\n"
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, Python "
        f"{platform.python_version()},"
        f" torch {torch.__version__}, {platform.platform()}.\n\n"
    )
    (ROOT / "BENCHMARKS.md").write_text(header + "\n".join(sections))
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
