"""Engines and the upstream clients that reach them: one turn's call and its answer.

The turn's engine call and step (:mod:`.turn`) sends the request built by
:mod:`.upstream_request` to an upstream of the pool (:mod:`.upstream`, over the HTTP
clients of :mod:`.upstream_http` and :mod:`.upstream_http1`), streamed
(:mod:`.streaming`) or whole, or renders it itself in token-in mode (:mod:`.token_in`);
it reads the answer (:mod:`.answers`) as the engine behind the upstream writes it
(:mod:`.probe`).
"""
