"""The README's test command is exactly what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.MULTILINE).group(1)
    assert command in (ROOT / "README.md").read_text()
