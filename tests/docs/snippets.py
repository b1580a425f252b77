"""The code blocks of README.md and docs/, and how the suite runs the runnable ones.

The convention (also in ``docs/contributing-docs.md``): every fenced block in one of
:data:`RUNNABLE_LANGUAGES` carries a marker, an HTML comment on the line before its fence:

* ``<!-- snippet: run [stack=any|classic|v1|core] [session=NAME] [ports=P,Q] [timeout=S]
  [expect=REGEX] -->``
* ``<!-- snippet: illustrative (why it is not run) -->``

Run blocks of one page with the same ``session`` run in order in one ``bash`` process
(sharing variables, working directory and background jobs); a block without a session
runs alone. A small collector of our own rather than pytest-examples or phmdoctest: those
run Python blocks (and compare printed output), while most of our blocks are shell
sessions with background servers, ports and per-stack installs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Fence languages whose blocks need a marker.
RUNNABLE_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "python"})
#: Stacks a run block may name (tests/stacks.py; ``core``: no verifiers installed).
STACKS = frozenset({"any", "classic", "v1", "core"})
#: Seconds a run block may take unless it says otherwise.
DEFAULT_TIMEOUT_S = 120.0

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")


class SnippetMarkerError(ValueError):
    """A marker that does not follow the convention (the message says where and why)."""


@dataclass
class Block:
    """One fenced code block of a page."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # the marker's text after "snippet:", or None

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


@dataclass
class RunOptions:
    """The options of a ``run`` marker."""

    stack: str = "any"
    session: str | None = None
    ports: tuple[int, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: A regular expression the block's output must match (for commands whose exit
    #: status does not say whether they did their job, such as vf-eval's).
    expect: str | None = None


@dataclass
class Session:
    """Run blocks of one page executed in one shell, in order."""

    page: Path
    name: str
    blocks: list[tuple[Block, RunOptions]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}::{self.name}"

    @property
    def ports(self) -> tuple[int, ...]:
        """The ports any of its blocks declares (they apply to every block)."""
        return tuple(sorted({p for _, options in self.blocks for p in options.ports}))

    @property
    def timeout_s(self) -> float:
        return sum(options.timeout_s for _, options in self.blocks)

    def blocks_for(self, stack: str) -> list[Block]:
        """The blocks this stack runs."""
        return [b for b, o in self.blocks if o.stack in ("any", stack)]

    def options_of(self, block: Block) -> RunOptions:
        return next(o for b, o in self.blocks if b is block)


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, each with the marker just before it."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        marker = None
        if i > 0 and (m := _MARKER.match(lines[i - 1])):
            marker = m["body"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["lang"]:
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        found.append(Block(path, i + 1, opening["lang"].lower(), "\n".join(body) + "\n", marker))
        i = j + 1
    return found


def parse_marker(block: Block) -> RunOptions | None:
    """A run block's options, ``None`` for an illustrative one.

    Raises :class:`SnippetMarkerError` for a runnable-language block without a marker,
    and for a marker that does not parse.
    """
    if block.marker is None:
        raise SnippetMarkerError(
            f"{block.where}: a {block.language} block needs a marker on the line before "
            "its fence: <!-- snippet: run ... --> or <!-- snippet: illustrative (why) --> "
            "(docs/contributing-docs.md)"
        )
    kind, _, rest = block.marker.partition(" ")
    if kind == "illustrative":
        if not re.fullmatch(r"\(.+\)", rest.strip()):
            raise SnippetMarkerError(f"{block.where}: say why in parentheses: illustrative (why)")
        return None
    if kind != "run":
        raise SnippetMarkerError(f"{block.where}: unknown snippet kind {kind!r}")
    if block.language not in RUNNABLE_LANGUAGES:
        raise SnippetMarkerError(f"{block.where}: a {block.language or 'plain'} block cannot run")
    options = RunOptions()
    for word in shlex.split(rest):
        key, eq, value = word.partition("=")
        if not eq or not value:
            raise SnippetMarkerError(f"{block.where}: expected key=value, got {word!r}")
        if key == "stack" and value in STACKS:
            options.stack = value
        elif key == "session" and re.fullmatch(r"[\w-]+", value):
            options.session = value
        elif key == "ports" and re.fullmatch(r"\d+(,\d+)*", value):
            options.ports = tuple(int(p) for p in value.split(","))
        elif key == "timeout" and re.fullmatch(r"\d+(\.\d+)?", value):
            options.timeout_s = float(value)
        elif key == "expect":
            try:
                re.compile(value)
            except re.error as e:
                raise SnippetMarkerError(f"{block.where}: expect= is not a regex: {e}") from None
            options.expect = value
        else:
            raise SnippetMarkerError(f"{block.where}: bad option {word!r}")
    return options


def sessions(path: Path) -> list[Session]:
    """The run blocks of a page grouped into sessions, in page order."""
    by_name: dict[str, Session] = {}
    for block in blocks(path):
        if block.language not in RUNNABLE_LANGUAGES and block.marker is None:
            continue
        options = parse_marker(block)
        if options is None:
            continue
        name = options.session or f"line-{block.line}"
        by_name.setdefault(name, Session(path, name)).blocks.append((block, options))
    return list(by_name.values())


def all_sessions() -> list[Session]:
    return [s for page in pages() for s in sessions(page)]
