"""The multi-turn flags (`--tool-config` and its limits; `arguments/rollouts.py`): the trajectory's budget resolved
from --max-length, what does not combine refused by name, and the startup line that says where the model learns of
the tools (the prompts' `_meta.json` from `preprocess_data.py --tool-config`), a mismatch refused. The YAML keys of
MindSpeed-RL's multi-turn config reach the same flags."""

import json
from pathlib import Path

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
    (["--tool-config", "{tools}", "--tool-parser-format", "nosuchparser"],
     "--tool-parser-format nosuchparser: no such tool call parser; known: hermes"),
    (["--tool-config", "{folder}"], "is a directory (--tool-config / tool_config_path): give the YAML file itself"),
    (["--tool-config", "{no_execute}"], "class 'tool_mod.NoExecute' has no execute method"),
    (["--tool-config", "{string_parameters}"], "tool_schema.function.parameters is a str, not a JSON schema"),
    (["--tool-rewards", "record"], "--tool-rewards record has no effect without --tool-config"),
])
def test_refused_by_name(tmp_path, tools, extra, needle, monkeypatch):
    """In argument validation (`parse_args`), before any model is built."""
    (tmp_path / "tool_mod.py").write_text("class NoExecute:\n    tool_schema = {'type': 'function', "
                                          "'function': {'name': 'n'}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "no_execute.yaml").write_text("tools:\n  - class_name: tool_mod.NoExecute\n")
    (tmp_path / "string_parameters.yaml").write_text(
        "tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c, parameters: "
        "'{\"x\": 1}'}}\n")
    paths = dict(tools=tools, folder=str(tmp_path), no_execute=str(tmp_path / "no_execute.yaml"),
                 string_parameters=str(tmp_path / "string_parameters.yaml"))
    with pytest.raises(ArgumentError) as caught:
        parse_args(_args(tmp_path, *[e.format(**paths) for e in extra]), 1)
    assert needle in str(caught.value)


def test_the_tools_built_by_validation_are_the_runs_and_tool_rewards_resolve(tmp_path, tools):
    from mindspeed_llm.rl.tools import load_tool_config

    settings = parse_args(_args(tmp_path, "--tool-config", tools), 1).settings
    assert settings.reward.tool_rewards == "add"  # the default: a tool's rewards enter the score
    from mindspeed_llm.rl.tools import config as tool_config

    validated = tool_config._BUILT[str(Path(tools).resolve())][1]
    built = load_tool_config(tools, cache="take")  # as the run's ToolBox does: validation's objects
    assert [t.name for t in built] == ["calculator"] and built[0] is validated[0]
    assert load_tool_config(tools, cache="take")[0] is not built[0]  # taken once: the next load builds afresh
    settings = parse_args(_args(tmp_path, "--tool-config", tools, "--tool-rewards", "record"), 1).settings
    assert settings.reward.tool_rewards == "record"
    assert parse_args(_args(tmp_path), 1).settings.reward.tool_rewards is None  # no tools: nothing to add


def test_a_tool_parser_without_tools_is_said_ignored(tmp_path, tools):
    args = parse_args(_args(tmp_path, "--tool-parser-format", "hermes"), 1)
    assert any(note.startswith("--tool-parser-format hermes is ignored: no --tool-config")
               for note in args.settings.startup.startup_notes)
    without = parse_args(_args(tmp_path), 1).settings.startup.startup_notes
    assert not any("tool-parser-format" in note for note in without)
    with_tools = parse_args(_args(tmp_path, "--tool-config", tools), 1)
    assert with_tools.settings.tools.tool_parser_format == "hermes"  # the default
    assert not any("tool-parser-format" in note for note in with_tools.settings.startup.startup_notes)


def test_the_startup_line_says_how_the_prompts_offer_the_tools(tmp_path, tools):
    from mindspeed_llm.arguments.parser import build_parser
    from mindspeed_llm.arguments.validation import validate_args
    from mindspeed_llm.data.templates import get_template

    def notes(data, **meta):
        (tmp_path / f"{data}_meta.json").write_text(json.dumps(meta))
        args = build_parser().parse_args(_args(tmp_path, "--tool-config", tools, data=data))
        validate_args(args, 1)
        return [n for n in args.settings.startup.startup_notes if n.startswith("multi-turn")]

    chatml, empty = get_template("chatml").to_dict(), get_template("empty").to_dict()
    assert "offer the tools calculator, rendered at rollout time from --tool-config through the chat template " \
           "chatml" in notes("plain", template=chatml)[0]
    assert "the chat template empty of --data-path" in notes("bare", template=empty)[0]  # no system turn: said
    old = {"names": ["calculator"], "schemas": [{"type": "function", "function": {"name": "calculator"}}]}
    assert "the block of the tools calculator an earlier preprocessing put in is kept where it is that block, else " \
           "replaced by it (never two blocks)" in notes("offered", template=chatml, tools=old)[0]
    with pytest.raises(ArgumentError, match=r"preprocessed with the tools \['search'\].*no schemas recorded.*"
                                            "preprocess the data again"):
        notes("other", template=chatml, tools={"names": ["search"]})


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
