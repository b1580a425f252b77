"""Every block README.md and docs/ tell a reader to run, run as written.

The convention marking blocks runnable or illustrative is in ``snippets.py`` and
``docs/contributing-docs.md``; how a block is run is in ``runner.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from runner import run_session
from snippets import (
    ROOT,
    RUNNABLE_LANGUAGES,
    Session,
    SnippetMarkerError,
    all_sessions,
    blocks,
    pages,
    parse_marker,
)
from stacks import STACK

#: The stack name run markers use for this run (``core``: no verifiers installed).
RUN_STACK = "core" if STACK == "none" else STACK


def test_every_runnable_language_block_is_marked_run_or_illustrative() -> None:
    problems = []
    for page in pages():
        for block in blocks(page):
            if block.language not in RUNNABLE_LANGUAGES and block.marker is None:
                continue
            try:
                parse_marker(block)
            except SnippetMarkerError as e:
                problems.append(str(e))
    assert not problems, "\n".join(problems)


def test_an_unmarked_block_is_refused_with_the_convention(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Run this:\n\n```bash\necho hi\n```\n")
    (block,) = blocks(page)
    with pytest.raises(SnippetMarkerError, match="needs a marker"):
        parse_marker(block)


def test_a_marked_block_in_a_list_item_is_found_with_its_indent_removed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "- item:\n\n  <!-- snippet: run stack=v1 session=s ports=8000 -->\n"
        "  ```python\n  print(1)\n  ```\n"
    )
    (block,) = blocks(page)
    assert block.code == "print(1)\n"
    options = parse_marker(block)
    assert options is not None
    assert (options.stack, options.session, options.ports) == ("v1", "s", (8000,))


_SESSIONS = all_sessions()


def _same_as_earlier(session: Session) -> Session | None:
    """An earlier session (in page order) running the very same blocks on this stack: a
    command shown on two pages (the README and getting-started) runs once."""
    mine = [(b.language, b.code) for b in session.blocks_for(RUN_STACK)]
    for other in _SESSIONS:
        if other is session:
            return None
        if [(b.language, b.code) for b in other.blocks_for(RUN_STACK)] == mine:
            return other
    return None


@pytest.mark.slow
@pytest.mark.parametrize("session", _SESSIONS, ids=[s.id for s in _SESSIONS])
def test_doc_session_runs(session: Session, tmp_path: Path) -> None:
    to_run = session.blocks_for(RUN_STACK)
    if not to_run:
        pytest.skip(f"no block of this session runs on the {RUN_STACK} stack")
    if (earlier := _same_as_earlier(session)) is not None:
        pytest.skip(f"the same blocks run as {earlier.id}")
    result = run_session(session, to_run, tmp_path)
    where = ", ".join(b.where for b in to_run)
    if result.returncode is None:
        pytest.fail(f"{where}: timed out after {session.timeout_s:.0f} s\n{result.output}")
    assert result.returncode == 0, f"{where}: exit status {result.returncode}\n{result.output}"
    assert "### doc session done" in result.output
    for block in to_run:
        expect = session.options_of(block).expect
        if expect is not None:
            printed = result.output_of(block)
            assert re.search(expect, printed, re.MULTILINE), (
                f"{block.where}: no match for {expect!r}\n{printed}"
            )


def test_readme_links_resolve_in_the_checkout() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing


def test_readme_is_a_short_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
