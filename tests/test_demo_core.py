"""The demo's runner core, the same on both stacks, driven through a fake stack adapter.

The core starts the real scripted model and gateway; :class:`FakeStack` stands in for the
verifiers stack (its rollouts are scripted), so these tests pin down what the core owns:
metadata from ``running`` to a final status, ``--resume`` (settings, failures, a finished
run), preflight leaving nothing behind, signals and ``--timeout`` during setup, a closed
output pipe, exit codes. Both stacks' real adapters run end to end in
``test_demo.py``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rollout_gateway.demo import DemoError, DemoOptions, run_demo
from rollout_gateway.demo.progress import ProgressView, Screen, Tally, print_summary
from rollout_gateway.demo.resume import resumed_options
from rollout_gateway.demo.run_dir import RunDir
from rollout_gateway.demo.stack import DemoStack, RolloutSummary, StackSetup, WorkItem
from rollout_gateway.demo.threads import off_loop


class FakeStack(DemoStack):
    """A stack whose rollouts are scripted: ``fail`` lists the (example, rollout) keys
    that fail; each stored rollout is one line of ``fake.jsonl``."""

    name = "fake"
    env_id = "fake-env"

    def __init__(
        self,
        *,
        fail: frozenset[tuple[int, int]] = frozenset(),
        isolation: str = "bwrap",
        on_prepare: Any = None,
        rollout_seconds: float = 0.0,
        slow: dict[tuple[int, int], float] | None = None,
    ) -> None:
        self.fail = fail
        self.isolation = isolation
        self.on_prepare = on_prepare
        self.rollout_seconds = rollout_seconds
        self.slow = slow or {}
        self.setup: StackSetup | None = None
        self.started = False
        self.ran: list[tuple[int, int]] = []
        self.verifiers_version = "0.0"

    def stored(self, run_dir: Path) -> list[RolloutSummary]:
        path = run_dir / "fake.jsonl"
        if not path.exists():
            return []
        return [RolloutSummary(**json.loads(line)) for line in path.read_text().splitlines()]

    def resolve_isolation(self, requested: str) -> str:
        if self.isolation == "unavailable":
            raise DemoError(f"isolation {requested} is unavailable: no namespaces here")
        return self.isolation

    async def prepare(self) -> None:
        if self.on_prepare is not None:
            await self.on_prepare()

    async def start(self, setup: StackSetup, stack: contextlib.AsyncExitStack) -> list[WorkItem]:
        self.setup, self.started = setup, True
        path = setup.run_dir / "fake.jsonl"
        kept = [s for s in self.stored(setup.run_dir) if setup.keep_failed or not s.failed]
        path.write_text("".join(json.dumps(s.__dict__) + "\n" for s in kept))
        done = {(s.example_id, s.rollout_index) for s in kept}
        opts = setup.options
        return [
            WorkItem(e, i)
            for e in range(opts.examples)
            for i in range(opts.rollouts_per_example)
            if (e, i) not in done
        ]

    async def run(self, item: WorkItem, limit: asyncio.Semaphore) -> RolloutSummary:
        key = (item.example_id, item.rollout_index)
        async with limit:
            await asyncio.sleep(self.slow.get(key, self.rollout_seconds))
        self.ran.append(key)
        failed = key in self.fail
        summary = RolloutSummary(
            example_id=item.example_id,
            rollout_index=item.rollout_index,
            task=f"task-{item.example_id}",
            reward=0.0 if failed else 1.0,
            turns=2,
            error="SandboxError: it broke" if failed else None,
        )
        assert self.setup is not None
        with (self.setup.run_dir / "fake.jsonl").open("a") as f:
            f.write(json.dumps(summary.__dict__) + "\n")
        return summary

    def metadata(self) -> dict[str, Any]:
        return {"fake_key": 1, "status": "the demo's own keys win"}


def options(tmp_path: Path, **kw: Any) -> DemoOptions:
    values: dict[str, Any] = {
        "examples": 2,
        "rollouts_per_example": 2,
        "output": tmp_path / "run",
        "timeout": 60.0,
    }
    values.update(kw)
    return DemoOptions(**values)


def run(opts: DemoOptions, stack: DemoStack) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_demo(opts, out, err, stack=stack)
    return code, out.getvalue(), err.getvalue()


def metadata(path: Path) -> dict[str, Any]:
    return json.loads((path / "metadata.json").read_text())


def test_a_run_records_its_metadata_from_start_to_a_final_status(tmp_path: Path) -> None:
    stack = FakeStack()
    code, out, err = run(options(tmp_path), stack)
    assert code == 0, out + err
    meta = metadata(tmp_path / "run")
    assert meta["status"] == "completed" and meta["stack"] == "fake"
    assert meta["counts"] == {"total": 4, "done": 4, "failed": 0, "pending": 0, "mean_reward": 1.0}
    assert meta["fake_key"] == 1  # the stack's keys are merged in...
    assert meta["env_id"] == "fake-env" and meta["isolation"] == "bwrap"
    assert meta["options"]["examples"] == 2 and meta["duration_s"] > 0
    assert "pid" not in meta and "resumes" not in meta
    # The setup the stack got: a running gateway, its token, the scripted model.
    assert stack.setup is not None and stack.setup.model == "scripted"
    assert stack.setup.gateway_url.startswith("http://127.0.0.1:")
    assert "status         completed" in out and "rollout gateway http://127.0.0.1:" in out
    assert "resume with" not in out and err == ""


def test_failed_rollouts_exit_1_and_resume_runs_them_again_keeping_the_start(
    tmp_path: Path,
) -> None:
    opts = options(tmp_path, temperature=0.3, max_tokens=99, concurrency=3)
    code, out, _ = run(opts, FakeStack(fail=frozenset({(0, 1), (1, 0)})))
    assert code == 1
    first = metadata(tmp_path / "run")
    assert first["counts"]["failed"] == 2 and first["status"] == "completed"
    assert f"resume with    rollout-gateway demo --resume {tmp_path / 'run'}" in out

    time.sleep(1.1)  # started_at has one-second resolution
    again = FakeStack()
    resumed = DemoOptions(resume=tmp_path / "run")  # nothing else given: all reused
    code, out, _ = run(resumed, again)
    assert code == 0, out
    assert sorted(again.ran) == [(0, 1), (1, 0)]  # only the failed ones ran again
    assert "resuming: 2 finished, 2 to run" in out
    assert "running 2 of 4 rollouts (2 tasks x 2), 3 at once" in out
    assert again.setup is not None
    reused = again.setup.options
    assert (reused.examples, reused.rollouts_per_example) == (2, 2)
    assert (reused.temperature, reused.max_tokens, reused.concurrency) == (0.3, 99, 3)
    assert reused.isolation == "bwrap"  # the mode the run ran under, not "auto"
    meta = metadata(tmp_path / "run")
    assert meta["status"] == "completed" and meta["counts"]["failed"] == 0
    assert meta["started_at"] == first["started_at"]  # the original start is kept
    (entry,) = meta["resumes"]
    assert entry["to_run"] == 2 and entry["keep_failed"] is False
    assert entry["started_at"] != first["started_at"]
    assert meta["duration_s"] > first["duration_s"]


def test_keep_failed_keeps_them_and_a_finished_run_is_not_run_again(tmp_path: Path) -> None:
    run(options(tmp_path), FakeStack(fail=frozenset({(1, 1)})))
    before = (tmp_path / "run" / "metadata.json").read_text()
    again = FakeStack()
    code, out, _ = run(DemoOptions(resume=tmp_path / "run", keep_failed=True), again)
    assert code == 1  # the kept failure still counts
    assert not again.started and again.ran == []  # nothing served, nothing run
    assert "nothing to resume" in out and "1 failed, kept with --keep-failed" in out
    assert "rollout gateway" not in out
    assert (tmp_path / "run" / "metadata.json").read_text() == before  # left as it was


def test_resume_refuses_a_typed_setting_that_differs_and_takes_run_settings(
    tmp_path: Path,
) -> None:
    run(options(tmp_path, temperature=0.5), FakeStack(fail=frozenset({(0, 0)})))
    path = tmp_path / "run"
    before = sorted(p.name for p in path.iterdir())
    typed = DemoOptions(
        resume=path,
        examples=1,
        temperature=0.9,
        explicit=frozenset({"resume", "examples", "temperature"}),
    )
    code, out, err = run(typed, FakeStack())
    assert code == 2
    assert err.count("\n") == 1  # one line
    assert "--examples 2 (typed: 1)" in err and "--temperature 0.5 (typed: 0.9)" in err
    assert sorted(p.name for p in path.iterdir()) == before

    # The same values typed again are fine; --concurrency and --timeout may change.
    same = DemoOptions(
        resume=path,
        examples=2,
        concurrency=1,
        timeout=30.0,
        explicit=frozenset({"resume", "examples", "concurrency", "timeout"}),
    )
    stack = FakeStack()
    code, out, err = run(same, stack)
    assert code == 0, out + err
    assert stack.setup is not None and stack.setup.options.concurrency == 1
    assert stack.setup.options.temperature == 0.5
    (entry,) = metadata(path)["resumes"]
    assert entry["changed"] == {"concurrency": 1, "timeout": 30.0}


def test_resume_refuses_a_run_of_another_stack() -> None:
    meta = {"stack": "classic", "options": {"examples": 1}}
    with pytest.raises(DemoError, match="a run of the classic stack"):
        resumed_options(DemoOptions(resume=Path("r")), meta, "v1")


@pytest.mark.parametrize("case", ["taken", "under-a-file", "isolation", "dead-upstream"])
def test_a_failed_preflight_leaves_nothing_behind(tmp_path: Path, case: str) -> None:
    target = tmp_path / "run"
    kw: dict[str, Any] = {}
    stack = FakeStack()
    if case == "taken":
        target.mkdir()
        (target / "results.jsonl").write_text("{}\n")
    elif case == "under-a-file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "run"
    elif case == "isolation":
        stack = FakeStack(isolation="unavailable")
    else:
        kw = {"upstream": "http://127.0.0.1:9/v1", "model": "m"}
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    started = time.monotonic()
    code, out, err = run(options(tmp_path, output=target, **kw), stack)
    assert code == 2
    assert time.monotonic() - started < 30  # a dead upstream is refused, not retried
    assert len(err.strip().splitlines()) == 1 and err.startswith("rollout-gateway demo: error:")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert not stack.started


def test_a_signal_during_setup_stops_the_run_at_once(tmp_path: Path) -> None:
    signalled: list[float] = []

    async def slow_import() -> None:
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the stack is being imported
        await off_loop(time.sleep, 30)  # a blocking import: the loop stays free

    stack = FakeStack(on_prepare=slow_import)
    code, out, _ = run(options(tmp_path), stack)
    stopped_after = time.monotonic() - signalled[0]
    assert code == 130
    assert stopped_after < 5, stopped_after  # the target is 1 s; generous for loaded CI
    assert not stack.started and stack.ran == []
    meta = metadata(tmp_path / "run")
    assert meta["status"] == "interrupted" and meta["stopped_by"] == "SIGINT"
    assert meta["counts"]["done"] == 0
    assert "stopping (SIGINT received); setup abandoned" in out
    assert f"resume with    rollout-gateway demo --resume {tmp_path / 'run'}" in out


def test_the_timeout_covers_setup(tmp_path: Path) -> None:
    async def never() -> None:
        await asyncio.sleep(3600)

    code, out, _ = run(options(tmp_path, timeout=0.5), FakeStack(on_prepare=never))
    assert code == 3
    assert "timed_out (--timeout 0.5 s reached)" in out
    assert metadata(tmp_path / "run")["status"] == "timed_out"


def test_the_timeout_keeps_finished_rollouts(tmp_path: Path) -> None:
    stack = FakeStack(slow={(1, 1): 3600.0})
    code, out, _ = run(options(tmp_path, timeout=8.0, concurrency=4), stack)
    assert code == 3
    meta = metadata(tmp_path / "run")
    assert meta["status"] == "timed_out" and meta["counts"]["done"] == 3
    assert len(stack.stored(tmp_path / "run")) == 3


class SignalledWhileFinishing(FakeStack):
    """Its teardown (after every rollout ended) receives a SIGINT."""

    async def start(self, setup: StackSetup, stack: contextlib.AsyncExitStack) -> list[WorkItem]:
        async def ctrl_c() -> None:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.2)  # the handler runs while the teardown goes on

        stack.push_async_callback(ctrl_c)
        return await super().start(setup, stack)


def test_a_signal_after_every_rollout_ended_does_not_change_the_outcome(tmp_path: Path) -> None:
    code, out, _ = run(options(tmp_path), SignalledWhileFinishing())
    meta = metadata(tmp_path / "run")
    # The exit status says what the summary and metadata say: completed, all clean.
    assert (code, meta["status"], meta["counts"]["done"]) == (0, "completed", 4)
    assert "stopped_by" not in meta
    assert "SIGINT received while finishing; every rollout had ended" in out
    assert "status         completed" in out


class ClosedAfter(io.StringIO):
    """An output whose reader goes away after ``lines`` lines (``demo | head``)."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= text.count("\n")
        return super().write(text)


def test_a_closed_output_ends_the_run_with_a_final_status(tmp_path: Path) -> None:
    stack = FakeStack(rollout_seconds=3600)
    out, err = ClosedAfter(lines=2), io.StringIO()
    code = run_demo(options(tmp_path), out, err, stack=stack)
    assert code == 128 + signal.SIGPIPE
    meta = metadata(tmp_path / "run")
    assert meta["status"] == "interrupted" and meta["stopped_by"] == "SIGPIPE"
    assert "pid" not in meta


def test_no_containment_is_a_visible_warning(tmp_path: Path) -> None:
    code, _, err = run(options(tmp_path), FakeStack(isolation="process-group"))
    assert code == 0
    assert "WITHOUT containment" in err


def test_one_run_directory_one_demo(tmp_path: Path) -> None:
    held = RunDir.create(tmp_path / "run")
    try:
        with pytest.raises(DemoError, match="another demo is running"):
            RunDir.open(tmp_path / "run")
    finally:
        held.unlock()
    RunDir.open(tmp_path / "run").unlock()


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere() -> None:
    ok = RolloutSummary(0, 0, "calc-add", reward=1.0, turns=4)
    failed = replace(ok, rollout_index=1, reward=0.0, error="E: x")
    screen = io.StringIO()
    tally = Tally(total=2)
    with ProgressView(Screen(screen), tally, terminal=True) as view:
        for summary in (ok, failed):
            tally.add(summary)
            view.finished(summary, verbose=False)
    shown = screen.getvalue()
    assert "2/2" in shown and "failed 1" in shown and "mean reward 0.500" in shown

    log = io.StringIO()
    tally = Tally(total=2)
    with ProgressView(Screen(log), tally, terminal=False) as view:
        for summary in (ok, failed):
            tally.add(summary)
            view.finished(summary, verbose=False)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in log.getvalue()
    assert lines[1].startswith("[2/2]") and "failed=1" in lines[1] and "error=E: x" in lines[1]

    long_error = replace(failed, error="SandboxError: " + "y" * 300)
    table = io.StringIO()
    print_summary(Screen(table), [long_error], [("status", "done")])
    assert table.getvalue().count("y") == 300  # wrapped, never cut off


# -- the interface and its adapters (issue 32 point 5) ---------------------------------------


def test_the_demo_package_imports_no_stack() -> None:
    """``demo/`` is the interface and the runner: it names each stack's adapter and
    imports none (an adapter imports the interface, never the reverse: no circle)."""
    import ast

    import rollout_gateway.demo

    package = Path(rollout_gateway.demo.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                stack = name.startswith(("rollout_gateway.classic", "rollout_gateway.v1"))
                assert not (stack or name.split(".")[0] == "verifiers"), (path.name, name)


def test_each_adapter_lives_beside_its_stack_and_is_resolved_by_name() -> None:
    from stacks import STACK

    from rollout_gateway.demo.adapters import ADAPTERS, stack_class

    assert ADAPTERS == {
        "classic": "rollout_gateway.classic.demo:ClassicStack",
        "v1": "rollout_gateway.v1.demo:V1Stack",
    }
    if STACK in ADAPTERS:
        adapter = stack_class(STACK)
        assert issubclass(adapter, DemoStack) and adapter.name == STACK
    with pytest.raises(ValueError, match="unknown stack 'v2'"):
        stack_class("v2")
