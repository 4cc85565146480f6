"""benchmarks/memory.py: the projection and the micro-batch padding analysis against hand computations (fast), and
the benchmark itself at a toy size (slow): its JSON's structure and invariants of what it measured (full recompute
keeps exactly the bf16 layer input, 2 x H bytes per token per layer, less than selective, less than none; model
state 2 + 4 + 4 + 8 bytes per parameter; the peak method exact on a scripted sequence)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import memory  # noqa: E402


def _tiny_launch(**overrides):
    shape = memory.Shape(hidden=8, ffn=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=32, qkv_bias=False)
    fields = dict(name="tiny", stage="grpo", world=2, tp=1, pp=1, ep=1, dp=2, expert_dp=2, micro_batch_size=1,
                  global_batch_size=2, n_samples=2, prompt_cap=6, response_cap=4, max_length=10, mini_batch=4,
                  distributed_optimizer=False, offload_ref_reward=False, routing_replay=False,
                  roles=[memory.Role("actor", shape, True, False, False),
                         memory.Role("reference", shape, False, False, True)])
    fields.update(overrides)
    return memory.Launch(**fields), shape


# Coefficients chosen by hand: 10 B per hidden unit per token per layer saved, a layer's backward working set of
# 1 B per token per hidden unit, the head's saved logits 2 B per read logit, its backward 1 B per read logit (+ the
# log-prob work buffer), a no-grad forward's working set 2 B per token per hidden unit.
HAND_COEF = {
    "saved.none.norms": {"h": 10.0},
    "working_set.train": {"tokens*h": 1.0},
    "working_set.forward": {"tokens*h": 2.0},
    "head_saved": {"read*V": 2.0},
    "head_backward.train": {"read*V": 1.0},
    "head_forward.train": {},
    "head_forward.forward": {},
}


def test_projection_of_a_tiny_launch_equals_a_hand_computation():
    launch, shape = _tiny_launch()
    p = memory.project(launch, HAND_COEF, memory.Levers(distributed_optimizer=True))
    phases = p["stages"][0]["phases"]
    # parameters: a layer has q, k, v, o = 8x8 + 8x4 + 8x4 + 8x8 = 192, two norms 16, fc1 + fc2 = 3 x 8 x 16 = 384;
    # embedding and output layer 32 x 8 each, the final norm 8: 2 x 592 + 256 + 256 + 8 = 1704
    params = 1704
    assert memory.param_counts(shape)["total"] == params
    # the actor: 2 (bf16) + 4 (fp32 grads) + 12 / DP (main weights and Adam, distributed over DP 2); the reference 2
    states = params * (6 + 12 / 2) + params * 2
    assert phases["train"]["states"] == states
    # one micro-batch of one row at the cap, 6 + 4 = 10 tokens: 2 layers x 10 tokens x 80 B; shared: the rotary
    # table 10 x 4 x 4 B, the causal mask 10 x 10 B, the token ids 10 x 8 B; the head's logits 4 read x 32 x 2 B
    saved = 2 * 10 * 80 + (160 + 100 + 80) + 4 * 32 * 2
    assert phases["train"]["activations_in_flight"] == saved
    # transient: the head's backward 4 x 32 x 1 B + the log-prob work buffer 2 x 4 rows x 32 x 4 B, more than a
    # layer's 10 x 8 B; the global buffer [1 x 2 heads, 10, 10] bf16 (the prefill's [1 x 2, 6, 6] is smaller)
    transient = 4 * 32 + 2 * 4 * 32 * 4
    assert phases["train"]["working_set"] == transient
    assert phases["train"]["global_buffer"] == 2 * 10 * 10 * 2
    assert p["train"] == states + saved + transient + 400
    # the rollout: 2 x 2 / DP 2 = 2 rows, KV cache 2 (K, V) x 2 layers x 10 slots x 2 rows x 1 kv head x 4 x 2 B
    assert phases["rollout"]["kv_cache"] == 2 * 2 * 10 * 2 * 1 * 4 * 2
    # recompute full: each layer keeps nothing of its own in these coefficients (no saved.full entry)
    assert memory.project(launch, HAND_COEF, memory.Levers(recompute="full"))["stages"][0]["phases"]["train"][
        "activations_in_flight"] == (160 + 100 + 80) + 4 * 32 * 2
    # --offload-ref-reward: the reference leaves the update's device memory
    offloaded = memory.project(launch, HAND_COEF, memory.Levers(distributed_optimizer=True, offload_ref_reward=True))
    assert offloaded["stages"][0]["phases"]["train"]["states"] == params * (6 + 12 / 2)


def test_pipeline_stage_zero_holds_pp_micro_batches():
    launch, shape = _tiny_launch(pp=2, dp=1, world=2, mini_batch=4)
    p = memory.project(launch, HAND_COEF, memory.Levers())
    first, last = p["stages"][0]["phases"]["train"], p["stages"][1]["phases"]["train"]
    assert first["in_flight"] == 2 and last["in_flight"] == 1
    # stage 0: one layer and the embedding; 2 micro-batches of 10 tokens x 80 B + shared
    assert first["activations_in_flight"] == 2 * (10 * 80 + 340)


def test_micro_batch_costs_of_a_hand_case():
    prompts, responses = [2, 2, 2, 2], [6, 1, 1, 1]  # lengths 8, 3, 3, 3: 17 real tokens, 64 + 27 = 91 s^2
    assert memory.token_budget_micro_batches_local([8, 3, 3, 3], 8) == [[0], [1, 2], [3]]
    costs = memory.micro_batch_costs(prompts, responses, group=1, micro_batch_size=2, budget=8)
    assert costs["real_tokens"] == 17 and costs["real_attention_work"] == 91
    assert costs["today"]["processed_tokens"] == 32 and costs["today"]["attention_work"] == 4 * 64
    assert costs["token_budget"]["processed_tokens"] == 8 + 6 + 3
    assert costs["token_budget"]["attention_work"] == 64 + 2 * 9 + 9
    assert 17 <= costs["own_length"]["processed_tokens"] <= 32
    prompts, responses = memory.skewed_mix(100, 4, 200, 1000)
    assert sum(r == 1000 for r in responses) == 10 and all(100 <= r <= 500 for r in responses if r != 1000)
    assert all(prompts[i] == prompts[i - i % 4] for i in range(100))  # a group shares its prompt


@pytest.mark.slow
def test_memory_benchmark_toy_run(tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--toy", "--no-tp2", "--no-rss-check",
           "--no-fit-grid", "--launchers", "examples/mcore/qwen25/grpo_qwen25_7b.sh", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Targets:" in proc.stdout and "needs (<= 56 GB" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("meta", "peak_check", "cases", "generate", "model_state", "fit", "micro_batching", "projection",
                "targets", "assumptions"):
        assert key in data, key
    check = data["peak_check"]["scripted"]
    assert check["measured"] == check["expected"] and check["end"] == 0
    hidden = data["meta"]["shape"]["hidden"]
    train = {(c["case"]["seq"], c["case"]["recompute"]): c for c in data["cases"]
             if c["case"]["tag"] == "main" and c["case"]["kind"] == "train"}
    for seq in data["meta"]["lengths"]:
        none, selective, full = (train[(seq, mode)]["per_layer"]["layer_total"] for mode in memory.RECOMPUTE)
        assert full == 2 * hidden  # each checkpoint keeps its bf16 layer input, nothing else
        assert full < selective < none
    for c in data["cases"]:
        if "saved" not in c:
            continue
        if c["case"]["kind"] == "forward":
            assert c["saved_total"] == 0  # no grad: nothing saved
        else:  # the saved tensors are live when the backward starts (less megatron's cached causal mask)
            assert c["phases"]["live_at_backward"] >= c["saved_total"] - c["seq"] ** 2
            assert c["peak"] >= c["phases"]["live_at_backward"]
    per_param = data["model_state"]["bytes_per_param"]
    assert (per_param["weights"], per_param["grad_buffer"], per_param["main_params"], per_param["adam_moments"]) == \
        (2.0, 4.0, 4.0, 8.0)
    assert data["model_state"]["frozen_bytes_per_param"] == 2.0
    projection = data["projection"]["examples/mcore/qwen25/grpo_qwen25_7b.sh"]
    assert projection["tp"] == 4 and projection["dp"] == 2 and projection["rollout_rows"] == 32 * 8 // 2
    assert abs(projection["params_counted"] / projection["params_published"] - 1) < 0.01
    as_launched = projection["rows"][0]
    assert as_launched["label"] == "as launched" and as_launched["train_gb"] > 0
    assert {t["status"] for t in data["targets"]} <= {"met", "not met", "pending"}
