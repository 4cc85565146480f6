"""Activation recompute (`--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`,
`--recompute-activations`, `--recompute-modules`, `--distribute-saved-activations`, `--moe-layer-recompute`):
megatron-core recomputes the trained models' training forwards, and that changes memory, never a number.

Tolerance: none. A recompute runs the same deterministic forward again on the same inputs (megatron's
checkpoint restores the RNG states, so dropout draws the same masks), and on CPU the kernels are deterministic,
so every gradient, weight and logged metric is asserted bit-identical to the run without recompute. The one
exception is selective recompute of the shared experts: the same numbers, but the MoE layer's input gradient sums
its branches in another order, so those cases are compared within float32 rounding (`ROUNDING`).

* flag rules: the combinations megatron-core's TransformerConfig refuses are refused by `validate_args`, naming
  the flags (each checked against megatron's own refusal), and so are those it would ignore;
* model level (one process, tiny models, packed prompt groups with padding): gradients with full (uniform and
  block) and every selective module the local spec runs equal those without; layers run twice in a training
  step and once in a forward-only pass; the saved bytes fall; multi-latent attention's per-layer rotary gets the
  packed positions in the recomputed forward; block recompute keeps the padding mask (the patch shown needed);
* routing replay under recompute: a planted routing (not the live one) changes the gradient identically with
  and without recompute, at PP2 with 1F1B's micro-batches in flight too (the snapshot patch shown needed);
* the real stages (slow): one update of trl_ppo and grpo on the word task gives the same logged metrics and
  weights with full uniform / full block / selective recompute as without, at TP1, TP2 and PP2, with dropout at
  TP1 and --distribute-saved-activations at TP2; the actor and critic are built with recompute, the reference
  and reward model without, and the actor's layers run twice per update micro-batch.
"""

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed
from tests.helpers.patch_removal import without_patch  # noqa: E402
from tests.helpers.hf_tiny import deepseek_variant
from tests.helpers.routing_batches import MOE_SPEC, groups_share_prompts, synthetic_experience

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

BASE_ARGV = ["--stage", "grpo", "--global-batch-size", "8", "--train-iters", "1", "--data-path", "x",
             "--ref-model", "r", "--verifier-function", "math_acc"]


# ---------------------------------------------------------------------------------------------- flag rules
def _parse(extra, world_size=1):
    from mindspeed_llm.arguments import parse_args

    return parse_args(BASE_ARGV + extra, world_size)


def _megatron_refuses(**fields) -> bool:
    """Whether megatron-core 0.16.1's TransformerConfig refuses these recompute fields (the independent rule)."""
    from megatron.core.transformer import TransformerConfig

    try:
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)
    except (ValueError, AssertionError):
        return True
    return False


@pytest.mark.parametrize("extra,fields,named", [
    (["--recompute-granularity", "full"], dict(recompute_granularity="full"), "--recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
     dict(recompute_granularity="full", recompute_num_layers=1), "--recompute-method uniform|block"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     dict(recompute_granularity="selective", recompute_num_layers=1), "--recompute-num-layers"),
    (["--recompute-activations", "--recompute-num-layers", "1"],
     dict(recompute_granularity="selective", recompute_num_layers=1), "--recompute-num-layers"),
    (["--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "1"],
     dict(moe_layer_recompute=True, recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
     "--moe-layer-recompute"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "--recompute-modules moe_act"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attention"],
     dict(recompute_granularity="selective", recompute_modules=["attention"]), "--recompute-modules attention"),
])
def test_what_megatron_refuses_is_refused_by_name(extra, fields, named):
    from mindspeed_llm.arguments import ArgumentError

    assert _megatron_refuses(**fields), fields
    with pytest.raises(ArgumentError, match=named.replace("|", r"\|")):
        _parse(extra)


@pytest.mark.parametrize("extra,named", [
    # Megatron-LM's validate_args: a method is not for selective; distributed saving needs TP > 1 and full
    (["--recompute-activations", "--recompute-method", "uniform"], "--recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--distribute-saved-activations"], "--tensor-model-parallel-size > 1"),
    (["--recompute-granularity", "selective", "--distribute-saved-activations"], "--distribute-saved-activations"),
    # contradictions, and flags that would do nothing
    (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations"),
    (["--recompute-method", "block", "--recompute-num-layers", "2"], "--recompute-method, --recompute-num-layers"),
    (["--recompute-modules", "core_attn"], "--recompute-modules"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
      "--recompute-modules", "mlp"], "--recompute-modules"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0"),
])
def test_megatron_lm_rules_and_no_op_flags_are_refused_by_name(extra, named):
    from mindspeed_llm.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=named):
        _parse(extra)


def test_flags_resolve_as_megatron_lm():
    def resolved(extra, world_size=1):
        return _parse(extra, world_size).settings.recompute

    a = resolved(["--recompute-activations"])
    assert (a.recompute_granularity, a.recompute_modules) == ("selective", ("core_attn",))
    a = resolved(["--moe-layer-recompute"])  # megatron-core: the default module list plus moe
    assert (a.recompute_granularity, a.recompute_modules) == ("selective", ("core_attn", "moe"))
    a = resolved(["--recompute-granularity", "selective", "--recompute-modules", "mlp", "core_attn", "mlp"])
    assert a.recompute_modules == ("mlp", "core_attn")
    a = resolved(["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
                  "--tensor-model-parallel-size", "2", "--distribute-saved-activations"], world_size=2)
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers, a.recompute_modules) == \
        ("full", "block", 2, None)
    a = resolved([])
    assert a.recompute_granularity is None and a.recompute_modules is None


def test_layer_counts_are_checked_per_pipeline_stage():
    """--recompute-num-layers counts the layers of one pipeline stage: 2 layers at PP2 leave 1 per stage."""
    from tests.helpers.hf_tiny import tiny_config

    from mindspeed_llm.arguments import ArgumentError
    from mindspeed_llm.models import ArchitectureSpec
    from mindspeed_llm.rl.update import recompute

    dense = ArchitectureSpec.from_hf_config(tiny_config("qwen2", num_layers=4).to_dict())
    moe = ArchitectureSpec.from_hf_config(tiny_config("qwen2_moe").to_dict())

    def options(spec, extra, world=1, policy=True, trained=True):
        return recompute.model_options(spec, _parse(extra, world).settings.recompute, trained=trained, policy=policy)

    full = ["--recompute-granularity", "full", "--recompute-method"]
    assert options(dense, full + ["uniform", "--recompute-num-layers", "2"])["recompute_num_layers"] == 2
    assert options(dense, full + ["block", "--recompute-num-layers", "2", "--pipeline-model-parallel-size", "2"],
                   2)["recompute_num_layers"] == 2
    with pytest.raises(ArgumentError, match="exceeds the 2 layers of each pipeline stage"):
        options(dense, full + ["block", "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2"], 2)
    with pytest.raises(ArgumentError, match="groups of 3"):
        options(dense, full + ["uniform", "--recompute-num-layers", "3"])
    assert options(dense, full + ["uniform", "--recompute-num-layers", "3"], trained=False) == {}  # frozen roles
    selective = ["--recompute-granularity", "selective", "--recompute-modules"]
    with pytest.raises(ArgumentError, match="--recompute-modules moe: this qwen2 model has no mixture-of-experts"):
        options(dense, selective + ["core_attn", "moe"])
    with pytest.raises(ArgumentError, match="--moe-layer-recompute: this qwen2 model"):
        options(dense, ["--moe-layer-recompute"])
    with pytest.raises(ArgumentError, match="--recompute-modules mlp: this qwen2_moe model has no dense MLP"):
        options(moe, selective + ["mlp"])
    with pytest.raises(ArgumentError, match="no multi-latent attention"):
        options(moe, selective + ["mla_up_proj"])
    # a critic of another architecture gets the modules that apply to it
    assert options(dense, selective + ["core_attn", "moe"], policy=False)["recompute_modules"] == ["core_attn"]
    assert options(moe, selective + ["moe", "shared_experts"])["recompute_modules"] == ["moe", "shared_experts"]


# ---------------------------------------------------------------------------------------------- model level
def _specs():
    from tests.helpers.hf_tiny import tiny_config

    from mindspeed_llm.models import ArchitectureSpec

    def spec(family, **overrides):
        return ArchitectureSpec.from_hf_config(tiny_config(family, **overrides).to_dict())


    return {"dense": spec("qwen2"), "moe": spec("qwen2_moe"),
            "mla": spec("deepseek_v3", **deepseek_variant("deepseek_v3"))}


def _batches(vocab, routing_layers=0, topk=0, experts=0):
    """Two plans of one synthetic batch of prompt groups of 2 with padding: one row per sample (2 micro-batches)
    and packed groups (RoPE at position ids that are not the slots, a group attention mask). With
    `routing_layers`, a planted routing (random experts, not the model's) for replay."""

    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan

    exp = synthetic_experience([4, 4, 6, 6], [5, 2, 3, 7], vocab=vocab, seed=1)
    groups_share_prompts(exp, 2)
    if routing_layers:
        g = torch.Generator().manual_seed(7)
        T = exp.tokens.shape[1]
        exp.routing = torch.rand(exp.batch_size, routing_layers, T, experts, generator=g).argsort(-1)[..., :topk] \
            .to(torch.int16)
    return {"rows": MicroBatchPlan.build(exp, 2).micro_batches(exp),
            "packed": MicroBatchPlan.build(exp, 4, 2).micro_batches(exp)}


class _Calls:
    """Forward calls per module of the given classes, split by train mode (a recompute is a train-mode call)."""

    def __init__(self, model, kinds):
        self.train, self.eval = {}, {}
        self.handles = []
        for name, module in model.named_modules():
            if isinstance(module, kinds):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args, output):
            counts = self.train if module.training else self.eval
            counts[name] = counts.get(name, 0) + 1
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _step(spec, state, fields, micro_batches, dtype="fp32", calls=(), seed=0):
    """One forward-backward of `micro_batches` on megatron's schedule (`engine.run_schedule`, train mode) from
    the weights `state`: ({param: grad}, the MoE update metrics, _Calls)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import engine, moe

    model = build_model(spec, params_dtype=dtype, **fields)
    model.load_state_dict(state)
    model.train()
    counter = _Calls(model, calls) if calls else None
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)  # the same dropout masks in every run
    with moe.update_stats(model) as stats:
        engine.run_schedule([model], micro_batches, lambda out, mb: (out.float().square().mean(), {}), False)
        stats.micro_batches(len(micro_batches))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = stats.metrics() if spec.is_moe else {}
    if counter is not None:
        counter.close()
    return grads, metrics, (counter, model)


def _same(a, b, rtol=0.0) -> bool:
    """Equal dicts of tensors or numbers: bit for bit, or within `rtol`."""
    if sorted(a) != sorted(b):
        return False
    if rtol:
        return all(abs(a[k] - b[k]) <= rtol * abs(b[k]) for k in a)
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _relative(a, b) -> float:
    """The largest difference of a tensor of `a` from `b`'s, relative to the norm of `b`'s."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in a)


# Selective recompute of the shared experts computes the same numbers, but the MoE layer's input gradient then sums
# its three branches (router, routed experts, shared experts) in another order: float32 rounding, ~1e-7 of a
# gradient's norm here. Those cases are compared within ROUNDING of each tensor's norm; all others bit for bit.
ROUNDING = 1e-5


FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)


def _selective(*modules):
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


def _model_level_body(rank, world_size):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import engine
    from mindspeed_llm.rl.update.batch_plan import gather_last_token

    distributed.initialize(1, 1, seed=5)
    specs = _specs()
    out = {"grads_equal": {}, "differs": {}, "rounding": {}}
    try:  # megatron's selective layernorm recompute, as TransformerLayer builds it
        from megatron.core import tensor_parallel

        tensor_parallel.CheckpointWithoutOutput().checkpoint(torch.nn.Identity(), torch.ones(2, requires_grad=True))
        out["layernorm_error"] = ""
    except NameError as exc:
        out["layernorm_error"] = str(exc)
    configs = {
        "dense": {"full_uniform": FULL_UNIFORM, "full_uniform2": dict(FULL_UNIFORM, recompute_num_layers=2),
                  "full_block": FULL_BLOCK, "core_attn": _selective("core_attn"), "mlp": _selective("mlp"),
                  "both": _selective("core_attn", "mlp")},
        "moe": {"full_uniform": FULL_UNIFORM, "full_block": FULL_BLOCK, "moe": _selective("moe"),
                "shared_experts": _selective("shared_experts"),
                "all": _selective("core_attn", "moe", "shared_experts")},
        "mla": {"full_uniform": FULL_UNIFORM, "full_block": FULL_BLOCK, "mla_up_proj": _selective("mla_up_proj"),
                "core_attn": _selective("core_attn"), "moe_mlp": _selective("moe", "mlp", "shared_experts")},
    }
    for family, cases in configs.items():
        spec = specs[family]
        state = build_model(spec).state_dict()
        for layout, mbs in _batches(spec.vocab_size).items():
            reference, ref_metrics, _ = _step(spec, state, {}, mbs)
            assert reference and any(g.abs().sum() > 0 for g in reference.values())
            for name, fields in cases.items():
                grads, metrics, _ = _step(spec, state, fields, mbs)
                if "shared_experts" in fields.get("recompute_modules", ()):  # see ROUNDING
                    out["rounding"][f"{family}/{layout}/{name}"] = (_relative(grads, reference),
                                                                    _same(metrics, ref_metrics, ROUNDING))
                else:
                    out["grads_equal"][f"{family}/{layout}/{name}"] = _same(grads, reference) and metrics == ref_metrics
            if family == "mla" and layout == "packed":  # MLA's rotary runs inside each (recomputed) layer
                with without_patch("tensor_parallel.checkpoint"):
                    grads, _, _ = _step(spec, state, FULL_UNIFORM, mbs)
                out["differs"]["mla_positions_without_snapshot"] = not _same(grads, reference)
            if family == "moe" and layout == "rows":  # block leaves layer 1 unchecked: it must get the padding mask
                with without_patch("TransformerBlock._checkpointed_forward"):
                    grads, metrics, _ = _step(spec, state, FULL_BLOCK, mbs)
                out["differs"]["block_padding_grads"] = not _same(grads, reference)
                out["differs"]["block_padding_tokens"] = (metrics["moe/tokens_per_expert_max"],
                                                         ref_metrics["moe/tokens_per_expert_max"])
        # dropout through megatron's RNG tracker: recompute redraws the same masks
        if family == "dense":
            mbs = _batches(spec.vocab_size)["rows"]
            drop = dict(attention_dropout=0.2, hidden_dropout=0.2)
            reference, _, _ = _step(spec, state, drop, mbs)
            plain, _, _ = _step(spec, state, {}, mbs)
            out["differs"]["dropout_acts"] = not _same(reference, plain)
            for name, fields in (("full_uniform", FULL_UNIFORM), ("full_block", FULL_BLOCK),
                                 ("core_attn", _selective("core_attn"))):
                grads, _, _ = _step(spec, state, dict(drop, **fields), mbs)
                out["grads_equal"][f"dense/dropout/{name}"] = _same(grads, reference)

    # forward calls: twice per micro-batch in a training step, once in a forward-only pass (eval mode)
    spec = specs["dense"]
    state = build_model(spec).state_dict()
    mbs = _batches(spec.vocab_size)["rows"]
    kinds = (TransformerLayer, DotProductAttention)
    calls = {}
    for name, fields in (("none", {}), ("full_uniform", FULL_UNIFORM), ("full_block", FULL_BLOCK),
                         ("core_attn", _selective("core_attn"))):
        _, _, (counter, model) = _step(spec, state, fields, mbs, calls=kinds)
        forward = _Calls(model, kinds)
        engine.forward_only(model, mbs, lambda o, mb: gather_last_token(o, mb)[:, 0])
        forward.close()
        calls[name] = (counter.train, counter.eval, forward.train, forward.eval)
    out["calls"] = calls
    out["micro_batches"] = len(mbs)
    out["saved_bytes"] = {name: _saved_bytes(spec, state, fields, mbs[0])
                          for name, fields in (("none", {}), ("core_attn", _selective("core_attn")),
                                               ("full_uniform", FULL_UNIFORM))}

    # routing replay under recompute: a planted routing (not the live one) reaches the recomputed routers
    spec = specs["moe"]
    state = build_model(spec, moe_enable_routing_replay=True).state_dict()
    L, k, E = spec.num_layers, spec.moe_router_topk, spec.num_experts
    replay = dict(moe_enable_routing_replay=True)
    for layout, mbs in _batches(spec.vocab_size, L, k, E).items():
        planted, planted_metrics, _ = _step(spec, state, replay, mbs)
        live_mbs = [{key: v for key, v in mb.items() if key != "routing"} for mb in mbs]
        live, _, _ = _step(spec, state, replay, live_mbs)
        out["differs"][f"replay_planted_vs_live/{layout}"] = not _same(planted, live)
        for name, fields in (("full_uniform", FULL_UNIFORM), ("full_block", FULL_BLOCK),
                             ("moe_layer_recompute", dict(moe_layer_recompute=True))):
            grads, metrics, _ = _step(spec, state, dict(replay, **fields), mbs)
            out["grads_equal"][f"replay/{layout}/{name}"] = _same(grads, planted) and metrics == planted_metrics
        with without_patch("tensor_parallel.checkpoint"):
            grads, _, _ = _step(spec, state, dict(replay, **FULL_UNIFORM), mbs)
        out["differs"][f"replay_without_snapshot/{layout}"] = not _same(grads, planted)
    return out


def _saved_bytes(spec, state, fields, micro_batch) -> int:
    """Bytes the autograd graph of one training forward keeps for the backward (parameters left out)."""
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import engine

    model = build_model(spec, **fields)
    model.load_state_dict(state)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = engine._model_forward(model, micro_batch)
    total = sum(s.nbytes() for s in kept.values())  # after the forward: discarded outputs count 0
    del output
    return total


@pytest.fixture(scope="module")
def model_level():
    return run_distributed(_model_level_body, 1)[0]


def test_gradients_equal_without_recompute(model_level):
    """Bit-identical gradients (and MoE metrics) with every recompute setting, in both micro-batch layouts."""
    failed = [name for name, ok in model_level["grads_equal"].items() if not ok]
    assert not failed and len(model_level["grads_equal"]) == 35, failed


def test_shared_experts_recompute_equals_within_rounding(model_level):
    rounding = model_level["rounding"]
    assert len(rounding) == 6, rounding
    for name, (relative, metrics_close) in rounding.items():
        assert relative <= ROUNDING and metrics_close, (name, relative)


def test_recompute_really_recomputes(model_level):
    calls, M = model_level["calls"], model_level["micro_batches"]
    layers = ["decoder.layers.0", "decoder.layers.1"]
    attn = [f"{layer}.self_attention.core_attention" for layer in layers]

    def train(name, module):
        return calls[name][0].get(module, 0)

    for name in calls:  # a forward-only pass runs each module once per micro-batch, in eval mode, never twice
        assert calls[name][3] == {m: M for m in layers + attn} and not calls[name][2], (name, calls[name])
        assert not calls[name][1], calls[name]  # the training step runs in train mode only
    assert [train("none", m) for m in layers + attn] == [M] * 4
    assert [train("full_uniform", m) for m in layers + attn] == [2 * M] * 4
    assert [train("full_block", m) for m in layers + attn] == [2 * M, M, 2 * M, M]  # the first layer only
    assert [train("core_attn", m) for m in layers + attn] == [M, M, 2 * M, 2 * M]
    saved = model_level["saved_bytes"]
    assert saved["none"] > saved["core_attn"] > saved["full_uniform"] > 0, saved


def test_recomputed_forward_gets_its_micro_batch_settings(model_level):
    """Without the checkpoint snapshot (`patches/recompute.py`), a recomputed MLA layer rotates by slot and a
    recomputed router routes live: the gradients change; with it they are bit-identical (above). The planted
    routing differs from the live one, so the equality above is about replay."""
    differs = model_level["differs"]
    assert differs["mla_positions_without_snapshot"]
    for layout in ("rows", "packed"):
        assert differs[f"replay_planted_vs_live/{layout}"] and differs[f"replay_without_snapshot/{layout}"]


def test_block_recompute_keeps_the_padding_mask(model_level):
    """Megatron's block recompute calls the layers it does not checkpoint without padding_mask: their routers
    count padding tokens (more tokens per expert, another aux-loss gradient). The patch gives them the mask."""
    differs = model_level["differs"]
    assert differs["block_padding_grads"]
    with_padding, without = differs["block_padding_tokens"]
    assert with_padding > without, differs


def test_dropout_is_active_in_the_recompute_cases(model_level):
    assert model_level["differs"]["dropout_acts"]


def test_layernorm_recompute_is_refused_as_megatron_fails_without_te(model_level):
    """megatron-core 0.16.1's layernorm recompute (CheckpointWithoutOutput, default fp8=False) reads Transformer
    Engine's FP8 state: NameError without TE, which the local spec runs without."""
    from mindspeed_llm.arguments import ArgumentError

    assert "FP8GlobalStateManager" in model_level["layernorm_error"]
    with pytest.raises(ArgumentError, match="--recompute-modules layernorm fails without Transformer Engine"):
        _parse(["--recompute-granularity", "selective", "--recompute-modules", "layernorm"])


# ---------------------------------------------------------------------------------------------- the stages
SEED = 4
SKIPPED = ("timing/", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps")  # wall-clock
RECOMPUTE = {
    "none": [],
    "full_uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "full_block": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    "selective": ["--recompute-activations"],
}
DROPOUT = ["--attention-dropout", "0.2", "--hidden-dropout", "0.2"]
# layout -> (tp, pp, world size, micro-batch size); TP1 runs in one process
LAYOUTS = {"tp1": (1, 1, 1, 2), "tp2": (2, 1, 2, 4), "pp2": (1, 2, 2, 2)}


def _stage_cases(layout):
    """{case: (stage, extra argv)}: each stage with each recompute setting; dropout at TP1 (plain, full and
    selective recompute), --distribute-saved-activations at TP2."""
    stages = {"trl_ppo": ["--global-batch-size", "4", "--kl-coef", "0.05", "--lr", "0.2"],
              "grpo": ["--global-batch-size", "4", "--n-samples-per-prompt", "2", "--verifier-function",
                       "odd_first_word", "--kl-coef", "0.05", "--entropy-coeff", "0.01", "--lr", "0.5"]}
    cases = {}
    for stage, extra in stages.items():
        for name, flags in RECOMPUTE.items():
            if not (layout == "pp2" and name == "full_block"):  # one layer per stage: block 1 is uniform 1 there
                cases[f"{stage}/{name}"] = (stage, extra + flags)
        if layout == "tp1":
            for name in ("none", "full_uniform", "selective"):
                cases[f"{stage}/dropout_{name}"] = (stage, extra + DROPOUT + RECOMPUTE[name])
        if layout == "tp2":
            cases[f"{stage}/full_distributed"] = (stage, extra + RECOMPUTE["full_uniform"] +
                                                  ["--distribute-saved-activations"])
    return cases


def _stage_argv(paths, stage, layout, extra, out: Path):
    tp, pp, _, mbs = LAYOUTS[layout]
    models = f"tp{tp}pp{pp}"
    argv = ["--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", str(mbs), "--train-iters", "1", "--seed", str(SEED), "--data-path", paths["data"],
            "--tokenizer-name-or-path", paths["tokenizer"], "--max-length", "64", "--max-new-tokens", "8",
            "--do-sample", "--temperature", "1.0", "--ref-model", paths[f"mg_actor_{models}"], "--optimizer", "sgd",
            "--sgd-momentum", "0", "--clip-grad", "1.0", "--log-interval", "1",
            "--metrics-jsonl", str(out / "metrics.jsonl")]
    if stage == "trl_ppo":
        argv += ["--reward-model", paths[f"mg_reward_{models}"]]
    return argv + list(extra)


def odd_first_word(text, label):
    """A coin-flip rule reward (as in test_layout_invariance): the groups' rewards differ."""
    words = text.split()
    return float(bool(words) and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 1)


def _stage_body(rank, world_size, runs, replay_check):
    """Every run of one layout in this process (megatron's parallel state rebuilt for each). Per run: how each role
    was built (flag, value head, trained, recompute granularity), the trained roles' weights after the update, and
    their layers' forward calls in train / eval mode. With `replay_check`, the PP2 routing replay check too."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.update import roles
    from mindspeed_llm.rl.verifiers import register_verifier

    register_verifier("odd_first_word", override=True)(odd_first_word)
    load_model, trainable = roles.load_model, roles.trainable
    built, trainables, counters = [], [], []

    def recording_load(root, flag, args, value_head=False, trained=False, **options):
        model = load_model(root, flag, args, value_head=value_head, trained=trained, **options)
        built.append((flag, value_head, trained, model.config.recompute_granularity))
        counter = _Calls(model, (TransformerLayer,))
        counters.append((flag, value_head, trained, counter))
        return model

    def recording_trainable(model, args, name, flag):
        role = trainable(model, args, name, flag)
        trainables.append((name, role))
        return role

    roles.load_model, roles.trainable = recording_load, recording_trainable
    results = []
    try:
        for argv in runs:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            built.clear(), trainables.clear(), counters.clear()
            trainer.run(parse_args(argv, world_size))
            results.append({
                "built": list(built),
                "weights": {name: {k: v.detach().clone() for k, v in role.module.state_dict().items()
                                   if torch.is_tensor(v)} for name, role in trainables},
                "calls": [(flag, value_head, was_trained, dict(c.train), dict(c.eval))
                          for flag, value_head, was_trained, c in counters],
            })
            for *_, c in counters:
                c.close()
    finally:
        roles.load_model, roles.trainable = load_model, trainable
    return {"runs": results, "replay": _pp2_replay_check() if replay_check else None}


def _pp2_replay_check():
    """PP2, 4 micro-batches on megatron's 1F1B schedule (stage 0 recomputes micro-batch 0 after micro-batch 1's
    forward): with a planted routing replayed, the gradients with full recompute and with --moe-layer-recompute
    equal those without; without the checkpoint snapshot they do not."""
    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model

    parallel_state.destroy_model_parallel()
    distributed.initialize(1, 2, seed=6)
    replay = dict(moe_enable_routing_replay=True)
    state = build_model(MOE_SPEC, **replay).state_dict()
    batches = [mb for _ in range(2) for mb in
               _batches(MOE_SPEC.vocab_size, 1, MOE_SPEC.moe_router_topk, MOE_SPEC.num_experts)["rows"]]  # 4 mbs
    planted, _, _ = _step(MOE_SPEC, state, replay, batches)
    live, _, _ = _step(MOE_SPEC, state, replay, [{k: v for k, v in mb.items() if k != "routing"} for mb in batches])
    out = {"planted_differs_from_live": not _same(planted, live)}
    for name, fields in (("full_uniform", FULL_UNIFORM), ("moe_layer_recompute", dict(moe_layer_recompute=True))):
        grads, _, _ = _step(MOE_SPEC, state, dict(replay, **fields), batches)
        out[name] = _same(grads, planted)
    with without_patch("tensor_parallel.checkpoint"):
        grads, _, _ = _step(MOE_SPEC, state, dict(replay, **FULL_UNIFORM), batches)
    out["without_snapshot_differs"] = not _same(grads, planted)
    return out


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """{layout: {case: (metrics row, rank results)}} after every case on every layout, and the PP2 replay check."""
    from tests.helpers import word_task

    task = word_task.build(tmp_path_factory.mktemp("word_task"), layouts=((1, 1), (2, 1), (1, 2)), reward=True)
    root = tmp_path_factory.mktemp("recompute_runs")
    out, replay = {}, None
    for layout, (_, _, world, _) in LAYOUTS.items():
        cases = _stage_cases(layout)
        dirs = {case: root / layout / case.replace("/", "_") for case in cases}
        runs = [_stage_argv(task, stage, layout, extra, dirs[case]) for case, (stage, extra) in cases.items()]
        ranks = run_distributed(_stage_body, world, runs, layout == "pp2")
        if layout == "pp2":
            replay = [r["replay"] for r in ranks]
        out[layout] = {}
        for i, case in enumerate(cases):
            (row,) = [json.loads(line) for line in (dirs[case] / "metrics.jsonl").read_text().splitlines()]
            out[layout][case] = ({k: v for k, v in row.items() if not k.startswith(SKIPPED)},
                                 [r["runs"][i] for r in ranks])
    return out, replay


def _compare(runs, case, reference):
    (metrics, ranks), (ref_metrics, ref_ranks) = runs[case], runs[reference]
    assert sorted(metrics) == sorted(ref_metrics)
    differ = {k: (metrics[k], ref_metrics[k]) for k in metrics if metrics[k] != ref_metrics[k]}
    assert not differ, f"{case}: metrics differ from {reference}: {differ}"
    for rank, (got, ref) in enumerate(zip(ranks, ref_ranks)):
        assert sorted(got["weights"]) == sorted(ref["weights"])
        for role in ref["weights"]:
            assert _same(got["weights"][role], ref["weights"][role]), f"{case} rank {rank}: {role} weights differ"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_update_equals_the_run_without_recompute(stage_runs, layout):
    """Both stages, every recompute setting: the logged metrics and the trained weights after one SGD update are
    bit-identical to the run without recompute (with dropout: to the run with the same dropout)."""
    runs = stage_runs[0][layout]
    for case in runs:
        stage, name = case.split("/")
        if name != "none" and name != "dropout_none":
            _compare(runs, case, f"{stage}/{'dropout_none' if name.startswith('dropout') else 'none'}")
    for stage in ("trl_ppo", "grpo"):  # a real update, that dropout changes
        metrics = runs[f"{stage}/none"][0]
        assert metrics["actor/grad_norm" if stage == "trl_ppo" else "grad_norm"] > 1e-3, metrics
        if layout == "tp1":
            plain, dropped = (runs[f"{stage}/{name}"][1][0]["weights"]["actor"] for name in ("none", "dropout_none"))
            assert not _same(plain, dropped)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trained_roles_recompute_and_frozen_roles_do_not(stage_runs, layout):
    """The actor (and trl_ppo's critic) are built with the run's recompute, the reference and reward model
    without; in the update the actor's layers run twice per micro-batch with full uniform recompute (forward and
    recompute), once without; generation and the log-prob / value passes run in eval mode, as often either way."""
    runs = stage_runs[0][layout]
    for case, (_, ranks) in runs.items():
        stage, name = case.split("/")
        setting = {"none": None, "selective": "selective"}.get(name.replace("dropout_", ""), "full")
        for flag, value_head, trained, granularity in ranks[0]["built"]:
            assert granularity == (setting if trained else None), (case, flag, value_head, trained, granularity)
        roles_built = sorted((flag, value_head, trained) for flag, value_head, trained, _ in ranks[0]["built"])
        critic = [("--reward-model", True, True)] if stage == "trl_ppo" else []
        frozen = [("--reward-model", True, False)] if stage == "trl_ppo" else []
        assert roles_built == sorted([("--ref-model", False, True), ("--ref-model", False, False)] + critic + frozen)
    for stage in ("trl_ppo", "grpo"):
        for rank in range(len(runs[f"{stage}/none"][1])):
            plain = {(f, v, t): (train, ev) for f, v, t, train, ev in runs[f"{stage}/none"][1][rank]["calls"]}
            full = {(f, v, t): (train, ev) for f, v, t, train, ev in runs[f"{stage}/full_uniform"][1][rank]["calls"]}
            for role, (train, ev) in plain.items():
                assert full[role][1] == ev  # eval-mode forwards (generation, passes): the same
                trained = role[2]
                assert full[role][0] == ({layer: 2 * n for layer, n in train.items()} if trained else train), role
                assert bool(train) == trained  # frozen roles never run in train mode


@pytest.mark.slow
def test_replay_under_pipeline_recompute(stage_runs):
    for rank, result in enumerate(stage_runs[1]):
        assert result["planted_differs_from_live"], (rank, result)
        assert result["full_uniform"] and result["moe_layer_recompute"], (rank, result)
        assert result["without_snapshot_differs"], (rank, result)
