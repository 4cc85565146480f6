"""Tools for multi-turn rollouts: what a tool is, the tool config file, the built-in tools, reading tool calls from
the model's text, running calls off the generation loop, and the chat template's tool delta as token ids.

- `base`: the tool protocol, `ToolResult`, `as_tool_result` (any answer as text), the schema helpers;
- `function_tool`: a plain function with type hints as a tool (schema from signature and docstring);
- `config`: ``load_tool_config(path)`` for verl's / MindSpeed-RL's ``tools:`` YAML, `BUILTIN_TOOLS`;
- `adapters`: verl-style tools (``instance_id``, ``async``) seen through the protocol;
- `calculator`, `python_exec`: the built-in tools (the python tool's kernel sandbox: `sandbox`, `sandbox_child`);
- `parsers`: ``TOOL_PARSERS`` (``hermes``), ``ParsedTurn``, ``ToolCall``;
- `executor`: ``ToolExecutor`` (per-trajectory create/release, parallel calls, timeouts, counters);
- `chat_delta`: ``ToolDelta`` (token-in / token-out), ``truncate``, ``tools_prompt``;
- `prompts`: the tools offered in a dataset's prompts, rendered at rollout time (imported by the run, not here).

Light to import: no torch, no megatron, and transformers only through the tokenizer objects passed in.
"""

from mindspeed_llm.rl.tools.base import (
    BaseTool, SchemaDict, Tool, ToolResult, ToolTimeout, as_text, as_tool_result, schema_dict, tool_name,
)
from mindspeed_llm.rl.tools.calculator import CalculatorTool, calculate
from mindspeed_llm.rl.tools.chat_delta import ToolDelta, hermes_tools_block, tools_prompt, truncate, truncate_text
from mindspeed_llm.rl.tools.config import (
    BUILTIN_TOOLS, ToolConfigError, check_tool_schema, load_tool_config, tool_schemas,
)
from mindspeed_llm.rl.tools.executor import ToolExecutor, TurnResult
from mindspeed_llm.rl.tools.function_tool import FunctionTool, function_schema, function_tool
from mindspeed_llm.rl.tools.parsers import TOOL_PARSERS, HermesParser, ParsedTurn, ToolCall, get_parser
from mindspeed_llm.rl.tools.python_exec import PythonTool, run_python

__all__ = [
    "BUILTIN_TOOLS", "BaseTool", "CalculatorTool", "FunctionTool", "HermesParser", "ParsedTurn", "PythonTool",
    "SchemaDict", "as_text", "check_tool_schema", "schema_dict",
    "TOOL_PARSERS", "Tool", "ToolCall", "ToolConfigError", "ToolDelta", "ToolExecutor", "ToolResult", "ToolTimeout",
    "TurnResult", "as_tool_result", "calculate", "function_schema", "function_tool", "get_parser",
    "hermes_tools_block", "load_tool_config", "run_python", "tool_name", "tool_schemas", "tools_prompt", "truncate",
    "truncate_text",
]
