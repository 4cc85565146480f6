"""The chat template's tool-role delta as token ids (token-in / token-out), the truncation of a tool's response,
and the prompt that offers the tools to the model.

Token-in / token-out: the model's sampled ids are never decoded and re-tokenized. After a turn that ended with the
template's end-of-turn token (Qwen's ``<|im_end|>``), the ids appended are exactly what the template renders after
that token for the tool messages, followed by the next assistant turn's generation prompt. As verl does, the delta
is found by rendering a fixed dummy conversation without the tool messages and with them
(``apply_chat_template(..., tokenize=False)``) and tokenizing the difference. This is only right when the
rendering with the tool messages starts with the rendering without them (the template appends, it does not rewrite
earlier text): `ToolDelta` checks that once at construction, and at each call, and refuses the template by name.

For Qwen2.5 the delta of one message ``5`` is
``"\\n<|im_start|>user\\n<tool_response>\\n5\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``: the newline
after ``<|im_end|>`` belongs to the delta, and consecutive tool messages share one user turn.

``transformers`` is only used through the tokenizer object given (and imported nowhere here).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

TRUNCATE_SIDES = ("left", "right", "middle")
_TRUNCATED = "...(truncated)"

# the dummy conversation the delta is cut from; its contents never reach a sample
_DUMMY_HEAD = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 1"}}}]},
]
_PROBES = ("TOOL_RESPONSE_PROBE_ONE", "TOOL_RESPONSE_PROBE_TWO")

_HERMES_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def truncate(ids: Sequence[int], max_len: int, side: str = "left") -> List[int]:
    """At most ``max_len`` of ``ids``, with verl's names for the sides (``--tool-response-truncate-side``):
    ``left`` keeps the left part (the first ``max_len``), ``right`` keeps the right part (the last ``max_len``),
    ``middle`` keeps both ends (the first ``ceil(max_len / 2)`` and the last ``floor(max_len / 2)``)."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {side!r}: use one of {', '.join(TRUNCATE_SIDES)}")
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    if side == "left":
        return ids[:max_len]
    if side == "right":
        return ids[len(ids) - max_len:]
    head, tail = (max_len + 1) // 2, max_len // 2
    return ids[:head] + (ids[len(ids) - tail:] if tail else [])


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token of ``tokenizer`` decodes to: its longest vocabulary entry (a
    byte-level entry has a character per byte, so it is never shorter than its text); 64 when the vocabulary
    cannot be read."""
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: a generous bound
        return 64


def precut_text(text: str, max_len: int, side: str, token_chars: int) -> str:
    """``text`` cut by characters to what its first / last ``max_len`` tokens can span (``max_len * token_chars``
    characters on each kept side), so that a tool's 8 MB answer is not tokenized whole to keep 256 tokens of it. The
    tokens kept by `truncate` are the same: the cut lies at least ``max_len`` tokens beyond them."""
    span = max_len * token_chars + 16  # a few characters more: a token merged across the cut is dropped anyway
    if len(text) <= (2 * span if side == "middle" else span):
        return text
    if side == "left":
        return text[:span]
    if side == "right":
        return text[len(text) - span:]
    return text[:span] + text[len(text) - span:]


def truncate_text(tokenizer: Any, text: str, max_len: int, side: str = "left",
                  token_chars: Optional[int] = None) -> str:
    """``text`` cut to ``max_len`` of its own tokens (not the template's), with verl's ``...(truncated)`` marker
    where text was dropped (the marker's few tokens come on top of ``max_len``, as in verl). A long text is first cut
    by characters (`precut_text`, with ``token_chars`` from `longest_token_chars`) so that only what can be kept is
    tokenized."""
    if not isinstance(text, str):
        raise TypeError(f"a tool message must be a str, got {type(text).__name__}")
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {side!r}: use one of {', '.join(TRUNCATE_SIDES)}")
    if len(text) > max_len:  # a text of at most max_len characters may still be more tokens (bytes of one char)
        text_kept = precut_text(text, max_len, side, token_chars or longest_token_chars(tokenizer))
    else:
        text_kept = text
    ids = tokenizer.encode(text_kept, add_special_tokens=False)
    if len(ids) <= max_len and text_kept is text:
        return text
    kept = truncate(ids, max_len, side)
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    if side == "left":
        return decode(kept) + _TRUNCATED
    if side == "right":
        return _TRUNCATED + decode(kept)
    head = (max_len + 1) // 2
    return decode(kept[:head]) + _TRUNCATED + decode(kept[head:])


def _render(tokenizer: Any, messages: List[Dict[str, Any]], generation_prompt: bool, **kwargs: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render the conversation: say which
        roles = "/".join(dict.fromkeys(m.get("role", "?") for m in messages))
        raise ValueError(f"the chat template cannot render a conversation of roles {roles} "
                         f"({type(exc).__name__}: {exc}); give the tokenizer a chat template that has these roles "
                         "(a tool role for multi-turn tool use)") from None


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ToolDelta:
    """The token ids to append after an assistant turn for its tool messages (see the module docstring).

    ``end_of_turn``: the text of the token that ends an assistant turn (default: the tokenizer's EOS token).
    ``max_tool_response_length``: when set, each message is cut to that many of its tokens (`truncate_text`).
    """

    def __init__(self, tokenizer: Any, end_of_turn: Optional[str] = None, tool_role: str = "tool",
                 max_tool_response_length: Optional[int] = None, truncate_side: str = "left"):
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"--tool-response-truncate-side {truncate_side!r}: use {', '.join(TRUNCATE_SIDES)}")
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        self.max_tool_response_length = max_tool_response_length
        self.truncate_side = truncate_side
        self.token_chars = longest_token_chars(tokenizer) if max_tool_response_length is not None else None
        self.end_of_turn = end_of_turn if end_of_turn is not None else getattr(tokenizer, "eos_token", None)
        if not self.end_of_turn:
            raise ValueError("the tokenizer has no EOS token; pass end_of_turn= (the token ending an assistant turn)")
        self.prefix = _render(tokenizer, _DUMMY_HEAD, False)
        self.cut = self._end_of_assistant_turn()
        self.check_template()

    def _end_of_assistant_turn(self) -> int:
        """Where the dummy assistant turn's end-of-turn token ends in the rendering without tool messages."""
        user_at = self.prefix.rfind(_DUMMY_HEAD[1]["content"])
        end_at = self.prefix.rfind(self.end_of_turn)
        if end_at < 0 or end_at < user_at:
            raise ValueError(
                f"chat template check: the assistant turn does not end with the end-of-turn token "
                f"{self.end_of_turn!r} (rendered: {self.prefix[-120:]!r}); pass end_of_turn= the token that ends "
                "an assistant turn (the generation's stop token)")
        return end_at + len(self.end_of_turn)

    def check_template(self) -> None:
        """Refuse a template whose rendering with tool messages does not extend the one without them, or that
        drops tool messages. Called at construction."""
        for probes in (_PROBES[:1], _PROBES):
            delta = self.delta_text(list(probes), truncate_messages=False)
            positions = [delta.find(probe) for probe in probes]
            if any(p < 0 for p in positions) or positions != sorted(positions):
                raise ValueError(f"chat template check: the template drops or reorders tool messages (role "
                                 f"{self.tool_role!r}); rendered delta {delta!r}; use a template with a tool role")

    def _messages(self, tool_messages: Sequence[str]) -> List[Dict[str, Any]]:
        return _DUMMY_HEAD + [{"role": self.tool_role, "content": text} for text in tool_messages]

    def delta_text(self, tool_messages: Sequence[str], truncate_messages: bool = True) -> str:
        """The text the template appends after the assistant's end-of-turn token for these tool messages,
        followed by the generation prompt."""
        if truncate_messages and self.max_tool_response_length is not None:
            tool_messages = [truncate_text(self.tokenizer, text, self.max_tool_response_length, self.truncate_side,
                                           self.token_chars) for text in tool_messages]
        rendered = _render(self.tokenizer, self._messages(tool_messages), True)
        if not rendered.startswith(self.prefix):
            at = _first_difference(rendered, self.prefix)
            raise ValueError(
                "chat template check: the template does not extend the conversation's prefix unchanged when tool "
                f"messages are added (it rewrites earlier text at character {at}: {self.prefix[at:at + 60]!r} "
                f"becomes {rendered[at:at + 60]!r}); token-in/token-out needs a template that appends each tool "
                "message after the assistant turn (as Qwen2.5's does): fix the template or give another tokenizer")
        return rendered[self.cut:]

    def delta_ids(self, tool_messages: Sequence[str]) -> List[int]:
        """The token ids of `delta_text` (one tool message per call, in call order)."""
        return list(self.tokenizer.encode(self.delta_text(tool_messages), add_special_tokens=False))


def hermes_tools_block(schemas: Sequence[Dict[str, Any]]) -> str:
    """The Hermes-style system text that lists the tools inside ``<tools></tools>`` and asks for
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` answers."""
    return _HERMES_BLOCK.format(schemas="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


def tools_prompt(tokenizer: Any, messages: Sequence[Dict[str, Any]], schemas: Sequence[Dict[str, Any]]) -> str:
    """The prompt text offering ``schemas``: through the template's own tools section (``tools=``), or, for a
    template that renders identically with and without tools, with `hermes_tools_block` in the system message
    (merged into a system message the conversation already has)."""
    messages = [dict(m) for m in messages]
    plain = _render(tokenizer, messages, True)
    if not schemas:
        return plain
    with_tools = _render(tokenizer, messages, True, tools=list(schemas))
    if with_tools != plain:
        return with_tools
    block = hermes_tools_block(schemas)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{block}".lstrip("\n")
    else:
        messages.insert(0, {"role": "system", "content": block})
    return _render(tokenizer, messages, True)
