"""The demo with ``--tools``: the tool task's answers, the tools offered in prompts preprocessed without them, the
tool-use conversation loop on a scripted model, the reward on the last turn, the stage's command line and the
report's tool panel.

Fast: a character-level ChatML tokenizer built in place (no model, no download).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from mindspeed_llm.demo import tool_task

@pytest.fixture(scope="module")
def char_tok_dir(tmp_path_factory):
    """Characters (newlines too) as tokens; ids 0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|> as SmolLM2, special;
    SmolLM2's template shape."""
    from tests.helpers.hf_tiny import write_char_tokenizer

    return Path(write_char_tokenizer(tmp_path_factory.mktemp("char_tok")))


@pytest.fixture(scope="module")
def char_tok(char_tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(char_tok_dir))


# ---- the task ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(tool_task.TOOL_VARIANTS))
def test_tool_splits_correct_disjoint_deterministic(name):
    train, test = tool_task.make_tool_splits(name, n_train=300, n_test=50, seed=7)
    assert (train, test) == tool_task.make_tool_splits(name, n_train=300, n_test=50, seed=7)
    assert len(train) == 300 and len(test) == 50
    v = tool_task.TOOL_VARIANTS[name]
    keys = set()
    for row in train + test:
        expr = row["problem"][len("What is "):-len("? Answer with just the number.")]
        numbers = [int(x) for x in expr.split(f" {v.op} ")]
        assert all(lo <= n <= hi for n, (lo, hi) in zip(numbers, v.operands))
        want = numbers[0]
        for n in numbers[1:]:
            want = want * n if v.op == "*" else want + n
        assert row["answer"] == str(want) == str(tool_task.expression_value(expr))
        assert row["messages"][-1] == {"role": "user", "content": row["problem"]}
        assert len(row["messages"]) == 4 * v.shots + 1
        keys.add(tuple(sorted(numbers)))
    assert len(keys) == 350  # disjoint, also as unordered operands
    shots = {tuple(sorted(int(x) for x in e.split(" * "))) for e, _ in tool_task.SHOTS}
    assert not keys & shots  # a worked example is never asked


def test_shot_messages_show_a_call_the_parser_reads():
    from mindspeed_llm.rl.tools import TOOL_PARSERS, calculate

    messages = tool_task.shot_messages(tool_task.TOOL_VARIANTS["mul3x2_2shot"])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"] * 2
    for call, tool, reply in zip(messages[1::4], messages[2::4], messages[3::4]):
        parsed = TOOL_PARSERS["hermes"]().parse(call["content"])
        assert parsed.calls[0].name == "calculator"
        assert calculate(parsed.calls[0].arguments["expression"]) == tool["content"] == reply["content"]


def test_final_answer_reads_the_last_assistant_turn():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "896 * 66"}}\n</tool_call><|im_end|>'
    trajectory = {"turns": [{"role": "assistant", "text": call, "tool_calls": [{}]},
                            {"role": "tool", "text": "\n<|im_start|>tool\n59136<|im_end|>\n<|im_start|>assistant\n"},
                            {"role": "assistant", "text": "59136<|im_end|>", "tool_calls": []}],
                  "num_turns": 2, "tool_calls": 1, "tool_reward": 0.0}
    text = "".join(t["text"] for t in trajectory["turns"])
    assert tool_task.final_answer(text, "59136", trajectory=trajectory) == 1.0
    assert tool_task.final_answer(text, "59136") == 1.0  # without the trajectory: after the last assistant header
    assert tool_task.final_answer(text, "59137", trajectory=trajectory) == 0.0
    assert tool_task.final_answer(call, "59136") == 0.0  # a call alone is no answer
    assert tool_task.final_answer("896 * 66 = 59136<|im_end|>", "59136") == 1.0  # in the head, right, counts


def test_tool_config_loads_the_calculator(tmp_path):
    from mindspeed_llm.rl.tools import load_tool_config

    tools = load_tool_config(str(tool_task.write_tool_config(tmp_path / "tools.yaml")))
    assert [t.name for t in tools] == ["calculator"]
    assert tools[0].execute({"expression": "896 * 66"}, {}) == "59136"


# ---- preprocessing ----------------------------------------------------------------------------------------------

def _preprocess(tmp_path, tok_dir, name, extra):
    from mindspeed_llm.data.preprocess import preprocess
    from mindspeed_llm.data.prompt_dataset import PromptDataset

    train, _ = tool_task.make_tool_splits("mul3x2", n_train=3, n_test=1)
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(train))
    prefix = tmp_path / name / "train"
    res = preprocess(["--input", str(src), "--tokenizer-name-or-path", str(tok_dir), "--output-prefix", str(prefix),
                      "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "chatml",
                      "--log-interval", "0", *extra])
    return res, PromptDataset(str(prefix)), train


def test_the_run_offers_the_tools_in_prompts_preprocessed_without_them(tmp_path, char_tok_dir, char_tok):
    from mindspeed_llm.demo.tool_eval import render_tool_prompts
    from mindspeed_llm.rl.tools import CalculatorTool
    from mindspeed_llm.rl.tools.prompts import offer_run_tools

    config = tool_task.write_tool_config(tmp_path / "tools.yaml")
    keys = json.dumps({"prompt": "messages", "system": "system", "labels": "answer"})
    res, data, rows = _preprocess(tmp_path, char_tok_dir, "tools", ["--map-keys", keys])
    assert "tools" not in res.meta
    stored = char_tok.decode(list(data[0]["input_ids"]), skip_special_tokens=False)
    assert "# Tools" not in stored and "<|im_start|>tool\n47058<|im_end|>" in stored  # the worked example's tool turn
    train, held_out = offer_run_tools(str(config), char_tok, data, [(None, data)])
    for offered in (train, held_out[0][1]):  # the training prompts and the held-out ones, as the engine gets them
        text = char_tok.decode(offered[0]["input_ids"], skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
        assert text.endswith(f"<|im_start|>user\n{rows[0]['problem']}<|im_end|>\n<|im_start|>assistant\n")
        # the evaluation renders the same prompt through the tokenizer's own template
        assert render_tool_prompts(char_tok, rows[:1], [CalculatorTool().tool_schema]) == [text]
        assert offered.prompt_lengths[0] == len(offered[0]["input_ids"]) > data.prompt_lengths[0]
    assert offer_run_tools(None, char_tok, data, None) == (data, None)  # no tools: the prompts as they are


def test_preprocess_refuses_tool_config_by_name(tmp_path, char_tok_dir):
    from mindspeed_llm.data.errors import DataError

    config = tool_task.write_tool_config(tmp_path / "tools.yaml")
    with pytest.raises(DataError, match="--tool-config .*tools.yaml: preprocessing no longer puts the tools into the "
                                        "prompts; the run renders them from its own --tool-config at rollout time"):
        _preprocess(tmp_path, char_tok_dir, "refused", ["--map-keys", json.dumps({"prompt": "problem",
                                                                                  "labels": "answer"}),
                                                        "--tool-config", str(config)])
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())  # nothing written


def test_preprocess_without_tool_config_is_unchanged(tmp_path, char_tok_dir, char_tok):
    res, data, rows = _preprocess(tmp_path, char_tok_dir, "plain",
                                  ["--map-keys", json.dumps({"prompt": "problem", "labels": "answer"})])
    assert "tools" not in res.meta
    text = char_tok.decode(list(data[0]["input_ids"]), skip_special_tokens=False)
    assert text == f"<|im_start|>user\n{rows[0]['problem']}<|im_end|>\n<|im_start|>assistant\n"


# ---- the conversation loop --------------------------------------------------------------------------------------

def _scripted(tok, replies):
    """A `Generate` that answers the i-th call with the texts of ``replies[i]`` (one per input), recording inputs."""
    seen = []

    def generate(inputs, max_new_tokens):
        seen.append([list(x) for x in inputs])
        out = replies[len(seen) - 1]
        assert len(out) == len(inputs)
        return [tok.encode(text, add_special_tokens=False) for text in out]

    generate.seen = seen
    return generate


def test_conversation_runs_calls_and_feeds_answers_back(char_tok):
    from mindspeed_llm.demo.tool_eval import ToolLoopSettings, run_conversations, tool_metrics
    from mindspeed_llm.rl.tools import CalculatorTool, ToolDelta

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "896 * 66"}}\n</tool_call><|im_end|>'
    bad = '<tool_call>\n{"name": "calculator", "arguments": 5}\n</tool_call><|im_end|>'
    gen = _scripted(char_tok, [[call, "5708<|im_end|>", bad], ["59136<|im_end|>", "I give up<|im_end|>"]])
    prompts = [char_tok.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False) for i in range(3)]
    rows = [{"answer": "59136"}, {"answer": "59136"}, {"answer": "1"}]
    settings = ToolLoopSettings(max_assistant_turns=3, max_tool_calls=2, max_new_tokens=200,
                                max_total_response_length=400)
    convs = run_conversations(gen, prompts, rows, [CalculatorTool()], char_tok, settings)
    delta = ToolDelta(char_tok).delta_ids(["59136"])
    call_ids = char_tok.encode(call, add_special_tokens=False)
    # token-in / token-out: the second turn's input is the prompt, the sampled ids, then the tool delta
    assert gen.seen[1][0] == prompts[0] + call_ids + delta
    assert convs[0]["response_ids"] == call_ids + delta + char_tok.encode("59136<|im_end|>", add_special_tokens=False)
    assert convs[0]["tool_mask"] == [0] * len(call_ids) + [1] * len(delta) + [0] * 6
    assert [c["finish"] for c in convs] == ["stop", "stop", "stop"]
    assert [c["trajectory"]["num_turns"] for c in convs] == [2, 1, 2]
    assert convs[2]["trajectory"]["turns"][1]["text"].startswith("error: tool call 1")  # the malformed call answered
    assert convs[2]["trajectory"]["failures"] == 1
    texts = [char_tok.decode(c["response_ids"], skip_special_tokens=False) for c in convs]
    scores = [tool_task.final_answer(t, r["answer"], trajectory=c["trajectory"]) for t, r, c in zip(texts, rows, convs)]
    assert scores == [1.0, 0.0, 0.0]
    m = tool_metrics(convs, scores)
    assert m["accuracy"] == pytest.approx(1 / 3) and m["tool_call_rate"] == pytest.approx(1 / 3)
    assert m["num_turns"] == pytest.approx(5 / 3)


def test_conversation_limits(char_tok):
    from mindspeed_llm.demo.tool_eval import ToolLoopSettings, run_conversations
    from mindspeed_llm.rl.tools import CalculatorTool

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call><|im_end|>'
    prompt = [char_tok.encode("<|im_start|>assistant\n", add_special_tokens=False)]
    # max_assistant_turns 2: the second call is not run
    gen = _scripted(char_tok, [[call], [call]])
    conv = run_conversations(gen, prompt, [{}], [CalculatorTool()], char_tok,
                             ToolLoopSettings(max_assistant_turns=2, max_tool_calls=5, max_new_tokens=200,
                                              max_total_response_length=1000))[0]
    assert conv["finish"] == "turns" and conv["trajectory"]["tool_calls"] == 1 and len(gen.seen) == 2
    # a turn cut by max_new_tokens ends the conversation, its calls unread
    gen = _scripted(char_tok, [[call]])
    conv = run_conversations(gen, prompt, [{}], [CalculatorTool()], char_tok,
                             ToolLoopSettings(max_new_tokens=20, max_total_response_length=1000))[0]
    assert conv["finish"] == "length" and len(conv["response_ids"]) == 20 and conv["trajectory"]["tool_calls"] == 0


# ---- the demo's command line and report -------------------------------------------------------------------------

def _args(**kw):
    from mindspeed_llm.demo import run

    args = run.build_parser().parse_args(["--tools", *kw.pop("argv", [])])
    for name, (real, _) in {**run.DEFAULTS, **__import__("mindspeed_llm.demo.tool_demo",
                                                         fromlist=["DEFAULTS"]).DEFAULTS}.items():
        if getattr(args, name) is None:
            setattr(args, name, real)
    return args


def test_stage_command_with_tools(tmp_path):
    from mindspeed_llm.demo import run

    args = _args()
    assert args.tools and args.max_new_tokens == 48
    cmd = [str(a) for a in run.stage_command(args, "d/train", "mg", "hf", tmp_path / "m.jsonl", tmp_path / "ck",
                                             ["--n-samples-per-prompt", 4], tmp_path / "tools.yaml")]
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert flags["--tool-config"] == str(tmp_path / "tools.yaml")
    assert flags["--max-assistant-turns"] == "2" and flags["--max-tool-calls"] == "1"
    assert flags["--max-total-response-length"] == "128" and flags["--max-new-tokens"] == "48"
    assert flags["--custom-reward-function"].endswith("mindspeed_llm/demo/tool_task.py:final_answer")
    # the prompts (393 tokens with two worked examples) fit, and the trajectory fits after them
    assert int(flags["--max-prompt-length"]) >= 475
    assert int(flags["--max-length"]) == int(flags["--max-prompt-length"]) + 128
    assert "--stop-token-ids" not in cmd and "--verifier-function" not in cmd  # a call spans lines
    plain = [str(a) for a in run.stage_command(argparse.Namespace(**{**vars(args), "tools": False}), "d", "mg", "hf",
                                               tmp_path / "m", tmp_path / "c", [])]
    assert "--tool-config" not in plain and "--stop-token-ids" in plain and "first_line_answer" in plain


def test_custom_reward_loads_by_path():
    from mindspeed_llm.demo import tool_demo
    from mindspeed_llm.rl.reward_functions import load_reward_function

    fn = load_reward_function(f"{tool_demo.REWARD}:final_answer")
    assert fn.plan.style == "keyword" and fn.plan.context == ("trajectory",)


def test_report_plots_turns_and_tool_calls(tmp_path):
    from mindspeed_llm.demo import report

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "grpo/score/mean": i / 10, "num_turns/mean": 1 + i / 10,
                                        "tool/calls": 3 * i, "tool/failures": 1}) + "\n" for i in range(1, 6)))
    summary = report.write_report(path, tmp_path / "r.png", 0.05, 0.6, print_fn=None)
    assert summary["metrics"]["tool/calls"]["last"] == 9.0 and (tmp_path / "r.png").stat().st_size > 1000


def test_hf_generator_shared_prefix_matches_left_padding(tmp_path, char_tok_dir):
    """Prefilling the batch's shared prefix once (then the rows' own tokens after masked padding) gives the ids that
    plain left padding gives (greedy), rows of different lengths included."""
    from mindspeed_llm.demo.evaluate import load_hf
    from mindspeed_llm.demo.model import tiny_random_llama
    from mindspeed_llm.demo.tool_eval import common_prefix_length, hf_generator

    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2 and common_prefix_length([]) == 0
    model, _ = load_hf(tiny_random_llama(tmp_path / "m", char_tok_dir, num_layers=2, hidden_size=64, seed=3))
    prefix = [1] + [5 + i % 50 for i in range(40)]
    inputs = [prefix + [7, 8, 9], prefix + [10], prefix + [11, 12, 13, 14, 15, 16], prefix[:39]]
    plain = hf_generator(model, 2, [2], share_prefix=False)(inputs, 6)
    shared = hf_generator(model, 2, [2], share_prefix=True, min_shared=8)(inputs, 6)
    assert shared == plain and all(len(x) == 6 for x in plain)
