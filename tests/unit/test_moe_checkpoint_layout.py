"""Megatron-LM's shard layout with expert parallelism: names, which shards exist, who writes them, and loads.

A checkpoint of another expert layout is refused with the conversion command. The training checkpoint at EP2
(written by both ranks, restored per rank): tests/dist/test_moe_checkpoint_layout_dist.py.
"""

import os

import pytest
import torch

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.models.architecture import ArchitectureSpec

MOE = ArchitectureSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       num_query_groups=2, kv_channels=8, vocab_size=64, qk_layernorm=True, num_experts=4,
                       moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_pattern=[0, 1])


def test_shard_names_follow_megatron_lm():
    assert layout.shard_dirname(1, 0, 1) == "mp_rank_01"
    assert layout.shard_dirname(1, 2, 4) == "mp_rank_01_002"
    assert layout.shard_dirname(1, 0, 1, 3, 4) == "mp_rank_01_003"
    assert layout.shard_dirname(0, 1, 2, 1, 2) == "mp_rank_00_001_001"


def test_expected_shards():
    # Expert TP == TP: every (tp, ep) pair is a rank.
    assert sorted(layout.expected_shards(2, 1, 2, 2)) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    # Expert TP 1 (--moe-tp-extend-ep at TP2 x EP2: 4 expert ranks): megatron's tp rank is ep rank % TP.
    assert layout.expected_shards(2, 1, 4, 1) == [(0, 0, 0), (1, 0, 1), (0, 0, 2), (1, 0, 3)]
    assert layout.expected_shards(2, 2, 1) == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    with pytest.raises(ValueError, match="expert TP must be 1 or TP"):
        layout.expected_shards(4, 1, 2, 2)


def _fake_checkpoint(root, ranks, pp, ep, etp=1, tp=1):
    ckpt = os.path.join(root, "release")
    for t, p, e in ranks:
        args = layout.make_args(MOE, tp, pp, torch.float32, False, ep=ep, etp=etp)
        layout.save_file({"model": {}, "args": args, "model_spec": MOE.to_dict()},
                         layout.shard_path(ckpt, t, p, pp, e, ep))
    layout.write_latest(root, "release")
    return ckpt


def test_read_layout_tells_ep_from_pp_by_the_shard_args(tmp_path):
    ep_ckpt = _fake_checkpoint(tmp_path / "ep", [(0, 0, 0), (0, 0, 1)], pp=1, ep=2)
    pp_ckpt = _fake_checkpoint(tmp_path / "pp", [(0, 0, 0), (0, 1, 0)], pp=2, ep=1)
    assert sorted(os.listdir(ep_ckpt)) == sorted(os.listdir(pp_ckpt)) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert layout.read_layout(ep_ckpt) == (1, 1, 2, 1)
    assert layout.read_layout(pp_ckpt) == (1, 2, 1, 1)
    info = layout.checkpoint_info(tmp_path / "ep")
    assert (info["tp"], info["pp"], info["ep"]) == (1, 1, 2)
    assert layout.load_shard(tmp_path / "ep", 0, 0, ep_rank=1)["args"].expert_model_parallel_size == 2
    with pytest.raises(layout.CheckpointNotFoundError, match="ep_rank=2"):
        layout.load_shard(tmp_path / "ep", 0, 0, ep_rank=2)
    os.remove(layout.shard_path(ep_ckpt, 0, 0, 1, 1, 2))
    with pytest.raises(layout.CheckpointNotFoundError, match="mp_rank_00_001.* is missing"):
        layout.read_layout(ep_ckpt)
