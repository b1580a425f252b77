"""The errors a dialect turns into its own wire shape.

A dialect never decides *what* went wrong, only how to say it. The turn (and the HTTP
layer before it) says what went wrong as a :class:`GatewayError`; each dialect renders it
in the shape its agent's SDK raises its own typed error from (an Anthropic
``{"type": "error", "error": {...}}`` with the status its SDK maps to
``anthropic.BadRequestError``..., an OpenAI ``{"error": {...}}``). Parsing a request that
cannot be served raises :class:`RequestError`, a 400 that names the offending field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GatewayError:
    """What went wrong with an agent's request, in no dialect's shape.

    ``code`` is the gateway's own specific code (``rollout_not_found``,
    ``max_turns_reached``, ``context_length_exceeded``...; ``None``: the status says it),
    ``error_type`` the OpenAI-style type the chat path has always sent (dialects with
    their own types derive theirs from the status), ``param`` the request field at fault.
    ``headers`` go on the HTTP answer as they are (``x-should-retry: false`` on a refusal).
    """

    status: int
    message: str
    code: str | None = None
    error_type: str | None = None
    param: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


class RequestError(ValueError):
    """A request a dialect cannot take (a 400): malformed, or asking for something the
    gateway cannot honour (``previous_response_id``, provider-side MCP servers...).

    ``param`` names the field (``messages[3].content[0].source``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def as_error(self) -> GatewayError:
        """This refusal as the :class:`GatewayError` every dialect renders."""
        return GatewayError(
            400,
            self.message,
            code=self.code,
            error_type="invalid_request_error",
            param=self.param,
        )


__all__ = ["GatewayError", "RequestError"]
