"""Where a server process's instructions go, by layer, from a callgrind profile.

A callgrind profile names C functions only; every Python function runs inside the
interpreter's one eval loop. Python 3.12 and later, run with ``-X perf``, enter each
Python function through a trampoline of its own and write the trampolines' addresses and
the functions' names to ``/tmp/perf-PID.map``: callgrind then sees one function per
Python function (named by its address, resolved here from that map). Profiled with
``--separate-callers=K`` (:data:`SEPARATE_CALLERS`), each function's cost is recorded
per chain of its ``K`` nearest callers, so every instruction is attributed to the
innermost Python function that caused it: the eval loop running that function's
bytecode, and every C function it called (orjson's parse, a hash, a copy).

Layers (:data:`PYTHON_LAYERS`, by the Python function's file; :data:`C_LAYERS`, by the
C library, wherever it is called from):

* ``HTTP``: the server (uvicorn, its httptools protocol, Starlette, the gateway's
  dispatch and connection handling; aiohttp's server in the proxy);
* ``intake``: the request bodies' admission and budgets (``server/http/intake.py``);
* ``JSON``: orjson, wherever it is called, and ``jsonio``;
* ``recording``: ``server/recording`` (not the digests), reading the engine's answer
  (``answers.py``, ``streaming.py``);
* ``digests``: xxhash and ``recording/digests.py``;
* ``store``: ``server/state`` (and sqlite3, redis-py, hiredis);
* ``upstream client``: ``server/engines/upstream*.py`` (aiohttp's client in the proxy);
* ``turn``: the rest of the gateway's own code (the chat route, the turn, limits,
  metrics);
* ``event loop``: asyncio and uvloop (what no Python function called: scheduling,
  polling, reading sockets into bytes);
* ``collector``: the garbage collector (it runs in whichever function allocated past
  the threshold);
* ``interpreter``, ``other``: what has no Python function within ``K`` callers
  (start-up, deep C) or none of the above (the standard library, logging).

Used by ``benchmarks/instructions.py --profile DIR``, which profiles the same sets its
counts come from and prints each cell's marginal layer shares (set ``j`` minus set 0, per
turn). Alone, on one profile or on the difference of two::

    python benchmarks/callgrind_layers.py PROFILE [--minus PROFILE0 --turns N]

On Python 3.11 (no trampolines) only the C layers are told apart; the Python code is
``interpreter``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

#: Callers per recorded context (callgrind's ``--separate-callers``): enough to reach
#: the calling Python function from most C code (orjson's parse: 3-5 frames below it).
SEPARATE_CALLERS = 6

#: Python files -> layer, the first matching substring of the file's path wins.
PYTHON_LAYERS = (
    ("rollout_gateway/server/recording/digests.py", "digests"),
    ("rollout_gateway/server/recording/", "recording"),
    ("rollout_gateway/server/engines/answers.py", "recording"),
    ("rollout_gateway/server/engines/streaming.py", "recording"),
    ("rollout_gateway/server/http/jsonio.py", "JSON"),
    ("rollout_gateway/server/http/intake.py", "intake"),
    ("rollout_gateway/server/http/budget.py", "intake"),
    ("rollout_gateway/server/state/", "store"),
    ("rollout_gateway/server/engines/upstream_http", "upstream client"),
    ("rollout_gateway/server/engines/upstream.py", "upstream client"),
    ("rollout_gateway/server/http/", "HTTP"),
    ("rollout_gateway/server/agents/endpoint.py", "HTTP"),
    ("rollout_gateway/server/agents/request.py", "HTTP"),
    ("rollout_gateway/server/agents/sse.py", "HTTP"),
    ("rollout_gateway/server/runner.py", "HTTP"),
    ("rollout_gateway/", "turn"),
    ("/uvicorn/", "HTTP"),
    ("/starlette/", "HTTP"),
    ("/httptools/", "HTTP"),
    ("/aiohttp/client", "upstream client"),
    ("/aiohttp/connector", "upstream client"),
    ("/aiohttp/", "HTTP"),
    ("/multidict/", "HTTP"),
    ("/yarl/", "HTTP"),
    ("/redis/", "store"),
    ("/sqlite3/", "store"),
    ("/orjson/", "JSON"),
    ("/asyncio/", "event loop"),
    ("/uvloop/", "event loop"),
)
#: C functions (a prefix of the name) and libraries (a substring of the object's path)
#: whose cost is their layer's wherever they are called from.
C_LAYERS = (
    ("orjson", "JSON"),
    ("xxhash", "digests"),
    ("XXH", "digests"),
    ("sqlite", "store"),
    ("hiredis", "store"),
)
C_FUNCTIONS = {"loads": "JSON", "dumps": "JSON", "gc_collect_main": "collector"}
#: Objects whose cost is the event loop's when no Python function called it (socket
#: reads and writes, polling, callbacks).
LOOP_OBJECTS = ("uvloop", "libuv", "_asyncio")

_TRAMPOLINE = re.compile(r"0x[0-9a-f]{16}$")


def perf_map(pid: int, directory: Path = Path("/tmp")) -> dict[str, str]:
    """The trampolines of process ``pid``: callgrind's name for each (its address) ->
    the Python function's ``qualname:file``."""
    out: dict[str, str] = {}
    path = directory / f"perf-{pid}.map"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        address, _, name = line.split(" ", 2)
        if name.startswith("py::"):
            out[f"0x{int(address, 16):016x}"] = name[4:]
    return out


def python_layer(function: str) -> str | None:
    """The layer of a Python function (``qualname:file``), if its file has one."""
    for fragment, layer in PYTHON_LAYERS:
        if fragment in function:
            return layer
    return None


def _c_layer(name: str, obj: str = "") -> str | None:
    if name in C_FUNCTIONS:
        return C_FUNCTIONS[name]
    for fragment, layer in C_LAYERS:
        if name.startswith(fragment) or fragment in obj:
            return layer
    return None


def layer_of(
    context: str, obj: str, trampolines: dict[str, str], objects: dict[str, str] | None = None
) -> str:
    """The layer of one recorded context (``function'caller'caller...``) of object ``obj``
    (``objects``: each function's object, for the callers')."""
    objects = objects or {}
    chain = context.split("'")
    if "gc_collect_main" in chain:
        return "collector"  # runs wherever an allocation crossed the threshold
    layer = _c_layer(chain[0], obj)
    if layer is not None:
        return layer
    first_python = None
    for name in chain[1:]:
        python = trampolines.get(name) if _TRAMPOLINE.match(name) else None
        if python is None:
            caller_obj = objects.get(name, "")
            if first_python is None and (layer := _c_layer(name, caller_obj)) is not None:
                return layer  # C code inside orjson, xxhash...: theirs
            if first_python is None and any(f in caller_obj for f in LOOP_OBJECTS):
                return "event loop"  # below uvloop's C (its socket reads) with no Python
            continue
        layer = python_layer(python)
        if layer is not None:
            return layer
        first_python = first_python or python
    if first_python is not None:
        return "other"
    if any(fragment in obj for fragment in LOOP_OBJECTS):
        return "event loop"
    return "interpreter"


def self_costs(path: Path) -> tuple[Counter[tuple[str, str]], int]:
    """Each context's own instructions (``(context, object) -> Ir``) and the pid. (A
    function's object is also each of its contexts' first name's: :func:`objects_of`.)"""
    names: dict[str, str] = {}
    objects: dict[str, str] = {}
    costs: Counter[tuple[str, str]] = Counter()
    pid = 0
    current = ("", "")
    obj = ""
    after_call = False

    def named(table: dict[str, str], value: str) -> str:
        # Name compression: "(id) name" defines id, "(id)" refers to it.
        if not value.startswith("("):
            return value
        close = value.index(")")
        key, name = value[1:close], value[close + 2 :]
        if name:
            table[key] = name
            return name
        return table[key]

    with path.open() as f:
        for line in f:
            head = line[:3]
            if line[0].isdigit() or line[0] in "+-*":
                if after_call:
                    after_call = False  # a call's inclusive cost: not this function's own
                    continue
                parts = line.split()
                if len(parts) > 1:
                    costs[current] += int(parts[1])
            elif head == "fn=":
                current = (named(names, line[3:].rstrip("\n")), obj)
            elif head == "ob=":
                obj = named(objects, line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                named(names, line[4:].rstrip("\n"))
            elif line.startswith("cob="):
                named(objects, line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                after_call = True
            elif line.startswith("pid:"):
                pid = int(line.split()[1])
    return costs, pid


def objects_of(costs: Counter[tuple[str, str]]) -> dict[str, str]:
    """Each function's object (callgrind names a function without symbols by its
    address in its object: the same name in two objects is left out)."""
    seen: dict[str, str] = {}
    for context, obj in costs:
        name = context.split("'", 1)[0]
        if seen.setdefault(name, obj) != obj:
            seen[name] = ""
    return seen


def layers(path: Path) -> Counter[str]:
    """A profile's instructions by layer."""
    costs, pid = self_costs(path)
    trampolines, objects = perf_map(pid), objects_of(costs)
    out: Counter[str] = Counter()
    for (context, obj), ir in costs.items():
        out[layer_of(context, obj, trampolines, objects)] += ir
    return out


def marginal(profile: Path, baseline: Path, turns: int) -> dict[str, float]:
    """Per turn, by layer: ``(profile - baseline) / turns`` (the same processes' run with
    ``turns`` more turns, against the shorter one)."""
    more, less = layers(profile), layers(baseline)
    return {name: (more[name] - less[name]) / turns for name in set(more) | set(less)}


def print_shares(figures: dict[str, float], title: str) -> None:
    """One layer per line: instructions and share, largest first."""
    total = sum(figures.values())
    print(f"{title}: {total / 1e6:.3f} M instructions")
    for name, value in sorted(figures.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<16}{value / 1e6:10.3f} M {value / total * 100:7.1f}%")


def main() -> None:
    """Print a profile's layer shares (or the marginal ones of two)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="a callgrind output file")
    parser.add_argument("--minus", type=Path, metavar="PROFILE0",
                        help="the same processes' shorter run: print the difference")  # fmt: skip
    parser.add_argument("--turns", type=int, default=1, help="divide the difference by this")
    args = parser.parse_args()
    if args.minus is not None:
        figures = marginal(args.profile, args.minus, args.turns)
        print_shares(figures, f"per turn ({args.profile.name} - {args.minus.name})")
    else:
        print_shares(dict(layers(args.profile)), str(args.profile))


if __name__ == "__main__":
    main()
