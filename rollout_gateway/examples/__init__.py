"""Example environments shipped with rollout-gateway (used by the demo; never by the library)."""
