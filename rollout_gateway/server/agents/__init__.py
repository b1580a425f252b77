"""The agent API: an agent's turn, from its route to its answer, in the agent's dialect.

The turn routes (:mod:`.endpoint`, one per dialect and route kind) read the request
(:mod:`.request`) and hand it to the turn (:mod:`.chat`): retries matched, the rollout's
budgets checked (:mod:`.limits`), the engine called (:mod:`rollout_gateway.server.engines`),
and the answer sent whole, streamed, or re-encoded as server-sent events (:mod:`.sse`);
what a Messages or Responses turn does beside a chat turn is :mod:`.dialect_turns`, and
Anthropic's ``count_tokens`` side route :mod:`.count_tokens`.
"""
