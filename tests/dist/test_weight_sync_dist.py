"""The weight stream over a gloo world (`rl/async_rl/`): trainer ranks hold the actor as megatron GPTModels at
TP2 or PP2 (loaded from a checkpoint of that layout), generator ranks as GPTModels at their own TP (1 or 2, built
on explicit groups, their parameters NaN before the sync); after a sync every generator parameter is torch.equal to
the checkpoint code's split, at the generator's TP, of the same model's TP1 x PP1 checkpoint (converted separately
from the same Hugging Face folder). LoRA: only the adapters go.

One world, two layouts: megatron's parallel_state is one global per process, so it is initialised over the trainer
ranks only (every rank calls it with torch's world size read as the trainers' count: the generators take part in
each `new_group` and belong to none), and the generators get explicit groups (`placement.create_sync_groups`).
"""

import os
import zlib
from unittest import mock

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


def _megatron_over_trainers(placement, tp, pp):
    import torch.distributed as dist
    from megatron.core import parallel_state

    trainers = len(placement.trainer_ranks)
    world_size = dist.get_world_size
    with mock.patch.object(dist, "get_world_size", lambda group=None: trainers if group is None else world_size(group)):
        parallel_state.initialize_model_parallel(tp, pp)


def _trainer(case, groups, rank):
    import torch
    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model, lora
    from mindspeed_llm.rl.async_rl import streaming, weights

    distributed.seed_all(1234)
    root = case["trainer_root"]
    model = build_model(load_spec(root), value_head=False).eval()
    load_megatron_weights(model, root)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    sender = streaming.WeightSender(groups.own, case["tp"], case["pp"], tp_rank, pp_rank, case["bucket_bytes"])
    stats = [sender.send(weights.model_tensors(model))]
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
    return {"role": "trainer", "stats": stats}


def _generator(case, groups, placement, rank):
    import torch

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import load_shard, load_spec, sharding
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
    return {"role": "generator", "stats": stats, "unequal": unequal, "same_names": names,
            "tensors": sum(len(p) for p in phases)}


def _sync_body(rank, world_size, case):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from mindspeed_llm import device
    from mindspeed_llm.rl.async_rl import placement as placing
    from mindspeed_llm.rl.async_rl.weights import WeightSyncError

    device.setup()
    tp, pp = case["tp"], case["pp"]
    placement = placing.plan_placement(world_size, world_size - tp * pp, case["generator_tp"], tp, pp)
    _megatron_over_trainers(placement, tp, pp)
    groups = placing.create_sync_groups(placement, placing.trainer_sources(tp, pp), backend="gloo")
    try:
        if placement.is_generator(rank):
            return _generator(case, groups, placement, rank)
        return _trainer(case, groups, rank)
    except WeightSyncError as error:
        return {"role": "generator" if placement.is_generator(rank) else "trainer", "error": str(error)}


CASES = {
    "tp2_to_tp1_two_versions": (3, dict(tp=2, pp=1, generator_tp=1, bucket_bytes=16 * 1024, step=True)),
    "pp2_to_tp1": (3, dict(tp=1, pp=2, generator_tp=1, bucket_bytes=16 * 1024)),
    "tp2_to_tp2_two_versions": (4, dict(tp=2, pp=1, generator_tp=2, bucket_bytes=1 << 30, step=True)),
    "tp2_to_two_tp1_lora": (4, dict(tp=2, pp=1, generator_tp=1, bucket_bytes=16 * 1024, lora=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_generators_hold_the_trainers_weights_resharded(checkpoints, name):
    world_size, case = CASES[name]
    case = dict(case, trainer_root=checkpoints[(case["tp"], case["pp"])], reference_root=checkpoints[(1, 1)])
    results = run_distributed(_sync_body, world_size, case)
    generators = [r for r in results if r["role"] == "generator"]
    assert len(generators) == world_size - case["tp"] * case["pp"]
    for result in generators:
        assert "error" not in result, result
        assert all(result["same_names"]), "the generator's GPTModel holds the checkpoint's tensors"
        assert result["unequal"] == [] and result["tensors"] > 0
        assert [s.version for s in result["stats"]] == ([1, 2] if case.get("lora") or case.get("step") else [1])
    trainers = [r for r in results if r["role"] == "trainer"]
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
