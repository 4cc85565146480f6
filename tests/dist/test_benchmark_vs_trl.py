"""Smoke test of benchmarks/vs_trl.py at a tiny size: both stages, both frameworks, one measured iteration.

Checks the JSON's structure and that every throughput, time and memory figure is a positive number; it asserts
nothing about which side is faster (the machine may be shared).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pytest.ini

ROOT = Path(__file__).resolve().parents[2]


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_vs_trl_smoke(tmp_path):
    out = tmp_path / "vs_trl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--model", "tiny", "--tiny-layers", "1",
           "--tiny-hidden", "64", "--iterations", "1", "--warmup", "1", "--prompts", "2", "--samples", "2",
           "--max-new-tokens", "4", "--micro-batch", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ours/TRL" in proc.stdout  # the printed table

    data = json.loads(out.read_text())
    for key in ("date", "load_average_start", "versions", "settings", "results", "table", "profile", "target_met"):
        assert key in data, key
    assert data["versions"]["trl"].startswith("1.12")
    results = data["results"]
    assert [(r["model"], r["stage"]) for r in results] == [("tiny", "grpo"), ("tiny", "trl_ppo")]
    for r in results:
        seqs = 2 * (2 if r["stage"] == "grpo" else 1)
        for fw in ("ours", "trl"):
            s = r[fw]
            for key in ("e2e_tps", "rollout_tps", "update_tps", "s_per_iteration", "peak_rss_mb",
                        "tokens_per_iteration", "process_wall_s"):
                assert _positive(s[key]), (r["stage"], fw, key, s[key])
            assert s["iterations_measured"] == 1 and len(s["per_iteration"]) == 2  # warm-up + measured
            # the seed's token count: prompt + response tokens of every sample, responses of at most 4 tokens
            it = s["per_iteration"][-1]
            assert it["n_sequences"] == seqs
            assert 0 < it["response_tokens"] <= 4 * seqs and it["prompt_tokens"] > 0
            assert s["e2e_tps"] < s["rollout_tps"] and s["e2e_tps"] < s["update_tps"]
            assert 0 < sum(s["phase_share"].values()) <= 1.0 + 1e-6
            assert "rollout" in s["phase_share"] and "update" in s["phase_share"]
        # both sides drew the same prompts
        ours_prompt, trl_prompt = (r[fw]["per_iteration"][-1]["prompt_tokens"] for fw in ("ours", "trl"))
        assert abs(ours_prompt - trl_prompt) < 1e-6
        for key in ("e2e_tps", "rollout_tps", "update_tps", "s_per_iteration", "peak_rss_mb"):
            assert _positive(r["ratio"][key]), (r["stage"], key)
    grpo = results[0]["trl"]
    assert grpo["token_count_check"]["trl_num_tokens"] == grpo["token_count_check"]["counted"]
