"""Instructions per turn of the Redis store's two scripts, each side counted alone.

Two gateways' stores in one process take turns of one rollout (the claim, behind: the
other gateway recorded the last turn, then the commit that ends it), as round robin has
them. Counted by valgrind's cachegrind, ``--turns`` and three times as many: the
difference over ``2 * --turns`` is a turn's, start-up cancelled. No HTTP, no model, no
other process competing: what ``instructions.py``'s redis-3 cells spread over four
processes (their sums differ by 10-20% run to run), in figures that repeat.

- **client**: the Python process (the store's encoding, the two commands, the replies'
  decoding and the catching up), on a ``redis-server`` run natively;
- **redis**: ``redis-server`` (append-only file, ``everysec``) under valgrind, the client
  native; each run's server lives the same time, so its cron weighs alike.

``--source DIR`` counts another checkout's store (``PYTHONPATH``), e.g. the base of a
change::

    python benchmarks/redis_turn_instructions.py
    python benchmarks/redis_turn_instructions.py --source <checkout of main>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support
from support.local_cluster import RedisServer, free_port  # noqa: E402

#: A lone server's lifetime from its start to its stop, whatever the number of turns.
REDIS_LIFETIME_S = 25.0
_VALGRIND = ["valgrind", "-q", "--tool=cachegrind", "--cache-sim=no", "--branch-sim=no"]


async def turns(url: str, count: int) -> None:
    """``count`` turns of one rollout, two gateways' stores taking them in turn."""
    from array import array

    from rollout_gateway.server.recording.steps import RecordedStep
    from rollout_gateway.server.recording.token_branches import StepIds
    from rollout_gateway.server.state.backends import coordinator_for
    from rollout_gateway.server.state.coordinator import HeldCopy
    from rollout_gateway.server.state.redis_backend.store import RedisStore
    from rollout_gateway.server.state.store import AnswerKey, RolloutRow, TurnAnswer, TurnCommit

    stores = [RedisStore(url, prefix="bench:", lease_s=30) for _ in range(2)]
    coordinators = [coordinator_for(store) for store in stores]
    for store in stores:
        await store.open()
    registration = {"rollout_id": "r1", "model": "m", "sampling_params": {}, "max_turns": None,
                    "max_seq_len": None, "upstream": "http://u/v1", "key_digest": "kd",
                    "trajectory_id": "t", "token_caps": None}  # fmt: skip
    await stores[0].create_rollout(RolloutRow(registration, {"num_turns": 0}, revision=0, steps=0))
    held = [HeldCopy(-1, 0), HeldCopy(-1, 0)]
    for index in range(count):
        side, owner = index % 2, f"gw{index % 2}"
        await coordinators[side].claim("r1", owner, 30.0, held[side])
        ids = StepIds(array("i", range(10 + index)), 0, 8 + index, 10 + index,
                      array("f", [-0.5, -0.25]), False, False)  # fmt: skip
        step = RecordedStep(0, [{"role": "user", "content": f"u{index}"}],
                            [{"role": "assistant", "content": "a"}], ids, False, {})  # fmt: skip
        answer = TurnAnswer(AnswerKey(b"\x01" * 16, None, time.time(), index), b'{"id":"x"}')
        commit = TurnCommit(index, step, {"num_turns": index + 1}, answer)
        commit.releases, commit.delivered = owner, True
        held[side] = HeldCopy(await stores[side].commit_turn("r1", commit), index + 1)
    for store in stores:
        await store.close()


def _summary(out: Path) -> int:
    for line in out.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{out}: no summary")


def client_count(source: str, url: str, count: int, out: Path) -> int:
    """The client process's instructions for ``count`` turns."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": source}
    cmd = [*_VALGRIND, f"--cachegrind-out-file={out}", sys.executable, __file__,
           "--drive", url, str(count)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True)
    return _summary(out)


def redis_count(source: str, count: int, directory: Path) -> int:
    """``redis-server``'s instructions while a native client runs ``count`` turns."""
    out, port = directory / f"redis-{count}.out", free_port()
    data = directory / f"data-{count}"
    data.mkdir()
    real = shutil.which("redis-server") or "redis-server"
    server = subprocess.Popen(
        [*_VALGRIND, f"--cachegrind-out-file={out}", real, "--port", str(port), "--bind",
         "127.0.0.1", "--dir", str(data), "--save", "", "--appendonly", "yes",
         "--appendfsync", "everysec", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        started = time.monotonic()
        env = {**os.environ, "PYTHONPATH": source}
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(600):  # under valgrind it takes seconds to listen
            ping = [sys.executable, __file__, "--ping", url]
            if subprocess.run(ping, env=env, stderr=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.2)
        subprocess.run([sys.executable, __file__, "--drive", url, str(count)], env=env, check=True)
        time.sleep(max(0.0, REDIS_LIFETIME_S - (time.monotonic() - started)))
    finally:
        server.terminate()
        server.wait(120)
    return _summary(out)


def main() -> None:
    """Print each side's instructions per turn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--drive", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--ping", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        asyncio.run(turns(args.drive[0], int(args.drive[1])))
        return
    if args.ping:
        import redis

        redis.Redis.from_url(args.ping, socket_connect_timeout=1).ping()
        return
    source, low, high = os.path.abspath(args.source), args.turns, 3 * args.turns
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        with RedisServer(directory / "native") as server:
            counts = [client_count(source, f"{server.url[:-1]}{db}", n, directory / f"c{n}.out")
                      for db, n in ((1, low), (2, high))]  # fmt: skip
        client = (counts[1] - counts[0]) / (high - low)
        redis_side = redis_count(source, high, directory) - redis_count(source, low, directory)
    redis_side /= high - low
    print(f"{source}: {low} vs {high} turns; millions of instructions per turn: "
          f"client {client / 1e6:.3f}, redis-server {redis_side / 1e6:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
