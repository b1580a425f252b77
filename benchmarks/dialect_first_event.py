"""How long after the engine's first chunk the agent gets its first event (issue 31).

A vLLM-shaped engine, the gateway and the agent run on loopback sockets in one process
(one event loop: all three share a core, as on a loaded machine). For each turn the
engine stamps the clock as it sends its first chunk (the role chunk with the prompt's
ids) and then waits; the agent stamps it when the first event of its stream arrives
(chat: the first ``data:`` chunk; Messages: ``message_start``; Responses:
``response.created``) and lets the engine go on. Prints the median and the 90th
percentile of the gap per dialect. ::

    python benchmarks/dialect_first_event.py [--turns 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server.dialects.support import engine_chunks  # noqa: E402

from rollout_gateway.server import GatewayConfig, create_app, running_server  # noqa: E402

ADMIN = "bench-admin-token-0123456789abcdef"
FIRST = {"chat": b"data: {", "anthropic": b"event: message_start", "responses": b"event: response."}


class Engine:
    """Streams a short answer; stamps its first chunk, then waits for the agent."""

    def __init__(self) -> None:
        self.sent_first = 0.0
        self.go = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        head = [(b"content-type", b"application/json")]
        if scope["path"] == "/v1/models":
            card = {"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]}
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": orjson.dumps(card)})
            return
        while (await receive()).get("more_body"):
            pass
        events = [b"data: " + orjson.dumps(c) + b"\n\n" for c in engine_chunks(content=["Hi", "!"])]
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        self.sent_first = time.perf_counter()
        await send({"type": "http.response.body", "body": events[0], "more_body": True})
        with contextlib.suppress(TimeoutError):  # (never stuck: at most a second)
            await asyncio.wait_for(self.go.wait(), 1.0)
        rest = b"".join(events[1:]) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": rest})


def request(dialect: str) -> tuple[str, dict[str, Any]]:
    if dialect == "chat":
        return "/chat/completions", {"model": "m", "stream": True,
                                     "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    if dialect == "anthropic":
        return "/v1/messages", {"model": "m", "max_tokens": 8, "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    return "/responses", {"model": "m", "input": "hi", "stream": True}


async def run(turns: int) -> None:
    engine = Engine()
    async with running_server(engine) as engine_root:
        config = GatewayConfig.from_fields(upstreams=[f"{engine_root}/v1"], admin_token=ADMIN)
        async with (
            running_server(create_app(config)) as root,
            httpx.AsyncClient(base_url=root, timeout=60) as client,
        ):
            for dialect in ("chat", "anthropic", "responses"):
                gaps = []
                for i in range(turns):
                    rollout = f"{dialect}-{i}"
                    r = await client.post(f"/v1/rollouts/{rollout}/register", json={"model": "m"},
                                          headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
                    key = r.json()["api_key"]
                    path, body = request(dialect)
                    auth = {"x-api-key": key, "Authorization": f"Bearer {key}"}
                    engine.go = asyncio.Event()
                    seen = b""
                    url = f"/v1/rollouts/{rollout}{path}"
                    async with client.stream("POST", url, json=body, headers=auth) as answer:
                        async for piece in answer.aiter_raw():
                            seen += piece
                            if not engine.go.is_set() and FIRST[dialect] in seen:
                                gaps.append(time.perf_counter() - engine.sent_first)
                                engine.go.set()
                gaps.sort()
                print(f"{dialect:10s} first event after the engine's first chunk: median "
                      f"{statistics.median(gaps) * 1e3:.2f} ms, p90 "
                      f"{gaps[int(len(gaps) * 0.9)] * 1e3:.2f} ms ({turns} turns)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    asyncio.run(run(parser.parse_args().turns))


if __name__ == "__main__":
    main()
