"""The README stays a quick start and the docs stay connected: the README is short and opens with the two
set-up commands the Makefile really has, every relative link of README.md and docs/*.md reaches a file (and a
heading) of the repository, and docs/EXTENDING.md's layout names every top-level folder of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    inside_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside_code = not inside_code
        elif not inside_code and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_readme_is_a_quick_start():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    before_any_section = lines[:next(i for i, line in enumerate(lines) if line.startswith("## "))]
    opening = "\n".join(before_any_section).split("```")
    assert len(opening) >= 3, "README.md opens without its set-up commands"
    commands = [line.split("#")[0].strip() for line in opening[1].splitlines() if line.strip()]
    assert commands[:2] == ["make pilot", "make test"], commands


def test_the_readme_set_up_commands_are_the_makefile_s():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^pilot:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert "pilotrun pilot" in makefile.split("\npilot:", 1)[1].split("\n\n", 1)[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the README's command


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.is_relative_to(ROOT) or not where.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading '{anchor}' in {where.relative_to(ROOT)}")
    assert broken == []


def test_the_docs_name_no_path_outside_the_repository():
    """A path in docs/'s prose is read from the repository's root, so one that climbs out (`../shared/...`)
    names a file a clone does not have; a link's target is the link test's."""
    outside = [f"{page.name}: {path}" for page in PAGES[1:]
               for path in re.findall(r"(?:\.\./)+[\w./-]*", LINK.sub("", page.read_text(encoding="utf-8")))]
    assert outside == []


def test_the_layout_names_every_top_level_folder_of_the_package():
    extending = (ROOT / "docs" / "EXTENDING.md").read_text(encoding="utf-8")
    layout = extending.split("## Layout", 1)[1].split("\n## ", 1)[0]
    folders = [p.name for p in (ROOT / "pilotrun").iterdir() if p.is_dir() and not p.name.startswith("__")]
    assert folders and [f for f in folders if f"`pilotrun/{f}/`" not in layout] == []
