"""What `make` is about to install, read from pyproject.toml: the base dependencies and each extra asked for.

`python scripts/describe_extras.py dev,hub` prints one line for the base and one per extra ("base" alone: the
base dependencies, what `make pilot` installs). Standard library only: it runs before pilotrun is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def names(requirements: list[str]) -> str:
    return ", ".join(re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in requirements)


def describe(extras: str, pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = [e for e in extras.split(",") if e and e != "base"]
    lines = [f"[make] 4/5 installing pilotrun (editable) with the extras [{','.join(wanted)}]" if wanted else
             "[make] 4/5 installing pilotrun (editable), no extra",
             f"[make]   base: {names(project['dependencies'])}"]
    optional = project.get("optional-dependencies", {})
    for extra in wanted:
        if extra not in optional:
            raise SystemExit(
                f"[make] unknown extra '{extra}' (pyproject.toml has: {', '.join(sorted(optional))})"
            )
        lines.append(f"[make]   [{extra}]: {names(optional[extra])}")
    return lines


if __name__ == "__main__":
    print("\n".join(describe(sys.argv[1] if len(sys.argv) > 1 else "base")))
