"""Reading an agent's JSON request field by field: checks that name the field at fault.

The dialect parsers translate what they read in the same pass (one pass over the
conversation, as the chat path's own check makes); these helpers only check a value's
type where the translation needs it, and raise :class:`~.errors.RequestError` (400)
naming the field (``messages[2].content[0].text``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollout_gateway.server.dialects.base import MAX_FIELD_NAME_CHARS, MAX_FIELD_NAMES
from rollout_gateway.server.dialects.errors import RequestError

#: Where a translated assistant message keeps the agent's opaque per-message state that
#: the chat shape has no field for (Anthropic thinking blocks, Responses items with
#: encrypted content): the name verifiers v1's chat dialect reads it from (its
#: ``provider_state``), so a recorded message means to v1 what the native one does.
STATE_FIELD = "reasoning_details"


def object_list(value: Any, where: str) -> list[dict[str, Any]]:
    """``value``, checked to be a list of objects."""
    if not isinstance(value, list):
        raise RequestError(f"'{where}' must be an array", where)
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise RequestError(f"'{where}[{index}]' must be an object", f"{where}[{index}]")
    return value


def typed(item: dict[str, Any], where: str) -> str:
    """``item["type"]``, checked to be a string."""
    kind = item.get("type")
    if not isinstance(kind, str):
        raise RequestError(f"'{where}.type' must be a string", f"{where}.type")
    return kind


def text(item: dict[str, Any], key: str, where: str, default: str = "") -> str:
    """``item[key]`` (``default`` when absent or null), checked to be a string."""
    value = item.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise RequestError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def optional_bool(body: dict[str, Any], key: str) -> bool | None:
    """``body[key]``, checked to be a boolean or null."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", key)
    return value


def positive_int(body: dict[str, Any], key: str, *, required: bool = False) -> int | None:
    """``body[key]``, checked to be an integer of at least 1 (or absent, unless
    ``required``)."""
    value = body.get(key)
    if value is None:
        if required:
            raise RequestError(f"'{key}' is required", key)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"'{key}' must be an integer of at least 1", key)
    return value


def string_list(value: Any, where: str) -> list[str]:
    """``value`` as a list of strings (a single string is one)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(f"'{where}' must be a string or an array of strings", where)
    return value


def bounded_names(names: Iterable[str]) -> list[str]:
    """Distinct ``names``, sorted, at most ``MAX_FIELD_NAMES`` of them, each cut short
    (they are the agent's choice and the step keeps them)."""
    return sorted({n[:MAX_FIELD_NAME_CHARS] for n in names})[:MAX_FIELD_NAMES]


def note_facts(facts: dict[str, Any], **named: Iterable[str]) -> None:
    """Add each non-empty list of names to ``facts`` (bounded, see :func:`bounded_names`)."""
    for key, names in named.items():
        if not names:  # the usual case: nothing to note, no set or sort made
            continue
        kept = bounded_names(names)
        if kept:
            facts[key] = kept


__all__ = [
    "STATE_FIELD",
    "bounded_names",
    "note_facts",
    "object_list",
    "optional_bool",
    "positive_int",
    "string_list",
    "text",
    "typed",
]
