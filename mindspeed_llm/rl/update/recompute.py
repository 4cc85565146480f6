"""Activation recompute of the trained models: Megatron-LM's flags (`arguments._check_recompute`) as the
TransformerConfig fields of each trained role (actor; trl_ppo's critic), checked against its layers.

Megatron-core does the recompute, in training forwards only: full recompute and the `core_attn` module check
`self.training`; the other selective modules checkpoint in any mode, but outside a training step the pass runs
under `no_grad` and nothing is ever recomputed (no backward). Generation, the old-log-prob / reference / value /
reward passes run in eval mode under no_grad (`engine.forward_only`, `inference.generate`), and the frozen roles
(reference, reward model) are built without any recompute field. What else recompute needs is in
`patches/recompute.py` (a recomputed region sees its micro-batch's per-forward settings; block recompute keeps the
padding mask).

`--recompute-num-layers` counts layers of one pipeline stage (megatron's `num_layers_per_pipeline_rank`): the
uniform groups and the block's checkpointed layers are taken within each stage.
"""

from __future__ import annotations

from typing import Dict

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models import ArchitectureSpec
from mindspeed_llm.rl.model_settings import RecomputeSettings


def _applies(spec: ArchitectureSpec) -> Dict[str, bool]:
    """Which selective modules have something to recompute in a model of `spec`."""
    moe = spec.moe_layers()
    return {
        "core_attn": True,
        "mlp": not all(moe),  # dense MLP layers (a mixture of experts' dense first layers included)
        "moe": any(moe),
        "shared_experts": any(moe) and bool(spec.moe_shared_expert_intermediate_size),
        "mla_up_proj": spec.is_mla,
    }


def model_options(spec: ArchitectureSpec, recompute: RecomputeSettings, trained: bool,
                  policy: bool) -> Dict[str, object]:
    """`build_model` overrides for activation recompute: empty for a frozen role (`trained=False`) or without
    --recompute-granularity. `policy`: the actor, whose layers every selective module must apply to (a critic of
    another architecture gets the modules that apply to it)."""
    granularity = recompute.recompute_granularity
    if not trained or granularity is None:
        return {}
    pp = recompute.pipeline_model_parallel_size
    if granularity == "full":
        per_stage = spec.num_layers // pp
        layers = recompute.recompute_num_layers
        if layers > per_stage:
            raise ArgumentError(
                f"--recompute-num-layers {layers} exceeds the {per_stage} layers of each pipeline stage "
                f"({spec.num_layers} layers / --pipeline-model-parallel-size {pp}; "
                f"megatron counts it per stage): use 1..{per_stage}")
        if recompute.recompute_method == "uniform" and per_stage % layers:
            raise ArgumentError(
                f"--recompute-method uniform --recompute-num-layers {layers}: the {per_stage} layers of each "
                f"pipeline stage do not split into groups of {layers} (megatron's uniform loop would run past the "
                "stage's last layer); use a divisor of it, or --recompute-method block")
        return dict(recompute_granularity="full", recompute_method=recompute.recompute_method,
                    recompute_num_layers=layers,
                    distribute_saved_activations=bool(recompute.distribute_saved_activations))
    applies = _applies(spec)
    if policy:
        for name in recompute.recompute_modules:
            if not applies[name]:
                given = "--moe-layer-recompute" if name == "moe" and recompute.moe_layer_recompute else \
                    f"--recompute-modules {name}"
                raise ArgumentError(f"{given}: this {spec.family} model has no {_WHAT[name]}, so nothing would be "
                                    "recomputed; drop it")
    modules = [name for name in recompute.recompute_modules if applies[name]]
    return dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}


_WHAT = {"mlp": "dense MLP layer", "moe": "mixture-of-experts layer", "shared_experts": "shared experts",
         "mla_up_proj": "multi-latent attention"}
