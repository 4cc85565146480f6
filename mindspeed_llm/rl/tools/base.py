"""What a tool is: the protocol the executor calls, the result it returns, and the helpers that turn what a tool
returns (a string, a `ToolResult`, a tuple, a coroutine) into one `ToolResult`.

A tool is any object with:

- ``name``: the function name the model calls (defaults to ``tool_schema["function"]["name"]``);
- ``tool_schema``: an OpenAI function schema,
  ``{"type": "function", "function": {"name", "description", "parameters": {JSON schema}}}``;
- ``execute(parameters: dict, row: dict) -> str | ToolResult | (text, reward[, metrics])``: one call; ``row`` is the
  dataset row of the trajectory (every column), so a tool can look at the task;
- optionally ``create(row)`` and ``release()``: called once at the start and at the end of each trajectory. A tool
  that has either is shallow-copied per trajectory by the executor, so attributes set in ``create`` belong to that
  trajectory; what the copy refers to (a loaded model, a client) is shared.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Protocol, runtime_checkable


class ToolTimeout(Exception):
    """Raised by a tool that enforces its own time limit (the python tool); counted as a timeout, its message is
    what the model reads."""


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome: the text the model reads, and optionally a reward and metrics of the tool's own."""

    text: str
    reward: Optional[float] = None
    metrics: Dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    name: str
    tool_schema: Dict[str, Any]

    def execute(self, parameters: Dict[str, Any], row: Mapping[str, Any]) -> Any: ...


class BaseTool:
    """A convenience base class: keeps ``config`` and ``tool_schema`` (the constructor's or the class attribute)
    and takes ``name`` from the schema. ``create`` / ``release`` are not defined here on purpose: a tool that
    defines neither is shared by all trajectories instead of copied."""

    tool_schema: Dict[str, Any] = {}

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Optional[Dict[str, Any]] = None):
        self.config = dict(config or {})
        if tool_schema is not None:
            self.tool_schema = tool_schema
        self.name = schema_name(self.tool_schema)

    def execute(self, parameters: Dict[str, Any], row: Mapping[str, Any]) -> Any:
        raise NotImplementedError


def schema_name(tool_schema: Any) -> str:
    """The function name of an OpenAI function schema; ValueError when there is none."""
    function = tool_schema.get("function") if isinstance(tool_schema, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError("the tool schema has no function name: write tool_schema: {type: function, function: "
                         "{name: ..., description: ..., parameters: {...}}}")
    return name


def tool_name(tool: Any) -> str:
    """A tool's name: its ``name`` attribute, else its schema's function name."""
    name = getattr(tool, "name", None)
    return name if isinstance(name, str) and name else schema_name(getattr(tool, "tool_schema", None))


def resolve(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (an ``async def`` tool method): run on a fresh event
    loop, which is right in the executor's worker threads (they have no running loop)."""
    if not inspect.isawaitable(value):
        return value
    import asyncio  # only for async tools: asyncio's import costs a quarter of a second

    if inspect.iscoroutine(value):
        return asyncio.run(value)

    async def wait_for_it():
        return await value

    return asyncio.run(wait_for_it())


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    text = getattr(value, "text", None)  # verl's ToolResponse and similar response objects
    if isinstance(text, str):
        return text
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def as_tool_result(value: Any) -> ToolResult:
    """A tool's return value as a `ToolResult`: a string; a `ToolResult`; a tuple ``(text, reward)`` or ``(text,
    reward, metrics)`` (verl's shape); anything else becomes its text (dicts and lists as JSON)."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, tuple) and 1 <= len(value) <= 3:
        text, reward, metrics = (tuple(value) + (None, None))[:3]
        if reward is not None and not isinstance(reward, (int, float)):
            raise TypeError(f"a tool's reward must be a number or None, got {type(reward).__name__}")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise TypeError(f"a tool's metrics must be a dict or None, got {type(metrics).__name__}")
        return ToolResult(_as_text(text), None if reward is None else float(reward), dict(metrics or {}))
    return ToolResult(_as_text(value))
