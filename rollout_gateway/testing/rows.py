"""Input rows for env tests: :func:`task_row`."""

from __future__ import annotations

from typing import Any


def task_row(example_id: int) -> dict[str, Any]:
    """One rollout input row in verifiers' format (for datasets and ``env.rollout``).

    ``info`` carries ``task_id``, not ``task``: verifiers reserves ``info["task"]``.
    """
    return {
        "prompt": [{"role": "user", "content": f"Fix bug #{example_id}"}],
        "answer": "fixed",
        "info": {"task_id": example_id},
        "example_id": example_id,
    }


__all__ = ["task_row"]
