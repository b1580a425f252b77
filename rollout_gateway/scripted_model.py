"""Shortcut module: ``from rollout_gateway.scripted_model import create_scripted_model_app``."""

from __future__ import annotations

from rollout_gateway.scripted import build_completion, create_scripted_model_app

__all__ = ["build_completion", "create_scripted_model_app"]
