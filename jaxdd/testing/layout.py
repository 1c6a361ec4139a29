"""The package's shape, measured: what tests/test_layout.py holds the tree to (modules at the
root, imports between parts, function and file lengths, measurements left in the prose)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("jaxdd", "pallas_kernels", "convert")
# A time or a throughput: what belongs in benchmarks/README.md, not in a comment.
MEASUREMENT = re.compile(
    r"\d[\d.,]*\s*(?:ms|us|µs|ns|s|seconds?|minutes?|min|hours?|[GMK]i?B/s|tokens/s|tok/s|("
    r"?:G )?values/s)(?![\w/])"
)
# A measured ratio: a number then x, times or %, then faster, slower, longer or shorter (or words
# for one).
SPEEDUP = re.compile(
    r"\d[\d.]*(?:\s*-\s*\d[\d.]*)?\s*(?:x|times|%)\s+(?:faster|slower|longer|shorter)\b"
    r"|\b(?:twice|half) as (?:long|fast|slow)\b|\ban order of magnitude (?:faster|slower)\b",
    re.IGNORECASE,
)


def sources(
    packages: tuple[str, ...] = LIBRARY, suffixes: tuple[str, ...] = (".py",)
) -> list[Path]:
    return sorted(
        p for package in packages for p in (ROOT / package).rglob("*") if p.suffix in suffixes
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The project modules ``path`` imports (anywhere in the file, lazily imported ones too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in LIBRARY}


def prose(path: Path) -> list[str]:
    """The comments and docstrings of a file (a C++ file's ``//`` comments)."""
    text = path.read_text()
    if path.suffix == ".cc":
        return re.findall(r"//(.*)", text)
    found = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            found += [docstring] if docstring else []
    return found


def measurements(path: Path) -> list[str]:
    patterns = (MEASUREMENT, SPEEDUP)
    return [m.group(0) for text in prose(path) for p in patterns for m in p.finditer(text)]


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]
