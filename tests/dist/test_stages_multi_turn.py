"""Multi-turn tool use in the stages (`--tool-config`, `rl/rollouts/tool_turns.py`) on the word task, with a user's tool, call
parser and reward function from outside the package (tests/fixtures/word_tools/word_tools.py; the tokenizer gets a
word-level chat template with a tool role).

* grpo: a run of 3 iterations, and the same command SIGKILLed right after its save of iteration 2 and run again: the
  same metrics rows and weights, bit for bit; the trajectories really have several turns and tool calls.
* grpo at DP2, TP2, PP2, CP2 and with token-budget micro-batches trains what DP1 trains (the same turns, tool rewards, scores;
  the losses to float rounding).
* trl_ppo runs with tools (GAE over the model's tokens, the critic beside them); its held-out evaluation generates
  trajectories with the tools too.
* two ranks render the tools into a share of the prompts each and gather them: each holds what one process renders.
The engine's parking against single-turn generations: tests/dist/test_multi_turn_engine.py; the masks and GAE over
tool spans by hand: tests/unit/test_tool_mask.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.word_task import TOOL_CONFIG, TOOLS_DIR  # the user's tool, call parser and reward function

pytestmark = [pytest.mark.usefixtures("warm_ranks"), pytest.mark.slow]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    root = tmp_path_factory.mktemp("multi_turn_task")
    paths = word_task.build(root, layouts=((1, 1), (2, 1), (1, 2)), reward=True)
    sys.path.insert(0, str(TOOLS_DIR))  # the warm ranks take the caller's sys.path (tests/helpers/multiproc.py)
    yield dict(paths, **word_task.write_chat_tools(root, paths["tokenizer"]))
    sys.path.remove(str(TOOLS_DIR))


def _argv(task, out, stage, *extra):
    # turns of up to 4 tokens, 40 stop ids (of 256) end some early; a trajectory of at most 3 turns in 14 tokens
    base = ["--stage", stage, "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path",
            task["chat_tokenizer"], "--data-path", task["data"], "--global-batch-size", "2", "--micro-batch-size", "2",
            "--train-iters", "3", "--max-length", "24", "--max-prompt-length", "8", "--max-new-tokens", "4",
            "--do-sample", "--seed", "5", "--lr", "1e-2", "--stop-token-ids", ",".join(map(str, range(100, 140))),
            "--tool-config", task["tools"], "--tool-parser-format", "first_word_even", "--max-assistant-turns", "3",
            "--max-total-response-length", "14", "--max-tool-response-length", "3", "--save", str(out), "--load",
            str(out), "--save-interval", "1", "--metrics-jsonl", str(out / "metrics.jsonl"),
            "--no-check-for-divergence"]
    if stage == "grpo":
        base += ["--n-samples-per-prompt", "2", "--custom-reward-function",
                 f"{TOOLS_DIR / 'word_tools.py'}:turns_reward", "--kl-coef", "0.01"]
    else:
        base += ["--reward-model", task["mg_reward_tp1pp1"]]
    return base + list(extra)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _compared(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith(("_tps", "seconds"))
            and k != "tool/wait_share"}


def _env():
    from tests.helpers.multiproc import single_rank_env
    from tests.helpers.stage_assets import ROOT

    return dict(single_rank_env(), PYTHONPATH=os.pathsep.join([str(ROOT), str(TOOLS_DIR)]))


@pytest.mark.parametrize("rollouts", ["whole", "partial"])
def test_grpo_with_tools_resumes_after_sigkill_bit_for_bit(task, tmp_path, rollouts):
    """Also with --partial-rollout: trajectories cut in rounds of 5 tokens (inside turns, while tools run, after
    tool answers) and carried across iterations and across the kill."""
    from tests.helpers.stage_assets import ROOT
    from tests.helpers.kill_driver import write_kill_after_save
    from tests.helpers.stage_layouts import full_weights

    whole, split = tmp_path / "whole", tmp_path / "split"
    driver = write_kill_after_save(tmp_path / "kill_after_save.py")

    extra = ["--partial-rollout", "--partial-rollout-max-split", "3"] if rollouts == "partial" else []

    def run(script, out, **env):
        return subprocess.run([sys.executable, str(script), *_argv(task, out, "grpo", *extra)], cwd=ROOT,
                              capture_output=True, text=True, env=dict(_env(), **env), timeout=300)

    done = run(Path(ROOT) / "posttrain_gpt.py", whole)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run(driver, split, KILL_AT="2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if rollouts == "partial":
        from mindspeed_llm.checkpoint import load_shard
        from mindspeed_llm.rl.rollouts.partial import pending

        saved = load_shard(str(split / "actor"), 0, 0, 2, weights_only=False)["data_position"]["partial_rollout"]
        assert pending(saved)[0] > 0  # cut trajectories cross the kill
        assert any(s["observed"] for rank in saved["carried"] for g in rank for s in g["samples"])
    again = run(Path(ROOT) / "posttrain_gpt.py", split)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {split} at iteration 2" in again.stdout

    rows = {"whole": _rows(whole), "split": _rows(split)}
    assert [r["iteration"] for r in rows["split"]] == [1, 2, 3]
    assert [_compared(r) for r in rows["whole"]] == [_compared(r) for r in rows["split"]]
    assert max(r["num_turns/max"] for r in rows["whole"]) >= 2 and sum(r["tool/calls"] for r in rows["whole"]) > 0
    assert all(r["tool/failures"] == 0 and r["tool/timeouts"] == 0 for r in rows["whole"])
    # the tool's own metric (`ToolResult.metrics`), summed over the calls: at least one word a call
    assert all(r.get("tool/echo/words", 0) >= r["tool/calls"] for r in rows["whole"])
    assert sum(r.get("tool/echo/words", 0) for r in rows["whole"]) > 0
    # the tool's own reward (0.25 a call) reaches the score; the user's reward sees the turns
    assert any(r["tool/reward/mean"] > 0 for r in rows["whole"]) and any(r["custom_rewards/mean"] > 0
                                                                         for r in rows["whole"])
    a, b = full_weights(whole, "actor"), full_weights(split, "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grpo_with_tools_is_layout_invariant(task, tmp_path):
    """DP2, TP2, PP2, CP2 and token-budget micro-batches train what DP1 trains: the same trajectories (turns, tool
    rewards, scores, lengths), the losses to float rounding (another reduction order)."""
    from tests.helpers.multiproc import run_distributed
    from tests.helpers.stage_layouts import run_stages

    def argv(out, *extra):
        return _argv(task, out, "grpo", "--global-batch-size", "4", "--train-iters", "2", "--log-samples", "8", *extra)

    tp2 = ["--tensor-model-parallel-size", "2", "--ref-model", task["mg_actor_tp2pp1"]]
    pp2 = ["--pipeline-model-parallel-size", "2", "--ref-model", task["mg_actor_tp1pp2"]]
    run_distributed(run_stages, 2, [argv(tmp_path / "dp2"), argv(tmp_path / "tp2", *tp2),
                                    argv(tmp_path / "pp2", *pp2),
                                    argv(tmp_path / "cp2", "--context-parallel-size", "2")])
    run_distributed(run_stages, 1, [argv(tmp_path / "dp1"),
                                    argv(tmp_path / "budget", "--max-tokens-per-micro-batch", "40")])
    one = _rows(tmp_path / "dp1")
    assert sum(r["tool/calls"] for r in one) > 0
    for layout in ("dp2", "tp2", "pp2", "cp2", "budget"):
        for a, b in zip(one, _rows(tmp_path / layout)):
            exact = [k for k in a if k.startswith(("num_turns/", "grpo/score/", "response_length", "custom_rewards/",
                                                   "tool/reward/"))]
            assert {k: a[k] for k in exact} == {k: b[k] for k in exact}, layout
            # tool/calls etc. count a rank's own rollouts' calls
            for key in ("actor/pg_loss", "grad_norm", "actor/kl_loss"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (layout, key)
    # the sample tables: the whole batch's trajectories, their turns and tool calls, the same at every layout
    samples = [json.loads(line) for line in (tmp_path / "dp1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8 and any(r["tool_calls"] > 0 for r in samples)
    called = next(r for r in samples if r["tool_calls"] > 0)
    assert called["num_turns"] == len([t for t in called["turns"] if t["role"] == "assistant"]) > 1
    assert called["score_parts"]["custom"] == called["score"] - called["score_parts"].get("tool", 0.0)
    for layout in ("dp2", "tp2", "pp2", "cp2", "budget"):
        other = [json.loads(line) for line in (tmp_path / layout / "samples.jsonl").read_text().splitlines()]
        assert [(r["prompt"], r["response"], r["turns"]) for r in other] == \
            [(r["prompt"], r["response"], r["turns"]) for r in samples], layout


def test_trl_ppo_with_tools_runs_gae_over_the_model_tokens(task, tmp_path):
    from tests.helpers.multiproc import run_distributed
    from tests.helpers.stage_layouts import run_stages

    out = tmp_path / "ppo"
    run_distributed(run_stages, 1, [_argv(task, out, "trl_ppo", "--train-iters", "2", "--eval-data-path",
                                          task["data"], "--eval-interval", "2", "--eval-samples", "4")])
    rows = [r for r in _rows(out) if "tool/calls" in r]
    assert len(rows) == 2 and sum(r["tool/calls"] for r in rows) > 0
    evaluated = [r for r in _rows(out) if "eval/score/mean" in r]  # the held-out prompts as trajectories too
    assert evaluated and all("eval/num_turns/mean" in r and "eval/tool/calls" in r for r in evaluated)
    for r in rows:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in r.items() if isinstance(v, float))
        assert r["response_length_with_tools/mean"] > r["response_length/mean"] or r["tool/calls"] == 0


def test_grpo_with_a_hostile_tool_and_recorded_tool_rewards(task, tmp_path):
    """A tool that exits, answers a number with a reward of 1e30, or a lone surrogate: the run trains, those calls
    are failures counted at once (no --tool-timeout waited), and with --tool-rewards record the score is the reward
    function's alone, the tool's reward a recorded score part."""
    from tests.helpers.multiproc import run_distributed
    from tests.helpers.stage_layouts import run_stages

    config = tmp_path / "hostile.yaml"
    config.write_text(TOOL_CONFIG.replace("word_tools.EchoTool", "word_tools.HostileEchoTool"))
    out = tmp_path / "hostile"
    run_distributed(run_stages, 1, [_argv(task, out, "grpo", "--train-iters", "2", "--global-batch-size", "4",
                                          "--tool-config", str(config), "--tool-rewards", "record",
                                          "--tool-timeout", "120", "--log-samples", "8")])
    rows = _rows(out)
    assert len(rows) == 2 and sum(r["tool/calls"] for r in rows) >= 2
    assert sum(r["tool/failures"] for r in rows) >= 1 and all(r["tool/timeouts"] == 0 for r in rows)
    assert all(r["tool/seconds"] < 60 for r in rows)  # a SystemExit is not a timeout of 120 s
    for r in rows:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in r.items() if isinstance(v, float)), r
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        assert "tool" not in sample["score_parts"] and sample["score"] == sample["score_parts"]["custom"]
    assert any(s["score_parts"].get("tool_recorded", 0.0) == 0.5 for s in samples)  # the surrogate call's reward


def _offered_prompts(rank, world_size, prefix, tokenizer_dir, tool_config):
    """The training prompts one rank of the run gets offering the tools, as `trainer.run` renders them (each rank a
    share, gathered): every prompt's ids and the lengths the --max-prompt-length check reads."""
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.data.tokenizer import load_tokenizer
    from mindspeed_llm.distributed import world_share
    from mindspeed_llm.rl.tools.prompts import offer_run_tools

    offered, _ = offer_run_tools(tool_config, load_tokenizer("PretrainedFromHF", tokenizer_dir), PromptDataset(prefix),
                                 None, ranks=world_share())
    return [offered[i]["input_ids"] for i in range(len(offered))], [int(n) for n in offered.prompt_lengths]


def test_every_rank_gets_the_prompts_one_process_renders(tmp_path):
    """Two ranks render the tools into a share of the prompts each (Qwen2.5's `# Tools` section, 7 prompts) and
    gather them over the process group: each gets every prompt's ids and length as one process rendering them all."""
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.data.offline_tokenizer import cached_qwen2_5_tokenizer
    from mindspeed_llm.demo.tool_task import write_tool_config
    from tests.helpers.fixtures_data import QWEN25_CHAT_TEMPLATE, run_preprocess
    from tests.helpers.multiproc import run_distributed

    tokenizer_dir = str(cached_qwen2_5_tokenizer(chat_template=QWEN25_CHAT_TEMPLATE))
    rows = [{"instruction": f"What is {i} * 7?", "system": "You solve sums." if i % 2 else ""} for i in range(7)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    run_preprocess(tokenizer_dir, tmp_path / "rows.json", tmp_path / "data", "R1AlpacaStyleInstructionHandler",
                   "qwen", map_keys={"prompt": "instruction", "system": "system", "labels": "instruction"})
    args = (str(tmp_path / "data"), tokenizer_dir, str(write_tool_config(tmp_path / "tools.yaml")))
    alone = _offered_prompts(0, 1, *args)
    stored = PromptDataset(args[0]).prompt_lengths
    assert all(offered > own for offered, own in zip(alone[1], stored))  # every prompt offers the tools
    assert run_distributed(_offered_prompts, 2, *args) == [alone, alone]
