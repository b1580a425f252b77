"""The files and Python names README.md and docs/ point readers at exist.

A page that says "see ``server/http/dispatch.py``" or "``rollout_gateway.protocol.
expand_delta_steps`` rebuilds..." goes stale when the code moves; mkdocs cannot tell.
"""

from __future__ import annotations

import importlib
import re

import pytest
from snippets import ROOT, pages

from rollout_gateway.verifiers_stack import WrongStackError

_CODE = re.compile(r"`([^`\s]+)`")
_FILE = re.compile(r"^[\w.-]+(/[\w.-]+)+/?$")
_DOTTED = re.compile(r"^rollout_gateway(\.\w+)+$")
#: Where a relative path may start: the checkout, or the package (``server/...``). A path
#: whose first directory is one of theirs names a file of ours (others: a sandbox's
#: ``.state/lock``, a run's ``logs/``...).
_BASES = (ROOT, ROOT / "rollout_gateway")


def _code_spans() -> list[tuple[str, str]]:
    found = []
    for page in pages():
        where = str(page.relative_to(ROOT))
        for line in page.read_text().splitlines():
            if line.startswith(":::"):  # mkdocstrings directive: checked by mkdocs itself
                continue
            found += [(where, span) for span in _CODE.findall(line)]
    return found


def test_named_files_exist() -> None:
    missing = []
    for where, span in _code_spans():
        path = span.rstrip("/")
        if not _FILE.match(span) or "..." in span:
            continue
        first = path.split("/")[0]
        bases = [base for base in _BASES if first not in (".", "..") and (base / first).is_dir()]
        if bases and not any((base / path).exists() for base in bases):
            missing.append(f"{where}: {span}")
    assert not missing, "\n".join(sorted(set(missing)))


def _resolves(name: str) -> bool | None:
    """Whether ``name`` imports (module) or is an attribute of one; None: another stack's."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except WrongStackError:
            return None
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in ("verifiers", "prime_sandboxes", "renderers"):
                return None
            continue
        for attribute in parts[i:]:
            try:
                obj = getattr(obj, attribute)
            except WrongStackError:
                return None
            except AttributeError:
                return False
        return True
    return False


@pytest.mark.slow
def test_named_python_names_exist() -> None:
    names = {span.rstrip(".") for _, span in _code_spans() if _DOTTED.match(span.rstrip("."))}
    assert "rollout_gateway.protocol.expand_delta_steps" in names  # the scan sees them
    missing = sorted(name for name in names if _resolves(name) is False)
    assert not missing, missing
