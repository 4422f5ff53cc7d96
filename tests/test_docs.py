"""Docs that cannot drift: the action tables list what `dflash2 --help` lists, and docs/README.md indexes every page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def help_actions() -> set[str]:
    """The actions `dflash2 --help` prints (run as a user runs it)."""
    done = subprocess.run(
        [sys.executable, "-m", "dflash2_lightning", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    )
    block = done.stdout.split("actions:\n", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0] for line in block.splitlines() if line.strip()}


def action_table(markdown: str, heading: str) -> set[str]:
    """Action names in the first column of the first table after ``heading``."""
    section = markdown.split(heading, 1)[1]
    table = re.search(r"(^\|.*\|\n)+", section, flags=re.M)
    assert table, f"no table under {heading!r}"
    names: set[str] = set()
    for line in table.group(0).splitlines()[2:]:  # past the header and its rule
        first = line.split("|")[1]
        names |= {name.removeprefix("dflash2 ") for name in re.findall(r"`([^`]+)`", first)}
    return names


def test_readme_action_table_is_dflash2_help() -> None:
    """README's CLI reference names exactly the actions `dflash2 --help` lists."""
    actions = help_actions()
    assert {"fit", "plan", "eval", "check-serving"} <= actions, actions
    listed = action_table((REPO / "README.md").read_text(), "## Configuration and CLI reference")
    assert listed == actions, f"README lacks {sorted(actions - listed)}, lists unknown {sorted(listed - actions)}"


def test_configuration_reference_lists_every_action() -> None:
    """docs/configuration.md's action table names exactly the actions `dflash2 --help` lists."""
    listed = action_table((REPO / "docs" / "configuration.md").read_text(), "## Actions")
    actions = help_actions()
    assert listed == actions, (
        f"docs/configuration.md lacks {sorted(actions - listed)}, lists unknown {sorted(listed - actions)}"
    )


def test_docs_index_names_every_page() -> None:
    """docs/README.md links every page in docs/, and every link there is a page that exists."""
    index = (REPO / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert linked >= pages, f"docs/README.md does not index {sorted(pages - linked)}"
    assert not linked - pages - {"README.md"}, f"docs/README.md links missing pages {sorted(linked - pages)}"
