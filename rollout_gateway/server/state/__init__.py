"""What the gateway must not lose, beside the recorded turns: the rollouts and their keys,
limits and counters (:mod:`.registry`, :mod:`.limits_v1`), the turns a retry may join
(:mod:`.dedupe`) and the policy version (:mod:`.policy`).

The agents' exit reports are :class:`rollout_gateway.exits.ExitBoard`'s. Today all of it
lives in this process's memory.
"""
