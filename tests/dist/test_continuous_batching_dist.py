"""The continuous-batching engine (`mindspeed_llm/inference/continuous.py`) on a tiny mixture of experts at EP2 on 2
gloo processes (all-to-all dispatcher), the ranks holding other prompts (GRPO groups of 2) and budgets, one rank
with nothing to generate in one case: the continuous engine at 3 rows in flight gives the static engine's tokens
(greedy and sampled), log-probs within 2e-5 and the same recorded routing, and both peers run the same number of
forwards (dummy ones where a rank has less to do). Its scheduler alone: tests/unit/test_continuous_batching.py.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_llm.models.architecture import ArchitectureSpec
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


SPEC = ArchitectureSpec(family="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                        num_query_groups=2, kv_channels=16, vocab_size=128, qk_layernorm=True, num_experts=16,
                        moe_ffn_hidden_size=32, moe_router_topk=4)


def _ep2_body(rank, world_size):
    from dataclasses import replace

    from mindspeed_llm import distributed
    from mindspeed_llm.inference import SamplingConfig, generate
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, seed=3, expert_model_parallel_size=2)
    model = build_model(SPEC, moe_token_dispatcher_type="alltoall", init_method_std=0.3)
    g = torch.Generator().manual_seed(11 + rank)
    lengths = (5, 9, 3, 7) if rank == 0 else (4, 6)
    prompts = [p for p in (torch.randint(3, 120, (n,), generator=g).tolist() for n in lengths) for _ in range(2)]
    ids = [100 * rank + i for i in range(len(prompts))]
    out = []
    for name, sampling in (("greedy", SamplingConfig(max_new_tokens=6 + 8 * rank, pad_token_id=0)),
                           ("sample", SamplingConfig(do_sample=True, max_new_tokens=6 + 8 * rank, pad_token_id=0,
                                                     seed=5)),
                           ("idle rank 0", SamplingConfig(max_new_tokens=0 if rank == 0 else 9, pad_token_id=0))):
        static = generate(model, prompts, sampling, iteration=2, sample_ids=ids, record_routing=True, engine="static")
        bounded = generate(model, prompts, replace(sampling, max_num_seqs=3), iteration=2, sample_ids=ids,
                           record_routing=True)
        out.append((name, static, bounded))
    return out


def test_expert_parallel_peers_equal_the_static_engine_and_run_the_same_forwards():
    results = run_distributed(_ep2_body, 2)
    for case in range(3):
        forwards = []
        for rank, per_rank in enumerate(results):
            name, static, bounded = per_rank[case]
            assert bounded.response_token_lists() == static.response_token_lists(), (rank, name)
            assert bounded.finish_reasons == static.finish_reasons
            torch.testing.assert_close(bounded.log_probs, static.log_probs, atol=2e-5, rtol=0)
            stats = bounded.stats
            forwards.append(stats["prefill_forwards"] + stats["decode_forwards"] + stats["dummy_forwards"])
            assert stats["kv_rows"] == 3 and stats["finished_row_steps"] == 0
            if stats["decode_forwards"] == 0:  # nothing to generate (budget 0): nothing run, nothing recorded
                assert name == "idle rank 0" and rank == 0 and not bool((bounded.routing >= 0).any())
                continue
            # the same experts for every token the continuous engine ran (all but each response's last token)
            total = bounded.prompt_lengths + bounded.response_lengths
            T = bounded.routing.shape[2]
            ran = torch.arange(T)[None, :] < (total - 1)[:, None]
            ours, theirs = bounded.routing.permute(0, 2, 1, 3)[ran], static.routing[:, :, :T].permute(0, 2, 1, 3)[ran]
            assert bool((ours >= 0).all()) and torch.equal(ours, theirs), (rank, name)
            assert not bool((bounded.routing.permute(0, 2, 1, 3)[~ran] >= 0).any())
        # the peers exchange tokens in every MoE layer of every forward: the same count, dummies on the rank with less
        assert forwards[0] == forwards[1], (name, forwards)
        assert results[0][case][2].stats["dummy_forwards"] > 0
    assert results[1][2][2].stats["dummy_forwards"] == 0
