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
import numbers
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
    """The function name of an OpenAI function schema (a mapping, or verl's / MindSpeed-RL's pydantic
    ``OpenAIFunctionToolSchema``); ValueError when there is none."""
    if isinstance(tool_schema, Mapping):
        function = tool_schema.get("function")
    else:
        function = getattr(tool_schema, "function", None)
    if isinstance(function, Mapping):
        name = function.get("name")
    else:
        name = getattr(function, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError("the tool schema has no function name: write tool_schema: {type: function, function: "
                         "{name: ..., description: ..., parameters: {...}}}")
    return name


def schema_dict(tool_schema: Any) -> Dict[str, Any]:
    """A tool schema as plain JSON data, for the prompt: a mapping copied, a pydantic schema as verl dumps it
    (``model_dump(exclude_unset=True, exclude_none=True)``)."""
    if isinstance(tool_schema, SchemaDict):
        return tool_schema.model_dump()
    if isinstance(tool_schema, Mapping):
        return json.loads(json.dumps(tool_schema, ensure_ascii=False))
    dump = getattr(tool_schema, "model_dump", None)
    if callable(dump):
        return dump(exclude_unset=True, exclude_none=True)
    raise TypeError(f"a tool schema must be a mapping or a pydantic model, got {type(tool_schema).__name__}")


class SchemaDict(dict):
    """A tool schema for a class written against verl's / MindSpeed-RL's pydantic ``OpenAIFunctionToolSchema`` when
    neither package can be imported: a dict (``schema["function"]["name"]``) whose keys also read as attributes
    (``schema.function.name``), with the pydantic methods such classes call (``model_dump``, ``model_dump_json``).
    A key the schema does not have reads as None, as an unset optional field of the pydantic model does."""

    def __init__(self, data: Mapping[str, Any] = ()):
        super().__init__({key: _schema_value(value) for key, value in dict(data).items()})

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return self.get(key)

    def model_dump(self, **_: Any) -> Dict[str, Any]:
        return json.loads(json.dumps(self, ensure_ascii=False))

    def model_dump_json(self, **_: Any) -> str:
        return json.dumps(self, ensure_ascii=False)


def _schema_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return SchemaDict(value)
    if isinstance(value, list):
        return [_schema_value(item) for item in value]
    return value


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


def as_text(value: Any) -> str:
    """Any answer of a tool as text a tokenizer takes: bytes decoded as UTF-8, dicts and lists as JSON, verl's
    ``ToolResponse`` by its ``text``, anything else by ``str``; what cannot be UTF-8 (a lone surrogate, bytes that
    are not UTF-8) becomes U+FFFD."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if not isinstance(value, str):
        if isinstance(value, (dict, list)):
            value = json.dumps(value, ensure_ascii=False, default=str)
        elif hasattr(value, "text"):  # verl's ToolResponse and similar response objects (text None: no text)
            return as_text(value.text) if value.text is not None else ""
        else:
            value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: the tokenizer would raise on them
        value = value.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    return value


def _reward(reward: Any) -> Optional[float]:
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):  # numpy's scalars are Real too
        raise TypeError(f"a tool's reward must be a number or None, got {type(reward).__name__}")
    return float(reward)


def as_tool_result(value: Any) -> ToolResult:
    """A tool's return value as a `ToolResult` whose ``text`` is a str a tokenizer takes: a string; a `ToolResult`
    (its fields checked too); a tuple ``(text, reward)`` or ``(text, reward, metrics)`` (verl's shape); anything else
    becomes its text (`as_text`). A reward that is not a number, or metrics that are not a mapping, raise TypeError
    (the executor counts the call as failed)."""
    if isinstance(value, ToolResult):
        text, reward, metrics = value.text, value.reward, value.metrics
    elif isinstance(value, tuple) and 1 <= len(value) <= 3:
        text, reward, metrics = (tuple(value) + (None, None))[:3]
    else:
        return ToolResult(as_text(value))
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(f"a tool's metrics must be a dict or None, got {type(metrics).__name__}")
    return ToolResult(as_text(text), _reward(reward), dict(metrics or {}))
