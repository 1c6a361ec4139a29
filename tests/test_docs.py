"""The README's and docs' relative links lead to files of the repository, and their links to a
heading (``page.md#heading``) to a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """The page's links to files of the repository (not to other sites)."""
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_lead_to_files():
    broken, seen = [], 0
    for page in pages():
        for target in relative_links(page):
            if target.startswith("#"):
                continue  # a heading of the same page
            seen += 1
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert seen >= 3  # the pages link to each other


def test_links_to_a_heading_find_it():
    broken, seen = [], 0
    for page in pages():
        for target in relative_links(page):
            path, _, heading = target.partition("#")
            linked = page.parent / path if path else page
            if not heading or linked.suffix != ".md" or not linked.exists():
                continue  # no heading named, or not a page (a missing file fails above)
            seen += 1
            if heading not in {anchor(h) for h in HEADING.findall(linked.read_text())}:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert seen >= 1


def test_anchor_follows_github():
    assert anchor("One request, from the prompt to its tokens") == (
        "one-request-from-the-prompt-to-its-tokens"
    )
    assert anchor("The cache: pages, admission, prefixes, chunks") == (
        "the-cache-pages-admission-prefixes-chunks"
    )
    assert anchor("Serving: `python -m jaxdd.serve`") == "serving-python--m-jaxddserve"
