"""What ``rollout_gateway`` shows as its public API."""

from __future__ import annotations

import rollout_gateway


def test_all_lists_every_lazy_export_once() -> None:
    # __all__ is a literal (read by tools without running the module, e.g. the API
    # reference's generator); it must stay in step with the lazy exports.
    assert sorted(rollout_gateway.__all__) == sorted(["__version__", *rollout_gateway._EXPORTS])
    assert len(set(rollout_gateway.__all__)) == len(rollout_gateway.__all__)
