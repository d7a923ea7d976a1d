"""The `builtin` source: real English prose that every Python install carries, for offline pilots and tests.

Two parts, both read without executing any of the code they come from:
1. `pydoc_data.topics.topics`, the interpreter's bundled copy of the language reference topics (a plain dict
   of strings; importing that one module has no side effects).
2. Docstrings of a fixed list of standard-library modules, read by parsing their source files with `ast`.
   Importing arbitrary stdlib modules is not safe (tkinter opens displays, `antigravity` opens a browser,
   `this` prints), so nothing here imports them.

Everything is gathered in a fixed sorted order and cut into documents by fixed rules, so the corpus is the
same on every machine with the same Python version. The manifest records that version, the documents,
characters and a sha256 of the whole text, so a machine whose standard library differs (a distribution that
strips a module) is visible as a different corpus identity rather than silently different data.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

# Modules whose docstrings are mostly prose, chosen by characters of docstring per second of parsing (the
# most text for the least start-up). Sorted; a module missing from an install is skipped (and shows up as a
# different `text_sha256`).
DOCSTRING_MODULES = (
    "_pydecimal", "base64", "bdb", "cmd", "codecs", "collections", "concurrent", "configparser", "contextlib",
    "copy", "difflib", "doctest", "email", "fileinput", "fractions", "ftplib", "hmac", "http", "imaplib",
    "importlib", "inspect", "ipaddress", "json", "logging", "lzma", "mimetypes", "numbers", "operator",
    "optparse", "os", "pathlib", "pdb", "pickletools", "platform", "poplib", "queue", "random", "sched",
    "secrets", "selectors", "shelve", "shutil", "smtplib", "socket", "socketserver", "ssl", "statistics",
    "subprocess", "tempfile", "textwrap", "threading", "timeit", "traceback", "turtle", "typing", "uuid",
    "wave",
)
SKIPPED_PACKAGE_FOLDERS = ("test", "tests", "__pycache__", "idle_test")

# Docstrings of one source file are packed, in source order, into documents of at least this many characters
# (a single short docstring is too little context to be a useful training document).
MIN_DOCUMENT_CHARACTERS = 2000


@dataclass(frozen=True)
class BuiltinCorpusInfo:
    python_version: str
    documents: int
    characters: int
    text_sha256: str

    def to_manifest(self) -> dict:
        return {
            "kind": "builtin",
            "python_version": self.python_version,
            "documents": self.documents,
            "characters": self.characters,
            "text_sha256": self.text_sha256,
            "parts": ["pydoc_data.topics", "stdlib docstrings (ast): " + ",".join(DOCSTRING_MODULES)],
        }


def _topic_documents() -> list[str]:
    from pydoc_data.topics import topics  # a data-only module: a dict of topic name -> text

    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def _module_source_files(stdlib_dir: str, module: str) -> list[str]:
    single = os.path.join(stdlib_dir, module + ".py")
    if os.path.isfile(single):
        return [single]
    package = os.path.join(stdlib_dir, module)
    if not os.path.isdir(package):
        return []
    files = []
    for root, dirs, names in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_PACKAGE_FOLDERS)
        files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
    # os.walk visits folders top-down in the sorted order imposed above; sort the full relative paths too so
    # the order never depends on the walk.
    return sorted(files, key=lambda p: os.path.relpath(p, stdlib_dir))


def _docstrings_in_source_order(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []

    def visit_statements(statements: list[ast.stmt]) -> None:
        # Only statement lists are walked (never expressions): docstrings live on modules, classes and
        # functions, which are statements, possibly nested in if/try/with blocks. This is much faster than
        # visiting every node.
        for statement in statements:
            if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(statement, clean=True)
                if text and text.strip():
                    found.append(text.strip())
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(statement, name, None)
                if isinstance(inner, list):
                    visit_statements(inner)
            for handler in getattr(statement, "handlers", ()):
                visit_statements(handler.body)

    module_text = ast.get_docstring(tree, clean=True)
    if module_text and module_text.strip():
        found.append(module_text.strip())
    visit_statements(tree.body)
    return found


def _pack(pieces: list[str]) -> list[str]:
    documents, current = [], []
    for piece in pieces:
        current.append(piece)
        if sum(len(p) for p in current) >= MIN_DOCUMENT_CHARACTERS:
            documents.append("\n\n".join(current))
            current = []
    if current:  # a short remainder joins the previous document of the same file rather than standing alone
        if documents:
            documents[-1] = documents[-1] + "\n\n" + "\n\n".join(current)
        else:
            documents.append("\n\n".join(current))
    return documents


def _docstring_documents() -> list[str]:
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    documents = []
    for module in DOCSTRING_MODULES:
        for path in _module_source_files(stdlib_dir, module):
            with open(path, encoding="utf-8") as handle:
                source = handle.read()
            try:
                pieces = _docstrings_in_source_order(source)
            except SyntaxError:  # never expected for the running interpreter's own library; skip, don't guess
                continue
            documents.extend(_pack(pieces))
    return documents


@functools.lru_cache(maxsize=1)
def builtin_documents() -> tuple[str, ...]:
    """All documents of the builtin corpus, in their fixed order (cached: gathering parses source files)."""
    return tuple(_topic_documents() + _docstring_documents())


def builtin_corpus_info() -> BuiltinCorpusInfo:
    documents = builtin_documents()
    digest = hashlib.sha256()
    for text in documents:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")  # document separator, so that moving a boundary changes the hash
    return BuiltinCorpusInfo(
        python_version=platform.python_version(),
        documents=len(documents),
        characters=sum(len(t) for t in documents),
        text_sha256=digest.hexdigest(),
    )


def iter_builtin_documents() -> Iterator[str]:
    yield from builtin_documents()
