"""Partial rollouts (`--partial-rollout`, `rl/rollouts/partial.py`) in spawned processes; their buffers and flags in
one process: tests/unit/test_partial_rollout.py.

* On a real model (one spawn): a carried sample's tokens are those of one generation whose weights changed at the
  cut (greedy: the first k tokens of the old weights, then the new weights' continuation of prompt + those k).
* The stages (slow, `posttrain_gpt.py` processes): with a budget that cuts samples, a run and a SIGKILL after a
  save + resume give the same metrics and weights, bit for bit (grpo and trl_ppo); DP2 trains what DP1 trains.
"""

from __future__ import annotations

import io

import pytest
import torch

from mindspeed_llm.inference import Rollout, SamplingConfig
from mindspeed_llm.rl.rollouts.partial import PartialRollouts, pending
from mindspeed_llm.rl.rollouts.base import PromptSource
from mindspeed_llm.rl.rollouts.plain import PlainGenerator
from mindspeed_llm.rl.settings import AlgorithmSettings, BatchSettings, ToolSettings

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


MAX_NEW, SPLIT = 8, 2  # a round adds at most 4 tokens to a sample


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _WordTokenizer(_Tokenizer):
    def __len__(self):
        return 256  # word_task.VOCAB


def _weights_change_at_the_cut(rank, world_size, actor_root):
    from types import SimpleNamespace

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.inference import generate
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, seed=0)
    model = build_model(load_spec(actor_root))
    load_megatron_weights(model, actor_root)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (3, 5, 4, 6)]
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=0)  # greedy, no EOS: every sample takes 2 rounds
    settings = SimpleNamespace(algorithm=AlgorithmSettings(n_samples_per_prompt=1, partial_rollout_max_split=SPLIT,
                                                           max_num_gen_batches=4),
                               batch=BatchSettings(global_batch_size=2), tools=ToolSettings())
    buffers = PartialRollouts.from_settings(settings, PlainGenerator(model, _WordTokenizer(), sampling))

    def rows(j):
        return [dict(input_ids=prompts[2 * j + k], position=2 * j + k, index=2 * j + k) for k in range(2)]

    w0 = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    # iteration 1: round 1 cuts prompts 0, 1; round 2 finishes them and cuts prompts 2, 3 (after 4 tokens of W0)
    first, _ = buffers.collect(1, PromptSource(rows(0), rows))
    with torch.no_grad():  # "the update": W1 = W0 + noise
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.5 * p.detach().float().std().clamp(min=1e-3))
    second, _ = buffers.collect(2, PromptSource(rows(0), lambda j: rows(j + 1)))  # iteration 2: prompts 2, 3 finish under W1
    w1 = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    k = MAX_NEW // SPLIT
    cut = [prompts[2], prompts[3]]
    model.load_state_dict(w0, strict=False)
    head = generate(model, cut, SamplingConfig(max_new_tokens=k, pad_token_id=0), vocab_size=256)
    whole_w0 = generate(model, cut, sampling, vocab_size=256)
    model.load_state_dict(w1, strict=False)
    tail = generate(model, [p + h for p, h in zip(cut, head.response_token_lists())],
                    SamplingConfig(max_new_tokens=MAX_NEW - k, pad_token_id=0), vocab_size=256)
    whole_w1 = generate(model, cut, sampling, vocab_size=256)
    return dict(first=first, second=second, head=head, tail=tail, whole_w0=whole_w0, whole_w1=whole_w1)


def test_a_carried_sample_is_one_generation_whose_weights_changed_at_the_cut(task):
    """Greedy: the carried sample's response is W0's first k tokens, then W1's continuation of prompt + those k
    (a fresh generation from that longer prompt), with each part's log-probs; it is neither W0's nor W1's whole
    uninterrupted response."""
    from tests.helpers.multiproc import run_distributed

    out = run_distributed(_weights_change_at_the_cut, 1, task["mg_actor_tp1pp1"])[0]
    second, head, tail = out["second"], out["head"], out["tail"]
    assert second.sample_data.started == [1, 1]
    k = MAX_NEW // SPLIT
    got = [second.responses[b, :MAX_NEW].tolist() for b in range(2)]
    expected = [h + t for h, t in zip(head.response_token_lists(), tail.response_token_lists())]
    assert got == expected
    assert got != out["whole_w0"].response_token_lists() and got != out["whole_w1"].response_token_lists()
    torch.testing.assert_close(second.rollout_logp[:, :k], head.log_probs[:, :k], atol=1e-5, rtol=0)
    torch.testing.assert_close(second.rollout_logp[:, k:MAX_NEW], tail.log_probs[:, :MAX_NEW - k], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("partial_task"), reward=True, teacher=True)


def _stage_argv(task, out, stage, *extra):
    # 8 new tokens in rounds of 3: every iteration cuts samples; 40 stop ids (of 256) end some responses early, so
    # groups finish in different rounds and finished groups wait in the checkpoint too
    base = ["--stage", stage, "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path", task["tokenizer"],
            "--data-path", task["data"], "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", "4",
            "--max-length", "24", "--max-new-tokens", "8", "--do-sample", "--seed", "5", "--lr", "1e-2",
            "--stop-token-ids", ",".join(map(str, range(100, 140))), "--partial-rollout",
            "--partial-rollout-max-split", "3", "--save", str(out), "--load", str(out), "--save-interval", "1",
            "--metrics-jsonl", str(out / "metrics.jsonl"), "--no-check-for-divergence"]
    if stage == "grpo":
        base += ["--n-samples-per-prompt", "2", "--verifier-function", "first_line_answer", "--kl-coef", "0.01"]
    else:
        base += ["--reward-model", task["mg_reward_tp1pp1"]]
    return base + list(extra)


def _with_teacher(task, stage):
    """A teacher of another size scoring the carried samples once they are whole (issue 48: distillation with partial
    rollouts and exact resume): grpo's k3 as a loss, trl_ppo's k1 as a reward."""
    mode = ["--distill-loss", "k3", "--distill-mode", "loss"] if stage == "grpo" else ["--distill-coef", "0.5"]
    return ["--teacher-load", task["mg_teacher_tp1pp1"], *mode]


def _compared(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith("_tps")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo", "trl_ppo"])
def test_kill_and_resume_gives_the_same_metrics_and_weights(task, tmp_path, stage):
    """A run of 4 iterations, and the same command SIGKILLed right after its save of iteration 2 and run again
    (it resumes, with the carried and the waiting groups): the same metrics rows and weights, bit for bit; with a
    teacher (`_with_teacher`), whose signal on the carried samples must come out the same after the resume."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.multiproc import single_rank_env
    from tests.helpers.kill_driver import write_kill_after_save
    from tests.helpers.stage_layouts import full_weights
    from tests.helpers.stage_assets import ROOT

    whole, split = tmp_path / "whole", tmp_path / "split"
    driver = write_kill_after_save(tmp_path / "kill_after_save.py")

    def run(script, out, **env):
        argv = _stage_argv(task, out, stage, *_with_teacher(task, stage))
        return subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, capture_output=True, text=True,
                              env=dict(single_rank_env(), **env), timeout=300)

    done = run(Path(ROOT) / "posttrain_gpt.py", whole)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run(driver, split, KILL_AT="2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    from mindspeed_llm.checkpoint import load_shard
    saved = load_shard(str(split / "actor"), 0, 0, 2, weights_only=False)["data_position"]["partial_rollout"]
    assert pending(saved)[0] > 0  # the checkpoint carries cut samples across the kill
    again = run(Path(ROOT) / "posttrain_gpt.py", split)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {split} at iteration 2" in again.stdout

    rows = {name: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for name, out in (("whole", whole), ("split", split))}
    assert [r["iteration"] for r in rows["split"]] == [1, 2, 3, 4]
    assert [_compared(r) for r in rows["whole"]] == [_compared(r) for r in rows["split"]]
    assert any(r["partial_rollout/carried"] > 0 for r in rows["whole"])
    assert max(r["partial_rollout/max_staleness"] for r in rows["whole"]) >= 1
    assert all(r["distill/kl_mean"] != 0 for r in rows["whole"])  # the teacher took part in every iteration
    assert os.path.exists(split / "latest_checkpointed_iteration.txt")
    for role in ("actor",) + (("critic",) if stage == "trl_ppo" else ()):
        a, b = full_weights(whole, role), full_weights(split, role)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), role


@pytest.mark.slow
def test_dp2_trains_what_dp1_trains(task, tmp_path):
    """grpo with cut samples at DP2 and at DP1 (same global batch): the same groups train (the same partial_rollout
    metrics and rewards), the losses to float rounding (another reduction order)."""
    import json

    from tests.helpers.multiproc import run_distributed
    from tests.helpers.stage_layouts import run_stages

    def argv(out):
        return ["--stage", "grpo", "--micro-batch-size", "2", "--global-batch-size", "4", "--n-samples-per-prompt",
                "2", "--seed", "5", "--data-path", task["data"], "--tokenizer-name-or-path", task["tokenizer"],
                "--max-length", "24", "--max-new-tokens", "8", "--do-sample", "--ref-model", task["mg_actor_tp1pp1"],
                "--verifier-function", "odd_first_word", "--kl-coef", "0.05", "--lr", "0.01", "--train-iters", "3",
                "--partial-rollout", "--partial-rollout-max-split", "3",
                "--stop-token-ids", ",".join(map(str, range(100, 140))), "--metrics-jsonl", str(out / "m.jsonl"),
                "--no-check-for-divergence"]

    run_distributed(run_stages, 2, [argv(tmp_path / "dp2")])
    run_distributed(run_stages, 1, [argv(tmp_path / "dp1")])
    rows = {dp: [json.loads(line) for line in (tmp_path / dp / "m.jsonl").read_text().splitlines()]
            for dp in ("dp1", "dp2")}
    assert any(r["partial_rollout/waiting"] > 0 for r in rows["dp1"])
    for one, two in zip(rows["dp1"], rows["dp2"]):
        exact = [k for k in one if k.startswith(("partial_rollout/", "grpo/score/", "response_length/"))]
        assert {k: one[k] for k in exact} == {k: two[k] for k in exact}
        for key in ("actor/pg_loss", "grad_norm", "actor/kl_loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
