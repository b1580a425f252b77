"""What the gateway's HTTP protocol relies on of uvicorn (server/http/connections.py).

uvicorn has no extension API for its protocols: ``LimitedHttpToolsProtocol`` subclasses
its httptools protocol, overrides some of its methods and reads some of its attributes.
uvicorn is pinned to one version (pyproject.toml); these tests fail, naming what moved,
when an upgrade changes any of it.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib import metadata
from pathlib import Path

from uvicorn import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import Server, ServerState

from rollout_gateway.server.http.connections import (
    ConnectionLimits,
    LimitedHttpToolsProtocol,
    limited_protocol,
)

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

#: Each method the protocol overrides, with uvicorn's parameters for it.
OVERRIDDEN = {
    "__init__": ["self", "config", "server_state", "app_state", "_loop"],
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "send_400_response": ["self", "msg"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
}


def test_uvicorn_is_pinned_to_the_version_installed() -> None:
    pins = re.findall(r'"uvicorn==([^";]+)"', PYPROJECT.read_text())
    assert pins == [metadata.version("uvicorn")], "pin uvicorn exactly, to the tested version"


def test_the_overridden_methods_keep_their_signatures() -> None:
    for name, params in OVERRIDDEN.items():
        method = getattr(HttpToolsProtocol, name, None)
        assert method is not None, f"uvicorn's HttpToolsProtocol has no {name}"
        assert list(inspect.signature(method).parameters) == params, name
        assert name in vars(LimitedHttpToolsProtocol), f"{name} is no longer overridden"


def test_uvicorn_builds_each_connections_protocol_by_calling_the_http_option() -> None:
    # Config keeps a non-string http= as is; the server calls it with these keywords.
    http = limited_protocol(ConnectionLimits())
    config = Config(app=lambda scope, receive, send: None, http=http)  # type: ignore[arg-type]
    config.load()
    assert config.http_protocol_class is http
    startup = inspect.getsource(Server.startup)
    for keyword in ("config=config", "server_state=self.server_state", "app_state=", "_loop="):
        assert keyword in startup, f"uvicorn's server no longer passes {keyword}"


async def test_the_attributes_read_are_there_and_answers_use_the_protocols_transport() -> None:
    config = Config(app=lambda scope, receive, send: None, http="httptools")
    config.load()
    protocol = LimitedHttpToolsProtocol(
        config=config,
        server_state=ServerState(),
        app_state={},
        _loop=asyncio.get_running_loop(),
        policy=limited_protocol(ConnectionLimits()).keywords["policy"],
    )
    for attribute in ("connections", "loop", "cycle", "server_state", "transport"):
        assert hasattr(protocol, attribute), f"uvicorn's protocol has no {attribute}"
    assert isinstance(protocol.server_state.default_headers, list)
    assert "response_complete" in inspect.getsource(RequestResponseCycle.__init__)
    # Each request's cycle answers through the protocol's transport (the wrapper that
    # sends a head with its body), and the scope is the protocol's.
    headers_complete = inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert "transport=self.transport" in headers_complete
    assert "scope=self.scope" in headers_complete


def test_the_body_held_is_handed_over_as_bytes_of_it_and_on_body_is_the_one_replaced() -> None:
    # on_body holds a body's first piece as the bytes it is: uvicorn's receive must hand
    # over bytes(held) (the very object for bytes) and start the next one empty.
    receive = inspect.getsource(RequestResponseCycle.receive)
    assert '"body": bytes(self.body)' in receive and "self.body = bytearray()" in receive
    # What LimitedHttpToolsProtocol.on_body does besides holding the piece is uvicorn's.
    on_body = inspect.getsource(HttpToolsProtocol.on_body)
    for line in (
        "if (self.parser.should_upgrade() and self._should_upgrade())"
        " or self.cycle.response_complete:",
        "self.cycle.body += body",
        "if len(self.cycle.body) > HIGH_WATER_LIMIT:",
        "self.flow.pause_reading()",
        "self.cycle.message_event.set()",
    ):
        assert line in on_body, f"uvicorn's on_body changed: {line}"
