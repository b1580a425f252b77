"""The fakes on a core install (no extra): importable, and usable without the sandbox
extra until a prime-sandboxes type is asked for."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from core_only import core_only_python

USE_THE_FAKES = textwrap.dedent(
    """
    import asyncio, importlib.util
    from types import SimpleNamespace
    from rollout_gateway.client import GatewayClient
    from rollout_gateway.testing import FakeGateway, FakeSandboxClient, FakeTunnelProvider

    assert importlib.util.find_spec("prime_sandboxes") is None

    async def main():
        gateway, sandboxes = FakeGateway(), FakeSandboxClient()
        async with GatewayClient("http://fake", transport=gateway.transport()) as client:
            await client.register("r1", model="m")
            gateway.add_turn("r1", [{"role": "user", "content": "x"}], [])
            assert (await client.get_trajectory("r1"))["num_turns"] == 1
        request = SimpleNamespace(name="r1", environment_vars={})
        sandbox = await sandboxes.create(request)
        await (await FakeTunnelProvider().open("http://fake", "127.0.0.1", 1)).stop()
        try:
            await sandboxes.start_background_job(sandbox.id, "agent")
        except ModuleNotFoundError as exc:
            print("needs", exc.name)

    asyncio.run(main())
    """
)


def test_the_fakes_import_their_extra_only_when_used(tmp_path: Path) -> None:
    python = core_only_python(tmp_path)
    done = subprocess.run(
        [str(python), "-c", USE_THE_FAKES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "needs prime_sandboxes"
