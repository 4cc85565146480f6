"""The models of a stage, by role: loaded from Megatron checkpoints onto the accelerator, frozen (reference,
reward) and offloaded to host memory between uses, or trained (actor, critic) with the command line's
optimizer settings."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from mindspeed_llm import device
from mindspeed_llm.arguments import ArgumentError
from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
from mindspeed_llm.models import ModelSpec, build_model
from mindspeed_llm.rl.engine import OptimizerSettings, TrainableModel


def _checked_spec(root: str, flag: str, args) -> ModelSpec:
    spec = load_spec(root)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "vocab_size"):
        wanted = getattr(args, name, None)
        if wanted is not None and wanted != getattr(spec, name):
            raise ValueError(
                f"--{name.replace('_', '-')} {wanted} does not match the checkpoint {flag} {root} "
                f"({name}={getattr(spec, name)}); drop the flag or convert the right model"
            )
    return spec


def load_model(root: str, flag: str, args, value_head: bool = False):
    """A GPTModel (or value-head model) for this rank on the accelerator, weights from a Megatron checkpoint
    at `root` (built in host memory, as megatron's CPU initialisation does, then moved).

    Every problem (missing files, a causal LM where a value head is needed, a TP/PP the model cannot be
    split into, a spec that contradicts the model flags) is raised before any compute, naming `flag`.
    """
    try:
        spec = _checked_spec(root, flag, args)
        model = build_model(spec, params_dtype=args.params_dtype, value_head=value_head)
        load_megatron_weights(model, root)
    except (ValueError, FileNotFoundError) as exc:
        raise ArgumentError(f"{flag} {root}: {exc}") from exc
    return model.to(device.current_device())


def frozen(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def trainable(model, args, name: str) -> TrainableModel:
    """The actor or the critic with its optimizer and LR schedule from the command line."""
    critic = name == "critic"
    schedule_on_resume = ("override" if args.override_opt_param_scheduler else
                          "checkpoint" if args.use_checkpoint_opt_param_scheduler else "check")
    return TrainableModel(model, OptimizerSettings(
        lr=args.critic_lr if critic else args.lr, optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
        min_lr=args.min_lr, lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
        schedule_on_resume=schedule_on_resume, lr_flag="--critic-lr" if critic else "--lr",
    ), name=name, check_finite=args.check_for_nan_in_loss_and_grad)


def load_reward_model(args):
    """The frozen reward model (value head) of `--reward-model` (in host memory with --offload-ref-reward)."""
    return offloaded(frozen(load_model(args.reward_model, "--reward-model", args, value_head=True)),
                     args.offload_ref_reward)


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
    """With `offload`, bring a frozen model to the accelerator for the block and back to host memory after it,
    timed as `timing/ref_onload` and `timing/ref_offload` (MindSpeed-RL's names; ~0 s on a CPU machine)."""
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
