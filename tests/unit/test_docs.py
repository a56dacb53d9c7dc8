"""The README is the front door: every relative link in it and in docs/ reaches a file (and a heading, for a
#fragment), and every `pipeline` command is named in the README beside the page that holds its detail, so a
newcomer finds any command in at most one link."""

from __future__ import annotations

import re
from pathlib import Path

import click

from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"^#+ (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_every_link_reaches_a_file_and_a_heading() -> None:
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and fragment not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name}" in readme, f"docs/{page.name} is not linked from the README"


def test_the_readme_is_a_front_door_naming_every_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260, "the README is the front door: the detail belongs under docs/"
    assert readme.splitlines()[3].startswith("make demo") and readme.splitlines()[4].startswith("make test")
    assert isinstance(main, click.Group)
    hidden = {name for name, cmd in main.commands.items() if cmd.hidden}
    missing = [name for name in main.commands if name not in hidden and f"pipeline {name}" not in readme]
    assert not missing, f"commands the README does not name: {missing}"
    # and on a line that links to the page holding its detail (the table of stages)
    unlinked = [
        name
        for name in set(main.commands) - hidden
        if not any(f"`pipeline {name}" in line and "(docs/" in line for line in readme.splitlines())
    ]
    assert not unlinked, f"commands without a link to their page on their line: {unlinked}"


def test_the_readme_map_names_every_module() -> None:
    """The README's map is held against the tree: every module of the package is named in it (by its file name, in
    its folder's line), so a new module cannot land unmapped."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Map", 1)[1].split("```")[1]
    named = set(re.findall(r"[a-z_0-9]+", block))
    missing = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        if path.stem not in ("__init__", "__main__") and path.stem not in named:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules the README's map does not name: {missing}"
