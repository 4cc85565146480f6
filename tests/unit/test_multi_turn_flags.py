"""The multi-turn flags (`--tool-config` and its limits; `arguments/rollouts.py`): the trajectory's budget resolved
from --max-length, what does not combine refused by name, and the startup line that says where the model learns of
the tools (the prompts' `_meta.json` from `preprocess_data.py --tool-config`), a mismatch refused. The YAML keys of
MindSpeed-RL's multi-turn config reach the same flags."""

import json

import pytest

from mindspeed_llm.arguments import ArgumentError, parse_args

TOOLS = """tools:
  - class_name: calculator
    tool_schema: {type: function, function: {name: calculator, description: d, parameters: {type: object}}}
"""


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS)
    return str(path)


def _args(tmp_path, *extra, data="d"):
    return ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", str(tmp_path / data),
            "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r", *extra]


def test_the_trajectory_budget_defaults_to_what_max_length_leaves(tmp_path, tools):
    settings = parse_args(_args(tmp_path, "--tool-config", tools, "--max-length", "512", "--max-prompt-length",
                                "100", "--max-new-tokens", "64"), 1).settings
    assert settings.tools.tool_config == tools and settings.tools.max_total_response_length == 412
    assert settings.tools.max_new_tokens == 64 and settings.tools.parked_kv == "auto"
    given = parse_args(_args(tmp_path, "--tool-config", tools, "--max-length", "512", "--max-prompt-length", "100",
                             "--max-total-response-length", "300", "--max-parallel-calls", "2"), 1).settings
    assert given.tools.max_total_response_length == 300 and given.tools.max_parallel_calls == 2


@pytest.mark.parametrize("extra,needle", [
    (["--multi-turn"], "--multi-turn (multi_turn_enable) needs the tools: give --tool-config"),
    (["--tool-config", "no_such.yaml"], "--tool-config no_such.yaml: no such file"),
    (["--tool-config", "{tools}", "--max-length", "64", "--max-prompt-length", "32", "--max-new-tokens", "16",
      "--max-total-response-length", "40"], "raise --max-length to 72"),
    (["--tool-config", "{tools}", "--max-length", "256", "--max-prompt-length", "32", "--max-new-tokens", "64",
      "--max-total-response-length", "40"], "--max-new-tokens 64 (one model turn) exceeds --max-total-response-length"),
    (["--tool-config", "{tools}", "--dynamic-sampling"], "with --dynamic-sampling is not supported yet"),
    (["--tool-config", "{tools}", "--max-tool-calls", "-1"], "--max-tool-calls -1 must be >= 0"),
    (["--tool-config", "{tools}", "--tool-timeout", "0"], "--tool-timeout 0.0 must be > 0"),
])
def test_refused_by_name(tmp_path, tools, extra, needle):
    with pytest.raises(ArgumentError) as caught:
        parse_args(_args(tmp_path, *[e.format(tools=tools) for e in extra]), 1)
    assert needle in str(caught.value)


def test_the_startup_line_says_whether_the_prompts_offer_the_tools(tmp_path, tools):
    from mindspeed_llm.arguments.parser import build_parser
    from mindspeed_llm.arguments.validation import validate_args

    def notes(data):
        args = build_parser().parse_args(_args(tmp_path, "--tool-config", tools, data=data))
        validate_args(args, 1)
        return [n for n in args.startup_notes if n.startswith("multi-turn")]

    assert "offer no tools (preprocessed without --tool-config)" in notes("plain")[0]
    (tmp_path / "offered_meta.json").write_text(json.dumps({"tools": {"names": ["calculator"]}}))
    assert "the prompts offer the tools calculator (rendered at preprocessing" in notes("offered")[0]
    (tmp_path / "other_meta.json").write_text(json.dumps({"tools": {"names": ["calculator", "search"]}}))
    with pytest.raises(ArgumentError, match="has no search: the model would call tools that are not there"):
        notes("other")


def test_mindspeed_rl_multi_turn_keys_reach_the_flags(tmp_path, tools):
    from mindspeed_llm.run_config import config_argv

    config = tmp_path / "run.yaml"
    config.write_text(f"""
rl_config:
  multi_turn_enable: true
  tool_config_path: {tools}
  max_tool_calls: 1
  max_parallel_calls: 1
  max_total_response_length: 2048
  max_tool_response_length: 256
  tool_response_truncate_side: 'middle'
  tool_parser_format: 'hermes'
  async_engine: true
""")
    argv = config_argv(["--config", str(config)])
    for flag, value in (("--tool-config", tools), ("--max-tool-calls", "1"), ("--max-parallel-calls", "1"),
                        ("--max-total-response-length", "2048"), ("--max-tool-response-length", "256"),
                        ("--tool-response-truncate-side", "middle"), ("--tool-parser-format", "hermes")):
        assert f"{flag}={value}" in argv, flag
    assert "--multi-turn" in argv
