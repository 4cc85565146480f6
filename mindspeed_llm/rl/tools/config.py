"""The tool config file (``--tool-config PATH``, YAML ``tool_config_path``), in the schema verl and MindSpeed-RL use:

```yaml
tools:
  - class_name: my_tools.WeatherTool          # a dotted path importable from PYTHONPATH, or a built-in name
    config: {type: native, units: metric}     # passed to the class (verl's `type: native` is accepted)
    tool_schema:                              # an OpenAI function schema; optional for functions and built-ins
      type: function
      function: {name: get_weather, description: ..., parameters: {type: object, properties: {...}}}
  - class_name: calculator                    # built in: calculator, python
```

A class is constructed as verl does, ``cls(config=..., tool_schema=...)``, or with only ``config``, or with no
argument, whichever its constructor takes; a ``class_name`` that names a plain function makes a function tool
(the entry's ``tool_schema``, when given, replaces the one built from the signature). Every mistake is a
`ToolConfigError` naming the file, the entry (``tools[i]``) and the fix.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from mindspeed_llm.errors import UserError
from mindspeed_llm.rl.tools.adapters import adapt_tool
from mindspeed_llm.rl.tools.base import schema_name, tool_name
from mindspeed_llm.rl.tools.calculator import CalculatorTool
from mindspeed_llm.rl.tools.python_exec import PythonTool

BUILTIN_TOOLS: Dict[str, type] = {"calculator": CalculatorTool, "python": PythonTool}

_ENTRY_FORMAT = "{class_name: pkg.module.ClassName, config: {...}, tool_schema: {type: function, function: {...}}}"


class ToolConfigError(UserError, ValueError):
    """A mistake in the tool config file; the message names the file, the entry and the fix."""


def _read_yaml(path: Path) -> Any:
    from mindspeed_llm.files import YamlFileError, read_yaml

    if not path.is_file():
        raise ToolConfigError(f"tool config {path}: no such file (--tool-config / tool_config_path)")
    try:  # not UTF-8 / not YAML / a key twice named with the line; a null is a tool schema's own business
        return read_yaml(str(path), f"tool config {path}", allow_null=lambda keys: True)
    except YamlFileError as exc:
        raise ToolConfigError(str(exc)) from None


def _import_attribute(class_name: str, where: str) -> Any:
    """The object a dotted path (``pkg.module.Name`` or ``pkg.module:Name``) names."""
    module_name, _, attribute = class_name.replace(":", ".").rpartition(".")
    if not module_name or not attribute:
        raise ToolConfigError(f"{where}: class_name {class_name!r} is neither a built-in tool "
                              f"({', '.join(BUILTIN_TOOLS)}) nor a dotted path such as my_tools.MyTool")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            top = module_name.split(".")[0]
            raise ToolConfigError(f"{where}: cannot import module {module_name!r} (class_name {class_name!r}); "
                                  f"put the folder that holds {top} on PYTHONPATH") from None
        raise ToolConfigError(f"{where}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - an error inside the user's module: show it with the entry
        raise ToolConfigError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attribute):
        raise ToolConfigError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                              f"attribute {attribute!r}; check the spelling of class_name")
    return getattr(module, attribute)


def construct_tool(cls: type, config: Dict[str, Any], tool_schema: Optional[Dict[str, Any]]) -> Any:
    """An instance of ``cls`` built with the arguments its constructor takes (verl's are config and tool_schema)."""
    parameters = inspect.signature(cls).parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    kwargs: Dict[str, Any] = {}
    if "config" in parameters or open_kwargs:
        kwargs["config"] = config
    if tool_schema is not None and ("tool_schema" in parameters or open_kwargs):
        kwargs["tool_schema"] = tool_schema
    return cls(**kwargs)


def tool_from_entry(entry: Any, where: str) -> Any:
    """One tool from one ``tools:`` entry."""
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: an entry must be a mapping {_ENTRY_FORMAT}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolConfigError(f"{where}: missing class_name; write class_name: pkg.module.ClassName (a class or "
                              f"function importable from PYTHONPATH) or a built-in ({', '.join(BUILTIN_TOOLS)})")
    config = entry.get("config") or {}
    tool_schema = entry.get("tool_schema")
    if not isinstance(config, Mapping):
        raise ToolConfigError(f"{where}: config must be a mapping, got {type(config).__name__}")
    if config.get("type", "native") != "native":
        raise ToolConfigError(f"{where}: config type {config['type']!r} is not supported; only in-process "
                              "(native) tools run here")
    if tool_schema is not None:
        try:
            schema_name(tool_schema)
        except ValueError:
            raise ToolConfigError(f"{where}: tool_schema has no function name; write tool_schema: {{type: function, "
                                  "function: {name: ..., description: ..., parameters: {...}}}") from None
    target = BUILTIN_TOOLS.get(class_name.strip()) or _import_attribute(class_name.strip(), where)
    try:
        if inspect.isclass(target):
            return adapt_tool(construct_tool(target, dict(config), tool_schema), tool_schema)
        return adapt_tool(target, tool_schema)
    except ToolConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a constructor's error or a function without hints: name the entry
        raise ToolConfigError(f"{where}: cannot make a tool of {class_name!r}: {type(exc).__name__}: {exc}") from None


def load_tool_config(path: str) -> List[Any]:
    """The tools of a tool config file, in file order; ToolConfigError naming the file, entry and fix."""
    file = Path(path)
    data = _read_yaml(file)
    tools_list = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(tools_list, list) or not tools_list:
        raise ToolConfigError(f"tool config {file}: expected a top-level `tools:` list of entries {_ENTRY_FORMAT}")
    tools: List[Any] = []
    seen: Dict[str, int] = {}
    for index, entry in enumerate(tools_list):
        where = f"tool config {file}, tools[{index}]"
        tool = tool_from_entry(entry, where)
        name = tool_name(tool)
        if name in seen:
            raise ToolConfigError(f"{where}: tool name {name!r} is also the name of tools[{seen[name]}]; each tool "
                                  "needs its own function name (tool_schema.function.name)")
        seen[name] = index
        tools.append(tool)
    return tools
