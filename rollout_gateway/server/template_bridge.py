"""A ``renderers`` renderer that bridges turns of any chat template closing turns with a token.

``renderers`` ships hand-written renderers (with ``bridge_to_next_turn``) for the model
families prime-rl trains; any other model gets its template-driven ``DefaultRenderer``,
which never bridges (an opaque template cannot promise prefix stability), so every turn
is rendered from scratch and re-tokenizes the sampled answers. :class:`TemplateBridgeRenderer`
is that default renderer plus a bridge that needs only one fact about the template: the
token that closes a turn (Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``):

* the previous prompt + completion is cut after its last close token (renderers'
  :func:`~renderers.base.trim_to_turn_close`; a close is appended when ``max_tokens`` cut
  the answer before it);
* the new messages' tokens are what the template adds after a closed assistant turn:
  rendered after a fixed two-message anchor, taken from the anchor's last close on;
* the result is ``previous ids (as sampled) + those tokens``, so it extends the previous
  turn exactly. ``None`` (render from scratch) when the template does not render the
  anchor as a prefix of the extension, or when the tail holds an assistant message.

It also reads tool calls written as a Python list of calls, ``[name(arg="v")]`` (what
vLLM's ``pythonic`` tool parser reads, and how the real-vLLM recipe's Gemma 3 template
renders calls): :class:`PythonicToolParser`. Use it with
``rollout-gateway serve --upstream-mode token-in --renderer
rollout_gateway.server.template_bridge:end_of_turn_pythonic`` (or any ``module:factory``
built on :class:`TemplateBridgeRenderer`); prime-rl can load the same class through
renderers' custom renderer config, so trainer and gateway tokenize alike.

Needs ``renderers`` (the ``[tito]`` extra); imported only by token-in mode.
"""

from __future__ import annotations

import ast
from typing import Any

from renderers import DefaultRendererConfig, RenderedTokens
from renderers.base import (
    ParsedToolCall,
    ToolCallParseStatus,
    reject_assistant_in_extension,
    trim_to_turn_close,
)
from renderers.default import DefaultRenderer

#: The anchor the tail of new messages is rendered after (any closed assistant turn).
_ANCHOR = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class PythonicToolParser:
    """Tool calls written as a Python list of keyword-argument calls:
    ``[run_shell(command="ls"), read(path="a.txt")]`` (a ``renderers`` tool parser)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def extract(self, token_ids: list[int]) -> tuple[list[int], list[ParsedToolCall]]:
        """``(content ids, calls)``: all ids are the calls when the text is a call list."""
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True).strip()
        if not (text.startswith("[") and text.endswith("]")):
            return token_ids, []
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return token_ids, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return token_ids, []
        if not all(isinstance(e, ast.Call) and isinstance(e.func, ast.Name) for e in tree.elts):
            return token_ids, []  # a list, not calls: plain text
        calls = []
        for node in tree.elts:
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            raw = ast.get_source_segment(text, node) or ""
            try:
                if node.args or any(kw.arg is None for kw in node.keywords):
                    raise ValueError("positional arguments")
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                calls.append(
                    ParsedToolCall(
                        raw=raw, name=node.func.id, status=ToolCallParseStatus.INVALID_JSON
                    )
                )
                continue
            calls.append(ParsedToolCall(raw=raw, name=node.func.id, arguments=arguments))
        return [], calls


class TemplateBridgeRenderer(DefaultRenderer):
    """``DefaultRenderer`` with a bridge for templates that close turns with ``close_token``.

    Args:
        tokenizer: a tokenizer with a chat template (``renderers.base.load_tokenizer``).
        close_token: the token that ends every turn (``"<end_of_turn>"``).
        tool_parser: a ``renderers`` tool parser instance (``None``: no tool calls).
    """

    def __init__(self, tokenizer: Any, close_token: str, tool_parser: Any = None) -> None:
        # model_construct: the config's tool_parser field names registered parsers only;
        # DefaultRenderer takes a parser instance as it is.
        super().__init__(tokenizer, DefaultRendererConfig.model_construct(tool_parser=tool_parser))
        close_id = tokenizer.convert_tokens_to_ids(close_token)
        if not isinstance(close_id, int) or close_id == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"close token {close_token!r} is not in the tokenizer's vocabulary")
        self.close_id = close_id

    def get_stop_token_ids(self) -> list[int]:
        """EOS and the turn close (the engine must stop at either)."""
        ids = list(super().get_stop_token_ids())
        return ids if self.close_id in ids else [*ids, self.close_id]

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
    ) -> RenderedTokens | None:
        """The previous ids as sampled plus what the template adds for ``new_messages``."""
        if not new_messages or reject_assistant_in_extension(new_messages):
            return None
        previous = trim_to_turn_close(
            previous_prompt_ids,
            previous_completion_ids,
            {self.close_id},
            synthesize_close=self.close_id,
        )
        if previous is None:
            return None
        base = self.render_ids(_ANCHOR, tools=tools)
        extended = self.render_ids(
            [*_ANCHOR, *new_messages], tools=tools, add_generation_prompt=True
        )
        if extended[: len(base)] != base or self.close_id not in base:
            return None
        last_close = len(base) - 1 - base[::-1].index(self.close_id)
        ids = [*previous, *extended[last_close + 1 :]]
        return RenderedTokens(token_ids=ids, message_indices=[-1] * len(ids))


def end_of_turn_pythonic(tokenizer: Any) -> TemplateBridgeRenderer:
    """Gemma-style turns (``<end_of_turn>``) with pythonic tool calls: the real-vLLM
    recipe's Gemma 3 template
    (``--renderer rollout_gateway.server.template_bridge:end_of_turn_pythonic``)."""
    return TemplateBridgeRenderer(tokenizer, "<end_of_turn>", PythonicToolParser(tokenizer))


__all__ = ["PythonicToolParser", "TemplateBridgeRenderer", "end_of_turn_pythonic"]
