"""The models of a stage, by role: loaded from Megatron checkpoints onto the accelerator (built there without
random initialisation), frozen (reference, reward) and offloaded to host memory between uses, or trained (actor,
critic) with the command line's optimizer settings and what of their training state waits in host memory between
updates (--offload-train-*); with LoRA the trained ones get adapters on a frozen base and the frozen
ones that share that base are views of it (`rl/update/lora.py`).

Everything here reads the run's typed parts (`rl/settings.py`, `rl/model_settings.py`), never the command line's
Namespace; megatron gets its model's TransformerConfig field by field from `models.build_model` (the glue to
megatron's model building), and its global args are never set."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace
from typing import Dict, Optional

import torch

from mindspeed_llm import device
from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models import ArchitectureSpec, build_model
from mindspeed_llm.rl.update import moe, recompute
from mindspeed_llm.rl.update.trainable import TrainableModel
from mindspeed_llm.rl.model_settings import ModelBuild, MoESettings
from mindspeed_llm.rl.settings import OffloadSettings, Settings


def _checked_spec(root: str, flag: str, settings: Settings) -> ArchitectureSpec:
    """The checkpoint's ArchitectureSpec, after checking every model flag the command line gave against it (Megatron-LM
    scripts describe the model with flags; here the checkpoint does, and a flag that disagrees is an error)."""
    spec = load_spec(root)
    given = settings.model

    def mismatch(option: str, what: str) -> ValueError:
        return ValueError(f"{option} does not match the checkpoint {flag} {root} ({what}); drop the flag or "
                          "convert the right model")

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "vocab_size",
                 "max_position_embeddings"):
        wanted = getattr(given, name)
        if wanted is not None and wanted != getattr(spec, name):
            option = "--padded-vocab-size" if name == "vocab_size" else f"--{name.replace('_', '-')}"
            raise mismatch(f"{option} {wanted}", f"{name}={getattr(spec, name)}")
    for name in ("rotary_base", "norm_epsilon"):
        wanted = getattr(given, name)
        if wanted is not None and not math.isclose(wanted, getattr(spec, name), rel_tol=1e-6):
            raise mismatch(f"--{name.replace('_', '-')} {wanted:g}", f"{name}={getattr(spec, name):g}")
    _check_attention_flags(spec, given, mismatch)
    if given.rope_scaling_type is not None and spec.rope_scaling_factor is None:
        raise mismatch(f"--rope-scaling-type {given.rope_scaling_type}", "no RoPE frequency scaling")
    factor = given.rope_scaling_factor
    if factor is not None and factor != spec.rope_scaling_factor:
        found = "no RoPE scaling" if spec.rope_scaling_factor is None else f"factor {spec.rope_scaling_factor:g}"
        raise mismatch(f"--rope-scaling-factor {factor:g}", f"llama3 RoPE scaling {found}")
    if given.untie_embeddings_and_output_weights and spec.tie_word_embeddings:
        raise mismatch("--untie-embeddings-and-output-weights", "the output layer shares the embedding's weights")
    if given.qk_layernorm and not spec.qk_layernorm:
        raise mismatch("--qk-layernorm", "no query/key norms")
    _check_moe_flags(spec, settings.moe, mismatch)
    return spec


def _check_moe_flags(spec: ArchitectureSpec, given: MoESettings, mismatch) -> None:
    """The mixture-of-experts shape flags of MindSpeed-LLM scripts (--num-experts, --moe-router-topk,
    --moe-ffn-hidden-size / --moe-intermediate-size, --moe-shared-expert-intermediate-size) against the checkpoint
    (a dense checkpoint has no experts)."""
    experts = given.num_experts
    if experts is not None and experts != (spec.num_experts or 0):
        found = f"num_experts={spec.num_experts}" if spec.is_moe else "a dense model"
        raise mismatch(f"--num-experts {experts}", found)
    for name, option in (("moe_router_topk", "--moe-router-topk"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
                         ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size")):
        wanted = getattr(given, name)
        if wanted is None:
            continue
        if not spec.is_moe:
            raise mismatch(f"{option} {wanted}", "a dense model")
        if wanted != getattr(spec, name):
            raise mismatch(f"{option} {wanted}", f"{name}={getattr(spec, name)}")


def _check_attention_flags(spec: ArchitectureSpec, given: ModelBuild, mismatch) -> None:
    """Grouped-query attention and q/k/v biases as Megatron-LM reads the flags: --num-query-groups counts with
    --group-query-attention (default 1), without it every head has its own keys and values; --disable-bias-linear
    turns the q/k/v bias off unless --add-qkv-bias turns it back on."""
    groups = given.num_query_groups
    if given.group_query_attention:
        groups = 1 if groups is None else groups
        if groups != spec.num_query_groups:
            option = f"--group-query-attention --num-query-groups {groups}" + (
                "" if given.num_query_groups is not None else " (Megatron-LM's default)")
            raise mismatch(option, f"num_query_groups={spec.num_query_groups}")
    elif groups is not None and groups != spec.num_query_groups:
        raise mismatch(f"--num-query-groups {groups}", f"num_query_groups={spec.num_query_groups}")
    elif given.num_attention_heads is not None and spec.num_query_groups != spec.num_attention_heads:
        raise mismatch(f"--num-attention-heads {given.num_attention_heads} without --group-query-attention "
                       "(multi-head attention)", f"grouped-query attention with num_query_groups="
                       f"{spec.num_query_groups}: add --group-query-attention --num-query-groups {spec.num_query_groups}")
    if given.disable_bias_linear or given.add_qkv_bias:
        if given.add_qkv_bias != spec.add_qkv_bias:
            if given.add_qkv_bias:
                raise mismatch("--add-qkv-bias", "no q/k/v biases")
            raise mismatch("--disable-bias-linear (without --add-qkv-bias)",
                           "q/k/v biases; add --add-qkv-bias, as Megatron-LM needs for this model")


def load_model(root: str, flag: str, settings: Settings, value_head: bool = False, trained: bool = False,
               on_host: bool = False, own_shape: bool = False):
    """A GPTModel (or value-head model) for this rank on the accelerator (`on_host`: in host memory, where an
    offloaded frozen model waits), weights from a Megatron checkpoint at `root`; `trained`: the actor or the critic
    (activation recompute applies to them only).

    The model is built where it will live, without megatron's random initialisation (`perform_initialization`
    off: its weights are allocated, not drawn), and every tensor of it is then loaded from the checkpoint, strictly:
    one the checkpoint lacks (a value head included) is an error, never a random or empty value (`from_checkpoint`).

    Every problem (missing files, a causal LM where a value head is needed, a TP/PP the model cannot be
    split into, a spec that contradicts the model flags) is raised before any compute, naming `flag`.
    `own_shape`: a model whose shape is its checkpoint's alone (the teacher: another size of the actor's family),
    not checked against the model flags, which describe the actor; the routing-replay and expert flags, the
    actor's, do not apply to it either.

    --sequence-parallel is built into every model (TP > 1), as are
    --attention-dropout / --hidden-dropout; the dropouts act only in train mode, i.e. in the
    trained models' (actor, critic) update forwards: frozen models, rollouts and the log-prob / value passes run
    in eval mode. Activation recompute (--recompute-*) is built into the `trained` ones only (`rl/update/recompute.py`).
    Every role gets the core attention of --attention-backend (`settings.model.attention`, validate_args) and the
    fused ops of --use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb (`settings.model.fused_ops`).
    Megatron gets its TransformerConfig from `models.build_model`, field by field: megatron's global args are
    never set.
    """
    built = settings.model
    dropout = dict(attention_dropout=built.attention_dropout, hidden_dropout=built.hidden_dropout,
                   # megatron's sequence parallelism (TP > 1, validate_args), every role alike; generation runs
                   # without it (models/sequence_parallel.py)
                   sequence_parallel=bool(built.sequence_parallel))
    try:
        spec = load_spec(root) if own_shape else _checked_spec(root, flag, settings)
        options = moe.model_options(spec, settings.moe, flag, root, policy=not value_head and not own_shape)
        options.update(recompute.model_options(spec, settings.recompute, trained=trained, policy=not value_head))
        model = build_model(spec, params_dtype=built.params_dtype, value_head=value_head,
                            attention=built.attention, fused_ops=built.fused_ops,
                            **dropout, **options,
                            **from_checkpoint(on_host))
        load_megatron_weights(model, root)
    except (ValueError, FileNotFoundError) as exc:
        raise ArgumentError(f"{flag} {root}: {exc}") from exc
    model.loaded_from = os.path.abspath(root)  # a LoRA run records its adapters' base (`rl/update/lora.py`)
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
    (`rl/update/model_state.PARTS`): --offload-train-optimizer the optimizer's moments, --offload-train-grad the grad
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


def trainable(model, settings: Settings, name: str, flag: str) -> TrainableModel:
    """The actor or the critic (loaded from `flag`) with its optimizer and LR schedule from the command line
    (`settings.optimizer.for_role`); with LoRA (--lora-target-modules / --lora-load) its base frozen and adapters
    trained (`rl/update/lora.py`)."""
    moe.check_trainable(model, settings.moe.tensor_model_parallel_size, name, flag, settings.model.sequence_parallel)
    optimizer = settings.optimizer.for_role(name)
    options = dict(name=name, check_finite=settings.optimizer.check_for_nan_in_loss_and_grad,
                   offload=offload_parts(settings.offload, name),
                   check_divergence=settings.optimizer.check_for_divergence)
    if settings.lora.lora:
        from mindspeed_llm.rl.update import lora

        return lora.trainable(model, settings.lora, optimizer, **options)
    return TrainableModel(model, optimizer, **options)


def load_reward_model(settings: Settings):
    """The frozen reward model (value head) of `--reward-model` (in host memory with --offload-ref-reward)."""
    offload = settings.offload.offload_ref_reward
    return offloaded(frozen(load_model(settings.models.reward_model, "--reward-model", settings, value_head=True,
                                       on_host=offload)), offload)


def load_judge(settings: Settings):
    """The frozen LLM judge of --judge-load (`rl/judge.py`): a causal LM of any supported family and size whose
    architecture is the checkpoint's alone (`load_model`'s `own_shape`: the model flags describe the actor), at the
    run's TP / PP, in host memory between uses with --offload-ref-reward. Every problem is an `ArgumentError`
    naming --judge-load."""
    return RoleFactory(settings).frozen(settings.judge.judge_load, "--judge-load", own_shape=True)


class RoleFactory:
    """A stage's roles, built from the run's typed settings: `trained` loads the actor or the critic and gives it
    its optimizer (and with LoRA its adapters: the critic's take the actor's config), `frozen` a reference
    (offloaded with --offload-ref-reward), `reward_model` the frozen --reward-model, `teacher` the frozen
    --teacher-load."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def trained(self, root: str, flag: str, name: str, value_head: bool = False) -> TrainableModel:
        model = load_model(root, flag, self.settings, value_head=value_head, trained=True)
        role = trainable(model, self.settings, name, flag)
        if name == "actor" and getattr(role, "is_lora", False):
            from mindspeed_llm.rl.update import lora

            # the critic's adapters: the actor's r, alpha and targets (with --lora-load, its adapter's), fresh
            self.settings = replace(self.settings, lora=lora.as_flags(role.config, self.settings.lora))
        return role

    def frozen(self, root: str, flag: str, value_head: bool = False, own_shape: bool = False):
        offload = self.settings.offload.offload_ref_reward
        return offloaded(frozen(load_model(root, flag, self.settings, value_head=value_head, on_host=offload,
                                           own_shape=own_shape)), offload)

    def reward_model(self):
        return load_reward_model(self.settings)

    def check_teacher(self, actor_root: str) -> None:
        """With --teacher-load, its checkpoint against the actor's at `actor_root`, from their specs alone: refused
        before any model is built (`teacher`'s checks; a problem of the actor's own checkpoint is left to its load,
        which names its flag)."""
        if not self.settings.distill.teacher_load:
            return
        try:
            vocab_size = load_spec(actor_root).vocab_size
        except (ValueError, FileNotFoundError):
            return
        self._teacher_spec(vocab_size)

    def _teacher_spec(self, vocab_size: int) -> None:
        """--teacher-load's spec: readable, with at least the actor's `vocab_size` rows (more: the same tokenizer
        padded further, as Qwen2.5's 7B pads to 152,064 where its 0.5B pads to 151,936; the teacher's rows past the
        actor's are never a token of the tokenizer and are masked out of its distribution, `passes.teacher_scores`),
        and --distill-topk within the actor's vocabulary."""
        distill, flag = self.settings.distill, "--teacher-load"
        root = distill.teacher_load
        try:
            teacher_vocab = load_spec(root).vocab_size
        except (ValueError, FileNotFoundError) as exc:
            raise ArgumentError(f"{flag} {root}: {exc}") from exc
        if teacher_vocab < vocab_size:
            raise ArgumentError(f"{flag} {root}: the teacher's vocabulary has {teacher_vocab} tokens, the actor's "
                                f"{vocab_size}; distillation compares both models' log-probs of the same token ids, "
                                "so the teacher must share the actor's tokenizer and cover its vocabulary (a model of "
                                "the same family; a teacher padded to more rows than the actor is fine)")
        if distill.distill_topk is not None and distill.distill_topk > vocab_size:
            raise ArgumentError(f"--distill-topk {distill.distill_topk} exceeds the vocabulary of {vocab_size} "
                                f"tokens ({flag} {root}); use at most {vocab_size} (the whole vocabulary: the "
                                "exact forward KL)")

    def teacher(self, vocab_size: int):
        """The frozen teacher of --teacher-load at the run's TP / PP, its architecture its checkpoint's (the model
        flags describe the actor), with the run's dtype, attention and fused ops; offloaded with
        --offload-ref-reward. Its own model even for a LoRA student (it shares no weights with it). Refused before
        its weights are built: a vocabulary smaller than the actor's `vocab_size` (the two models' log-probs are of
        the same token ids), a --distill-topk over it."""
        self._teacher_spec(vocab_size)
        return self.frozen(self.settings.distill.teacher_load, "--teacher-load", own_shape=True)


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
    CPU machine). A LoRA run's reference / reward model (`rl/update/lora.SharedBase`) is a trained model's base: its
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
