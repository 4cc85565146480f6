"""The weight stream's pure parts (`rl/async_rl/`): resharding a trainer's TP x PP slices to a generator's TP slice
against the checkpoint code's own split of the full tensors, the adapters' rules against `checkpoint/lora.py`,
the buckets, the byte packing, the receiver's refusals, and the placement. The stream over a gloo world:
tests/dist/test_weight_sync_dist.py."""

import pytest
import torch

from mindspeed_llm.checkpoint import lora as lora_files
from mindspeed_llm.checkpoint import sharding
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models.architecture import ArchitectureSpec
from mindspeed_llm.rl.async_rl import placement, streaming, weights
from mindspeed_llm.rl.async_rl.weights import REPLICATED, WeightSyncError

SPEC = ArchitectureSpec(family="qwen2", num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                        num_query_groups=4, kv_channels=4, vocab_size=64, add_qkv_bias=True,
                        tie_word_embeddings=False)


def _shape(name):
    h, f, v, kv = SPEC.hidden_size, SPEC.ffn_hidden_size, SPEC.vocab_size, SPEC.kv_channels
    qkv = (SPEC.num_attention_heads + 2 * SPEC.num_query_groups) * kv
    for suffix, shape in (("word_embeddings.weight", (v, h)), ("output_layer.weight", (v, h)),
                          ("linear_qkv.weight", (qkv, h)), ("linear_qkv.bias", (qkv,)),
                          ("linear_proj.weight", (h, SPEC.num_attention_heads * kv)),
                          ("linear_fc1.weight", (2 * f, h)), ("linear_fc2.weight", (h, f))):
        if name.endswith(suffix):
            return shape
    return (h,)  # the norms


def _full(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(_shape(n), generator=gen) for n in sharding.expected_local_names(SPEC, 1, 0, False)}


@pytest.mark.parametrize("source_tp,source_pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("target_tp", [1, 2, 4])
def test_reshard_matches_the_checkpoint_split_of_the_full_weights(source_tp, source_pp, target_tp):
    full = _full()
    shards = sharding.split_model(full, SPEC, source_tp, source_pp, False, with_extra_state=False)
    expected = sharding.split_model(full, SPEC, target_tp, 1, False, with_extra_state=False)
    per = SPEC.num_layers // source_pp
    slices = {}  # global name -> {tp_rank: slice}, as the senders name them
    for (t, p), shard in shards.items():
        for local, tensor in shard.items():
            slices.setdefault(weights.global_name(local, p * per), {})[t] = tensor
    assert set(slices) == set(full)
    for rank in range(target_tp):
        for name, parts in slices.items():
            rule = weights.split_name(name)
            got = weights.reshard(rule, [parts[t] for t in range(weights.parts_needed(rule, source_tp))],
                                  target_tp, rank)
            assert torch.equal(got, expected[(rank, 0)][name]), name
            assert weights.local_shape(rule, weights.full_shape(rule, parts[0].shape, source_tp),
                                       target_tp) == tuple(got.shape)


def test_swiglu_fc1_is_not_a_plain_concatenation():
    f, h = SPEC.ffn_hidden_size, SPEC.hidden_size
    gate, up = torch.arange(f * h).float().view(f, h), -torch.arange(f * h).float().view(f, h)
    fc1 = torch.cat([gate, up])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    parts = [torch.cat([gate[:f // 2], up[:f // 2]]), torch.cat([gate[f // 2:], up[f // 2:]])]  # by hand
    assert torch.equal(weights.reshard(weights.split_name(name), parts, 1, 0), fc1)
    assert not torch.equal(torch.cat(parts), fc1)


def test_adapter_rules_follow_the_checkpoint_code():
    gen = torch.Generator().manual_seed(1)
    for module, out_dim, in_dim in (("decoder.layers.1.self_attention.linear_qkv", 64, 32),
                                    ("decoder.layers.1.mlp.linear_fc1", 96, 32),
                                    ("decoder.layers.1.mlp.linear_fc2", 32, 48)):
        a, b = torch.randn(8, in_dim, generator=gen), torch.randn(out_dim, 8, generator=gen)
        row = lora_files.split_rule(module) == "row"
        assert (weights.split_name(module + lora_files.A_SUFFIX) == REPLICATED) != row
        assert (weights.split_name(module + lora_files.B_SUFFIX) == REPLICATED) == row
        sources = [lora_files.split_for_rank(module, a, b, 2, r) for r in range(2)]
        for rank in range(4):
            want_a, want_b = lora_files.split_for_rank(module, a, b, 4, rank)
            for suffix, index, want in ((lora_files.A_SUFFIX, 0, want_a), (lora_files.B_SUFFIX, 1, want_b)):
                rule = weights.split_name(module + suffix)
                parts = [s[index] for s in sources][:weights.parts_needed(rule, 2)]
                assert torch.equal(weights.reshard(rule, parts, 4, rank), want), module + suffix


def test_experts_are_refused_by_name():
    with pytest.raises(WeightSyncError, match="mixture-of-experts actor.*--rollout-world-size"):
        weights.split_name("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")


def test_megatron_attributes_are_checked_against_the_names():
    def marked(dim=None):
        param = torch.nn.Parameter(torch.zeros(2, 2))
        param.tensor_model_parallel = dim is not None
        if dim is not None:
            param.partition_dim = dim
        return param

    assert weights.attribute_problem("decoder.layers.0.mlp.linear_fc2.weight", marked(1)) is None
    assert weights.attribute_problem("decoder.layers.0.input_layernorm.weight", marked()) is None
    assert weights.attribute_problem("decoder.layers.0.input_layernorm.weight", torch.zeros(2)) is None
    assert "on dim 0, its name on dim 1" in weights.attribute_problem("decoder.layers.0.mlp.linear_fc2.weight",
                                                                       marked(0))
    assert "its name says replicated" in weights.attribute_problem("decoder.final_layernorm.weight", marked(0))
    assert "marks it replicated" in weights.attribute_problem("embedding.word_embeddings.weight", marked())


def test_global_names():
    assert weights.global_name("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert weights.global_name("decoder.final_layernorm.weight", 2) == "decoder.final_layernorm.weight"


def test_buckets():
    assert weights.plan_buckets([10, 10, 10, 50, 5], 25) == [[0, 1], [2], [3], [4]]
    assert weights.plan_buckets([10, 10], 1 << 30) == [[0, 1]]
    assert weights.plan_buckets([], 8) == []
    with pytest.raises(WeightSyncError, match="bucket size must be positive"):
        weights.plan_buckets([1], 0)


def test_pack_and_unpack_keep_every_dtype_bit_for_bit():
    tensors = [torch.randn(3, dtype=torch.bfloat16), torch.randn(2, 5), torch.arange(7, dtype=torch.int64),
               torch.randn(1, dtype=torch.float16)]
    payload = streaming._pack(tensors, torch.device("cpu"))
    assert payload.numel() == 16 + 48 + 64 + 16  # each at a 16-byte offset
    entries = [("t", REPLICATED, tuple(t.shape), t.dtype) for t in tensors]
    for got, want in zip(streaming._unpack(payload, entries), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _headers(version=1, tp=2, drop=None, shape_scale=1):
    full = _full()
    shards = sharding.split_model(full, SPEC, tp, 1, False, with_extra_state=False)
    headers = []
    for (t, _), shard in shards.items():
        entries = [(n, weights.split_name(n), tuple(x.shape) if n != "decoder.final_layernorm.weight"
                    else (x.shape[0] * shape_scale,), x.dtype)
                   for n, x in shard.items() if n != drop and (t == 0 or weights.split_name(n) != REPLICATED)]
        headers.append({"version": version, "tp": tp, "pp": 1, "tp_rank": t, "pp_rank": 0, "buckets": [entries]})
    return headers, sharding.split_model(full, SPEC, 1, 1, False, with_extra_state=False)[(0, 0)]


def test_the_receiver_refuses_what_does_not_fit():
    receiver = streaming.WeightReceiver([], tp=1, tp_rank=0)
    headers, targets = _headers()
    assert receiver.problem(headers, targets) is None
    receiver.version = 1
    assert "not newer than the generator's 1" in receiver.problem(headers, targets)
    receiver.version = 0
    assert "do not make one TP=2 x PP=1 actor" in receiver.problem(headers[:1], targets)
    dropped, _ = _headers(drop="decoder.layers.2.mlp.linear_fc2.weight")
    assert "not sent ['decoder.layers.2.mlp.linear_fc2.weight'] (1)" in receiver.problem(dropped, targets)
    assert "sent but not held here ['decoder.final_layernorm.weight']" in receiver.problem(
        headers, {n: t for n, t in targets.items() if n != "decoder.final_layernorm.weight"})
    scaled, _ = _headers(shape_scale=2)
    assert "decoder.final_layernorm.weight: the generator's TP=1 slice is (32,)" in receiver.problem(scaled, targets)
    half = {n: t.half() for n, t in targets.items()}
    assert "torch.float16, the trainers' TP=2 slices make" in receiver.problem(headers, half)
    wide = streaming.WeightReceiver([], tp=3, tp_rank=0)
    assert "do not divide over the generators' TP=3" in wide.problem(headers, targets)


def test_placement():
    layout = placement.plan_placement(6, 2, generator_tp=2, trainer_tp=2, trainer_pp=2)
    assert list(layout.trainer_ranks) == [0, 1, 2, 3] and list(layout.generator_ranks) == [4, 5]
    assert layout.generator_blocks() == [[4, 5]] and layout.generator_tp_rank(5) == 1
    assert placement.plan_placement(3, 1).generator_blocks() == [[2]]
    # megatron's order tp-cp-dp-pp: DP rank 0's slices of TP2 x PP2 at DP2 are ranks 0, 1 (stage 0) and 4, 5
    assert placement.trainer_sources(2, 2, dp=2) == [(0, 0, 0), (1, 1, 0), (4, 0, 1), (5, 1, 1)]
    for args, message in (((4, 4), "must leave at least one"), ((4, 0), "must leave at least one"),
                          ((5, 3, 2), "not a multiple of the generators' tensor-parallel size 2"),
                          ((5, 2, 1, 2), "the 3 trainer ranks .* not a multiple of --tensor-model-parallel-size 2")):
        with pytest.raises(ArgumentError, match=message):
            placement.plan_placement(*args)
