"""Mixture-of-experts actors in the RL stages (`mindspeed_llm/rl/update/moe.py`):

* the router's load-balancing loss reaches the trained model's gradient with its coefficient: the gradient of a
  step equals that of (loss shares + coeff x the micro-batch mean of the summed per-layer Switch loss), computed
  here by hand from the routers' inputs (coefficient 0: the plain loss's gradient);
* the MoE metrics (tokens per expert, imbalance, Megatron's tracked load-balancing loss) against a hand count
  over the real tokens of both ranks at EP2;
* the run's MoE flags reach the model and bad combinations are refused naming the flags;
* both stages with a tiny Qwen3-MoE actor at EP2 on 2 processes, and a resume from a saved iteration equal to the
  uninterrupted run, bit for bit;
* a trained MoE actor at TP2 x EP2 with --sequence-parallel and routing replay (4 processes) against TP1 x EP2: the
  metrics and the weights after the step.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import ATOL, KEY_ATOL, RTOL, SKIPPED, WEIGHT_RTOL, relative, run_stages

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

E, TOPK, LAYERS = 4, 2, 2


def _spec(**overrides):
    from mindspeed_llm.models import ArchitectureSpec

    fields = dict(family="qwen3_moe", num_layers=LAYERS, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, kv_channels=8, vocab_size=64, max_position_embeddings=64, qk_layernorm=True,
                  num_experts=E, moe_ffn_hidden_size=16, moe_router_topk=TOPK, moe_aux_loss_coeff=0.0)
    fields.update(overrides)
    return ArchitectureSpec(**fields)


def _micro_batches(seed: int, count: int = 2, rows: int = 2, width: int = 7):
    """`batch_plan`-style micro-batches (one row per sample): prompt + response + right padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompt = torch.randint(2, 4, (rows,), generator=gen)
        length = torch.randint(1, width - 3, (rows,), generator=gen)
        R = width - 2
        response_mask = (torch.arange(R)[None, :] < length[:, None]).float()
        out.append(dict(
            tokens=torch.randint(0, 64, (rows, width), generator=gen),
            position_ids=torch.arange(width).repeat(rows, 1),
            prompt_lengths=prompt, response_mask=response_mask, row_index=torch.arange(rows),
            last_token_index=prompt + length - 1,
            weights=torch.randn(rows, width, generator=gen),
        ))
    return out


def _share(output, mb, num_micro_batches):
    """A loss share: a fixed linear read of the logits (their mean over the vocabulary), so its gradient is simple
    and every position the model computes contributes."""
    return (output.float().mean(-1) * mb["weights"]).sum() / num_micro_batches


def _hand_padding(mb):
    """[rows, S] True past each row's prompt + response (one row per sample)."""
    end = mb["prompt_lengths"] + mb["response_mask"].sum(-1).long()
    return torch.arange(mb["tokens"].shape[1])[None, :] >= end[:, None]


def _hand_aux(router_inputs, weights, pads):
    """Megatron's Switch loss per layer, by hand: E / (k T^2) sum_e (sum_t p_te) (sum_t m_te) over real tokens."""
    total = 0.0
    counts = torch.zeros(LAYERS, E, dtype=torch.float64)
    for layer, (hidden, pad) in enumerate(zip(router_inputs, pads)):
        logits = hidden.reshape(-1, hidden.shape[-1]) @ weights[layer].t()
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.zeros_like(probs).scatter(1, probs.topk(TOPK, dim=-1).indices, 1.0)
        real = (~pad.t().reshape(-1)).float()[:, None]  # pad [rows, S]; the router's order is position-major
        probs, top = probs * real, top * real
        tokens = real.sum()
        total = total + E / (TOPK * tokens ** 2) * (probs.sum(0) * top.sum(0)).sum()
        counts[layer] += top.sum(0).double()
    return total, counts


def _capture_router_inputs(model):
    from mindspeed_llm.rl.update.moe import _routers

    seen = []
    handles = [r.register_forward_pre_hook(lambda m, args: seen.append((m.layer_number, args[0], args[1])))
               for r in _routers(model)]
    return seen, handles


def _aux_gradient_case(rank, world_size):
    from megatron.core import tensor_parallel

    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import moe
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel

    distributed.initialize(1, 1, 5)
    coeff = 0.3
    results = {}
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    base = build_model(_spec(), moe_aux_loss_coeff=0.0)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in base.state_dict().items()}
    micro_batches = _micro_batches(11)
    M = len(micro_batches)
    for c in (coeff, 0.0):
        model = build_model(_spec(), moe_aux_loss_coeff=c)
        model.load_state_dict(state)
        trainable = TrainableModel(model, OptimizerSettings(lr=0.0, optimizer="sgd", sgd_momentum=0.0, clip_grad=0.0))
        with moe.update_stats(model) as stats:
            stats.micro_batches(M)
            trainable.train_step(micro_batches, lambda out, mb: (_share(out, mb, M), {}))
        results[c] = ({n: p.main_grad.clone() for n, p in model.named_parameters()}, stats.metrics())

    # By hand: the same weights in train mode with no aux path, the loss written out.
    plain = build_model(_spec(), moe_aux_loss_coeff=0.0)
    plain.load_state_dict(state)
    plain.train()
    seen, handles = _capture_router_inputs(plain)
    router_weights = [plain.decoder.layers[i].mlp.router.weight for i in range(LAYERS)]
    total, aux_values = 0.0, []
    from mindspeed_llm.models.forward_layout import forward_layout

    for mb in micro_batches:
        seen.clear()
        with forward_layout(plain, mb["position_ids"]):
            out = plain(mb["tokens"], mb["position_ids"], None)
        assert [s[0] for s in seen] == [1, 2]
        aux, _ = _hand_aux([s[1] for s in seen], router_weights, [_hand_padding(mb)] * LAYERS)
        aux_values.append(float(aux) / LAYERS)
        total = total + _share(out, mb, M) + coeff * aux / M
    for h in handles:
        h.remove()
    total.backward()
    hand = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.zero_grad()
    sum(_share(plain(mb["tokens"], mb["position_ids"], None), mb, M) for mb in micro_batches).backward()
    hand_plain = {n: p.grad.clone() for n, p in plain.named_parameters()}
    return results, hand, hand_plain, sum(aux_values) / M


def relative(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.slow
def test_aux_loss_gradient_equals_the_hand_written_loss():
    results, hand, hand_plain, hand_aux = run_distributed(_aux_gradient_case, 1)[0]
    with_aux, metrics = results[0.3]
    without, metrics0 = results[0.0]
    for name in hand:
        scale = float(hand[name].norm())
        assert float((with_aux[name] - hand[name]).norm()) <= 1e-5 * scale + 1e-9, name
        assert float((without[name] - hand_plain[name]).norm()) <= 1e-5 * float(hand_plain[name].norm()) + 1e-9, name
    router = "decoder.layers.0.mlp.router.weight"
    # the aux term is really in the gradient: the router's gradient moves with it
    assert relative(with_aux[router], without[router]) > 1e-3
    # Megatron's tracked loss (without its coefficient), averaged over layers and micro-batches
    assert metrics["moe/load_balancing_loss"] == pytest.approx(hand_aux, rel=1e-5)
    assert "moe/load_balancing_loss" not in metrics0  # a zero coefficient: megatron computes none


def _metrics_case(rank, world_size):
    from megatron.core import tensor_parallel

    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import moe
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel

    distributed.initialize(1, 1, 5, expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    model = build_model(_spec(), moe_aux_loss_coeff=0.1, moe_token_dispatcher_type="alltoall")
    trainable = TrainableModel(model, OptimizerSettings(lr=0.0, optimizer="sgd", sgd_momentum=0.0, clip_grad=0.0))
    micro_batches = _micro_batches(100 + rank, count=3)  # each rank its own tokens
    seen, handles = _capture_router_inputs(model)
    with moe.update_stats(model) as stats:
        stats.micro_batches(len(micro_batches))
        trainable.train_step(micro_batches, lambda out, mb: (_share(out, mb, len(micro_batches)), {}))
    for h in handles:
        h.remove()
    metrics = stats.metrics()
    # Frozen / no-grad passes neither count nor track.
    from mindspeed_llm.rl.update.engine import forward_only

    with moe.update_stats(model) as idle:
        forward_only(model, [dict(mb, responses=mb["response_mask"]) for mb in micro_batches],
                     lambda out, mb: out[:, :1, 0])
    idle_counts = idle.counts.clone()
    assert idle.metrics()["moe/load_balancing_loss"] == 0.0  # megatron's tracker saw nothing either

    router_weights = [model.decoder.layers[i].mlp.router.weight.detach() for i in range(LAYERS)]
    counts = torch.zeros(LAYERS, E, dtype=torch.float64)
    aux = []
    for k, mb in enumerate(micro_batches):
        inputs = [s[1].detach() for s in seen[k * LAYERS:(k + 1) * LAYERS]]
        value, c = _hand_aux(inputs, router_weights, [_hand_padding(mb)] * LAYERS)
        counts += c
        aux.append(float(value) / LAYERS)
    return metrics, counts, sum(aux) / len(aux), idle_counts


@pytest.mark.slow
def test_moe_metrics_equal_a_hand_count_at_ep2():
    results = run_distributed(_metrics_case, 2)
    counts = results[0][1] + results[1][1]  # both ranks' tokens, every expert (global ids)
    for metrics, _, _, idle in results:
        assert metrics["moe/tokens_per_expert_min"] == float(counts.min())
        assert metrics["moe/tokens_per_expert_max"] == float(counts.max())
        per_layer = counts.max(dim=1).values / counts.mean(dim=1)
        assert metrics["moe/expert_imbalance"] == pytest.approx(float(per_layer.max()), rel=1e-12)
        # each real token is routed to top-k experts in each layer
        real = sum(int((~_hand_padding(mb)).sum()) for seed in (100, 101) for mb in _micro_batches(seed, count=3))
        assert counts.sum(dim=1).tolist() == [real * TOPK] * LAYERS
        # Megatron's tracker: mean over both ranks' micro-batches and the layers
        hand = (results[0][2] + results[1][2]) / 2
        assert metrics["moe/load_balancing_loss"] == pytest.approx(hand, rel=1e-5)
        assert float(idle.sum()) == 0.0
    assert counts.min() < counts.max()  # not a degenerate routing


# ---------------------------------------------------------------------------------------------- the stages at EP2
MOE_KEYS = ["moe/load_balancing_loss", "moe/tokens_per_expert_min", "moe/tokens_per_expert_max",
            "moe/expert_imbalance"]


@pytest.fixture(scope="module")
def moe_task(tmp_path_factory):
    from tests.helpers import stage_assets

    return stage_assets.build_moe(tmp_path_factory.mktemp("moe_task"), ep=2)


def _stage_argv(task, stage, out, iters, *extra):
    argv = ["--stage", stage.split("-")[0], "--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "5",
            "--data-path", task["data"], "--tokenizer-name-or-path", task["tokenizer"], "--max-length", "64",
            "--max-new-tokens", "8", "--do-sample", "--lr", "0.01", "--log-interval", "1",
            "--ref-model", task["mg_moe_actor_ep2"], "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--train-iters", str(iters), "--save", str(out),
            "--metrics-jsonl", str(out / "m.jsonl")]
    if stage == "grpo":  # MoE actor and reference, a rule reward
        argv += ["--n-samples-per-prompt", "2", "--verifier-function", "odd_first_word", "--kl-coef", "0.05"]
    else:  # MoE actor and reference; dense critic and reward model, or MoE ones (trl_ppo-moe-critic)
        reward = task["mg_moe_reward_ep2"] if stage.endswith("moe-critic") else task["mg_reward_tp1pp1"]
        argv += ["--reward-model", reward, "--temperature", "1.0"]
    return argv + list(extra)


def _shards(root, role, iteration):
    """{shard folder: model state} of one saved role."""
    folder = root / role / f"iter_{iteration:07d}"
    return {p.parent.name: torch.load(p, weights_only=False)["model"]
            for p in sorted(folder.glob("*/model_optim_rng.pt"))}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo", "trl_ppo", "trl_ppo-moe-critic"])
def test_moe_actor_at_ep2_trains_and_resumes_bitwise(moe_task, tmp_path, stage):
    """Two iterations with a save after each equal one iteration, a save, and a second run with --load, bit for
    bit (metrics and every expert-parallel shard), with the MoE metrics logged and finite."""
    import json


    whole, split = tmp_path / "whole", tmp_path / "split"
    hf = ("--save-hf",) if stage == "grpo" else ()  # the actor's Hugging Face folder, gathered over EP
    run_distributed(run_stages, 2, [_stage_argv(moe_task, stage, whole, 2, "--save-interval", "1", *hf),
                                     _stage_argv(moe_task, stage, split, 1),
                                     _stage_argv(moe_task, stage, split, 2, "--load", str(split))])
    rows = {name: [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
            for name, out in (("whole", whole), ("split", split))}
    assert [r["iteration"] for r in rows["whole"]] == [1, 2] == [r["iteration"] for r in rows["split"]]
    for r in rows["whole"]:
        for key in MOE_KEYS:
            assert math.isfinite(r[f"actor/{key}"]), key
        if stage == "trl_ppo-moe-critic":  # the critic's own update, its own counts
            for key in MOE_KEYS:
                assert math.isfinite(r[f"critic/{key}"]), key
            assert r["critic/moe/tokens_per_expert_max"] != r["actor/moe/tokens_per_expert_max"] or \
                r["critic/moe/load_balancing_loss"] != r["actor/moe/load_balancing_loss"]
        else:
            assert not any(k.startswith("critic/moe/") for k in r)  # a dense critic
        assert r["actor/moe/tokens_per_expert_min"] <= r["actor/moe/tokens_per_expert_max"]
        assert r["actor/moe/expert_imbalance"] >= 1.0 and r["actor/moe/load_balancing_loss"] > 0
        assert math.isfinite(r["actor/pg_loss"])
    def steady(r):  # wall-clock times and throughputs differ between runs
        return {k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_tps")}

    assert steady(rows["whole"][1]) == steady(rows["split"][1])
    roles = ["actor"] if stage == "grpo" else ["actor", "critic"]
    for role in roles:
        a, b = _shards(whole, role, 2), _shards(split, role, 2)
        # the actor: one shard per expert-parallel rank; the dense critic: one
        moe_role = role == "actor" or stage == "trl_ppo-moe-critic"
        assert sorted(a) == sorted(b) == (["mp_rank_00_000", "mp_rank_00_001"] if moe_role else ["mp_rank_00"])
        for shard in a:
            for key, value in a[shard].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b[shard][key]), f"{role}/{shard}/{key}"
    if hf:  # --save-hf at EP2: every expert of both ranks, as convert_ckpt.py exports the checkpoint
        from transformers import AutoModelForCausalLM

        from mindspeed_llm.checkpoint import convert_mg_to_hf
        from tests.helpers.convert_checks import assert_identical, hf_tensors

        convert_mg_to_hf(str(whole / "actor"), str(tmp_path / "exported"), progress=False)
        folder = whole / "actor" / "iter_0000002" / "hf"
        assert_identical(hf_tensors(tmp_path / "exported"), hf_tensors(folder))
        _, loading = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    experts = _shards(whole, "actor", 2)
    assert not torch.equal(experts["mp_rank_00_000"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                           experts["mp_rank_00_001"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])


@pytest.mark.slow
def test_moe_flags_that_cannot_work_are_refused_by_name(moe_task, tmp_path):
    from tests.helpers.multiproc import _posttrain_main_cases

    dense = moe_task["mg_actor_tp1pp1"]

    def argv(*extra, actor=moe_task["mg_moe_actor_ep2"]):
        return _stage_argv(moe_task, "grpo", tmp_path / "out", 1, "--ref-model", actor, "--verifier-function",
                           "format", *extra)  # a built-in verifier: this process registers none

    cases = {
        "dense actor at EP2": (argv(actor=dense), ["--expert-model-parallel-size 2 needs a mixture-of-experts actor",
                                                   f"--ref-model {dense}"]),
        "routing replay with a dense actor": (argv("--expert-model-parallel-size", "1", "--moe-routing-replay",
                                                   actor=dense), ["--moe-routing-replay needs a mixture-of-experts"]),
        "expert count": (argv("--num-experts", "8"), ["--num-experts 8 does not match the checkpoint --ref-model",
                                                      "num_experts=4"]),
        "top-k": (argv("--moe-router-topk", "1"), ["--moe-router-topk 1 does not match", "moe_router_topk=2"]),
        "expert width (MindSpeed's name)": (argv("--moe-intermediate-size", "64"),
                                            ["--moe-ffn-hidden-size 64 does not match", "moe_ffn_hidden_size=32"]),
        "experts on a dense model": (argv("--num-experts", "4", "--expert-model-parallel-size", "1", actor=dense),
                                     ["--num-experts 4 does not match", "a dense model"]),
    }
    results = run_distributed(_posttrain_main_cases, 2, [a for a, _ in cases.values()])[0]
    for (name, (_, needles)), (code, out, err) in zip(cases.items(), results):
        assert code == 2, f"{name}: exit {code}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{name}: {err[-3000:]}"
        for needle in needles:
            assert needle in err, f"{name}: {needle!r} not in {err[-2000:]!r}"


def test_a_trained_moe_model_needs_tp1_or_sequence_parallel():
    from mindspeed_llm.arguments import ArgumentError
    from mindspeed_llm.rl.update.moe import check_trainable

    moe_model = types.SimpleNamespace(model_spec=_spec())
    check_trainable(moe_model, 1, "actor", "--ref-model")
    check_trainable(moe_model, 2, "actor", "--ref-model", sequence_parallel=True)
    check_trainable(types.SimpleNamespace(model_spec=_spec(num_experts=None)), 2, "critic", "--reward-model")
    with pytest.raises(ArgumentError, match="the actor \\(--ref-model\\) is a mixture-of-experts model.*"
                                            "--tensor-model-parallel-size 2 only together with --sequence-parallel"):
        check_trainable(moe_model, 2, "actor", "--ref-model")


@pytest.mark.slow
def test_moe_actor_at_tp2_ep2_with_sequence_parallel(moe_task, tmp_path):
    """A trained MoE actor at TP2 x EP2 with --sequence-parallel (megatron-core trains MoE layers at TP > 1 only so)
    on 4 processes, with routing replay, gives the iteration of the TP1 x EP2 run on 2 processes: every metric (the
    MoE ones and moe/routing_mismatch included) within the layout test's tolerances, and the weights after the step
    (resharded to TP1 x EP1) within 1e-5 of their norm. SGD, as in the layout test."""
    import json


    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_mg, load_shard

    tp2 = tmp_path / "mg_moe_actor_tp2ep2"
    convert_hf_to_mg(moe_task["hf_moe_actor"], str(tp2), 2, 1, tokenizer_dir=moe_task["tokenizer"], progress=False,
                     ep=2)
    common = ["--moe-routing-replay", "--recompute-old-logprobs", "--optimizer", "sgd", "--sgd-momentum", "0",
              "--lr", "0.5", "--clip-grad", "1.0", "--micro-batch-size", "4"]
    reference, sequence_parallel = tmp_path / "tp1ep2", tmp_path / "tp2ep2_sp"
    run_distributed(run_stages, 2, [_stage_argv(moe_task, "grpo", reference, 1, *common)])
    run_distributed(run_stages, 4, [_stage_argv(moe_task, "grpo", sequence_parallel, 1, *common, "--ref-model",
                                                 str(tp2), "--tensor-model-parallel-size", "2",
                                                 "--sequence-parallel")])
    (expected,), (got,) = ([json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
                           for out in (reference, sequence_parallel))
    for key in MOE_KEYS + ["moe/routing_mismatch"]:
        assert key in expected or f"actor/{key}" in expected, key
    assert expected["moe/routing_mismatch"] == 0.0  # replayed
    for key, value in expected.items():
        if key.startswith(SKIPPED) or key == "world_size":
            continue
        atol = KEY_ATOL.get(key, ATOL)
        assert abs(got[key] - value) <= atol + RTOL * abs(value), (key, got[key], value)
    assert expected["grad_norm"] > 1e-3 and expected["actor/moe/tokens_per_expert_min"] > 0, expected  # a real step
    merged = {}
    for name, root in (("reference", reference / "actor"), ("sp", sequence_parallel / "actor"),
                       ("initial", moe_task["mg_moe_actor_ep2"])):
        convert_mg_to_mg(str(root), str(tmp_path / f"{name}_tp1"), 1, 1, progress=False, ep=1)
        merged[name] = load_shard(str(tmp_path / f"{name}_tp1"), 0, 0)["model"]
    moved = 0.0
    for key, value in merged["reference"].items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert relative(merged["sp"][key].float(), value.float()) <= WEIGHT_RTOL, key
            moved = max(moved, relative(merged["initial"][key].float(), value.float()))
    assert moved > 1e-3, moved  # the step moved the weights well past the tolerance


def test_mindspeed_moe_switches_are_ignored_once_and_grouped_gemm_fallback_is_noted():
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.models.builder import grouped_gemm_kernel
    from mindspeed_llm.rl.startup import startup_lines

    switches = ["--moe-permutation-async-comm", "--moe-alltoall-overlap-comm", "--moe-fb-overlap",
                "--moe-permute-fusion", "--use-fused-moe-token-permute-and-unpermute"]
    args = parse_args(["--stage", "grpo", "--data-path", "d", "--train-iters", "1", "--global-batch-size", "4",
                       "--ref-model", "r", "--verifier-function", "format", "--moe-grouped-gemm",
                       "--moe-zero-memory", "level1", "--moe-zero-memory-num-layers", "2", *switches], world_size=1)
    lines = startup_lines(args.settings, backend="gloo")
    ignored = [line for line in lines if line.startswith("ignored flags: ")]
    assert len(ignored) == 1
    for flag in switches + ["--moe-zero-memory", "--moe-zero-memory-num-layers"]:
        assert ignored[0].count(flag + ",") + ignored[0].count(flag + " (") == 1, flag
    notes = [line for line in lines if line.startswith("--moe-grouped-gemm")]
    assert len(notes) == (1 if grouped_gemm_kernel() is None else 0)
    if notes:
        assert "SequentialMLP" in notes[0]
