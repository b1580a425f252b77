"""The agent API: an agent's chat request, from its route to its answer.

The chat routes (:mod:`.endpoint`) read the request (:mod:`.request`) and hand it to
the turn (:mod:`.chat`): retries matched, the rollout's budgets checked
(:mod:`.limits`), the engine called (:mod:`rollout_gateway.server.engines`), and the
answer sent whole, streamed, or re-encoded as server-sent events (:mod:`.sse`).
"""
