"""The models of a stage, by role: loaded from Megatron checkpoints onto the accelerator (built there without
random initialisation), frozen (reference, reward) and offloaded to host memory between uses, or trained (actor,
critic) with the command line's optimizer settings and what of their training state waits in host memory between
updates (--offload-train-*); with LoRA the trained ones get adapters on a frozen base and the frozen
ones that share that base are views of it (`rl/lora.py`)."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Dict, Optional

import torch

from mindspeed_llm import device
from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models import ArchitectureSpec, build_model
from mindspeed_llm.rl import moe, recompute
from mindspeed_llm.rl.engine import OptimizerSettings, TrainableModel
from mindspeed_llm.rl.settings import OffloadSettings


def _checked_spec(root: str, flag: str, args) -> ArchitectureSpec:
    """The checkpoint's ArchitectureSpec, after checking every model flag the command line gave against it (Megatron-LM
    scripts describe the model with flags; here the checkpoint does, and a flag that disagrees is an error)."""
    spec = load_spec(root)

    def mismatch(given: str, what: str) -> ValueError:
        return ValueError(f"{given} does not match the checkpoint {flag} {root} ({what}); drop the flag or "
                          "convert the right model")

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "vocab_size",
                 "max_position_embeddings"):
        wanted = getattr(args, name, None)
        if wanted is not None and wanted != getattr(spec, name):
            option = "--padded-vocab-size" if name == "vocab_size" else f"--{name.replace('_', '-')}"
            raise mismatch(f"{option} {wanted}", f"{name}={getattr(spec, name)}")
    for name in ("rotary_base", "norm_epsilon"):
        wanted = getattr(args, name, None)
        if wanted is not None and not math.isclose(wanted, getattr(spec, name), rel_tol=1e-6):
            raise mismatch(f"--{name.replace('_', '-')} {wanted:g}", f"{name}={getattr(spec, name):g}")
    _check_attention_flags(spec, args, mismatch)
    scaling = getattr(args, "rope_scaling_type", None)
    if scaling is not None and spec.rope_scaling_factor is None:
        raise mismatch(f"--rope-scaling-type {scaling}", "no RoPE frequency scaling")
    factor = getattr(args, "rope_scaling_factor", None)
    if factor is not None and factor != spec.rope_scaling_factor:
        found = "no RoPE scaling" if spec.rope_scaling_factor is None else f"factor {spec.rope_scaling_factor:g}"
        raise mismatch(f"--rope-scaling-factor {factor:g}", f"llama3 RoPE scaling {found}")
    if getattr(args, "untie_embeddings_and_output_weights", False) and spec.tie_word_embeddings:
        raise mismatch("--untie-embeddings-and-output-weights", "the output layer shares the embedding's weights")
    if getattr(args, "qk_layernorm", False) and not spec.qk_layernorm:
        raise mismatch("--qk-layernorm", "no query/key norms")
    _check_moe_flags(spec, args, mismatch)
    return spec


def _check_moe_flags(spec: ArchitectureSpec, args, mismatch) -> None:
    """The mixture-of-experts shape flags of MindSpeed-LLM scripts (--num-experts, --moe-router-topk,
    --moe-ffn-hidden-size / --moe-intermediate-size, --moe-shared-expert-intermediate-size) against the checkpoint
    (a dense checkpoint has no experts)."""
    experts = getattr(args, "num_experts", None)
    if experts is not None and experts != (spec.num_experts or 0):
        found = f"num_experts={spec.num_experts}" if spec.is_moe else "a dense model"
        raise mismatch(f"--num-experts {experts}", found)
    for name, option in (("moe_router_topk", "--moe-router-topk"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
                         ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size")):
        wanted = getattr(args, name, None)
        if wanted is None:
            continue
        if not spec.is_moe:
            raise mismatch(f"{option} {wanted}", "a dense model")
        if wanted != getattr(spec, name):
            raise mismatch(f"{option} {wanted}", f"{name}={getattr(spec, name)}")


def _check_attention_flags(spec: ArchitectureSpec, args, mismatch) -> None:
    """Grouped-query attention and q/k/v biases as Megatron-LM reads the flags: --num-query-groups counts with
    --group-query-attention (default 1), without it every head has its own keys and values; --disable-bias-linear
    turns the q/k/v bias off unless --add-qkv-bias turns it back on."""
    groups = getattr(args, "num_query_groups", None)
    if getattr(args, "group_query_attention", False):
        groups = 1 if groups is None else groups
        if groups != spec.num_query_groups:
            given = f"--group-query-attention --num-query-groups {groups}" + (
                "" if args.num_query_groups is not None else " (Megatron-LM's default)")
            raise mismatch(given, f"num_query_groups={spec.num_query_groups}")
    elif groups is not None and groups != spec.num_query_groups:
        raise mismatch(f"--num-query-groups {groups}", f"num_query_groups={spec.num_query_groups}")
    elif getattr(args, "num_attention_heads", None) is not None and spec.num_query_groups != spec.num_attention_heads:
        raise mismatch(f"--num-attention-heads {args.num_attention_heads} without --group-query-attention "
                       "(multi-head attention)", f"grouped-query attention with num_query_groups="
                       f"{spec.num_query_groups}: add --group-query-attention --num-query-groups {spec.num_query_groups}")
    add_qkv_bias = getattr(args, "add_qkv_bias", False)
    if getattr(args, "disable_bias_linear", False) or add_qkv_bias:
        if add_qkv_bias != spec.add_qkv_bias:
            if add_qkv_bias:
                raise mismatch("--add-qkv-bias", "no q/k/v biases")
            raise mismatch("--disable-bias-linear (without --add-qkv-bias)",
                           "q/k/v biases; add --add-qkv-bias, as Megatron-LM needs for this model")


def load_model(root: str, flag: str, args, value_head: bool = False, trained: bool = False, on_host: bool = False):
    """A GPTModel (or value-head model) for this rank on the accelerator (`on_host`: in host memory, where an
    offloaded frozen model waits), weights from a Megatron checkpoint at `root`; `trained`: the actor or the critic
    (activation recompute applies to them only).

    The model is built where it will live, without megatron's random initialisation (`perform_initialization`
    off: its weights are allocated, not drawn), and every tensor of it is then loaded from the checkpoint, strictly:
    one the checkpoint lacks (a value head included) is an error, never a random or empty value (`from_checkpoint`).

    Every problem (missing files, a causal LM where a value head is needed, a TP/PP the model cannot be
    split into, a spec that contradicts the model flags) is raised before any compute, naming `flag`.

    --sequence-parallel is built into every model (TP > 1), as are
    --attention-dropout / --hidden-dropout; the dropouts act only in train mode, i.e. in the
    trained models' (actor, critic) update forwards: frozen models, rollouts and the log-prob / value passes run
    in eval mode. Activation recompute (--recompute-*) is built into the `trained` ones only (`rl/recompute.py`).
    Every role gets the core attention of --attention-backend (`args.attention`, validate_args) and the fused ops
    of --use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb (`args.fused_ops`).
    """
    dropout = dict(attention_dropout=getattr(args, "attention_dropout", 0.0),
                   hidden_dropout=getattr(args, "hidden_dropout", 0.0),
                   # megatron's sequence parallelism (TP > 1, validate_args), every role alike; generation runs
                   # without it (models/sequence_parallel.py)
                   sequence_parallel=bool(getattr(args, "sequence_parallel", False)))
    try:
        spec = _checked_spec(root, flag, args)
        options = moe.model_options(spec, args, flag, root, policy=not value_head)
        options.update(recompute.model_options(spec, args, trained=trained, policy=not value_head))
        model = build_model(spec, params_dtype=args.params_dtype, value_head=value_head,
                            attention=getattr(args, "attention", "sdpa"), fused_ops=getattr(args, "fused_ops", ()),
                            **dropout, **options,
                            **from_checkpoint(on_host))
        load_megatron_weights(model, root)
    except (ValueError, FileNotFoundError) as exc:
        raise ArgumentError(f"{flag} {root}: {exc}") from exc
    model.loaded_from = os.path.abspath(root)  # a LoRA run records its adapters' base (`rl/lora.py`)
    return model.to("cpu" if on_host else device.current_device())


def from_checkpoint(on_host: bool = False) -> dict:
    """TransformerConfig settings of a model whose every weight comes from a checkpoint: megatron allocates the
    weights without drawing them (`perform_initialization=False`), on the accelerator (`use_cpu_initialization`
    off: megatron's `torch.cuda.current_device()`, the device layer's answer) or in host memory (`on_host`)."""
    return dict(perform_initialization=False, use_cpu_initialization=on_host)


def frozen(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def offload_parts(offload: OffloadSettings, name: str) -> tuple:
    """What of the actor's or critic's training state waits in host memory between updates
    (`rl/model_state.PARTS`): --offload-train-optimizer the optimizer's moments, --offload-train-grad the grad
    buffers, --offload-train-param the fp32 main weights and, for the critic, its weights too (the actor's weights
    generate, so they stay)."""
    parts = []
    if offload.offload_train_optimizer:
        parts.append("moments")
    if offload.offload_train_grad:
        parts.append("grads")
    if offload.offload_train_param:
        parts += ["masters"] + (["weights"] if name == "critic" else [])
    return tuple(parts)


def trainable(model, args, name: str, flag: str) -> TrainableModel:
    """The actor or the critic (loaded from `flag`) with its optimizer and LR schedule from the command line; with
    LoRA (--lora-target-modules / --lora-load) its base frozen and adapters trained (`rl/lora.py`)."""
    moe.check_trainable(model, args.tensor_model_parallel_size, name, flag, getattr(args, "sequence_parallel", False))
    critic = name == "critic"
    schedule_on_resume = ("override" if args.override_opt_param_scheduler else
                          "checkpoint" if args.use_checkpoint_opt_param_scheduler else "check")
    settings = OptimizerSettings(
        lr=args.critic_lr if critic else args.lr, optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
        min_lr=args.min_lr, lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
        schedule_on_resume=schedule_on_resume, lr_flag="--critic-lr" if critic else "--lr",
        **_loss_scale_settings(args),
    )
    options = dict(name=name, check_finite=args.check_for_nan_in_loss_and_grad,
                   offload=offload_parts(args.settings.offload, name), check_divergence=args.check_for_divergence)
    if getattr(args, "lora", False):
        from mindspeed_llm.rl import lora

        return lora.trainable(model, args, settings, **options)
    return TrainableModel(model, settings, **options)


def _loss_scale_settings(args) -> dict:
    """--fp16's grad-scaler flags that were given (megatron's defaults otherwise); nothing for bf16 / fp32."""
    if args.params_dtype != "fp16":
        return {}
    names = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def load_reward_model(args):
    """The frozen reward model (value head) of `--reward-model` (in host memory with --offload-ref-reward)."""
    return offloaded(frozen(load_model(args.reward_model, "--reward-model", args, value_head=True,
                                       on_host=args.offload_ref_reward)), args.offload_ref_reward)


def check_vocab(models: Dict[str, Optional[torch.nn.Module]], tokenizer) -> None:
    """All models of a stage read the same token ids, and the tokenizer's fit them (None entries: roles this
    run does not load)."""
    sizes = {name: m.model_spec.vocab_size for name, m in models.items() if m is not None}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ArgumentError(f"the models disagree on vocabulary size ({listed}); all must share one tokenizer")
    vocab_size = next(iter(sizes.values()))
    if len(tokenizer) > vocab_size:
        raise ArgumentError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size}: "
            "--tokenizer-name-or-path does not belong to this checkpoint"
        )


def offloaded(model, offload: bool):
    """With --offload-ref-reward, a frozen model waits in host memory until `on_device` brings it in."""
    return model.to("cpu") if offload else model


@contextlib.contextmanager
def on_device(model, offload: bool, timers):
    """The frozen model to run in the block: with `offload`, brought to the accelerator for the block and back to
    host memory after it, timed as `timing/ref_onload` and `timing/ref_offload` (MindSpeed-RL's names; ~0 s on a
    CPU machine). A LoRA run's reference / reward model (`rl/lora.SharedBase`) is a trained model's base: its
    adapters are off in the block, and nothing moves."""
    shared = getattr(model, "active", None)
    if shared is not None:
        with shared() as base:
            yield base
        return
    if not offload:
        yield model
        return
    with timers("ref_onload"):
        model.to(device.current_device())
    try:
        yield model
    finally:
        with timers("ref_offload"):
            model.to("cpu")
