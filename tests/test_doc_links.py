"""Every relative link in the README and docs/ points at a file that exists, and the README links every topic
page of docs/ (the front door loses nothing when a page moves)."""

from __future__ import annotations

import re

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_readme_links_every_topic_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    topics = [p.name for p in (REPO / "docs").glob("*.md")]
    missing = [name for name in topics if f"docs/{name}" not in readme]
    assert not missing, f"README.md does not link {missing}"
