"""rl/tools: the tool result helper, function tools (schema from signature and docstring), the calculator and the
hermes call parser. Pure Python, no subprocess."""

import time
from typing import Dict, List, Literal, Optional, Union

import pytest

from mindspeed_llm.rl.tools import (
    TOOL_PARSERS, CalculatorTool, ToolCall, ToolResult, as_tool_result, calculate, function_schema, function_tool,
    get_parser,
)
from mindspeed_llm.rl.tools.calculator import CalculationError


# ---- ToolResult ---------------------------------------------------------------------------------------------------
def test_as_tool_result_normalises_every_return_shape():
    assert as_tool_result("4") == ToolResult("4")
    assert as_tool_result(ToolResult("x", 1.0)) == ToolResult("x", 1.0)
    assert as_tool_result(("x", 1)) == ToolResult("x", 1.0, {})
    assert as_tool_result(("x", None, {"n": 2})) == ToolResult("x", None, {"n": 2})
    assert as_tool_result(42) == ToolResult("42")
    assert as_tool_result({"a": 1}) == ToolResult('{"a": 1}')
    assert as_tool_result(None) == ToolResult("")

    class Response:  # verl's ToolResponse-like object
        text = "from .text"

    assert as_tool_result((Response(), 0.0, {})) == ToolResult("from .text", 0.0, {})
    with pytest.raises(TypeError, match="reward must be a number"):
        as_tool_result(("x", "high"))


# ---- function tools -----------------------------------------------------------------------------------------------
def search(query: str, limit: int = 5, exact: bool = False, scale: Optional[float] = None,
           tags: List[str] = (), filters: Dict[str, str] = None, mode: Literal["fast", "deep"] = "fast",
           key: Union[int, str] = 0) -> str:
    """Search the notes.

    Returns the matching lines, best first.

    Args:
        query: The words to look for.
        limit (int): How many lines to return
            at most.
        exact: Match whole words only.
        tags: Only notes with these tags.

    Returns:
        The lines.
    """
    return f"{query}:{limit}"


def test_function_schema_from_signature_and_docstring():
    assert function_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "The words to look for."},
                    "limit": {"type": "integer", "description": "How many lines to return at most."},
                    "exact": {"type": "boolean", "description": "Match whole words only."},
                    "scale": {"type": "number", "nullable": True},
                    "tags": {"type": "array", "items": {"type": "string"}, "description": "Only notes with these tags."},
                    "filters": {"type": "object"},
                    "mode": {"type": "string", "enum": ["fast", "deep"]},
                    "key": {"type": ["integer", "string"]},
                },
                "required": ["query"],
            },
        },
    }


def test_function_tool_executes_and_tells_the_model_its_argument_mistakes():
    tool = function_tool(search)
    assert tool.name == "search" and tool("q") == "q:5"  # still callable as the function
    assert tool.execute({"query": "cats", "limit": 2}, {}) == "cats:2"
    with pytest.raises(ValueError, match="missing argument"):
        tool.execute({}, {})
    with pytest.raises(ValueError, match="unknown argument.*colour"):
        tool.execute({"query": "q", "colour": "red"}, {})


def test_function_without_a_hint_is_refused_naming_the_parameter():
    def add(a: int, b):
        return a + b

    with pytest.raises(ValueError, match="parameter 'b' has no type hint"):
        function_tool(add)
    with pytest.raises(ValueError, match="lambda"):
        function_tool(lambda x: x)

    def star(*args: int):
        return 0

    with pytest.raises(ValueError, match=r"\*args"):
        function_tool(star)


def test_given_schema_wins_over_the_signature():
    schema = {"type": "function", "function": {"name": "find", "description": "d", "parameters": {}}}
    assert function_tool(search, schema).tool_schema is schema and function_tool(search, schema).name == "find"


# ---- calculator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, expected", [
    ("12345 * 678", "8369910"), ("2 ** 10 - 24", "1000"), ("-(3 + 4) * 2", "-14"), ("7 // 2", "3"),
    ("7 % 4", "3"), ("1 / 4", "0.25"), ("0.1 + 0.2", "0.3"), ("10 / 2", "5"), ("+5", "5"), ("2 ** -1", "0.5"),
    ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_arithmetic(expression, expected):
    assert calculate(expression) == expected
    assert CalculatorTool().execute({"expression": expression}, {}) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo hi')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("True + 1", "Constant is not allowed"),
    ("9 ** 9 ** 9", "too large"),
    ("2 ** 100000", "too large"),
    ("10.0 ** 400", "too large"),
    ("(10 ** 1000) * (10 ** 1000) * (10 ** 1000)", "too large"),
    ("1 / 0", "division by zero"),
    ("2 ^ 3", "write \\*\\*"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "cannot read"),
    ("(" * 200 + "1" + ")" * 200, "nested too deeply"),
    ("1" * 2000, "longer than"),
    ("", "empty"),
])
def test_calculator_refuses_hostile_and_huge_inputs_as_text(expression, message):
    with pytest.raises(CalculationError, match=message):
        calculate(expression)
    assert CalculatorTool().execute({"expression": expression}, {}).startswith("error: ")


def test_calculator_refuses_a_huge_power_before_computing_it():
    started = time.monotonic()
    with pytest.raises(CalculationError, match="too large"):
        calculate("(10 ** 1200) ** 9000")  # within the exponent bound, but 36 million bits
    assert time.monotonic() - started < 0.5


def test_calculator_argument_shapes():
    tool = CalculatorTool()
    assert tool.execute({"expression": 12}, {}) == "12"
    assert tool.execute({}, {}).startswith("error: give the expression")


# ---- hermes parser ------------------------------------------------------------------------------------------------
def test_hermes_parses_one_and_several_calls_and_keeps_the_content():
    parser = TOOL_PARSERS["hermes"]()
    assert (parser.start, parser.end) == ("<tool_call>", "</tool_call>")
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
            '</tool_call>\n<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    turn = parser.parse(text)
    assert turn.calls == [ToolCall("calculator", {"expression": "2 + 3"}), ToolCall("python", {"code": "print(1)"})]
    assert turn.errors == [] and turn.content == "Let me compute." and turn.has_calls
    no_call = parser.parse("The answer is 5.")
    assert no_call.calls == [] and no_call.errors == [] and not no_call.has_calls
    assert parser.parse('<tool_call>{"name": "ping"}</tool_call>').calls == [ToolCall("ping", {})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "", "arguments": {}}', 'has no "name"'),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be an object'),
    ('{"name": "calculator", "arguments": "not json"}', "not JSON"),
    ('["calculator"]', "must be a JSON object"),
])
def test_hermes_malformed_calls_become_errors_never_exceptions(body, message):
    turn = get_parser("hermes").parse(f'ok <tool_call>{{"name": "a", "arguments": {{}}}}</tool_call>'
                                      f"<tool_call>{body}</tool_call>")
    assert turn.calls == [ToolCall("a", {})]
    assert len(turn.errors) == 1 and turn.errors[0].startswith("error: tool call 2") and message in turn.errors[0]
    assert "<tool_call>" in turn.errors[0]  # the error shows the model the expected format


def test_hermes_unclosed_tag_is_an_error():
    turn = get_parser("hermes").parse('<tool_call>{"name": "a", "arguments": {}}')
    assert turn.calls == [] and "no closing </tool_call>" in turn.errors[0] and turn.has_calls


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown tool parser format 'json'; known: hermes"):
        get_parser("json")
