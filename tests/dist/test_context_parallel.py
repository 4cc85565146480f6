"""Context parallelism (`--context-parallel-size`, `mindspeed_llm/models/context_parallel.py`).

* the load-balanced layout's arithmetic (pure): the CP ranks hold every position exactly once, chunks r and
  2N-1-r; a read's local index is its place in the rank's outputs from `logits_from` on;
* the core attention alone at CP2 (2 gloo processes) against the whole sequence on one rank: causal rows and packed
  prompt groups whose prompt and response slots are cut by the chunk boundaries, fp32 outputs and the q / k / v
  gradients (those of k and v come back through the all-gather's reduce-scatter);
* a training checkpoint written at CP2 resumes at CP1 and one written at CP1 at CP2 (`test_checkpoint_moves_between_
  cp_sizes`, slow: both stages' real runs); the training results of CP2 and SP against the TP1 reference are in
  tests/dist/test_stages_layout_invariance.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TOL = 5e-6


# ============================================================================================ layout arithmetic

@pytest.mark.parametrize("size,seq_length,logits_from", [(2, 24, 0), (2, 24, 7), (3, 36, 20), (4, 16, 15)])
def test_layout_covers_every_position_once(size, seq_length, logits_from):
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    positions = torch.arange(seq_length)
    seen = torch.zeros(seq_length, dtype=torch.long)
    for rank in range(size):
        layout = ContextParallelLayout(size, rank, seq_length)
        c = seq_length // (2 * size)
        local = layout.split(positions[None], dim=1)[0]
        assert local.tolist() == list(range(rank * c, (rank + 1) * c)) + list(
            range((2 * size - 1 - rank) * c, (2 * size - rank) * c))
        seen[local] += 1
        # the outputs this rank computes: its local positions at or after logits_from, in local order
        kept = torch.cat([local[a:b] for a, b in layout.local_output_spans(logits_from)]) \
            if layout.local_output_spans(logits_from) else local[:0]
        assert bool((kept >= logits_from).all()) and len(kept) == int((local >= logits_from).sum())
        index, held = layout.local_index(positions, logits_from)
        assert held.tolist() == [bool(p in kept.tolist()) for p in range(seq_length)]
        assert kept[index[held]].tolist() == positions[held].tolist()
        # the gathered local sequences in rank order, put back in natural order
    gathered = torch.cat([ContextParallelLayout(size, r, seq_length).split(positions[None], 1)[0]
                          for r in range(size)])
    assert gathered[ContextParallelLayout(size, 0, seq_length).natural_order("cpu")].tolist() == positions.tolist()
    assert seen.tolist() == [1] * seq_length


def test_layout_refuses_a_width_that_does_not_split():
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    with pytest.raises(ValueError, match="do not split into 4 chunks"):
        ContextParallelLayout(2, 0, 10)


# ============================================================================================ the attention alone

# (name, packed layout (n, prompt lengths, slot widths) or None, width S, batch): S = 24 splits into 4 chunks of 6
ATTENTION_CASES = [
    ("causal", None, 24, 2),
    # prompts of 5 and 9 with slots of 4 and 3: chunk borders at 6, 12, 18 cut prompts and slots
    ("packed", (3, (5, 9), (4, 3)), 24, 2),
    ("packed_gqa_one_slot", (2, (7,), (8,)), 24, 1),
]


def _attention_worker(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_llm import device
    from mindspeed_llm.models.attention import PackedGroups, SDPAttention, layout_params
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    device.setup()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world_size)
    heads, groups, hn = 4, 2, 8
    config = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=hn, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    module = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self", softmax_scale=1.0 / math.sqrt(hn)).eval()
    out = {}
    for name, packed, S, b in ATTENTION_CASES:
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(S, b, h, hn, generator=g) for h in (heads, groups, groups))
        weights = torch.randn(S, b, heads * hn, generator=g)
        layout_groups = None if packed is None else PackedGroups(packed[0], packed[1], packed[2], S)
        # the whole sequence here (no context parallelism): the reference
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = module(*full, None, packed_seq_params=layout_params(layout_groups, None, S))
        (reference * weights).sum().backward()
        layout = ContextParallelLayout.current(S)
        local = [layout.split(t, dim=0).detach().requires_grad_() for t in (q, k, v)]
        got = module(*local, None, packed_seq_params=layout_params(layout_groups, layout, S))
        (got * layout.split(weights, dim=0)).sum().backward()
        # the tail of a packed row (past its slots) is zeros and never read; compare everything
        out[name] = {
            "out": (got - layout.split(reference, dim=0)).abs().max().item(),
            "grads": max((t.grad - layout.split(f.grad, dim=0)).abs().max().item() for t, f in zip(local, full)),
            "scale": reference.abs().max().item(),
        }
    return out


@pytest.fixture(scope="module")
def attention_cp2():
    return run_distributed(_attention_worker, 2)


@pytest.mark.parametrize("case", [c[0] for c in ATTENTION_CASES])
def test_attention_at_cp2_equals_the_whole_sequence(attention_cp2, case):
    for rank, result in enumerate(attention_cp2):
        r = result[case]
        assert r["scale"] > 0.1
        assert r["out"] <= TOL and r["grads"] <= TOL, (rank, case, r)


# ============================================================================================ checkpoints across CP

def _coin_flip(text, label):
    words = text.split()
    return float(bool(words) and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 1)


def _resume_worker(rank, world_size, task, root):
    """Per stage: A, CP1 (DP2) for 2 iterations; B, CP2 (DP1) for 1, resumed at CP1 for the 2nd (C); A's
    iteration-1 checkpoint resumed at CP2 for the 2nd (D)."""
    import shutil

    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.verifiers import register_verifier

    register_verifier("coin_flip", override=True)(_coin_flip)
    root = Path(root)

    def run(stage, name, cp, iters, *extra):
        out = root / stage / name
        argv = ["--stage", stage, "--context-parallel-size", str(cp), "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", str(iters), "--seed", "5", "--data-path", task["data"],
                "--tokenizer-name-or-path", task["tokenizer"], "--max-length", "64", "--max-new-tokens", "6",
                "--do-sample", "--ref-model", task["mg_actor_tp1pp1"], "--optimizer", "sgd", "--sgd-momentum", "0.9",
                "--lr", "0.1", "--kl-coef", "0.05",
                "--log-interval", "1", "--metrics-jsonl", str(out / "metrics.jsonl"), "--save-interval", "1"]
        argv += (["--reward-model", task["mg_reward_tp1pp1"]] if stage == "trl_ppo" else
                 ["--n-samples-per-prompt", "2", "--verifier-function", "coin_flip"])
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer.run(parse_args(argv + list(extra), world_size))

    for stage in ("grpo", "trl_ppo"):
        base = root / stage
        run(stage, "A", 1, 2, "--save", str(base / "A"))
        run(stage, "B", 2, 1, "--save", str(base / "B"))
        if rank == 0:
            shutil.copytree(base / "B", base / "C")
        torch.distributed.barrier()
        run(stage, "C", 1, 2, "--load", str(base / "C"), "--save", str(base / "C"))
        run(stage, "D", 2, 2, "--load", str(base / "A"), "--ckpt-step", "1", "--save", str(base / "D"))
    return True


@pytest.mark.slow
def test_checkpoint_moves_between_cp_sizes(tmp_path):
    """A checkpoint saved at CP2 resumes at CP1, one saved at CP1 at CP2 (same world size: DP2 and DP1), each
    giving the uninterrupted CP1 run's second iteration: its metrics within the layout test's tolerances and its
    weights within 1e-5 of their norm (both stages; SGD with momentum, so the optimizer state moves too: Adam would
    turn the rounding of near-zero gradients into whole steps)."""
    from tests.helpers import word_task
    from tests.helpers.stage_layouts import ATOL, KEY_ATOL, RTOL, SKIPPED, WEIGHT_RTOL, full_weights, relative

    task = word_task.build(tmp_path / "task", reward=True)
    run_distributed(_resume_worker, 2, task, str(tmp_path / "runs"))
    for stage, roles in (("grpo", ["actor"]), ("trl_ppo", ["actor", "critic"])):
        base = tmp_path / "runs" / stage
        rows = {name: [json.loads(line) for line in (base / name / "metrics.jsonl").read_text().splitlines()]
                for name in "ACD"}
        reference = rows["A"][-1]
        assert reference["iteration"] == 2
        # D resumed (its first row is iteration 2); C resumed from B's iteration 1, which it kept as it was
        assert [r["iteration"] for r in rows["D"]] == [2] and [r["iteration"] for r in rows["C"]] == [1, 2]
        from mindspeed_llm.checkpoint import load_shard

        saved_by_b = load_shard(str(base / "B" / "actor"), 0, 0, 1)["model"]
        kept_in_c = load_shard(str(base / "C" / "actor"), 0, 0, 1)["model"]
        assert all(torch.equal(saved_by_b[k], kept_in_c[k]) for k in saved_by_b if torch.is_tensor(saved_by_b[k]))
        for name in "CD":
            got = rows[name][-1]
            assert got["iteration"] == 2, (stage, name, got["iteration"])
            for key, expected in reference.items():
                if key.startswith(SKIPPED) or not isinstance(expected, float):
                    continue
                atol = KEY_ATOL.get(key, ATOL)
                assert abs(got[key] - expected) <= atol + RTOL * abs(expected), (stage, name, key, got[key], expected)
            for role in roles:
                ref, weights = full_weights(base / "A", role), full_weights(base / name, role)
                for tensor in ref:
                    assert relative(weights[tensor], ref[tensor]) <= WEIGHT_RTOL, (stage, name, role, tensor)
