"""Every path argument of every command, with the kind it must be: one table, checked before any command runs.

A path of the wrong kind is named as such ("--data F is a file, not a folder", "--config D is a folder, not a
file"), whatever the command would have said on its own ("does not exist", "already exists", an OSError). A
missing path is left to the command, which knows whether it is an output to make or an input to name. A new
path argument belongs in this table; tests/commands/test_cli_paths.py gives each one a path of the wrong kind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pilotrun.common.files import refuse_wrong_kind

# (command, subcommand or None) -> {argparse dest: (kind, how the message names it: the option, or what a
# positional argument is)}. "recipe": a file, or the name of a packaged recipe (`--config stability` stays
# valid beside a folder named stability). "data": a data folder or a mixture file (data/mixture.py), either
# kind.
PATH_ARGUMENTS: dict[tuple[str, str | None], dict[str, tuple[str, str]]] = {
    ("prepare", None): {"out": ("folder", "--out"), "source": ("file", "--source")},
    ("data", "verify"): {"dir": ("folder", "data folder")},
    ("data", "merge"): {"out": ("folder", "--out"), "parts": ("folder", "part")},
    ("train", None): {
        "config": ("recipe", "--config"),
        "frozen": ("file", "--frozen"),
        "data": ("data", "--data"),
        "run_dir": ("folder", "--run-dir"),
    },
    ("inspect-batch", None): {"run_dir": ("folder", "run folder")},
    ("summarize", None): {"run_dir": ("folder", "run folder")},
    ("verdict", None): {"run_dir": ("folder", "run folder")},
    ("tune", None): {"run_dir": ("folder", "run folder"), "data": ("data", "--data")},
    ("freeze", None): {"run_dir": ("folder", "run folder"), "out": ("file", "--out")},
    ("watch", None): {"run_dir": ("folder", "run folder"), "against": ("file", "--against")},
    ("pilot", None): {
        "workdir": ("folder", "--workdir"),
        "config": ("recipe", "--config"),
        "data": ("data", "--data"),
        "freeze": ("file", "--freeze"),
    },
    ("export", None): {
        "run_dir": ("folder", "run folder"),
        "out": ("folder", "--out"),
        "data": ("data", "--data"),
    },
    ("export-metrics", None): {"run_dir": ("folder", "run folder"), "out": ("folder", "--out")},
    ("config", None): {"config": ("recipe", "--config")},
}


def _is_packaged_recipe(name: str) -> bool:
    from pilotrun.common.errors import ConfigError
    from pilotrun.config import resolve_recipe_path

    try:
        resolve_recipe_path(name)
    except ConfigError:
        return False
    return True


def check_path_arguments(args: argparse.Namespace) -> None:
    """PilotrunError naming the first path argument of the wrong kind; nothing is read or written."""
    table = PATH_ARGUMENTS.get((args.command, getattr(args, "data_command", None)), {})
    for dest, (kind, what) in table.items():
        value = getattr(args, dest, None)
        for path in value if isinstance(value, list) else [value]:
            if not isinstance(path, str) or not path:
                continue
            if kind == "recipe" and Path(path).is_dir() and _is_packaged_recipe(path):
                continue
            # --source is a path only where one is there (else builtin, a hub name or a glob): a folder is
            # refused
            refuse_wrong_kind(path, "file" if kind == "recipe" else kind, what)
