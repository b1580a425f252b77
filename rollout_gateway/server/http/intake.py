"""Request bodies in: admitted before they are read, costed before they are parsed.

A parsed JSON body can cost far more memory than its bytes: 16 MiB of ``[{}, {}, ...]``
is 5.6 million dicts, about 400 MiB, and orjson builds it in one call that holds the
interpreter lock for a second or more. Bounding bodies by size alone let one agent
with four such bodies take the gateway from 51 MiB to 1.8 GiB, and stall every other
rollout's turns while it parsed. :class:`BodyIntake` bounds what bodies cost, by their
parse cost, not only their size:

* **Admission before reading.** A body's declared size (``Content-Length``; the most a
  body may be, when it is chunked) is held in a gateway-wide budget of body bytes being
  read or waiting to be parsed (:attr:`IntakeLimits.raw_capacity`) before its first byte
  is read; beyond it, the request waits (the server stops reading its socket, so
  unread bodies cost nothing). One rollout's bodies being read hold at most one maximum
  body's bytes together.
* **A cost before parsing.** A body over :attr:`IntakeLimits.big_body_bytes` is scanned
  first (``bytes.count`` in C, about 1 ms per MiB, off the event loop): its parse cost is
  estimated as its size plus :data:`VALUE_COST` bytes for each ``,``, ``[`` and ``{`` in
  it, an upper bound of what orjson builds (measured: 24-72 bytes per value for dicts,
  lists, strings and numbers, 93 per object member). A body whose cost exceeds
  :attr:`IntakeLimits.max_body_cost` is refused with 413 ``request_too_complex``
  before anything is built. Smaller bodies are charged their worst case (every byte a
  value) without a scan.
* **A cost held while the request lives.** A request holds its body's cost until it is
  answered (the parsed body is alive until then); one rollout's requests together hold
  at most :attr:`IntakeLimits.max_body_cost`, so one agent cannot keep more than one
  maximum body alive, however many requests it sends.
* **Big parses bounded and shared fairly.** At most
  :attr:`IntakeLimits.max_concurrent_parses` big bodies are parsed at once, in worker
  threads; the body bytes budget leaves room for them (``body_memory`` bounds bodies being
  read plus parses in progress). The parse holds the interpreter lock throughout (orjson
  releases nothing), so while it runs the event loop serves nobody: a rollout's big
  bodies may take at most :attr:`IntakeLimits.rollout_parse_share` of the time. Its
  reading (the server's part, :class:`~.connections.ReadTimer`: not the kernel's copy),
  scan, parse and the work that grows with it afterwards (:meth:`BodyIntake.offload`)
  are measured; after one took ``t`` seconds, the same rollout's next big body waits
  ``t * (1 / share - 1)`` before it is read. An agent that sends maximum-size bodies
  back to back then slows other rollouts by a bounded share, not by its whole work.

Nothing here knows rollouts: a lease's ``key`` is whatever the caller groups requests by.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.types import Receive

from rollout_gateway.options import POSITIVE_INT, SHARE, option
from rollout_gateway.server.http.body_prefix import BodyPrefix
from rollout_gateway.server.http.budget import ByteBudget
from rollout_gateway.server.http.connections import ReadTimer
from rollout_gateway.server.http.jsonio import (
    OFF_LOOP_PARSE_BYTES,
    ConversationText,
    ParsedBody,
    loads_chat_body,
)
from rollout_gateway.server.http.responses import ApiError, receive_body

T = TypeVar("T")

#: Bytes of memory a parsed value may cost, charged per ``,``, ``[`` and ``{`` of a body
#: (see the module docstring).
VALUE_COST = 96
#: Bytes scanned per ``bytes.count`` call: a worker thread gives the interpreter lock
#: back between calls, so the event loop is never held for a whole 16 MiB scan.
SCAN_CHUNK = 1024 * 1024
#: Forgotten fair-share entries (rollouts whose wait is over) are swept past this many.
_SHARE_ENTRIES_SWEPT_AT = 4096


def body_cost(raw: bytes, stop_above: int | None = None) -> int:
    """The estimated memory of ``raw`` parsed: its size plus :data:`VALUE_COST` per
    ``,``, ``[`` and ``{`` (counted in strings too: an overestimate, never an under).

    Stops counting once the estimate exceeds ``stop_above``.
    """
    total = len(raw)
    for start in range(0, len(raw), SCAN_CHUNK):
        end = start + SCAN_CHUNK
        values = raw.count(b",", start, end) + raw.count(b"[", start, end)
        total += VALUE_COST * (values + raw.count(b"{", start, end))
        if stop_above is not None and total > stop_above:
            break
    return total


def worst_case_cost(nbytes: int) -> int:
    """The most a body of ``nbytes`` may cost parsed (every byte a value)."""
    return nbytes * (1 + VALUE_COST)


#: Largest request body.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: Request bodies over 256 KiB parsed at once, gateway-wide.
DEFAULT_MAX_CONCURRENT_PARSES = 2
#: Largest estimated parse cost (memory) of one request body, and of one rollout's
#: requests alive at once: a 16 MiB body of chat text costs about 140 MiB by the
#: estimate, 16 MiB of ``[{}, ...]`` about 1 GiB.
DEFAULT_MAX_BODY_COST = 256 * 1024 * 1024
#: Request bodies being read or parsed at once, gateway-wide, at their size while read
#: and their estimated cost while parsed.
DEFAULT_BODY_MEMORY = 1024 * 1024 * 1024
#: Share of the gateway's time one rollout's big bodies (over 256 KiB) may take to be
#: read, scanned, parsed and written again (the interpreter serves nobody else while it
#: parses). Low, as the kernel's copy of the bytes is not measured.
DEFAULT_ROLLOUT_PARSE_SHARE = 0.02


@dataclass(frozen=True)
class IntakeLimits:
    """The bounds of :class:`BodyIntake` (see the module docstring), each a ``serve``
    option (:mod:`rollout_gateway.options`). Not checked when built (:meth:`problems`
    says what cannot hold; :class:`~rollout_gateway.server.GatewayConfig` checks both).

    ``big_body_bytes``: bodies larger than this are big: scanned, parsed in a worker
    thread, and shared fairly (no option).
    """

    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, flag="--max-body-bytes", bound=POSITIVE_INT, metavar="N",
        help="largest request body (413 beyond)",
    )  # fmt: skip
    max_body_cost: int = option(
        DEFAULT_MAX_BODY_COST, flag="--max-body-cost", bound=POSITIVE_INT, metavar="BYTES",
        help="largest estimated parse cost of a request body: its size plus 96 bytes per "
        "',' '[' '{' in it (413 request_too_complex beyond, before parsing); one rollout's "
        "requests alive at once hold at most this much together, more wait",
    )  # fmt: skip
    body_memory: int = option(
        DEFAULT_BODY_MEMORY, flag="--body-memory", bound=POSITIVE_INT, metavar="BYTES",
        help="request bodies being read or parsed at once, gateway-wide (at their size, "
        "then at their parse cost); more wait before being read; must hold "
        "--max-concurrent-parses x --max-body-cost + --max-body-bytes",
    )  # fmt: skip
    max_concurrent_parses: int = option(
        DEFAULT_MAX_CONCURRENT_PARSES, flag="--max-concurrent-parses", bound=POSITIVE_INT,
        metavar="N",
        help="request bodies over 256 KiB parsed at once, gateway-wide; more wait their "
        "turn (bounds the memory of many big bodies at once)",
    )  # fmt: skip
    rollout_parse_share: float = option(
        DEFAULT_ROLLOUT_PARSE_SHARE, flag="--rollout-parse-share", bound=SHARE, metavar="F",
        help="share of the gateway's time one rollout's bodies over 256 KiB may take (read, "
        "scanned, parsed, written again): after one took t of CPU, its next one waits "
        "t x (1/F - 1) before it is read; in (0, 1], 1 turns the wait off",
    )  # fmt: skip
    big_body_bytes: int = OFF_LOOP_PARSE_BYTES

    @property
    def raw_capacity(self) -> int:
        """Bytes of bodies being read or waiting to be parsed, gateway-wide: what
        ``body_memory`` leaves beside the parses in progress."""
        return self.body_memory - self.max_concurrent_parses * self.max_body_cost

    def problems(self) -> list[str]:
        """Why these bounds cannot hold together (empty when they can), each naming the
        ``serve`` options involved."""
        out = []
        sizes = {
            "--max-body-bytes": self.max_body_bytes,
            "--max-body-cost": self.max_body_cost,
            "--body-memory": self.body_memory,
            "--max-concurrent-parses": self.max_concurrent_parses,
        }
        out += [f"{name}: must be at least 1, got {v}" for name, v in sizes.items() if v < 1]
        if out:
            return out
        if not 0 < self.rollout_parse_share <= 1:
            out.append(f"--rollout-parse-share: must be in (0, 1], got {self.rollout_parse_share}")
        if self.max_body_cost < self.max_body_bytes:
            out.append(
                f"--max-body-cost ({self.max_body_cost}) is below --max-body-bytes "
                f"({self.max_body_bytes}): a body costs at least its size parsed"
            )
        if self.raw_capacity < self.max_body_bytes:
            need = self.max_concurrent_parses * self.max_body_cost + self.max_body_bytes
            out.append(
                f"--body-memory ({self.body_memory}) cannot hold --max-concurrent-parses "
                f"({self.max_concurrent_parses}) parses of --max-body-cost "
                f"({self.max_body_cost}) plus one body of --max-body-bytes "
                f"({self.max_body_bytes}): it needs at least {need}"
            )
        return out


def _too_complex(cost: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body too complex: its parse would cost about {cost} bytes of memory "
        f"(this gateway takes at most {limit}: fewer JSON values, or a smaller body)",
        "request_too_large",
        code="request_too_complex",
    )


class BodyLease:
    """What one request holds of a :class:`BodyIntake`'s budgets (release it once the
    request is answered: :meth:`release` is idempotent)."""

    __slots__ = (
        "_intake", "key", "raw", "cost", "big", "messages_text", "conversation", "prefix"
    )  # fmt: skip

    def __init__(self, intake: BodyIntake, key: str) -> None:
        self._intake = intake
        #: What the request's bodies are grouped by (its rollout).
        self.key = key
        #: Body bytes held (being read, or read and not parsed yet).
        self.raw = 0
        #: Parse cost held (the parsed body is alive).
        self.cost = 0
        #: Whether its body is big (scanned, parsed off the loop, on the key's share).
        self.big = False
        #: Its body's ``messages`` as JSON, when the parse wrote them (see
        #: :class:`~.jsonio.ParsedBody`).
        self.messages_text: bytes | memoryview | None = None
        #: Its body's conversation list as JSON, when the parse wrote it (a dialect's
        #: parse compares it with the rollout's previous request's).
        self.conversation: ConversationText | None = None
        #: Its body's conversation list in its bytes, when the parse found it (see
        #: :func:`~.body_prefix.loads_extending`).
        self.prefix: BodyPrefix | None = None

    async def hold_raw(self, nbytes: int) -> None:
        """Hold ``nbytes`` more of the body bytes budget (waits for room)."""
        budget = self._intake.raw
        if not budget.try_acquire(self.key, nbytes):
            await budget.acquire(self.key, nbytes)
        self.raw += nbytes

    def shrink_raw(self, nbytes: int) -> None:
        """Hold only ``nbytes`` of body bytes from now (a body shorter than reserved)."""
        if nbytes < self.raw:
            self._intake.raw.release(self.key, self.raw - nbytes)
            self.raw = nbytes

    def drop_raw(self) -> None:
        """The body's bytes are gone (parsed, or refused)."""
        if self.raw:
            self._intake.raw.release(self.key, self.raw)
            self.raw = 0

    async def hold_cost(self, nbytes: int) -> None:
        """Hold ``nbytes`` more of the key's parse-cost budget (waits for room)."""
        budget = self._intake.parsed
        if not budget.try_acquire(self.key, nbytes):
            await budget.acquire(self.key, nbytes)
        self.cost += nbytes

    def release(self) -> None:
        """Give back everything held."""
        intake = self._intake
        if self.raw:
            intake.raw.release(self.key, self.raw)
            self.raw = 0
        cost = self.cost
        if cost:
            self.cost = 0
            intake.parsed.release(self.key, cost)
            if self.big and intake.on_big_release is not None:
                intake.on_big_release(cost)


class BodyIntake:
    """Reads and parses request bodies within :class:`IntakeLimits` (see the module
    docstring).

    Args:
        limits: the bounds (raises ``ValueError`` when they cannot hold together).
        loads: the parse function (strict JSON, depth-checked; a seam for tests); a
            :class:`~.jsonio.ParsedBody` it returns leaves its ``messages_text`` on the
            lease.
        cpu_clock: CPU seconds of the calling thread (run inside worker threads).
        clock: monotonic seconds (when a rollout's next big body may start).
        sleep: awaited to wait for a rollout's share (a seam for tests).
        on_big_release: called with the cost when a request that held a big body's
            cost is answered (e.g. to give memory back to the system).
    """

    def __init__(
        self,
        limits: IntakeLimits,
        *,
        loads: Callable[[bytes], Any] = loads_chat_body,
        cpu_clock: Callable[[], float] = time.thread_time,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = asyncio.sleep,
        on_big_release: Callable[[int], None] | None = None,
    ) -> None:
        problems = limits.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.limits = limits
        self.raw = ByteBudget(limits.raw_capacity, limits.max_body_bytes)
        self.parsed = ByteBudget(None, limits.max_body_cost)
        self.on_big_release = on_big_release
        self._loads = loads
        self._cpu_clock = cpu_clock
        self._clock = clock
        self._sleep = sleep
        self._slots: asyncio.Semaphore | None = None  # made on first use, in the loop
        #: When each key's next big body may start (absent: now).
        self._next_big: dict[str, float] = {}
        #: Seconds big bodies waited for their rollout's share, in all (for metrics).
        self.share_wait_s = 0.0
        #: Bodies refused for their parse cost.
        self.refused_complex = 0

    def lease(self, key: str) -> BodyLease:
        """A new request's (empty) lease, its bodies grouped under ``key``."""
        return BodyLease(self, key)

    async def read(
        self,
        lease: BodyLease,
        receive: Receive,
        content_length: str | None,
        read_timer: ReadTimer | None = None,
    ) -> bytes:
        """The request's body, read once its bytes are admitted (413 beyond
        ``max_body_bytes``, from ``content_length`` before reading).

        A big body (declared, or chunked) first waits for its key's share of time; its
        reading, as ``read_timer`` (the server's) measured it, is charged to the key.
        """
        limits = self.limits
        limit = limits.max_body_bytes
        declared = content_length.strip() if content_length is not None else ""
        if declared.isascii() and declared.isdigit() and len(declared) < 20:
            reserve = int(declared)
            if reserve > limit:
                raise ApiError(413, f"request body exceeds {limit} bytes", "request_too_large")
        else:
            reserve = limit  # chunked: the most it may be, until it is read
        if reserve > limits.big_body_bytes:
            await self._wait_share(lease.key)
        if self.raw.try_acquire(lease.key, reserve):  # every turn: no coroutine when free
            lease.raw = reserve
        else:
            await lease.hold_raw(reserve)
        # The declared size was checked above: only the bytes received are counted there.
        raw = await receive_body(receive, None, limit)
        size = len(raw)
        if size < reserve:
            lease.shrink_raw(size)
        if size > limits.big_body_bytes:
            lease.big = True
            if read_timer is not None:
                self._charge(lease.key, read_timer.seconds)
        return raw

    async def parse(
        self, lease: BodyLease, raw: bytes, loads: Callable[[bytes], Any] | None = None
    ) -> Any:
        """``raw`` parsed (see the module docstring; raises ``JSONDecodeError``,
        ``TooDeepError`` or the 413 :class:`ApiError` ``request_too_complex``), by
        ``loads`` when given (a dialect's: :func:`~.body_prefix.loads_extending`)."""
        parsed = await self._parse(lease, raw, self._loads if loads is None else loads)
        if isinstance(parsed, ParsedBody):
            lease.messages_text = parsed.messages_text
            lease.conversation = parsed.conversation
            lease.prefix = parsed.prefix
            return parsed.value
        return parsed

    async def _parse(self, lease: BodyLease, raw: bytes, loads: Callable[[bytes], Any]) -> Any:
        limits = self.limits
        size = len(raw)
        if size <= limits.big_body_bytes:
            cost = size * (1 + VALUE_COST)  # its worst case (worst_case_cost), no scan
            if self.parsed.try_acquire(lease.key, cost):
                lease.cost += cost
            else:
                await lease.hold_cost(cost)
            return loads(raw)
        lease.big = True
        spent = [0.0]
        try:
            cost = await asyncio.to_thread(self._timed, spent, body_cost, raw, limits.max_body_cost)
            if cost > limits.max_body_cost:
                self.refused_complex += 1
                raise _too_complex(cost, limits.max_body_cost)
            await lease.hold_cost(cost)
            if self._slots is None:
                self._slots = asyncio.Semaphore(limits.max_concurrent_parses)
            async with self._slots:
                return await asyncio.to_thread(self._timed, spent, loads, raw)
        finally:
            self._charge(lease.key, spent[0])

    async def offload(self, lease: BodyLease, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: work on a parsed body that grows with it (writing it again).
        For a big body, in a worker thread, its CPU charged to the key's share like its
        parse; else here, at once."""
        if not lease.big:
            return fn(*args)
        spent = [0.0]
        try:
            return await asyncio.to_thread(self._timed, spent, fn, *args)
        finally:
            self._charge(lease.key, spent[0])

    def _timed(self, spent: list[float], fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread, its CPU time added to ``spent``."""
        start = self._cpu_clock()
        try:
            return fn(*args)
        finally:
            spent[0] += self._cpu_clock() - start

    async def _wait_share(self, key: str) -> None:
        at = self._next_big.get(key)
        if at is None:
            return
        delay = at - self._clock()
        if delay > 0:
            self.share_wait_s += delay
            await self._sleep(delay)
        if self._next_big.get(key) == at:
            del self._next_big[key]

    def _charge(self, key: str, cpu_s: float) -> None:
        """``key``'s big body took ``cpu_s``: its next one waits its share."""
        share = self.limits.rollout_parse_share
        if share >= 1 or cpu_s <= 0:
            return
        now = self._clock()
        start = max(now, self._next_big.get(key, now))
        self._next_big[key] = start + cpu_s * (1 / share - 1)
        if len(self._next_big) > _SHARE_ENTRIES_SWEPT_AT:
            self._next_big = {k: at for k, at in self._next_big.items() if at > now}


__all__ = [
    "SCAN_CHUNK",
    "VALUE_COST",
    "BodyIntake",
    "BodyLease",
    "DEFAULT_BODY_MEMORY",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_BODY_COST",
    "DEFAULT_MAX_CONCURRENT_PARSES",
    "DEFAULT_ROLLOUT_PARSE_SHARE",
    "IntakeLimits",
    "body_cost",
    "worst_case_cost",
]
