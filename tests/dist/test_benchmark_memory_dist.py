"""benchmarks/memory.py at a toy size (slow, its own processes): its JSON's structure and invariants of what it
measured (full recompute keeps exactly the bf16 layer input, 2 x H bytes per token per layer, less than selective,
less than none; the fused attention's saved bytes per token the same at two lengths, the local one's growing; what
is saved but not allocated in the step before its backward, by name; model state 2 + 4 + 4 + 8 bytes per parameter
and what each offload flag leaves). The analyses against hand computations: tests/unit/test_benchmark_memory.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import step_memory as memory  # noqa: E402


@pytest.mark.slow
def test_memory_benchmark_toy_run(tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--toy", "--no-tp2", "--no-rss-check",
           "--no-fit-grid", "--launchers", "examples/mcore/qwen25/grpo_qwen25_7b.sh", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Targets:" in proc.stdout and "recommended (<= 56 GB" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("meta", "peak_check", "cases", "generate", "model_state", "fit", "micro_batching", "projection",
                "targets", "assumptions"):
        assert key in data, key
    check = data["peak_check"]["scripted"]
    assert check["measured"] == check["expected"] and check["end"] == 0
    hidden = data["meta"]["shape"]["hidden"]
    train = {(c["case"]["attention"], c["case"]["seq"], c["case"]["recompute"]): c for c in data["cases"]
             if c["case"]["tag"] == "main" and c["case"]["kind"] == "train"}
    for attention in ("sdpa", "local"):
        for seq in data["meta"]["lengths"]:
            none, selective, full = (train[(attention, seq, mode)]["per_layer"]["layer_total"]
                                     for mode in memory.RECOMPUTE)
            assert full == 2 * hidden  # each checkpoint keeps its bf16 layer input, nothing else
            assert full < selective <= none
    short, long = data["meta"]["lengths"]
    attention = {a: [train[(a, s, "none")]["per_layer"]["attention"] for s in (short, long)] for a in ("sdpa", "local")}
    assert attention["sdpa"][0] == attention["sdpa"][1]  # per token: linear in s per layer
    assert attention["local"][1] > attention["local"][0]  # the [heads, s, s] scores
    for c in data["cases"]:
        if "saved" not in c:
            continue
        rows, seq = c["rows"], c["seq"]
        if c["case"]["kind"] == "forward":
            assert c["saved_total"] == 0  # no grad: nothing saved
            continue
        # The saved tensors are live when the backward starts, except what the step does not allocate before it:
        # storages from before the step (the micro-batch's token ids the embedding saves, int64; the loss's
        # [samples, 1] int64 read index; megatron's cached [s, s] bool causal mask, saved by the local attention in
        # the row layout without recompute: the packed layout's mask is built in the step, a recomputed attention
        # saves nothing in the forward, the fused attention takes no mask) and storages
        # freed before the backward (a [samples, response] fp32 tensor of the entropy metric's branch, computed with
        # grad and detached into the metrics: entropy_coeff is 0).
        outside = c["saved_outside_step"]
        assert outside["before_step"]["embedding"] == rows * seq * 8
        local_row = (c["case"]["attention"], c["case"]["layout"], c["case"]["recompute"]) == ("local", "row", "none")
        # and the rotary table's cos and sin (bf16, rows * seq x head_dim each), which patches/rotary.py keeps on CPU
        # from the warm-up step's forward while the same table comes back
        rotary = 2 * rows * seq * data["meta"]["shape"]["head_dim"] * 2
        assert sum(outside["before_step"].values()) == (rows * seq * 8 + c["samples"] * 8 + local_row * seq * seq
                                                         + rotary)
        assert sum(outside["freed_before_backward"].values()) == c["samples"] * c["response"] * 4
        assert c["phases"]["live_at_backward"] >= c["saved_total"] - c["saved_outside_step_total"]
        assert c["peak"] >= c["phases"]["live_at_backward"]
    per_param = data["model_state"]["bytes_per_param"]
    assert (per_param["weights"], per_param["grads"], per_param["masters"], per_param["moments"]) == \
        (2.0, 4.0, 4.0, 8.0)
    assert data["model_state"]["frozen_bytes_per_param"] == 2.0
    offloaded = data["model_state"]["offloaded"]
    every = "--offload-train-optimizer --offload-train-grad --offload-train-param"
    assert offloaded[f"actor: {every}"]["on_device_during_rollout"] == dict(weights=2.0, grads=0.0, masters=0.0,
                                                                            moments=0.0, total=2.0)
    assert offloaded["critic: --offload-train-param"]["on_device_during_rollout"]["weights"] == 0.0
    assert offloaded[f"critic: {every}"]["after_onload"] == per_param
    projection = data["projection"]["examples/mcore/qwen25/grpo_qwen25_7b.sh"]
    assert projection["tp"] == 4 and projection["dp"] == 2 and projection["rollout_rows"] == 32 * 8 // 2
    as_launched = projection["rows"][0]
    assert as_launched["label"] == "as launched" and as_launched["train_gb"] > 0
    assert {t["status"] for t in data["targets"]} <= {"met", "not met", "pending"}
