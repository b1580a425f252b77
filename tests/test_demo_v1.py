"""The demo on verifiers v1: its run directory is a v1 run directory that v1's own tools
take (``vf-replay``, ``vf-eval --resume``), its traces keep the gateway's logprobs to the
last bit, the default ``--examples`` gives that many tasks, and a timeout stops agents."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import verifiers.v1 as vf
from verifiers.v1.graph import RECORD_FLOAT_DECIMALS
from verifiers.v1.task import WireTaskData
from verifiers.v1.trace import Trace
from verifiers.v1.utils.trace_store import read_episodes

from rollout_gateway import child_processes
from rollout_gateway.demo import DemoOptions, run_demo
from rollout_gateway.examples.fix_bug_v1 import TASKSET_ID, FixBugTaskset
from rollout_gateway.protocol import expand_delta_steps
from rollout_gateway.scripted import create_scripted_model_app
from rollout_gateway.server import GatewayConfig, create_app
from rollout_gateway.server.runner import server_thread
from rollout_gateway.v1.demo import V1Stack

BIN = Path(sys.executable).parent


class TrajectorySpy(httpx.AsyncBaseTransport):
    """A real transport keeping every trajectory the gateway answered (expanded)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.trajectories: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/trajectory") and response.status_code == 200:
            body = await response.aread()
            answer = json.loads(body)
            if answer.get("format") == "delta":
                answer["trajectory"] = expand_delta_steps(answer["trajectory"])
            self.trajectories.append(answer)
            return httpx.Response(response.status_code, headers=response.headers, content=body)
        return response


def demo(tmp_path: Path, stack: V1Stack | None = None, **kw: Any) -> tuple[int, str]:
    out = io.StringIO()
    options = DemoOptions(output=tmp_path / "run", **kw)
    return run_demo(options, out, io.StringIO(), stack=stack), out.getvalue()


def episodes(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    """A demo run with the defaults but one rollout per task, at temperature 0, and the
    trajectories the gateway answered the env."""
    stack = V1Stack()
    spy = stack.gateway_transport = TrajectorySpy()
    base = tmp_path_factory.mktemp("v1-demo")
    code, printed = demo(base, stack, rollouts_per_example=1, temperature=0.0, max_tokens=300)
    assert code == 0, printed
    return base / "run", spy.trajectories, printed


def test_default_examples_give_as_many_tasks_and_traces_keep_the_gateways_logprobs(
    finished_run: tuple[Path, list[dict], str],
) -> None:
    run, trajectories, printed = finished_run
    rows = episodes(run)
    # --examples 3 (the default): three tasks, the classic example's first three.
    names = sorted(e["task"]["data"]["name"] for e in rows)
    assert names == ["calc-add", "stats-mean", "text-palindrome"]
    assert "running 3 rollouts (3 tasks x 1)" in printed
    assert [e["traces"][0]["info"]["demo_rollout_index"] for e in rows] == [0, 0, 0]
    # The tokens column counts what the trace counts: fed in once + generated.
    for row in rows:
        (trace,) = row["traces"]
        shown = f"{trace['num_input_tokens']}+{trace['num_output_tokens']}"
        assert shown in printed and trace["num_input_tokens"] > 0

    # Full precision: every per-token logprob in traces.jsonl is the gateway's, exactly.
    by_first_prompt = {
        json.dumps(t["trajectory"][0]["prompt"][-1]["content"]): t for t in trajectories
    }
    rounded_away = compared = 0
    for row in rows:
        (trace,) = row["traces"]
        recorded = by_first_prompt[json.dumps(trace["nodes"][1]["message"]["content"])]
        gateway = [x for s in recorded["trajectory"] for x in s["tokens"]["completion_logprobs"]]
        nodes = trace["nodes"]
        # One root-to-leaf path (one training sample): each node extends the previous one.
        assert [n.get("parent") for n in nodes] == [None, *range(len(nodes) - 1)]
        on_disk = [x for n in nodes if n["sampled"] for x in n["logprobs"]]
        assert on_disk == gateway  # to the last bit
        assert sum(sum(n["mask"]) for n in nodes) == len(gateway)
        rounded_away += sum(round(x, RECORD_FLOAT_DECIMALS) != x for x in gateway)
        compared += len(gateway)
        # Each agent ran contained: the local_sandbox runtime, in the mode preflight chose
        # (recorded in info.local_sandbox; the typed slots say subprocess, v1's word).
        runtime = trace["info"]["local_sandbox"]
        assert runtime["type"] == "local_sandbox"
        assert runtime["isolation"] == json.loads((run / "metadata.json").read_text())["isolation"]
        assert runtime["isolation"] != "process-group"
        assert trace["agent"]["runtime"]["type"] == "subprocess"
        # What the agent used and how long the model took, per v1's own fields.
        assert [tool["name"] for tool in trace["tools"]] == ["run_shell"]
        assert trace["timing"]["agent"]["model"]["duration"] > 0
        assert {c["sampling"]["max_tokens"] for c in trace["calls"]} == {300}
    # What v1's own writer (4 decimals) would have changed.
    assert compared > 100 and rounded_away > compared // 2


def test_v1s_own_readers_take_the_demos_traces(
    finished_run: tuple[Path, list[dict], str], tmp_path: Path
) -> None:
    from verifiers.v1.cli.eval import resume
    from verifiers.v1.configs.agent import WireAgentConfig
    from verifiers.v1.state import State

    run, _, _ = finished_run
    # docs/demo.md's command, as written: it re-scores what needs no runtime (nothing of
    # the example's: its reward runs the test in the gone sandbox) into outputs/.
    replayed = subprocess.run(
        [str(BIN / "vf-replay"), str(run), "--no-rich"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    said = replayed.stdout + replayed.stderr
    assert replayed.returncode == 0, said[-3000:]
    assert "skipped runtime-dependent signals: ['tests_pass']" in said
    (out,) = (tmp_path / "outputs" / f"{TASKSET_ID}--replay").iterdir()
    rescored = episodes(out)
    assert len(rescored) == 3 and all(e["traces"][0].get("rewards", {}) == {} for e in rescored)
    assert all(e["traces"][0]["rewards"] for e in episodes(run))  # the run's own: untouched
    # Without --no-rich, verifiers 0.4.0's replay refuses the saved config (docs/demo.md).
    plain = subprocess.run(
        [str(BIN / "vf-replay"), str(run)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert plain.returncode == 1 and "Input should be a valid boolean" in " ".join(
        (plain.stdout + plain.stderr).split()
    )
    loaded = read_episodes(run, Trace[WireTaskData, State, WireAgentConfig])
    assert len(loaded) == 3
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    tasks = list(FixBugTaskset(vf.TasksetConfig(id=TASKSET_ID)))[:3]
    plan = resume.load(copy, tasks, 1)
    assert [(len(kept), owed) for _, kept, owed in plan] == [(1, 0)] * 3  # all kept
    rows = sorted((copy / "traces.jsonl").read_bytes().splitlines())
    assert rows == sorted((run / "traces.jsonl").read_bytes().splitlines())  # none dropped


@pytest.fixture
def upstream_gone_run(tmp_path: Path) -> Path:
    """A demo run whose upstream went away after preflight: every rollout failed."""
    run = tmp_path / "run"
    env = {**os.environ, "ROLLOUT_GATEWAY_LOCAL_SANDBOX_ROOT": str(tmp_path / "sb")}
    with server_thread(create_scripted_model_app()) as root:
        command = [sys.executable, "-m", "rollout_gateway.cli", "demo", "--output", str(run)]
        command += ["--examples", "2", "--rollouts-per-example", "1"]
        command += ["--upstream", f"{root}/v1", "--model", "scripted"]
        proc = child_processes.spawn(  # dead with this process, even by kill -9
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("results "):
                break
    printed, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, printed
    assert not any(e["ok"] for e in episodes(run))
    return run


def test_vf_eval_resume_continues_a_demo_run(upstream_gone_run: Path, tmp_path: Path) -> None:
    run = upstream_gone_run
    config = json.loads((run / "configs" / "resolved" / "eval.json").read_text())
    gateway_url = config["client"]["base_url"].removesuffix("/v1")
    assert config["env"]["interception"]["url"] == gateway_url
    port = int(gateway_url.rsplit(":", 1)[1])
    token = "resume-admin-token-0123456789"
    with server_thread(create_scripted_model_app()) as model_root:
        app = create_app(GatewayConfig(upstreams=[f"{model_root}/v1"], admin_token=token))
        with server_thread(app, port=port):  # a gateway where the saved config says
            done = subprocess.run(
                [str(BIN / "vf-eval"), "@", str(run / "configs/resolved/eval.json"), "--resume"],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                env={**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": token, "NO_COLOR": "1"},
            )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = episodes(run)
    assert len(rows) == 2 and all(e["ok"] for e in rows)  # the failed ones ran again
    assert (run / "logs" / "attempt_2").is_dir()  # vf-eval's own attempt next to the demo's


def _children() -> set[int]:
    """Live child processes of this test process (Linux /proc), but for the sandbox
    client's warden (it lives as long as the client, which this process keeps)."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        warden = b"rollout_gateway.local_sandbox.warden" in cmdline
        if int(fields[1]) == me and fields[0] != "Z" and not warden:
            found.add(int(stat.parent.name))
    return found


def test_a_timeout_stops_the_agents_and_keeps_the_run_resumable(tmp_path: Path) -> None:
    before = _children()
    # Each of the task's 4 turns takes 6 s: the 10 s timeout falls mid-run however fast the
    # machine (at 2 s a turn, an idle machine finished the run in 9.8 s).
    with server_thread(create_scripted_model_app(latency_ms=6000)) as root:
        code, printed = demo(
            tmp_path, upstream=f"{root}/v1", model="scripted", examples=1, timeout=10.0
        )
    assert code == 3, printed
    assert _children() <= before  # no agent left running
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    assert meta["status"] == "timed_out" and meta["stopped_by"] == "timeout"


def test_a_re_read_run_numbers_rollouts_as_the_live_table(tmp_path: Path) -> None:
    """Each episode carries the rollout index it ran as, so the table of a re-read run
    (resume, nothing to run) has the live table's rows whatever the finish order."""
    from rollout_gateway.v1.demo import ROLLOUT_INDEX_KEY, number_rollouts

    def episode(task: int, index: int | None, reward: float) -> dict[str, Any]:
        info = {} if index is None else {ROLLOUT_INDEX_KEY: index}
        trace = {
            "task": {"data": {"idx": task, "name": f"t{task}"}},
            "rewards": {"tests_pass": {"score": reward}},
            "info": info,
        }
        return {"ok": True, "traces": [trace]}

    finished = [episode(0, 2, 0.0), episode(0, 0, 1.0), episode(1, None, 1.0), episode(0, 1, 1.0)]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(e) + "\n" for e in finished))
    rows = {(s.example_id, s.rollout_index): s.reward for s in V1Stack().stored(tmp_path)}
    assert rows == {(0, 0): 1.0, (0, 1): 1.0, (0, 2): 0.0, (1, 0): 1.0}
    # Older episodes without an index, and new rollouts, take the lowest free indexes.
    assert number_rollouts([2, None, 0, 2], 2) == ([2, 1, 0, 3], [4, 5])
    assert number_rollouts([], 3) == ([], [0, 1, 2])
