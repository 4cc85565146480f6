"""rl/tools/config.py: the verl / MindSpeed-RL tool config file, with a user's tool module from outside the package
(tests/fixtures/user_tools, put on sys.path here as a user's PYTHONPATH would be) and the built-ins; every error
names the file, the entry and the fix."""

import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed_llm.errors import UserError
from mindspeed_llm.rl.tools import (
    CalculatorTool, FunctionTool, PythonTool, ToolConfigError, ToolExecutor, ToolCall, load_tool_config,
)
from mindspeed_llm.rl.tools.adapters import InstanceTool

USER_TOOLS = Path(__file__).resolve().parents[1] / "fixtures" / "user_tools"

VERL_STYLE = """
tools:
  - class_name: "my_tools.LookupTool"
    config:
      type: native
      prefix: "got "
    tool_schema:
      type: "function"
      function:
        name: "lookup"
        description: "Look up a key."
        parameters:
          type: "object"
          properties:
            key: {type: "string", description: "The key."}
          required: ["key"]
  - class_name: my_tools.multiply
  - class_name: my_tools:ConfigOnlyTool
    config: {suffix: "?"}
  - class_name: my_tools.NoArgumentTool
  - class_name: calculator
  - class_name: python
    config: {timeout: 2, memory_mb: 256}
"""


@pytest.fixture
def user_tools(monkeypatch):
    monkeypatch.syspath_prepend(str(USER_TOOLS))
    yield
    sys.modules.pop("my_tools", None)  # each test imports it afresh from its own sys.path


def write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_user_module_is_not_importable_without_its_folder_on_the_path():
    with pytest.raises(ImportError):
        __import__("my_tools")


def test_loads_a_verl_style_config_with_user_tools_and_builtins(tmp_path, user_tools):
    tools = load_tool_config(str(write(tmp_path, VERL_STYLE)))
    assert [t.name for t in tools] == ["lookup", "multiply", "shout", "ping", "calculator", "python"]
    lookup, multiply, shout, ping, calculator, python = tools
    assert lookup.config == {"type": "native", "prefix": "got "}  # verl's cls(config=..., tool_schema=...)
    assert lookup.tool_schema["function"]["parameters"]["required"] == ["key"]
    assert isinstance(multiply, FunctionTool) and multiply.tool_schema["function"]["description"] == \
        "Multiply two integers."
    assert shout.suffix == "?" and shout.execute({"text": "hi"}, {}) == "HI?"
    assert ping.execute({}, {}) == "pong"
    assert isinstance(calculator, CalculatorTool) and isinstance(python, PythonTool)
    assert python.config["timeout"] == 2 and python.config["memory_mb"] == 256

    executor = ToolExecutor(tools, timeout=10)
    executor.start("t", {"label": "42"})
    turn = executor.run("t", [ToolCall("lookup", {"key": "k"}), ToolCall("multiply", {"a": 6, "b": 7})])
    assert turn.messages == ["got k=42", "42"] and turn.reward == 0.5 and turn.metrics == {"lookup": {"lookups": 1.0}}
    executor.finish("t")


def test_config_schema_wins_for_a_function(tmp_path, user_tools):
    path = write(tmp_path, """
        tools:
          - class_name: my_tools.multiply
            tool_schema: {type: function, function: {name: times, description: Product., parameters: {}}}
    """)
    (tool,) = load_tool_config(str(path))
    assert tool.name == "times" and tool.tool_schema["function"]["description"] == "Product."
    assert tool.execute({"a": 2, "b": 3}, {}) == 6


def test_verl_async_instance_tool_gets_an_id_per_trajectory(tmp_path, user_tools):
    path = write(tmp_path, """
        tools:
          - class_name: my_tools.AsyncInstanceTool
            config: {type: native}
            tool_schema: {type: function, function: {name: counter, description: Count calls., parameters: {}}}
    """)
    (tool,) = load_tool_config(str(path))
    assert isinstance(tool, InstanceTool)
    import my_tools

    my_tools.EVENTS.clear()
    executor = ToolExecutor([tool])
    row = {"extra_info": {"tools_kwargs": {"counter": {"create_kwargs": {"start": 7}}}}}
    executor.start("a", row)
    executor.start("b", {})
    first = executor.run("a", [ToolCall("counter", {})]).messages[0]
    second = executor.run("a", [ToolCall("counter", {})]).messages[0]
    other = executor.run("b", [ToolCall("counter", {})]).messages[0]
    assert first.startswith("call 1 of") and first.endswith("start=7")
    assert second.startswith("call 2 of") and other.startswith("call 1 of") and other.endswith("start=None")
    executor.finish("a")
    executor.finish("b")
    created = [d for e, d in my_tools.EVENTS if e == "async_create"]
    released = [d for e, d in my_tools.EVENTS if e == "async_release"]
    assert len(set(created)) == 2 and sorted(created) == sorted(released)
    assert tool.inner.instances == {}


@pytest.mark.parametrize("text, message", [
    ("tools: [", r"line 1, column 9: not valid YAML"),
    ("tools:\n  - class_name: calculator\n    class_name: python\n",
     r"'tools\[0\].class_name' is given twice \(lines 2 and 3\)"),
    ("other: 1\n", r"has no `tools:` key \(it has other\); write a top-level `tools:` list"),
    ("tools: []\n", r"expected a top-level `tools:` list .* \(the list is empty\)"),
    ("", r"is empty; write a top-level `tools:` list"),
    ("tools:\n", r"expected a top-level `tools:` list .* \(the list is empty\)"),
    ("tools:\n  - class_name: my_tools.NoExecute\n", r"tools\[0\]: class 'my_tools.NoExecute' has no execute method"),
    ("tools:\n  - class_name: my_tools.NumberExecute\n",
     r"class 'my_tools.NumberExecute' has an execute that is a int, not a method"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
     "'a: int'}}\n",
     r"tools\[0\]: tool_schema.function.parameters is a str, not a JSON schema; write parameters: \{type: object"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
     "{type: string}}}\n",
     r"parameters has type 'string'; the arguments of a call are an object"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
     "{type: object, properties: {x: int}}}}\n", r"properties must map each parameter name to its JSON schema"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
     "{type: object, properties: {x: {type: integer}}, required: [y]}}}\n", r"required names y, which properties"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: retrieval, function: {name: c}}\n",
     r"tools\[0\]: tool_schema type 'retrieval': only function tools are offered to the model"),
    ("tools:\n  - class_name: my_tools.BadOwnSchema\n",
     r"tools\[0\] \(my_tools.BadOwnSchema's own tool_schema\): tool_schema type None"),
    ("tools:\n  - config: {}\n", r"tools\[0\]: missing class_name; write class_name: pkg.module.ClassName"),
    ("tools:\n  - 3\n", r"tools\[0\]: an entry must be a mapping"),
    ("tools:\n  - class_name: calculator\n  - class_name: not_a_module_here.Tool\n",
     r"tools\[1\]: cannot import module 'not_a_module_here'.*put the folder that holds not_a_module_here on PYTHONPATH"),
    ("tools:\n  - class_name: my_tools.Missing\n", r"tools\[0\]: module 'my_tools' .* has no attribute 'Missing'"),
    ("tools:\n  - class_name: wordcount\n", "neither a built-in tool .calculator, python. nor a dotted path"),
    ("tools:\n  - class_name: my_tools.LookupTool\n    tool_schema: {type: function, function: {description: x}}\n",
     r"tools\[0\]: tool_schema has no function name; write tool_schema: \{type: function"),
    ("tools:\n  - class_name: calculator\n  - class_name: my_tools.multiply\n"
     "    tool_schema: {type: function, function: {name: calculator}}\n",
     r"tools\[1\]: tool name 'calculator' is also the name of tools\[0\]"),
    ("tools:\n  - class_name: my_tools.no_hints\n",
     r"tools\[0\]: cannot make a tool of 'my_tools.no_hints'.*parameter 'a' has no type hint"),
    ("tools:\n  - class_name: python\n    config: {timeout_s: 3}\n", r"unknown config key\(s\) timeout_s"),
    ("tools:\n  - class_name: calculator\n    config: {type: mcp}\n", "config type 'mcp' is not supported"),
])
def test_each_error_names_the_file_the_entry_and_the_fix(tmp_path, user_tools, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ToolConfigError, match=message) as caught:
        load_tool_config(str(path))
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, UserError)  # the entry points print it as one line, without a traceback


def test_missing_file(tmp_path):
    with pytest.raises(ToolConfigError, match=r"no_such\.yaml: no such file \(--tool-config"):
        load_tool_config(str(tmp_path / "no_such.yaml"))


def test_error_inside_the_user_module_is_shown(tmp_path, monkeypatch):
    (tmp_path / "broken_tools.py").write_text("import not_installed_dependency\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools:\n  - class_name: broken_tools.Tool\n")
    with pytest.raises(ToolConfigError, match="importing 'broken_tools' failed: No module named "
                                              "'not_installed_dependency'"):
        load_tool_config(str(path))
    sys.modules.pop("broken_tools", None)


# ------------------------------------------------------------------------ published tool classes, as published
VERL_GSM8K_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "gsm8k_tool_config.yaml"


@pytest.fixture
def verl_tools():
    from tests.helpers.verl_tools import published_verl_tools

    with published_verl_tools() as root:
        yield root


def test_verls_own_gsm8k_tool_config_runs_verls_gsm8k_tool(verl_tools):
    """verl's gsm8k_tool_config.yaml (verbatim) with verl's Gsm8kTool, BaseTool and schemas (the wheel's files): the
    tool gets verl's pydantic OpenAIFunctionToolSchema, and its rewards are verl's (0 for an improved answer, -0.05
    for one that is not)."""
    from verl.tools.base_tool import BaseTool as VerlBaseTool
    from verl.tools.gsm8k_tool import Gsm8kTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    (tool,) = load_tool_config(str(VERL_GSM8K_CONFIG))
    assert isinstance(tool, InstanceTool) and type(tool.inner) is Gsm8kTool and isinstance(tool.inner, VerlBaseTool)
    assert isinstance(tool.inner.tool_schema, OpenAIFunctionToolSchema) and tool.name == "calc_gsm8k_reward"
    import yaml

    published = yaml.safe_load(VERL_GSM8K_CONFIG.read_text())["tools"][0]["tool_schema"]
    executor = ToolExecutor([tool], timeout=10)
    assert executor.schemas == [published]  # the prompt offers the YAML's schema as written
    row = {"extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
    executor.start("t", row)
    wrong = executor.run("t", [ToolCall("calc_gsm8k_reward", {"answer": "70"})])
    right = executor.run("t", [ToolCall("calc_gsm8k_reward", {"answer": "72"})])
    again = executor.run("t", [ToolCall("calc_gsm8k_reward", {"answer": "72"})])
    executor.finish("t")
    assert wrong.messages == ["Current parsed answer='70' reward=0.0"] and wrong.reward == -0.05
    assert right.messages == ["Current parsed answer='72' reward=1.0"] and right.reward == 0.0
    assert again.reward == -0.05 and (wrong.failures, right.failures, again.failures) == (0, 0, 0)
    assert tool.inner._instance_dict == {}  # released


def test_verls_gsm8k_tool_config_passes_argument_validation(verl_tools, tmp_path):
    """The sweep's failure was at start-up: the run's argument validation now builds verl's tool and accepts it."""
    from mindspeed_llm.arguments import parse_args

    settings = parse_args(["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", str(tmp_path / "d"),
                           "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r",
                           "--tool-config", str(VERL_GSM8K_CONFIG)], 1).settings
    assert settings.tools.tool_config == str(VERL_GSM8K_CONFIG)
    (tool,) = load_tool_config(str(VERL_GSM8K_CONFIG), cache="take")
    assert type(tool.inner).__name__ == "Gsm8kTool" and tool.name == "calc_gsm8k_reward"


def test_a_schema_verls_type_refuses_is_named(verl_tools, tmp_path):
    path = write(tmp_path, """
        tools:
          - class_name: verl.tools.gsm8k_tool.Gsm8kTool
            config: {type: native}
            tool_schema:
              type: function
              function: {name: g, description: d, parameters: {type: object, properties: {a: {description: x}},
                                                               required: [a]}}
    """)
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: tool_schema does not fit "
                                              r"verl.tools.schemas.OpenAIFunctionToolSchema, the schema type "
                                              r"Gsm8kTool takes: tool_schema.function.parameters.properties.a.type: "
                                              r"Field required$"):
        load_tool_config(str(path))


def test_a_mindspeed_rl_style_tool_reads_its_schema_as_attributes(tmp_path, user_tools):
    """Without MindSpeed-RL installed, a class written against its pydantic schema gets a SchemaDict: the schema line
    of its BaseTool (`tool_schema.function.name`, `model_dump(...)`) passes and the tool runs."""
    text = """
        tools:
          - class_name: my_tools.MindSpeedRLStyleTool
            config: {type: native, default_timeout: 30}
            tool_schema:
              type: function
              function:
                name: code_interpreter
                description: A tool for executing code.
                parameters: {type: object, properties: {code: {type: string, description: The code.}}, required: [code]}
    """
    (tool,) = load_tool_config(str(write(tmp_path, text)))
    import yaml

    published = yaml.safe_load(textwrap.dedent(text))["tools"][0]["tool_schema"]
    assert tool.name == "code_interpreter" and tool.inner.dumped == published and tool.inner.required == ["code"]
    executor = ToolExecutor([tool])
    executor.start("t", {})
    turn = executor.run("t", [ToolCall("code_interpreter", {"code": "print(1)"})])
    executor.finish("t")
    assert turn.messages == ["ran 'print(1)'"] and turn.failures == 0 and executor.schemas == [published]
