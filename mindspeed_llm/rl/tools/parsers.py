"""Tool calls read from the model's output text, behind a small registry (``--tool-parser-format``).

A parser never raises on what the model wrote: a malformed call becomes an entry of `ParsedTurn.errors`, a message
the caller returns to the model as that call's tool message, so the model learns the format instead of the run
crashing. A parser also names its markers (``start`` / ``end``): the end marker is the stop string of a turn that
calls a tool, and must be kept in the text given to `parse` (token-in / token-out keeps the sampled ids whole).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from mindspeed_llm.registry import Registry

_CALL_FORMAT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """The calls found (in order), the errors of the malformed ones (in order, after the calls when turned into
    tool messages), and the text outside the call blocks."""

    calls: List[ToolCall]
    errors: List[str]
    content: str

    @property
    def has_calls(self) -> bool:
        """True when the turn asked for tools (also when every call was malformed: the errors must be answered)."""
        return bool(self.calls or self.errors)


def _arguments(payload: Mapping[str, Any], number: int):
    """(arguments dict, None) or (None, error text)."""
    arguments = payload.get("arguments", payload.get("parameters", {}))  # Llama-style `parameters` accepted too
    if isinstance(arguments, str):  # OpenAI's wire format: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f"error: tool call {number}: \"arguments\" is a string that is not JSON; " \
                         f"write {_CALL_FORMAT}"
    if not isinstance(arguments, dict):
        return None, f"error: tool call {number}: \"arguments\" must be an object, got " \
                     f"{type(arguments).__name__}; write {_CALL_FORMAT}"
    return arguments, None


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Qwen2.5's and SmolLM2's chat
    templates (and NousResearch's Hermes, after which it is named). Several blocks in one turn are several calls."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _call(self, body: str, number: int):
        """(ToolCall, None) or (None, error text) for the text between the markers."""
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"error: tool call {number} is not valid JSON ({exc.msg} at character {exc.pos}); " \
                         f"write {_CALL_FORMAT}"
        if not isinstance(payload, dict):
            return None, f"error: tool call {number} must be a JSON object; write {_CALL_FORMAT}"
        name = payload.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, f"error: tool call {number} has no \"name\"; write {_CALL_FORMAT}"
        arguments, error = _arguments(payload, number)
        return (ToolCall(name.strip(), arguments), None) if error is None else (None, error)

    def parse(self, text: str) -> ParsedTurn:
        calls: List[ToolCall] = []
        errors: List[str] = []
        content: List[str] = []
        position, number = 0, 0
        while True:
            opened = text.find(self.start, position)
            if opened < 0:
                content.append(text[position:])
                break
            content.append(text[position:opened])
            number += 1
            body_start = opened + len(self.start)
            closed = text.find(self.end, body_start)
            if closed < 0:
                errors.append(f"error: tool call {number} has no closing {self.end}; write {_CALL_FORMAT}")
                break
            call, error = self._call(text[body_start:closed].strip(), number)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
            position = closed + len(self.end)
        return ParsedTurn(calls, errors, "".join(content).strip())


# format name -> parser class (`--tool-parser-format`); a user's tool module may add one: TOOL_PARSERS[name] = cls
TOOL_PARSERS = Registry({"hermes": HermesParser})
DEFAULT_TOOL_PARSER = "hermes"  # --tool-parser-format's default (verl's and MindSpeed-RL's)


def get_parser(name: Optional[str]):
    """A parser by its registry name (None: the default); ValueError naming the choices."""
    try:
        return TOOL_PARSERS[name or DEFAULT_TOOL_PARSER]()
    except KeyError:
        raise ValueError(f"unknown tool parser format {name!r}; known: {', '.join(sorted(TOOL_PARSERS))} "
                         "(--tool-parser-format)") from None
