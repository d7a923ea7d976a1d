"""The package's shape, checked from its source: the folders import only the ones before them, no two files
import each other (function-local imports counted), the run folder's format imports no torch, no test hook
ships in production, no function outgrows its cap, docstrings name what exists, the loop fits on one screen,
and tests mirror the package.

The import graph is read with `ast`, so an import inside a function is an arrow like any other: hiding a cycle
in a function body does not make it go away.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pilotrun"

# The layers in the order data flows; each may import only the layers before it. `common` (files, parsing,
# errors, stop signals, progress, the deadline clock) is the floor everything stands on, the recipe's config
# and the version stand on it; `pilotrun/__init__.py` and `__main__.py` are the front door, which may reach
# the commands (the lazy API, `python -m pilotrun`).
LAYERS = (
    "common",
    "<floor>",
    "config",
    "data",
    "model",
    "optim",
    "run",
    "training",
    "report",
    "commands",
    "<door>",
)
DOOR_MODULES = {"pilotrun", "pilotrun.__main__"}
MAX_LOOP_LINES = 80


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every pilotrun module `name` imports anywhere in its file, resolved to a module of the package."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def nearest(target: str) -> str:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {nearest(alias.name) for alias in node.names if alias.name.split(".")[0] == "pilotrun"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "pilotrun":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else nearest(base))
    found.discard(name)
    return found


def layer_of(name: str) -> str:
    if name in DOOR_MODULES:
        return "<door>"
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else "<floor>"


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_every_layer_imports_only_the_layers_before_it():
    upward = []
    for source, targets in import_graph().items():
        for target in targets:
            if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)):
                upward.append(f"{source} ({layer_of(source)}) -> {target} ({layer_of(target)})")
    assert upward == [], "imports that run back up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_between_files():
    graph = import_graph()
    # Tarjan's strongly connected components: any component of more than one file is a loop.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert loops == []


def test_the_checker_sees_function_local_imports_and_upward_arrows(tmp_path):
    """The graph reader itself: a function-local import is an arrow, a relative import resolves, and an arrow
    from data up to training is reported as upward (else the two tests above could not fail)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from pilotrun.training.trainer import Trainer\nfrom . import shards\n")
    modules = {"pilotrun.data.m": source, "pilotrun.training.trainer": source, "pilotrun.data.shards": source}
    found = imported_modules("pilotrun.data.m", source, modules)
    assert found == {"pilotrun.training.trainer", "pilotrun.data.shards"}
    assert LAYERS.index(layer_of("pilotrun.training.trainer")) > LAYERS.index(layer_of("pilotrun.data.m"))


def test_the_run_folder_format_imports_no_torch_training_or_report():
    offenders = []
    for path in sorted((PACKAGE / "run").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for imported in names:
                if imported.split(".")[0] == "torch" or imported.startswith(
                    ("pilotrun.training", "pilotrun.report", "pilotrun.commands")
                ):
                    offenders.append(f"{path.name}: {imported}")
    assert offenders == []


def test_no_test_hook_in_production_code():
    hooks = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "PILOTRUN_TEST_" in p.read_text()]
    assert hooks == []


def test_the_training_loop_fits_on_one_screen():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    loops = [
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "train_loop"
    ]
    assert len(loops) == 1
    assert loops[0].end_lineno - loops[0].lineno + 1 <= MAX_LOOP_LINES


def canonical_spellings(source: str) -> int:
    """json.dumps calls with sorted keys and compact separators: a canonical JSON spelled out."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "dumps":
            keywords = {k.arg: k.value for k in node.keywords}
            sorted_keys = (
                isinstance(keywords.get("sort_keys"), ast.Constant) and keywords["sort_keys"].value is True
            )
            compact = "separators" in keywords and ast.literal_eval(keywords["separators"]) == (",", ":")
            count += sorted_keys and compact
    return count


def test_one_canonical_json():
    """Identity hashes are taken over one serialisation (pilotrun.common.files.canonical_json): a second
    spelling would let two readers disagree on the same value's hash. (A metrics.jsonl line is compact but
    keeps its fields in written order: a line format, not an identity.)"""
    spelled = {str(p.relative_to(ROOT)): canonical_spellings(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in spelled.items() if n} == {"pilotrun/common/files.py": 1}
    assert canonical_spellings('json.dumps(x, separators=(",", ":"), sort_keys=True)') == 1


def test_tests_mirror_the_package():
    """Each folder of the package has its test folder, and each module with logic its test file."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name.startswith("__") or len(path.read_text().splitlines()) < 40:
            continue
        mirror = ROOT / "tests" / relative.parent / f"test_{path.name}"
        if not mirror.exists():
            missing.append(str(relative))
    assert missing == []


def test_folder_graph_is_acyclic_as_a_whole():
    edges = defaultdict(set)
    for source, targets in import_graph().items():
        for target in targets:
            if layer_of(source) != layer_of(target):
                edges[layer_of(source)].add(layer_of(target))
    order = {layer: i for i, layer in enumerate(LAYERS)}
    assert all(order[b] < order[a] for a, bs in edges.items() for b in bs)


# A function longer than this is split, or named below with why it is one piece. Counted in source lines,
# docstring included, after the code is laid out within the line limit.
MAX_FUNCTION_LINES = 100
LONG_FUNCTIONS = {
    # The numbered set-up steps a session takes in order; each step is a call, the order is the content.
    "pilotrun/commands/pilot.py:_rehearse": "the pilot's rehearsal steps, in order",
}
# A module past this size is a hint that it holds more than one concern: a warning to read, not a failure.
MODULE_WARNING_LINES = 800


def function_lengths() -> dict[str, int]:
    lengths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = f"{relative}:{node.name}"
                lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_over_the_length_cap():
    lengths = function_lengths()
    over = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS}
    assert over == {}, "functions over the cap: split them, or list them with why in LONG_FUNCTIONS"
    # The list cannot rot: each exemption names a function that exists and still needs it.
    stale = {name for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES}
    assert stale == set(), "exemptions no longer needed"


def test_a_large_module_is_reported():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50  # the package itself was read
    for path, n in sorted(sizes.items()):
        if n > MODULE_WARNING_LINES:
            warnings.warn(f"{path}: {n} lines; does it still hold one concern?", stacklevel=1)


# What a docstring names must exist: a file (a repository path, or a path relative to the package or to one of
# the folders above the module) and a `module.Name` whose module is one of the package's and whose name
# starts with a capital (a class or a constant; lower-case words after a dot are as often recipe keys and
# record fields as functions, so they are not checked).
DOC_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|cpp|sbatch|yaml))\b")
DOC_NAME = re.compile(r"(?<![\w.])((?:[a-z_][a-z0-9_]*\.)*[a-z_][a-z0-9_]*)\.([A-Z][A-Za-z0-9_]*)\b")


def docstrings_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield node.body[0].lineno, text


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def stale_docstring_references(package: Path, root: Path) -> list[str]:
    repository = [p for p in root.rglob("*") if p.is_file() and not {".git", ".venv"} & set(p.parts)]
    basenames = {p.name for p in repository}
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}
    stale = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for line, text in docstrings_of(path):
            for found in DOC_FILE.finditer(text):
                name = found.group(1)
                bases = [root, package, *path.parents]
                exists = name in basenames if "/" not in name else any((b / name).is_file() for b in bases)
                if not exists:
                    stale.append(f"{where}:{line}: no file {name}")
            for found in DOC_NAME.finditer(text):
                prefix, name = found.groups()
                owners = [m for m in modules if m.split(".", 1)[-1] == prefix or m.endswith("." + prefix)]
                if owners and not any(name in top_level_names(modules[m]) for m in owners):
                    stale.append(f"{where}:{line}: no {prefix}.{name}")
    return stale


def test_docstrings_name_only_files_and_names_that_exist():
    assert stale_docstring_references(PACKAGE, ROOT) == []


def test_the_reference_check_can_fail(tmp_path):
    package = tmp_path / "pilotrun"
    (package / "room").mkdir(parents=True)
    (package / "room" / "kept.py").write_text(
        '"""Reads room/kept.py and room/gone.py."""\nclass Here:\n    pass\n'
    )
    (package / "room" / "other.py").write_text('"""See `kept.Here` and `kept.Gone`."""\n')
    found = stale_docstring_references(package, tmp_path)
    assert found == [
        "pilotrun/room/kept.py:1: no file room/gone.py",
        "pilotrun/room/other.py:1: no kept.Gone",
    ]
