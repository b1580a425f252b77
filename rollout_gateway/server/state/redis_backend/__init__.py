"""The Redis backend of the state seam: several gateways on one Redis
(:class:`~.store.RedisStore`, ``serve --redis URL``; see ``docs/state.md``).

Needs the ``redis`` extra (redis-py, hiredis): import :mod:`.store` only where Redis is
used.
"""
