"""One shape for every tool the executor runs: `adapt_tool` turns a plain function into a `FunctionTool` and wraps
a verl-style tool (methods that take an ``instance_id``) into `InstanceTool`.

verl's tools (``verl.tools.base_tool.BaseTool`` subclasses) keep per-trajectory state in a dict keyed by an
instance id: ``async create(instance_id=None, **kwargs)`` (returning the id, or ``(id, response)`` in newer
versions), ``async execute(instance_id, parameters, **kwargs) -> (text or response, reward, metrics)``,
``async release(instance_id, **kwargs)``. `InstanceTool` gives each trajectory a fresh id (the executor copies the
wrapper per trajectory) and runs the coroutines with `resolve`. The ``create_kwargs`` / ``execute_kwargs`` /
``release_kwargs`` that verl reads from a row's ``tools_kwargs[tool name]`` (top level or under ``extra_info``)
are passed the same way.
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any, Dict, Mapping, Optional

from mindspeed_llm.rl.tools.base import resolve, schema_dict, schema_name, tool_name
from mindspeed_llm.rl.tools.function_tool import function_tool


def _takes(method: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _row_tool_kwargs(row: Mapping[str, Any], name: str, kind: str) -> Dict[str, Any]:
    """verl's per-row tool arguments: ``row["tools_kwargs"][name][kind]`` (or under ``row["extra_info"]``)."""
    for holder in (row, row.get("extra_info") or {}):
        per_tool = holder.get("tools_kwargs") if isinstance(holder, Mapping) else None
        if isinstance(per_tool, Mapping) and isinstance(per_tool.get(name), Mapping):
            found = per_tool[name].get(kind)
            return dict(found) if isinstance(found, Mapping) else {}
    return {}


class InstanceTool:
    """A verl-style tool seen through this package's protocol; one copy per trajectory holds its instance id."""

    def __init__(self, inner: Any, tool_schema: Optional[Dict[str, Any]] = None):
        self.inner = inner  # keeps the schema its class takes (verl's pydantic one); the prompt gets plain JSON
        self.tool_schema = schema_dict(tool_schema if tool_schema is not None else inner.tool_schema)
        self.name = schema_name(tool_schema) if tool_schema is not None else tool_name(inner)
        self.instance_id: Optional[str] = None
        self._row: Mapping[str, Any] = {}

    def create(self, row: Mapping[str, Any]) -> None:
        self._row = row
        self.instance_id = str(uuid.uuid4())
        create = getattr(self.inner, "create", None)
        if create is None:
            return
        created = resolve(create(self.instance_id, **_row_tool_kwargs(row, self.name, "create_kwargs")))
        if isinstance(created, tuple) and created and isinstance(created[0], str):
            created = created[0]
        if isinstance(created, str) and created:
            self.instance_id = created  # verl's create may choose the id itself

    def execute(self, parameters: Mapping[str, Any], row: Mapping[str, Any]) -> Any:
        if self.instance_id is None:  # the executor always calls create first; be safe when used alone
            self.create(row)
        kwargs = _row_tool_kwargs(row, self.name, "execute_kwargs")
        return resolve(self.inner.execute(self.instance_id, dict(parameters), **kwargs))

    def release(self) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None and self.instance_id is not None:
            resolve(release(self.instance_id, **_row_tool_kwargs(self._row, self.name, "release_kwargs")))
        self.instance_id = None


def adapt_tool(obj: Any, tool_schema: Optional[Dict[str, Any]] = None) -> Any:
    """``obj`` as a tool of this package's protocol: a function becomes a `FunctionTool`, a verl-style tool an
    `InstanceTool`, any other object with a callable ``execute`` is used as it is. ``tool_schema``, when given, is
    the schema the prompt offers (the tool config's schema wins); an object holding a schema of another type (verl's
    pydantic one) keeps it."""
    execute = getattr(obj, "execute", None)
    if execute is None:
        if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
            return function_tool(obj, tool_schema)
        raise TypeError(f"{obj!r} is not a tool: give a function with type hints or an object with "
                        "execute(parameters, row) and a tool_schema")
    if not callable(execute):
        raise TypeError(f"its execute is a {type(execute).__name__}, not a method: define execute(self, parameters, "
                        "row) (or verl's async execute(self, instance_id, parameters, **kwargs))")
    if _takes(execute, "instance_id"):
        return InstanceTool(obj, tool_schema)
    if tool_schema is not None:
        if getattr(obj, "tool_schema", None) is None or isinstance(getattr(obj, "tool_schema"), Mapping):
            obj.tool_schema = schema_dict(tool_schema)
        obj.name = schema_name(tool_schema)
    tool_name(obj)  # a tool must have a name: raises ValueError naming the schema problem otherwise
    return obj
