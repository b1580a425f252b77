"""CPU per upstream call of the gateway's upstream client and of two general clients, side by side.

The gateway's one upstream call per turn is ``POST /chat/completions``. This benchmark
makes that call through the gateway's client (``httptools``: ``Http1Upstream``) and, for
reference, through aiohttp's and httpx's clients set up as the gateway once used them
(``aiohttp``, ``httpx``: the choice the lean client was measured against), against the
scripted model in its own process, and prints this process's CPU per call for each, with
ratios to aiohttp's. Whole answers by default;
``--stream`` also measures streamed answers (read line by line, as the gateway relays
them). The clients take turns round by round (``--rounds``), so a drift of the shared
machine weighs on each alike::

    python benchmarks/upstream_client.py --calls 2000 --concurrency 1,64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
import uvloop
from gateway_overhead import _first_messages, _free_port, _process

from rollout_gateway.server.engines.upstream_http import HTTPAnswer, split_lines
from rollout_gateway.server.engines.upstream_http1 import Http1Upstream

CLIENTS = ("httptools", "aiohttp", "httpx")
_JSON = {"Content-Type": "application/json"}


class _Reference:
    """A general client making the same calls (aiohttp's or httpx's, pooled and set up as
    the gateway used them before its own client)."""

    def __init__(self, kind: str, base_url: str) -> None:
        self.kind, self.base_url = kind, base_url
        self.session: Any = None

    def _session(self) -> Any:
        if self.session is None:
            if self.kind == "aiohttp":
                connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0)
                self.session = aiohttp.ClientSession(
                    connector=connector, cookie_jar=aiohttp.DummyCookieJar()
                )
            else:
                limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
                self.session = httpx.AsyncClient(timeout=None, limits=limits)
        return self.session

    async def post(self, path: str, content: bytes) -> HTTPAnswer:
        url = self.base_url + path
        if self.kind == "aiohttp":
            async with self._session().post(url, data=content, headers=_JSON) as response:
                return HTTPAnswer(response.status, await response.read())
        answer = await self._session().post(url, content=content, headers=_JSON)
        return HTTPAnswer(answer.status_code, answer.content)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, content: bytes) -> AsyncIterator[Any]:
        url = self.base_url + path
        if self.kind == "aiohttp":
            async with self._session().post(url, data=content, headers=_JSON) as response:
                yield _Lines(response.status, response.content.iter_any())
            return
        request = self._session().build_request("POST", url, content=content, headers=_JSON)
        response = await self._session().send(request, stream=True)
        try:
            yield _Lines(response.status_code, response.aiter_bytes())
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        if self.session is not None:
            await (self.session.close() if self.kind == "aiohttp" else self.session.aclose())


class _Lines:
    def __init__(self, status_code: int, chunks: AsyncIterator[bytes]) -> None:
        self.status_code, self._chunks = status_code, chunks

    def lines(self) -> AsyncIterator[str]:
        return split_lines(self._chunks)


def _client(kind: str, base_url: str) -> Any:
    return Http1Upstream(base_url) if kind == "httptools" else _Reference(kind, base_url)


def _body(context_tokens: int, stream: bool) -> bytes:
    # The first turn of gateway_overhead.py's conversation, padded to the context.
    messages = _first_messages(1, context_tokens)
    body = {"model": "scripted", "messages": messages, "return_token_ids": True, "logprobs": True}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


async def _cpu_per_call(
    kind: str, base_url: str, body: bytes, calls: int, concurrency: int, stream: bool
) -> float:
    client = _client(kind, base_url)

    async def call() -> None:
        if stream:
            async with client.stream("/chat/completions", body) as answer:
                assert answer.status_code == 200
                async for _ in answer.lines():
                    pass
        else:
            answer = await client.post("/chat/completions", body)
            assert answer.status_code == 200, answer.content[:200]

    async def worker(n: int) -> None:
        for _ in range(n):
            await call()

    await worker(3)  # connections open, first-call costs paid
    per_worker = max(1, calls // concurrency)
    start = time.process_time()
    await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
    cpu = time.process_time() - start
    await client.aclose()
    return cpu / (per_worker * concurrency)


@contextlib.contextmanager
def _scripted_model() -> Iterator[str]:
    port = _free_port()
    cli = [sys.executable, "-m", "rollout_gateway.cli", "scripted-model", "--port", str(port)]
    root = f"http://127.0.0.1:{port}"
    with _process([*cli, "--log-level", "warning"], f"{root}/v1/models"):
        yield f"{root}/v1"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per client per round")
    parser.add_argument("--concurrency", type=_ints, default=[1, 64], help="calls in flight")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (clients take turns)")
    parser.add_argument("--context", type=int, default=1000, help="context tokens (bytes)")
    parser.add_argument("--stream", action="store_true", help="also measure streamed answers")
    args = parser.parse_args()
    modes = [False, True] if args.stream else [False]
    with _scripted_model() as base_url:
        print(f"{'answer':8s} {'conc':>5s} " + " ".join(f"{k:>10s}" for k in CLIENTS)
              + "   (CPU us per call, median of rounds)")  # fmt: skip
        for stream in modes:
            body = _body(args.context, stream)
            for concurrency in args.concurrency:
                samples: dict[str, list[float]] = {k: [] for k in CLIENTS}
                for _ in range(args.rounds):
                    for kind in CLIENTS:
                        cpu = uvloop.run(
                            _cpu_per_call(kind, base_url, body, args.calls, concurrency, stream)
                        )
                        samples[kind].append(cpu * 1e6)
                medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
                row = " ".join(f"{medians[k]:10.1f}" for k in CLIENTS)
                ratios = ", ".join(
                    f"{k}/aiohttp {medians[k] / medians['aiohttp']:.2f}x"
                    for k in CLIENTS
                    if k != "aiohttp"
                )
                label = "streamed" if stream else "whole"
                print(f"{label:8s} {concurrency:5d} {row}   {ratios}")


if __name__ == "__main__":
    main()
