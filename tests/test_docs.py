"""The README's and docs' relative links lead to files of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_lead_to_files():
    broken, seen = [], 0
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # another site, or a heading of the same page
            seen += 1
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert seen >= 3  # the pages link to each other
