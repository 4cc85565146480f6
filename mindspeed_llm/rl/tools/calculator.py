"""The built-in ``calculator`` tool: arithmetic on numbers, read with `ast` and evaluated node by node (no `eval`).

Allowed: int and float literals, ``+ - * / // % **``, unary ``-`` / ``+`` and parentheses. Everything else (names,
calls, attributes, strings, ``^``) is refused. Sizes are bounded before they are computed, so a hostile expression
cannot take the process's memory or time: the expression's length, an exponent's magnitude, and every integer
result's number of bits. Mistakes come back as text starting with ``error:`` (the model reads them), never as
exceptions.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Dict, Mapping, Optional, Union

Number = Union[int, float]

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_RESULT_BITS = 4096  # about 1233 decimal digits
MAX_DEPTH = 100  # nesting; `ast` itself recurses, so a deep expression is refused before it is walked

CALCULATOR_SCHEMA: Dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. 12345 * 678"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculationError(ValueError):
    """An expression the calculator refuses or cannot compute; its message is shown to the model."""


def _bits(value: Number) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_size(op: type, left: Number, right: Number) -> None:
    """Refuse an operation whose integer result would be too big, before computing it."""
    if op is ast.Pow:
        if abs(right) > MAX_EXPONENT:
            raise CalculationError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(left, int) and isinstance(right, int) and right > 0 and _bits(left) * right > MAX_RESULT_BITS:
            raise CalculationError("the result is too large")
    elif op is ast.Mult and _bits(left) + _bits(right) > MAX_RESULT_BITS + 1:
        raise CalculationError("the result is too large")


def _evaluate(node: ast.AST, depth: int = 0) -> Number:
    if depth > MAX_DEPTH:
        raise CalculationError("the expression is nested too deeply")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass: refused
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        _check_size(type(node.op), left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # (-8) ** 0.5
            raise CalculationError("the result is not a real number")
        if _bits(result) > MAX_RESULT_BITS:
            raise CalculationError("the result is too large")
        return result
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculationError("^ is not a power here; write ** (2 ** 10)")
    raise CalculationError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def format_number(value: Number) -> str:
    """An int as all its digits; a float with up to 15 significant digits (0.1 + 0.2 -> 0.3)."""
    if isinstance(value, int):
        return str(value)
    if math.isinf(value) or math.isnan(value):
        raise CalculationError("the result is not a finite number")
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.15g}"


def calculate(expression: str) -> str:
    """The value of ``expression`` as text; CalculationError with a message for the model."""
    text = expression.strip()
    if not text:
        raise CalculationError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if text.count("(") > MAX_DEPTH:
        raise CalculationError("the expression is nested too deeply")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculationError(f"cannot read {text!r} as arithmetic") from None
    try:
        return format_number(_evaluate(tree))
    except ZeroDivisionError:
        raise CalculationError("division by zero") from None
    except OverflowError:
        raise CalculationError("the result is too large") from None


class CalculatorTool:
    """``calculator(expression)``: safe arithmetic. Stateless: shared by all trajectories."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Optional[Dict[str, Any]] = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or CALCULATOR_SCHEMA
        self.name = self.tool_schema["function"]["name"]

    def execute(self, parameters: Mapping[str, Any], row: Mapping[str, Any]) -> str:
        expression = parameters.get("expression")
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            return 'error: give the expression as a string argument: {"expression": "12 * 34"}'
        try:
            return calculate(expression)
        except CalculationError as exc:
            return f"error: {exc}"
