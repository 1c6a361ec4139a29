"""The package keeps its shape: few modules at the root, parts that
import downward only, no import cycle, short functions and files,
and measurements in benchmarks/README.md rather than in comments."""

from __future__ import annotations

import graphlib
import re

from jaxdd.testing.layout import ROOT, imports, long_functions, measurements, module_name, sources

# Each part may import its own layer and the layers before it.
LAYERS = [
    ("jaxdd.types", "jaxdd.errors", "jaxdd.config"),
    ("jaxdd.runtime", "pallas_kernels", "jaxdd.cache"),
    ("jaxdd.models",),
    ("jaxdd.weights", "jaxdd.decoding"),
    ("jaxdd.api", "jaxdd"),
    ("jaxdd.planning", "jaxdd.testing", "jaxdd.serve"),
    (
        "jaxdd.cli",
        "jaxdd.generate",
        "jaxdd.plan",
        "jaxdd.serve.__main__",
        "jaxdd.crosscheck",
        "jaxdd.train",
        "convert",
    ),
]


def layer(module: str) -> int:
    """The layer of the longest part that names ``module``."""
    best = max(
        (p for parts in LAYERS for p in parts if module == p or module.startswith(p + ".")), key=len
    )
    return next(i for i, parts in enumerate(LAYERS) if best in parts)


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in sources()}
    edges = {}
    for name, path in modules.items():
        found = imports(path)
        # "from jaxdd.x import y" names module jaxdd.x.y when y is one, else the object y of jaxdd.x
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def test_root_holds_at_most_eight_modules():
    root = sorted(p.name for p in (ROOT / "jaxdd").glob("*.py"))
    assert len(root) <= 8, root


def test_no_import_cycle():
    graphlib.TopologicalSorter(graph()).prepare()  # raises CycleError naming the cycle


def test_parts_import_downward_only():
    upward = [
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if layer(target) > layer(name) and not target.startswith(name + ".")
    ]
    assert upward == []


def test_functions_and_files_stay_short():
    files = sources(suffixes=(".py", ".cc"))
    assert [f for f in files if len(f.read_text().splitlines()) > 500] == []
    assert [f for p in sources() for f in long_functions(p, 90)] == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200  # a front page: guides in docs


def test_measurements_live_in_the_benchmarks_readme():
    found = {str(p.relative_to(ROOT)): measurements(p) for p in sources(suffixes=(".py", ".cc"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_test_files_have_unique_names():
    """pytest imports test files by their base name (no
    packages under tests/): two of one name cannot both run."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# Slot arithmetic: writes at a row's slots, slot masks, the slot axis, row placement in a batch.
SLOT_ARITHMETIC = re.compile(
    r"dynamic_update_slice|\bwrite_rows\b|SLOT_AXIS|\.at\[:, *:|arange\((?:cache\.)?slots\)"
    r"|\bCacheView\("
)


def test_only_the_cache_computes_where_rows_live():
    """jaxdd.cache decides where each request's rows are; the models and the decoding loop take
    its views and tables (the kernels in pallas_kernels read what a view hands them)."""
    cache = ROOT / "jaxdd" / "cache"
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources(("jaxdd",))
        if cache not in path.parents
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SLOT_ARITHMETIC.search(line)
    ]
    assert found == []
