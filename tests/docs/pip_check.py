"""``pip`` as doc blocks see it in the suite: ``pip install X`` checks that X is installed.

Each requirement (``'rollout-gateway[v1]'``, ``openai``) and each project path
(``-e '.[classic]'``, ``-e ./examples/fix_bug_v1``) must be installed in this
virtualenv, with every requirement of the extras it names, at a version the project
pins. Exit status 1 with one line per problem otherwise. Other pip commands are refused:
a doc block runs ``pip install`` only.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_PATH_SPEC = re.compile(r"^(?P<path>[./~][^\[]*)(\[(?P<extras>[^\]]*)\])?$")
#: pip options that take a value (skipped with it).
_VALUED = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url"}


def _installed(requirement: Requirement) -> str | None:
    """Why ``requirement`` is not satisfied here, or None."""
    if requirement.marker is not None and not requirement.marker.evaluate():
        return None
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return f"{requirement.name} is not installed"
    if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
        return f"{requirement.name} {version} is installed, not {requirement.specifier}"
    return None


def _extras_requirements(name: str, extras: set[str]) -> list[Requirement]:
    """The requirements an installed distribution declares for ``extras``."""
    found = []
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None:
            continue
        for extra in extras:
            if marker.evaluate({"extra": extra}):
                requirement.marker = None
                found.append(requirement)
                break
    return found


def _check_requirement(requirement: Requirement) -> list[str]:
    problem = _installed(requirement)
    if problem:
        return [problem]
    declared = {
        canonicalize_name(e)
        for e in metadata.metadata(requirement.name).get_all("Provides-Extra") or []
    }
    problems = [
        f"{requirement.name} has no extra {extra!r}"
        for extra in requirement.extras
        if canonicalize_name(extra) not in declared
    ]
    for needed in _extras_requirements(requirement.name, set(requirement.extras)):
        if problem := _installed(needed):
            problems.append(f"{requirement.name}[{','.join(requirement.extras)}]: {problem}")
    return problems


def _check_path(spec: str) -> list[str]:
    match = _PATH_SPEC.match(spec)
    if not match:
        return [f"cannot read {spec!r} as a project path"]
    project = Path(match["path"]).expanduser() / "pyproject.toml"
    if not project.is_file():
        return [f"{match['path']} has no pyproject.toml"]
    name = tomllib.loads(project.read_text())["project"]["name"]
    extras = f"[{match['extras']}]" if match["extras"] else ""
    return _check_requirement(Requirement(f"{name}{extras}"))


def check(args: list[str]) -> list[str]:
    """The problems of ``pip <args>``, as this virtualenv stands."""
    if not args or args[0] != "install":
        return [f"pip {' '.join(args)}: doc blocks may only run pip install"]
    problems: list[str] = []
    words = iter(args[1:])
    for word in words:
        if word in _VALUED:
            next(words, None)
            continue
        if word in ("-e", "--editable"):
            word = next(words, "")
            problems += _check_path(word)
        elif word.startswith("-"):
            continue
        elif _PATH_SPEC.match(word):
            problems += _check_path(word)
        else:
            problems += _check_requirement(Requirement(word))
    return problems


def main() -> int:
    problems = check(sys.argv[1:])
    for problem in problems:
        print(f"pip (doc test, checks instead of installing): {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
