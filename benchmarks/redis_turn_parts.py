"""The pieces of a turn on Redis, each measured alone in one process (no other process
competing for the cores): what ``scaleout.py``'s figures are made of where a machine of
few cores cannot separate them.

1. **The client's CPU per command**: a 3 kB ``SET`` issued one at a time straight
   through redis-py's asyncio client (hiredis parsing), then through
   ``RedisConnection.cmd`` (the store's code path) one at a time and ``--batch`` at once
   (the commands of concurrent turns, sent in one pipeline by
   ``redis_backend/batches.py``). Needs ``redis-server`` (started on a free port).
2. **Catching up**: a copy ``--behind`` steps behind (another gateway recorded them)
   decodes and replays them (``codec.decode_step``, ``TrajectoryRecorder.replay``), then
   checks and records the next turn: with the last step's check state (what the Redis
   store reads along) and without it (what a copy did before), beside the recording
   gateway's own next turn. A conversation of ``--turns`` turns, at each context size.

CPU is the thread's (``time.thread_time``), median over ``--repeat`` tries::

    python benchmarks/redis_turn_parts.py
    python benchmarks/redis_turn_parts.py --contexts 1000,32000 --behind 3 --batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from rollout_gateway.server.recording.recorder import TrajectoryRecorder
from rollout_gateway.server.state import codec

# -- 1. the client -------------------------------------------------------------------------


async def client_cpu_us(url: str, commands: int, batch: int) -> tuple[float, float, float]:
    """CPU per command (µs) issuing ``commands`` SETs one at a time straight through
    redis-py (no batching), one at a time through the store's connection, and ``batch``
    at once through it."""
    from rollout_gateway.server.state.redis_backend.connection import RedisConnection

    connection = RedisConnection(url, timeout_s=5.0)
    value = b"v" * 3000
    try:
        await connection.cmd("PING")
        start = time.thread_time()
        for i in range(commands):
            await connection.client.execute_command("SET", f"bench:{i % 64}", value)
        plain = (time.thread_time() - start) / commands * 1e6
        start = time.thread_time()
        for i in range(commands):
            await connection.cmd("SET", f"bench:{i % 64}", value)
        alone = (time.thread_time() - start) / commands * 1e6
        start = time.thread_time()
        for i in range(0, commands, batch):
            await asyncio.gather(
                *(connection.cmd("SET", f"bench:{(i + j) % 64}", value) for j in range(batch))
            )
        together = (time.thread_time() - start) / commands * 1e6
        return plain, alone, together
    finally:
        await connection.aclose()


def measure_client(commands: int, batch: int) -> None:
    """Start a ``redis-server`` and print the client's CPU per command."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
    from support.local_cluster import RedisServer

    if shutil.which("redis-server") is None:
        print("client: skipped (no redis-server on PATH)")
        return
    with tempfile.TemporaryDirectory(prefix="rg-turn-parts-") as tmp:
        with RedisServer(Path(tmp)) as server:
            # The gateway's event loop (uvloop) where installed, as ``serve`` runs it.
            run: Any = asyncio.run
            with contextlib.suppress(ImportError):
                import uvloop

                run = uvloop.run
            plain, alone, together = run(client_cpu_us(server.url, commands, batch))
    print(
        f"client CPU per command (3 kB SET): redis-py's execute_command one at a time "
        f"{plain:.1f} us; the store's connection one at a time {alone:.1f} us, {batch} at a "
        f"time (one pipeline) {together:.1f} us"
    )


# -- 2. catching up ------------------------------------------------------------------------


def conversation(
    turns: int, context: int
) -> tuple[TrajectoryRecorder, tuple[list[Any], bytes, bytes]]:
    """A tool-calling conversation of ``turns`` turns growing to about ``context`` tokens,
    recorded as the chat path records it; and the next request (messages, their text,
    the engine's prompt-id text)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s" * 400},
        {"role": "user", "content": "task " * 50},
    ]
    ids = list(range(1000, 1000 + context // 4))
    recorder = TrajectoryRecorder("t", None)

    def ids_text(values: list[int]) -> bytes:
        return ("[" + ", ".join(map(str, values)) + "]").encode()  # as vLLM writes it

    for turn in range(turns):
        history = recorder.match_history(messages, orjson.dumps(messages))
        call = {"id": f"c{turn}", "type": "function",
                "function": {"name": "run", "arguments": f'{{"cmd": "ls {turn}"}}'}}  # fmt: skip
        answer = {"role": "assistant", "content": None, "tool_calls": [call]}
        completion = list(range(5000 + turn * 40, 5040 + turn * 40))
        recorder.record(
            messages, [answer], prompt_ids_json=ids_text(ids), completion_ids=completion,
            completion_logprobs=[-0.1] * 40, history=history,
        )  # fmt: skip
        messages = [
            *messages,
            {**answer, "refusal": None},  # echoed back as SDKs do
            {"role": "tool", "tool_call_id": f"c{turn}", "content": "x" * 200},
        ]
        ids = [*ids, *completion, *range(9000, 9000 + max(1, context // turns - 40))]
    return recorder, (messages, orjson.dumps(messages), ids_text(ids))


def next_turn_us(recorder: TrajectoryRecorder, request: tuple[list[Any], bytes, bytes]) -> float:
    messages, text, ids_text = request
    start = time.thread_time_ns()
    history = recorder.match_history(messages, text)
    recorder.record(
        messages, [{"role": "assistant", "content": "done"}], prompt_ids_json=ids_text,
        completion_ids=[1], completion_logprobs=[-0.1], history=history,
    )  # fmt: skip
    return (time.thread_time_ns() - start) / 1e3


def measure_catch_up(context: int, turns: int, behind: int, repeat: int) -> None:
    """Print what a copy ``behind`` steps behind costs to catch up and take the next turn."""
    original, request = conversation(turns, context)
    steps = original._steps
    blobs = [codec.encode_step(step) for step in steps]
    held = turns - behind

    def copy_behind(with_check: bool) -> TrajectoryRecorder:
        copy = TrajectoryRecorder("t", None)
        deltas = [codec.decode_step(blob, "step") for blob in blobs[:held]]
        if with_check:
            deltas[-1].check = steps[held - 1].check
        copy.replay(deltas)
        return copy

    for with_check in (False, True):
        replays, checks = [], []
        for _ in range(repeat):
            copy = copy_behind(with_check)
            start = time.thread_time_ns()
            new = [codec.decode_step(blob, "step") for blob in blobs[held:]]
            if with_check:  # what the claim reads along beside the last step
                new[-1].check = steps[-1].check
            copy.replay(new, start=held)
            replays.append((time.thread_time_ns() - start) / 1e3)
            checks.append(next_turn_us(copy, request))
        what = "with the check state" if with_check else "without it (before)"
        print(
            f"{context:>6} tokens, {behind} steps behind, {what:<21}: decode + replay "
            f"{statistics.median(replays):7.1f} us, next turn's check + record "
            f"{statistics.median(checks):7.1f} us"
        )
    own = []
    for _ in range(repeat):
        current = TrajectoryRecorder("t", None)
        current.replay([step.delta() for step in steps])  # every step with its check state
        assert current.check_state == original.check_state  # as recording left it
        own.append(next_turn_us(current, request))
    print(
        f"{context:>6} tokens, the recording gateway's own next turn: check + record "
        f"{statistics.median(own):7.1f} us"
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=_ints, default=[1000, 32000], help="context tokens")
    parser.add_argument("--turns", type=int, default=20, help="turns of the conversation")
    parser.add_argument("--behind", type=int, default=3, help="steps the copy is behind")
    parser.add_argument("--batch", type=int, default=8, help="commands issued at once")
    parser.add_argument("--commands", type=int, default=4000, help="commands per figure")
    parser.add_argument("--repeat", type=int, default=200, help="tries per catch-up figure")
    args = parser.parse_args()
    measure_client(args.commands, args.batch)
    for context in args.contexts:
        measure_catch_up(context, args.turns, args.behind, args.repeat)


if __name__ == "__main__":
    main()
