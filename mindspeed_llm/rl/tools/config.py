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
(the entry's ``tool_schema``, when given, replaces the one built from the signature). The schema is handed over in
the type the class takes (`schema_for`): verl's and MindSpeed-RL's ``BaseTool`` subclasses get their package's
pydantic ``OpenAIFunctionToolSchema``, other classes a `base.SchemaDict` (a dict whose keys read as attributes too).
Every schema is checked (`check_tool_schema`: ``type: function``, a name, JSON-schema shaped ``parameters``) and
every class must have a callable ``execute``. Every mistake is a `ToolConfigError` naming the file, the entry
(``tools[i]``) and the fix. Argument validation builds the tools before any model is built
(``load_tool_config(path, cache="store")``); the run's `multi_turn.ToolBox` takes those (``cache="take"``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from mindspeed_llm.errors import UserError
from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.tools.adapters import adapt_tool
from mindspeed_llm.rl.tools.base import SchemaDict, schema_dict, schema_name, tool_name
from mindspeed_llm.rl.tools.calculator import CalculatorTool
from mindspeed_llm.rl.tools.python_exec import PythonTool

BUILTIN_TOOLS = Registry({"calculator": CalculatorTool, "python": PythonTool})

_ENTRY_FORMAT = "{class_name: pkg.module.ClassName, config: {...}, tool_schema: {type: function, function: {...}}}"


class ToolConfigError(UserError, ValueError):
    """A mistake in the tool config file; the message names the file, the entry and the fix."""


def _read_yaml(path: Path) -> Any:
    from mindspeed_llm.files import YamlFileError, read_yaml

    if path.is_dir():
        raise ToolConfigError(f"tool config {path} is a directory (--tool-config / tool_config_path): give the YAML "
                              "file itself, e.g. tools.yaml with a `tools:` list")
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


# the pydantic schema module of each published tool package whose BaseTool reads `tool_schema.function.name`
_SCHEMA_MODULES = {"verl": "verl.tools.schemas", "mindspeed_rl": "mindspeed_rl.tools.utils.schemas"}
_SCHEMA_SHAPE = "{type: object, properties: {name: {type: string, description: ...}}, required: [name]}"


def _pydantic_schema_type(cls: type) -> Optional[type]:
    """The pydantic schema type ``cls`` takes as ``tool_schema``: its constructor's annotation, else the
    ``OpenAIFunctionToolSchema`` of the published package (verl, MindSpeed-RL) one of its bases comes from."""
    try:
        hint = typing.get_type_hints(cls.__init__).get("tool_schema")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: look at the bases instead
        hint = None
    for candidate in (hint, *typing.get_args(hint)):
        if inspect.isclass(candidate) and callable(getattr(candidate, "model_validate", None)):
            return candidate
    for base in inspect.getmro(cls):
        module = _SCHEMA_MODULES.get(getattr(base, "__module__", "").split(".")[0])
        if module:
            try:
                return importlib.import_module(module).OpenAIFunctionToolSchema
            except Exception:  # noqa: BLE001 - not importable here: the SchemaDict behaves like it
                return None
    return None


def schema_for(cls: type, tool_schema: Mapping[str, Any], where: str) -> Any:
    """``tool_schema`` in the type ``cls`` takes: its pydantic schema type, validated (a mismatch is named), else a
    `SchemaDict`."""
    schema_type = _pydantic_schema_type(cls)
    if schema_type is None:
        return SchemaDict(tool_schema)
    try:
        return schema_type.model_validate(dict(tool_schema))
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError lists the fields
        try:  # one line: each field's path and problem
            problems = "; ".join(f"tool_schema.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        except Exception:  # noqa: BLE001
            problems = str(exc)
        raise ToolConfigError(f"{where}: tool_schema does not fit {schema_type.__module__}.{schema_type.__name__}, "
                              f"the schema type {cls.__name__} takes: {problems}") from None


def construct_tool(cls: type, config: Dict[str, Any], tool_schema: Optional[Dict[str, Any]],
                   where: str = "tool config") -> Any:
    """An instance of ``cls`` built with the arguments its constructor takes (verl's are config and tool_schema);
    the schema in the type the class takes (`schema_for`)."""
    parameters = inspect.signature(cls).parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    kwargs: Dict[str, Any] = {}
    if "config" in parameters or open_kwargs:
        kwargs["config"] = config
    if tool_schema is not None and ("tool_schema" in parameters or open_kwargs):
        kwargs["tool_schema"] = schema_for(cls, tool_schema, where)
    return cls(**kwargs)


def check_tool_schema(tool_schema: Any, where: str) -> None:
    """An OpenAI function schema the prompt can offer: ``type: function``, a function name, an optional string
    description and JSON-schema shaped ``parameters`` (an object schema: ``type: object``, ``properties`` of
    schemas, ``required`` naming properties); ToolConfigError naming the key and the fix otherwise."""
    fix = ("write tool_schema: {type: function, function: {name: ..., description: ..., parameters: "
           f"{_SCHEMA_SHAPE}}}}}")
    if not isinstance(tool_schema, Mapping):
        raise ToolConfigError(f"{where}: tool_schema is a {type(tool_schema).__name__}, not a mapping; {fix}")
    if tool_schema.get("type") != "function":
        raise ToolConfigError(f"{where}: tool_schema type {tool_schema.get('type')!r}: only function tools are "
                              f"offered to the model; {fix}")
    try:
        schema_name(tool_schema)
    except ValueError:
        raise ToolConfigError(f"{where}: tool_schema has no function name; {fix}") from None
    function = tool_schema["function"]
    if function.get("description") is not None and not isinstance(function.get("description"), str):
        raise ToolConfigError(f"{where}: tool_schema.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        return
    if not isinstance(parameters, Mapping):
        raise ToolConfigError(f"{where}: tool_schema.function.parameters is a {type(parameters).__name__}, not a JSON "
                              f"schema; write parameters: {_SCHEMA_SHAPE}")
    if not parameters:  # {}: a function without parameters
        return
    if parameters.get("type") != "object":
        raise ToolConfigError(f"{where}: tool_schema.function.parameters has type {parameters.get('type')!r}; the "
                              f"arguments of a call are an object: write parameters: {_SCHEMA_SHAPE}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(v, Mapping) for v in properties.values()):
        raise ToolConfigError(f"{where}: tool_schema.function.parameters.properties must map each parameter name to "
                              f"its JSON schema (e.g. {{type: string}}); write parameters: {_SCHEMA_SHAPE}")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolConfigError(f"{where}: tool_schema.function.parameters.required must be a list of parameter names")
    unknown = [r for r in required if r not in properties]
    if unknown:
        raise ToolConfigError(f"{where}: tool_schema.function.parameters.required names {', '.join(unknown)}, which "
                              "properties does not define")


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
        check_tool_schema(tool_schema, where)
        tool_schema = schema_dict(tool_schema)
    target = BUILTIN_TOOLS.get(class_name.strip()) or _import_attribute(class_name.strip(), where)
    if inspect.isclass(target) and not callable(getattr(target, "execute", None)):
        what = "no execute method" if getattr(target, "execute", None) is None else \
            f"an execute that is a {type(getattr(target, 'execute')).__name__}, not a method"
        raise ToolConfigError(f"{where}: class {class_name!r} has {what}; a tool class defines execute(self, "
                              "parameters, row) (or verl's async execute(self, instance_id, parameters, **kwargs))")
    try:
        if inspect.isclass(target):
            tool = adapt_tool(construct_tool(target, dict(config), tool_schema, where), tool_schema)
        else:
            tool = adapt_tool(target, tool_schema)
    except ToolConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a constructor's error or a function without hints: name the entry
        raise ToolConfigError(f"{where}: cannot make a tool of {class_name!r}: {type(exc).__name__}: {exc}") from None
    if tool_schema is None:  # the class's own schema (or the one built from a function's signature)
        try:
            own = schema_dict(tool.tool_schema)
        except Exception as exc:  # noqa: BLE001
            raise ToolConfigError(f"{where}: the tool_schema of {class_name!r} cannot be read: {exc}") from None
        check_tool_schema(own, f"{where} ({class_name}'s own tool_schema)")
    return tool


_BUILT: Dict[str, Tuple[Tuple[int, int], List[Any]]] = {}  # built by argument validation, for the run to take


def load_tool_config(path: str, cache: Optional[str] = None) -> List[Any]:
    """The tools of a tool config file, in file order; ToolConfigError naming the file, entry and fix.
    ``cache="store"`` (argument validation, before any model is built) keeps what it builds; ``cache="take"`` (the
    run's `multi_turn.ToolBox`) takes those tools when the file is unchanged since (size and modification time),
    once: a later load builds afresh, so tools never carry over from one run to the next in one process."""
    if cache not in (None, "store", "take"):
        raise ValueError(f"cache={cache!r}: use None, 'store' or 'take'")
    key = os.path.realpath(path)
    try:
        stamp = (os.stat(path).st_mtime_ns, os.stat(path).st_size)
    except OSError:
        stamp = None
    if cache == "take":
        stored = _BUILT.pop(key, None)
        if stored is not None and stored[0] == stamp:
            return list(stored[1])
    tools = _load(Path(path))
    if cache == "store" and stamp is not None:
        _BUILT.clear()
        _BUILT[key] = (stamp, tools)
    return list(tools)


def tool_schemas(path: str) -> List[Dict[str, Any]]:
    """The schemas of the tools of ``path`` as plain JSON data (what the prompts offer, `prompts.py`): those of the
    tools argument validation stored (left for the run's ``cache="take"``), else of tools built here."""
    stored = _BUILT.get(os.path.realpath(path))
    tools = stored[1] if stored is not None else load_tool_config(path)
    return [schema_dict(tool.tool_schema) for tool in tools]

def _load(file: Path) -> List[Any]:
    data = _read_yaml(file)
    if data is None:
        raise ToolConfigError(f"tool config {file} is empty; write a top-level `tools:` list of entries "
                              f"{_ENTRY_FORMAT}")
    tools_list = data.get("tools") if isinstance(data, Mapping) else None
    if isinstance(data, Mapping) and "tools" not in data:
        raise ToolConfigError(f"tool config {file} has no `tools:` key (it has {', '.join(map(str, data)) or 'none'}); "
                              f"write a top-level `tools:` list of entries {_ENTRY_FORMAT}")
    if not isinstance(tools_list, list) or not tools_list:
        raise ToolConfigError(f"tool config {file}: expected a top-level `tools:` list of entries {_ENTRY_FORMAT}"
                              + (" (the list is empty)" if tools_list == [] or tools_list is None else ""))
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
