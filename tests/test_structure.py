"""The package's shape, checked from its source: the folders import only the ones before them, no two files
import each other (function-local imports counted), the run folder's format imports no torch, no test hook
ships in production, no module outgrows one concern, the loop fits on one screen, and tests mirror the package.

The import graph is read with `ast`, so an import inside a function is an arrow like any other: hiding a
cycle in a function body does not make it go away.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pilotrun"

# The layers in the order data flows; each may import only the layers before it. `common` (files, parsing,
# errors, stop signals, progress, the deadline clock) is the floor everything stands on, the recipe's config
# and the version stand on it; `pilotrun/__init__.py` and `__main__.py` are the front door, which may reach
# the commands (the lazy API, `python -m pilotrun`).
LAYERS = ("common", "<floor>", "config", "data", "model", "optim", "run", "training", "report", "commands", "<door>")
DOOR_MODULES = {"pilotrun", "pilotrun.__main__"}
MAX_MODULE_LINES = 550
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
                if imported.split(".")[0] == "torch" or imported.startswith(("pilotrun.training", "pilotrun.report",
                                                                              "pilotrun.commands")):
                    offenders.append(f"{path.name}: {imported}")
    assert offenders == []


def test_no_test_hook_in_production_code():
    hooks = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "PILOTRUN_TEST_" in p.read_text()]
    assert hooks == []


def test_no_module_over_the_size_of_one_concern():
    # moe_kernels.cpp is one compiled extension and not Python; every Python module holds one concern.
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_the_training_loop_fits_on_one_screen():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "train_loop"]
    assert len(loops) == 1
    assert loops[0].end_lineno - loops[0].lineno + 1 <= MAX_LOOP_LINES


def canonical_spellings(source: str) -> int:
    """json.dumps calls with sorted keys and compact separators: a canonical JSON spelled out."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "dumps":
            keywords = {k.arg: k.value for k in node.keywords}
            sorted_keys = isinstance(keywords.get("sort_keys"), ast.Constant) and keywords["sort_keys"].value is True
            compact = "separators" in keywords and ast.literal_eval(keywords["separators"]) == (",", ":")
            count += sorted_keys and compact
    return count


def test_one_canonical_json():
    """Identity hashes are taken over one serialisation (pilotrun.common.files.canonical_json): a second spelling
    would let two readers disagree on the same value's hash. (A metrics.jsonl line is compact but keeps its
    fields in written order: a line format, not an identity.)"""
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
