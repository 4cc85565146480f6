"""The weight stream over a gloo world (`rl/async_rl/`): trainer ranks hold the actor as megatron GPTModels at
TP2 or PP2 (loaded from a checkpoint of that layout), generator ranks as GPTModels at their own TP (1 or 2, built
on explicit groups, their parameters NaN before the sync); after a sync every generator parameter is torch.equal to
the checkpoint code's split, at the generator's TP, of the same model's TP1 x PP1 checkpoint (converted separately
from the same Hugging Face folder). LoRA: only the adapters go.

One world, two layouts: megatron's parallel_state is one global per process, so it is initialised over the trainer
ranks only (`placement.initialize`: every rank calls megatron's `initialize_model_parallel` with the world size read
as the trainers' count, `patches/trainer_world.py`; the generators take part in each `new_group` and belong to
none), and the generators get explicit groups (`placement.create_sync_groups`).

A generator that generates: after the sync the generator's continuous engine (on its explicit groups, seeded from
its own TP rank) generates, greedily and sampled, the tokens and log-probs that the trainers' own engine generates
from the weights they sent, bit for bit. The reference is the trainers' generate at the generator's TP (TP2 trainers
for the TP2 generator; TP1 x DP2 trainers for the TP1 one) because at equal TP every rank runs the same arithmetic
on the same shards (the weights are torch.equal after the sync), so equality is exact; at another TP the row-parallel
sums are split differently and only agree to rounding. The trainers run the engine on megatron's parallel_state, the
path of today's synchronous runs.
"""

import os
import zlib

import pytest

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes
LORA_RANK = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.helpers.hf_tiny import save_tiny

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    root = tmp_path_factory.mktemp("weight_sync")
    hf = save_tiny("qwen2", root / "hf", tie=True, seed=3)  # tied: PP2's last stage holds a copy that stays home
    out = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        out[(tp, pp)] = str(root / f"tp{tp}pp{pp}")
        convert_hf_to_mg(hf, out[(tp, pp)], tp, pp, progress=False)
    return out


def _full_adapter(module, out_features, in_features):
    """The full (A, B) of `module`, drawn from its name: the trainers slice it, the test's reference too."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(module.encode()))
    return torch.randn(LORA_RANK, in_features, generator=gen), torch.randn(out_features, LORA_RANK, generator=gen)


PROMPTS = [[5, 17, 3, 9], [11, 2], [7, 7, 7, 1, 4, 20], [30, 6, 8]]


def _generations(model):
    """Greedy and sampled (a fixed seed, explicit sample ids) continuous-engine rollouts of PROMPTS: tokens, log-probs."""
    from mindspeed_llm.inference import SamplingConfig, generate

    out = {}
    for name, sampling in (("greedy", SamplingConfig(max_new_tokens=6)),
                           ("sampled", SamplingConfig(do_sample=True, temperature=0.9, top_k=40, max_new_tokens=6,
                                                      seed=77, max_num_seqs=2))):
        rollout = generate(model, PROMPTS, sampling, iteration=3, sample_ids=[10, 11, 12, 13], engine="continuous")
        out[name] = (rollout.responses.tolist(), rollout.response_lengths.tolist(), rollout.log_probs.tolist())
    return out


def _trainer(case, groups, rank):
    import torch
    from megatron.core import parallel_state

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model, lora
    from mindspeed_llm.rl.async_rl import streaming, weights

    root = case["trainer_root"]
    model = build_model(load_spec(root), value_head=False).eval()
    load_megatron_weights(model, root)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    if groups.own is None:  # not a source (a data-parallel rank > 0): it holds the same weights and sends nothing
        return {"role": "trainer", "stats": [],
                "generated": _generations(model) if case.get("generate") else None}
    sender = streaming.WeightSender(groups.own, case["tp"], case["pp"], tp_rank, pp_rank, case["bucket_bytes"])
    stats = [sender.send(weights.model_tensors(model))]
    generated = _generations(model) if case.get("generate") else None
    if case.get("step"):  # an "optimizer step": every weight changes, and the next sync carries the new ones
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        stats.append(sender.send(weights.model_tensors(model)))
    if case.get("lora"):
        lora.apply_lora(model, lora.LoRAConfig(r=LORA_RANK, alpha=8.0, target_modules=lora.DENSE_TARGETS))
        with torch.no_grad():
            for module, (a, b) in lora.adapter_tensors(model).items():
                out_features = weights.full_shape(weights.split_name(module + lora_files.B_SUFFIX), b.shape,
                                                  case["tp"])[0]
                in_features = weights.full_shape(weights.split_name(module + lora_files.A_SUFFIX), a.shape,
                                                 case["tp"])[1]
                full_a, full_b = _full_adapter(module, out_features, in_features)
                mine_a, mine_b = lora_files.split_for_rank(module, full_a, full_b, case["tp"], tp_rank)
                a.copy_(mine_a)
                b.copy_(mine_b)
        tensors = weights.model_tensors(model)
        assert all(lora_files.module_of(n) for n in tensors), "a LoRA actor sends its adapters only"
        stats.append(sender.send(tensors))
    return {"role": "trainer", "stats": stats, "generated": generated}


def _generator(case, groups, placement, rank):
    import torch

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import load_shard, load_spec, sharding
    from mindspeed_llm.inference import SamplingConfig, engine_inputs, generate
    from mindspeed_llm.models import build_model, lora
    from mindspeed_llm.rl.async_rl import streaming, weights

    g, r = case["generator_tp"], placement.generator_tp_rank(rank)
    reference = case["reference_root"]  # TP1 x PP1: the full weights
    spec = load_spec(reference)
    full = {n: t for n, t in load_shard(reference, 0, 0)["model"].items() if not sharding.is_extra_state(n)}
    expected = sharding.split_model(full, spec, g, 1, False, with_extra_state=False)[(r, 0)]
    # the generator's actor: a GPTModel at its own TP on explicit groups (no megatron parallel_state on this rank)
    model = build_model(spec, groups=groups.model_groups()).eval()
    receiver = streaming.WeightReceiver(groups.sources, g, r)
    phases = [expected]
    if case.get("step"):
        phases.append({n: t + 1.0 for n, t in expected.items()})
    if case.get("lora"):
        adapters = {}
        for name, weight in full.items():
            if name.endswith(tuple(f"{t}.weight" for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))):
                module = name[:-len(".weight")]
                a, b = lora_files.split_for_rank(module, *_full_adapter(module, *weight.shape), g, r)
                adapters[module + lora_files.A_SUFFIX], adapters[module + lora_files.B_SUFFIX] = a, b
        phases.append(adapters)
    stats, unequal, names = [], [], []
    for phase, want in enumerate(phases):
        if phase == 1 and case.get("lora"):
            lora.apply_lora(model, lora.LoRAConfig(r=LORA_RANK, alpha=8.0, target_modules=lora.DENSE_TARGETS))
        targets = weights.model_tensors(model)
        if case.get("drop"):
            targets.pop(case["drop"])
        with torch.no_grad():
            for tensor in targets.values():
                tensor.fill_(float("nan"))  # a tensor the sync misses stays NaN
        stats.append(receiver.receive(targets))
        names.append(sorted(targets) == sorted(want))
        unequal += [n for n in want if not torch.equal(targets[n], want[n])]
        if phase == 0 and case.get("generate"):
            generated = _generations(model)
            source = engine_inputs.source_rank(model)[1]  # the rank that picks the block's tokens
            try:  # the static engine reads megatron's parallel_state throughout: refused on explicit groups
                generate(model, PROMPTS, SamplingConfig(max_new_tokens=2), engine="static")
                static = None
            except ValueError as error:
                static = str(error)
    return {"role": "generator", "stats": stats, "unequal": unequal, "same_names": names,
            "tensors": sum(len(p) for p in phases), "generated": generated if case.get("generate") else None,
            "source": source if case.get("generate") else None, "static": static if case.get("generate") else None}


def _sync_body(rank, world_size, case):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from mindspeed_llm import device
    from mindspeed_llm.rl.async_rl import placement as placing
    from mindspeed_llm.rl.async_rl.weights import WeightSyncError

    device.setup()
    tp, pp = case["tp"], case["pp"]
    trainers = tp * pp * case.get("dp", 1)
    placement = placing.plan_placement(world_size, world_size - trainers, case["generator_tp"], tp, pp)
    groups = placing.initialize(placement, tp, pp, seed=1234, backend="gloo")
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # megatron's groups over the trainers alone (patches/trainer_world.py): their DP, and none on a generator
    layout = ({"megatron_groups": parallel_state.model_parallel_is_initialized()} if placement.is_generator(rank)
              else {"dp": parallel_state.get_data_parallel_world_size()})
    with get_cuda_rng_tracker().fork():  # the tensor-parallel stream: a generator's follows its own TP rank
        layout["tp_draw"] = torch.rand(3).tolist()
    try:
        if placement.is_generator(rank):
            return dict(_generator(case, groups, placement, rank), **layout)
        return dict(_trainer(case, groups, rank), **layout)
    except WeightSyncError as error:
        return {"role": "generator" if placement.is_generator(rank) else "trainer", "error": str(error)}


CASES = {
    "tp2_to_tp1_two_versions": (3, dict(tp=2, pp=1, generator_tp=1, bucket_bytes=16 * 1024, step=True)),
    "pp2_to_tp1": (3, dict(tp=1, pp=2, generator_tp=1, bucket_bytes=16 * 1024)),
    "tp2_to_tp2_two_versions_generates": (4, dict(tp=2, pp=1, generator_tp=2, bucket_bytes=1 << 30, step=True,
                                                  generate=True)),
    "tp1_dp2_to_tp1_generates": (3, dict(tp=1, pp=1, dp=2, generator_tp=1, bucket_bytes=16 * 1024, generate=True)),
    "tp2_to_two_tp1_lora": (4, dict(tp=2, pp=1, generator_tp=1, bucket_bytes=16 * 1024, lora=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_generators_hold_the_trainers_weights_resharded(checkpoints, name):
    world_size, case = CASES[name]
    case = dict(case, trainer_root=checkpoints[(case["tp"], case["pp"])], reference_root=checkpoints[(1, 1)])
    results = run_distributed(_sync_body, world_size, case)
    generators = [r for r in results if r["role"] == "generator"]
    assert len(generators) == world_size - case["tp"] * case["pp"] * case.get("dp", 1)
    for result in generators:
        assert "error" not in result, result
        assert all(result["same_names"]), "the generator's GPTModel holds the checkpoint's tensors"
        assert result["unequal"] == [] and result["tensors"] > 0
        assert [s.version for s in result["stats"]] == ([1, 2] if case.get("lora") or case.get("step") else [1])
    trainers = [r for r in results if r["role"] == "trainer"]
    assert [g["megatron_groups"] for g in generators] == [False] * len(generators)
    assert [t["dp"] for t in trainers] == [case.get("dp", 1)] * len(trainers)
    # seeded as a trainer of the same TP rank is (the same seed, megatron's offset by TP rank)
    g = case["generator_tp"]
    assert [r["tp_draw"] for r in generators] == [trainers[i % g]["tp_draw"] for i in range(len(generators))]
    if g == 2:
        assert generators[0]["tp_draw"] != generators[1]["tp_draw"]
    if case.get("generate"):  # the generator's engine on its own groups = the trainers' on megatron's, bit for bit
        for result in generators + trainers[1:]:
            assert result["generated"] == trainers[0]["generated"]
        first = world_size - len(generators)  # a TP2 block's first rank picks its tokens and broadcasts them
        assert [g["source"] for g in generators] == ([first] * 2 if case["generator_tp"] == 2 else [None])
        assert all("a model built on explicit groups (a generator rank) runs the continuous engine only" in g["static"]
                   for g in generators)
        responses, lengths, _ = trainers[0]["generated"]["sampled"]
        assert min(lengths) > 0 and responses != trainers[0]["generated"]["greedy"][0]
    trainers = [t for t in trainers if t["stats"]]  # the sources
    for phase in range(len(generators[0]["stats"])):
        sent = sum(t["stats"][phase].bytes for t in trainers)
        # every generator receives what every source sends, the full model once (replicated tensors from TP rank 0)
        assert all(g["stats"][phase].bytes == sent for g in generators)
        if case["bucket_bytes"] < 1 << 20 and phase == 0:
            assert all(t["stats"][0].buckets > 1 for t in trainers)
    if case.get("lora"):  # the adapters are a small fraction of the weights
        assert generators[0]["stats"][1].bytes < generators[0]["stats"][0].bytes / 4


def test_a_generator_that_does_not_fit_stops_every_rank_with_the_tensor_named(checkpoints):
    case = dict(tp=2, pp=1, generator_tp=1, bucket_bytes=1 << 20, trainer_root=checkpoints[(2, 1)],
                reference_root=checkpoints[(1, 1)], drop="decoder.layers.1.mlp.linear_fc2.weight")
    results = run_distributed(_sync_body, 3, case)
    assert "sent but not held here ['decoder.layers.1.mlp.linear_fc2.weight'] (1)" in results[2]["error"]
    for trainer in results[:2]:
        assert "a generator rank refused weight version 1 from trainer rank" in trainer["error"]
