"""What tests and benchmarks share, out of the package they test.

- :mod:`.local_cluster`: scale-out on one machine (redis-server, gateway processes,
  HAProxy) for the several-gateway tests and benchmarks, and free loopback ports;
- :mod:`.servers`: one server process (a gateway, the scripted model) started so that
  it dies with its parent, ready once a URL answers, stopped by its process group;
- :mod:`.shared_memory`: several gateways of this process on one memory store, as
  gateways share Redis (the fast tests of the shared path);
- :mod:`.tools`: the example agent's tool, as conversations sent to real engines use it;
- :mod:`.waiting`: waiting until something holds.

Tests import it as ``support`` (``tests/`` is on their path); a benchmark puts ``tests/``
on its path first (``sys.path.insert(0, str(ROOT / "tests"))``).
"""
