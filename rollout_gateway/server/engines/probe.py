"""What engine runs behind an upstream, and how to ask it for token ids.

Read once at start-up (and again on the first turn if the upstream was not up yet) from
``GET {base}/models``: vLLM's model cards say ``owned_by: "vllm"``, SGLang's
``owned_by: "sglang"``; both carry ``max_model_len``, the gateway's default
``max_seq_len``. vLLM started with ``VLLM_SERVER_DEV_MODE=1`` also answers
``GET /server_info``, from which the logprobs mode is checked (the gateway needs
``processed_logprobs``: the logprobs of the distribution the token was sampled from).

Request flags (:func:`token_flags`): vLLM wants ``return_token_ids``; SGLang
``return_prompt_token_ids`` / ``return_token_ids`` / ``return_meta_info``. An unknown
engine gets all of them (vLLM 0.32 ignores SGLang's, verified against the real server).
SGLang refuses its flags on streamed requests, so only vLLM is streamed from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollout_gateway.server.engines.upstream_http1 import Http1Upstream
from rollout_gateway.server.http import jsonio

logger = logging.getLogger("rollout_gateway.server")

EngineKind = Literal["vllm", "sglang", "unknown"]

_VLLM_FLAGS = {"return_token_ids": True, "logprobs": True}
_SGLANG_FLAGS = {
    "return_prompt_token_ids": True,
    "return_token_ids": True,
    "return_meta_info": True,
    "logprobs": True,
}

#: Request fields the gateway sets itself to get token data (never the agent's).
TOKEN_FLAG_FIELDS = frozenset({*_VLLM_FLAGS, *_SGLANG_FLAGS})


def token_flags(kind: EngineKind) -> dict[str, Any]:
    """The request fields that make an engine of ``kind`` answer ids and logprobs."""
    if kind == "vllm":
        return dict(_VLLM_FLAGS)
    if kind == "sglang":
        return dict(_SGLANG_FLAGS)
    return {**_VLLM_FLAGS, **_SGLANG_FLAGS}


@dataclass
class EngineInfo:
    """What the gateway knows about the engine behind one upstream."""

    kind: EngineKind = "unknown"
    #: Context length the engine serves (``max_model_len`` of its model card).
    max_model_len: int | None = None
    #: The engine's logprobs mode, when it tells (vLLM dev mode ``/server_info``).
    logprobs_mode: str | None = None
    #: Whether ``/models`` answered (a failed probe is retried, see :meth:`due`).
    probed: bool = False
    #: Monotonic time of the last probe attempt.
    probed_at: float | None = None
    #: ``None`` until the first answer; then whether answers carry token ids.
    token_ids: bool | None = None

    def due(self, now: float, retry_s: float = 30.0) -> bool:
        """Whether to probe now: never answered, and no attempt in the last ``retry_s``
        (a turn must not wait on a dead upstream's ``/models`` every time)."""
        return not self.probed and (self.probed_at is None or now - self.probed_at >= retry_s)

    @property
    def streams_token_ids(self) -> bool:
        """Whether a streamed request still returns ids (vLLM; SGLang refuses)."""
        return self.kind == "vllm"

    def describe(self) -> dict[str, Any]:
        """For ``/health``."""
        out: dict[str, Any] = {
            "engine": self.kind,
            "max_model_len": self.max_model_len,
            "logprobs_mode": self.logprobs_mode,
            "token_ids": self.token_ids,
        }
        if self.token_ids is False:
            out["warning"] = (
                "the upstream's answers carry no token ids: turns are recorded with "
                "tokens null (run vLLM >= 0.10.2 or SGLang with token-id support)"
            )
        return out


def read_model_cards(listing: Any) -> tuple[EngineKind, int | None]:
    """Engine kind and ``max_model_len`` from a ``/models`` answer."""
    cards = listing.get("data") if isinstance(listing, Mapping) else None
    kind: EngineKind = "unknown"
    max_len: int | None = None
    for card in cards if isinstance(cards, list) else ():
        if not isinstance(card, Mapping):
            continue
        owner = str(card.get("owned_by") or "").lower()
        if owner in ("vllm", "sglang"):
            kind = owner  # type: ignore[assignment]
        value = card.get("max_model_len")
        # A context length an engine can have (a bigger number is not one, and JSON
        # could not carry it back in /health).
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**40:
            max_len = value if max_len is None else min(max_len, value)
    return kind, max_len


def _logprobs_mode(server_info: Any) -> str | None:
    config = server_info.get("vllm_config") if isinstance(server_info, Mapping) else None
    model = config.get("model_config") if isinstance(config, Mapping) else None
    mode = model.get("logprobs_mode") if isinstance(model, Mapping) else None
    return str(mode) if mode is not None else None


async def probe_engine(
    client: Http1Upstream, info: EngineInfo, label: str, timeout_s: float = 2.0
) -> None:
    """Fill ``info`` from the upstream's ``/models`` (and vLLM's dev ``/server_info``).

    ``label`` names the upstream in logs (its URL without credentials). Failures leave
    ``info.probed`` false (retried on the next use); they never raise.
    """
    info.probed_at = time.monotonic()
    try:
        response = await client.get("/models", timeout_s=timeout_s)
        listing = jsonio.loads_lenient(response.content) if response.status_code == 200 else None
    except Exception as exc:  # a probe never fails the caller: the engine stays unknown
        logger.info("upstream=%s /models probe failed: %r", label, exc)
        return
    if listing is None:
        return
    info.kind, info.max_model_len = read_model_cards(listing)
    info.probed = True
    if info.kind == "vllm":
        root = client.base_url.rstrip("/").removesuffix("/v1")
        try:
            response = await client.get(
                f"{root}/server_info", timeout_s=timeout_s, params={"config_format": "json"}
            )
            if response.status_code == 200:
                info.logprobs_mode = _logprobs_mode(jsonio.loads_lenient(response.content))
        except Exception:  # dev mode off (404) or unreachable: the mode stays unreported
            pass
        if info.logprobs_mode is not None and info.logprobs_mode != "processed_logprobs":
            logger.warning(
                "upstream=%s runs vLLM with --logprobs-mode %s: recorded logprobs are not "
                "those of the sampling distribution when temperature/top-p/top-k apply; "
                "start vLLM with --logprobs-mode processed_logprobs",
                label,
                info.logprobs_mode,
            )
    logger.info(
        "upstream=%s engine=%s max_model_len=%s logprobs_mode=%s",
        label,
        info.kind,
        info.max_model_len,
        info.logprobs_mode or "unreported",
    )


__all__ = [
    "TOKEN_FLAG_FIELDS",
    "EngineInfo",
    "EngineKind",
    "probe_engine",
    "read_model_cards",
    "token_flags",
]
