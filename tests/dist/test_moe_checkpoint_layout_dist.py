"""The training checkpoint of a mixture of experts at EP2 (2 gloo processes): written by both ranks (each holds
other experts), that of a dense model next to it by DP rank 0 only; a load restores each rank's own experts.
The shard names and layout reads: tests/unit/test_moe_checkpoint_layout.py.
"""

import os

import pytest
import torch

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.models.architecture import ArchitectureSpec
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


MOE = ArchitectureSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       num_query_groups=2, kv_channels=8, vocab_size=64, qk_layernorm=True, num_experts=4,
                       moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_pattern=[0, 1])


DENSE = ArchitectureSpec(family="qwen3", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                         num_query_groups=2, kv_channels=8, vocab_size=64, qk_layernorm=True)


class _Trainable:
    """What checkpoint.training.save / load use of a TrainableModel: the module and its state."""

    def __init__(self, module):
        self.module = module

    def state_dict(self):
        return {"model": self.module.state_dict()}

    def load_state_dict(self, state, load_optim=True):
        self.module.load_state_dict(state["model"], strict=True)


def _save_and_load_at_ep2(rank, world_size, root):
    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, training
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, seed=5, expert_model_parallel_size=2)
    torch.manual_seed(100 + rank)  # the ranks' models differ everywhere: a shard from the wrong rank shows
    roles = {"actor": _Trainable(build_model(MOE)), "critic": _Trainable(build_model(DENSE, value_head=True))}
    for trainable in roles.values():
        for param in trainable.module.parameters():
            param.data.normal_()
    if rank == 1:  # DP replicas of the dense critic are equal in a real run
        roles["critic"].module.load_state_dict(roles["critic"].module.state_dict())
    saved = {name: {k: v.clone() for k, v in t.module.state_dict().items() if v is not None}
             for name, t in roles.items()}
    training.save(root, 1, roles, {"position": 7})
    distributed.barrier()
    files = sorted(os.listdir(os.path.join(root, "actor", "iter_0000001"))), \
        sorted(os.listdir(os.path.join(root, "critic", "iter_0000001")))
    for trainable in roles.values():
        for param in trainable.module.parameters():
            param.data.zero_()
    loop_state = training.load(root, roles, 1, load_optim=False, load_rng=False)
    restored = all(torch.equal(saved["actor"][k], v) for k, v in roles["actor"].module.state_dict().items()
                   if v is not None)
    # A release checkpoint of the other expert layout is refused, naming the conversion.
    error = None
    if rank == 0:
        other = os.path.join(root, "ep1")
        layout.save_file(layout.make_payload({}, MOE, 1, 1, 0, 0, torch.float32, False),
                         layout.shard_path(os.path.join(other, "release"), 0, 0, 1))
        layout.write_latest(other, "release")
    distributed.barrier()
    try:
        load_megatron_weights(roles["actor"].module, os.path.join(root, "ep1"))
    except ValueError as exc:
        error = str(exc)
    return {"files": files, "restored": restored, "loop_state": loop_state, "error": error,
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "expert0": saved["actor"]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]}


def test_training_checkpoint_at_ep2_round_trips(tmp_path):
    results = run_distributed(_save_and_load_at_ep2, 2, str(tmp_path / "save"))
    for r in results:
        assert r["files"] == (["mp_rank_00_000", "mp_rank_00_001"], ["mp_rank_00"]), r["files"]
        assert r["restored"] and r["loop_state"] == {"position": 7}
        assert "is split TP=1 x PP=1 but" in r["error"] and "--expert-model-parallel-size 2" in r["error"], r["error"]
        assert "--target-expert-parallel-size 2" in r["error"], r["error"]
    assert [r["ep_rank"] for r in results] == [0, 1]
    # Each EP rank's file holds that rank's experts under local indices.
    for r in results:
        stored = layout.load_shard(str(tmp_path / "save" / "actor"), 0, 0, 1, ep_rank=r["ep_rank"])["model"]
        assert torch.equal(stored["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"], r["expert0"])
    assert not torch.equal(results[0]["expert0"], results[1]["expert0"])
