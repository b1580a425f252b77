"""What the gateway must not lose, and where it keeps it.

The working copy: the rollouts and their keys, limits and counters (:mod:`.registry`,
:mod:`.limits_v1`), the turns a retry may join (:mod:`.dedupe`) and the policy version
(:mod:`.policy`). The store behind it (:mod:`.store`, the seam; :mod:`.stored` keeps the
two in step): :mod:`.memory` (this process only, the default) or :mod:`.sqlite` (one
gateway, durable; :mod:`.codec` is the bytes it keeps), chosen by :mod:`.backends`.
The agents' exit reports are :class:`rollout_gateway.exits.ExitBoard`'s, written through
to the same store.
"""
