"""A plain Python function as a tool (TRL's style): its OpenAI schema is built from its signature and docstring.

Type hints map to JSON schema as transformers' ``get_json_schema`` does: ``int`` -> integer, ``float`` -> number,
``str`` -> string, ``bool`` -> boolean, ``list`` / ``List[X]`` -> array (with ``items``), ``dict`` -> object,
``Optional[X]`` -> X with ``"nullable": true``, ``Union[X, Y]`` -> a list of types, ``Literal[...]`` -> ``enum``.
A parameter with a default is not required. The docstring's first paragraph is the description; a Google-style
``Args:`` section gives the parameters' descriptions (``name: text`` or ``name (type): text``, continuation lines
indented further).
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):\s*$")
_ARGS_SECTIONS = ("Args", "Arguments", "Parameters")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _type_schema(hint: Any, where: str) -> Dict[str, Any]:
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, List, tuple, Tuple):
        schema: Dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _type_schema(args[0], where)
        return schema
    if origin in (dict, Dict):
        return {"type": "object"}
    if origin is typing.Literal:
        kinds = {_SCALARS.get(type(value)) for value in args}
        schema = {"type": kinds.pop()} if len(kinds) == 1 else {}
        return {**schema, "enum": list(args)}
    if origin is typing.Union or type(hint).__name__ == "UnionType":  # Union[...], Optional[...], X | Y
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        if len(members) == 1:
            schema = _type_schema(members[0], where)
        else:
            schema = {"type": [_type_schema(m, where)["type"] for m in members]}
        return {**schema, "nullable": True} if nullable else schema
    raise ValueError(f"{where}: type {hint!r} has no JSON schema here; use int, float, str, bool, list, dict, "
                     "Optional[...], Union[...] or Literal[...]")


def parse_docstring(doc: Optional[str]) -> Tuple[str, Dict[str, str]]:
    """(description, {parameter: description}) from a docstring: the first paragraph, and the ``Args:`` lines."""
    lines = inspect.cleandoc(doc or "").splitlines()
    first: List[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    described: Dict[str, str] = {}
    in_args, header_indent, arg_indent, current = False, 0, None, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if not stripped:
            continue
        section = _SECTION.match(stripped)
        if section and (not in_args or indent <= header_indent):  # a section header at the level of `Args:`
            in_args, header_indent, arg_indent, current = section.group(1) in _ARGS_SECTIONS, indent, None, None
            continue
        if not in_args:
            continue
        match = _ARG_LINE.match(stripped)
        if match and (arg_indent is None or indent <= arg_indent):
            arg_indent, current = indent, match.group(1).lstrip("*")
            described[current] = match.group(2).strip()
        elif current is not None and indent > arg_indent:  # a continuation line of the current parameter
            described[current] = (described[current] + " " + stripped).strip()
    return " ".join(first), described


def function_schema(fn: Callable[..., Any]) -> Dict[str, Any]:
    """The OpenAI function schema of ``fn``; ValueError naming the parameter that has no type hint."""
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ValueError("a function tool needs a named function (def name(...)), not a lambda")
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - an unresolvable annotation: say which function
        raise ValueError(f"function tool {name!r}: cannot resolve its type hints ({exc})") from None
    description, described = parse_docstring(inspect.getdoc(fn))
    properties: Dict[str, Any] = {}
    required: List[str] = []
    for parameter in signature.parameters.values():
        where = f"function tool {name!r}, parameter {parameter.name!r}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"{where}: *args / **kwargs cannot be described to the model; name each parameter")
        if parameter.name not in hints:
            raise ValueError(f"{where} has no type hint; annotate it (e.g. {parameter.name}: int)")
        schema = _type_schema(hints[parameter.name], where)
        if parameter.name in described:
            schema["description"] = described[parameter.name]
        properties[parameter.name] = schema
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    parameters: Dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


class FunctionTool:
    """A tool that calls ``fn(**parameters)``; still callable as the function itself."""

    def __init__(self, fn: Callable[..., Any], tool_schema: Optional[Dict[str, Any]] = None):
        self.fn = fn
        self.tool_schema = tool_schema if tool_schema is not None else function_schema(fn)
        self.name = self.tool_schema["function"]["name"]
        self._accepted = set(inspect.signature(fn).parameters)
        self._required = {p.name for p in inspect.signature(fn).parameters.values() if p.default is p.empty}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def execute(self, parameters: Mapping[str, Any], row: Mapping[str, Any]) -> Any:
        # the model's mistakes in the arguments are told back to it plainly, not as a Python TypeError
        unknown = sorted(set(parameters) - self._accepted)
        missing = sorted(self._required - set(parameters))
        if unknown or missing:
            problems = ([f"unknown argument(s) {', '.join(unknown)}"] if unknown else []) + (
                [f"missing argument(s) {', '.join(missing)}"] if missing else [])
            raise ValueError(f"{'; '.join(problems)}; the parameters are {', '.join(sorted(self._accepted)) or 'none'}")
        return self.fn(**parameters)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name})"


def function_tool(fn: Callable[..., Any], tool_schema: Optional[Dict[str, Any]] = None) -> FunctionTool:
    """A tool from a plain function with type hints (usable as a decorator); ``tool_schema``, when given, is used
    instead of the one built from the signature."""
    return FunctionTool(fn, tool_schema)
