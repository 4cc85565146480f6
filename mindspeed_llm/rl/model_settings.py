"""The typed parts model building reads (`rl/update/roles.py`, `rl/update/lora.py`, `rl/update/moe.py`, `rl/update/recompute.py`), made by
`arguments.validate_args` with the rest of the settings (`rl/settings.py`: `Settings.model`, `.optimizer`, `.lora`,
`.moe`, `.recompute`), and the optimizer settings of one trained role that `rl/update/trainable.TrainableModel` takes.

    ModelBuild          what every role is built with, and the model flags checked against each checkpoint
    OptimizerFlags      Megatron-LM's optimizer, LR-schedule and grad-scaler flags; `for_role` gives a role's
    OptimizerSettings   one trained role's optimizer (the actor's --lr, the critic's --critic-lr)
    LoRASettings        LoRA's flags (`rl/update/lora.py`)
    MoESettings         the mixture-of-experts flags and the resolved expert layout (`rl/update/moe.py`)
    RecomputeSettings   activation recompute, as `validate_args` resolved it (`rl/update/recompute.py`)

As in `rl/settings.py`, a field is named after the flag destination it holds and its default is the parser's
(tests/unit/test_settings.py); `derived` fields are values `validate_args` works out of several flags.

This module imports nothing of the package (the parser imports it through `rl/settings.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


def derived(default=None):
    """A field no flag sets: `validate_args` works it out of several flags."""
    return field(default=default, metadata={"derived": True})


@dataclass(frozen=True)
class ModelBuild:
    """What `roles.load_model` builds every role with, and the model flags of MindSpeed-LLM scripts, which the
    checkpoint's own description must match (`roles.checked_spec`; None / False: not given)."""
    params_dtype: str = derived("fp32")  # --bf16 / --fp16
    attention: str = derived("sdpa")  # the core attention of --attention-backend (sdpa or megatron's local)
    fused_ops: Tuple[str, ...] = derived(())  # the --use-fused-* ops this device runs
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    sequence_parallel: bool = False  # validate_args: off at TP 1
    # checked against the checkpoint
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    kv_channels: Optional[int] = None
    vocab_size: Optional[int] = None  # --padded-vocab-size
    max_position_embeddings: Optional[int] = None
    rotary_base: Optional[float] = None
    norm_epsilon: Optional[float] = None
    rope_scaling_type: Optional[str] = None
    rope_scaling_factor: Optional[float] = None
    untie_embeddings_and_output_weights: bool = False
    qk_layernorm: bool = False
    num_query_groups: Optional[int] = None
    group_query_attention: bool = False
    add_qkv_bias: bool = False
    disable_bias_linear: bool = False


@dataclass(frozen=True)
class OptimizerSettings:
    """One trained role's optimizer and LR schedule (`trainable.TrainableModel`); a run's come from
    `OptimizerFlags.for_role`, tests and benchmarks build their own."""
    lr: float
    optimizer: str = "adam"  # or "sgd"
    sgd_momentum: float = 0.9
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 1
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    params_dtype: str = "fp32"
    use_distributed_optimizer: bool = False
    # On resume, an LR schedule that differs from the checkpoint's is an error ("check"), or the command line's
    # ("override", --override-opt_param-scheduler) or the checkpoint's ("checkpoint") applies (Megatron-LM).
    schedule_on_resume: str = "check"
    # The flag names of the role's settings, for messages (the critic's lr is --critic-lr).
    lr_flag: str = "--lr"
    # fp16's grad scaler (Megatron-LM's flags and defaults): a constant scale, or a dynamic one.
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2


LOSS_SCALE_FLAGS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


@dataclass(frozen=True)
class OptimizerFlags:
    """Megatron-LM's optimizer flags of a run, validated: --critic-lr defaults to --lr, the warmup and decay lengths
    resolved in iterations (--lr-warmup-fraction, --lr-decay-iters defaulting to --train-iters)."""
    lr: float = 1e-06
    critic_lr: Optional[float] = None  # validate_args: --lr when not given
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0  # validate_args: from --lr-warmup-fraction when given
    lr_decay_iters: Optional[int] = None  # validate_args: --train-iters when not given
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    params_dtype: str = derived("fp32")
    use_distributed_optimizer: bool = False
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    # --fp16's grad scaler; None: megatron's default (`OptimizerSettings`)
    loss_scale: Optional[float] = None
    initial_loss_scale: Optional[float] = None
    min_loss_scale: Optional[float] = None
    loss_scale_window: Optional[float] = None
    hysteresis: Optional[int] = None
    check_for_nan_in_loss_and_grad: bool = True
    check_for_divergence: bool = True

    def loss_scale_settings(self) -> dict:
        """--fp16's grad-scaler flags that were given (megatron's defaults otherwise); nothing for bf16 / fp32."""
        if self.params_dtype != "fp16":
            return {}
        return {name: getattr(self, name) for name in LOSS_SCALE_FLAGS if getattr(self, name) is not None}

    def for_role(self, name: str) -> OptimizerSettings:
        """The optimizer of the trained role `name` ("actor", "critic": its own learning rate, --critic-lr)."""
        critic = name == "critic"
        schedule_on_resume = ("override" if self.override_opt_param_scheduler else
                              "checkpoint" if self.use_checkpoint_opt_param_scheduler else "check")
        return OptimizerSettings(
            lr=self.critic_lr if critic else self.lr, optimizer=self.optimizer, sgd_momentum=self.sgd_momentum,
            min_lr=self.min_lr, lr_decay_style=self.lr_decay_style, lr_warmup_iters=self.lr_warmup_iters,
            lr_decay_iters=self.lr_decay_iters, weight_decay=self.weight_decay, clip_grad=self.clip_grad,
            adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
            params_dtype=self.params_dtype, use_distributed_optimizer=self.use_distributed_optimizer,
            schedule_on_resume=schedule_on_resume, lr_flag="--critic-lr" if critic else "--lr",
            **self.loss_scale_settings())


@dataclass(frozen=True)
class LoRASettings:
    """LoRA's flags (`rl/update/lora.py`); r / alpha / dropout None: not given (with --lora-load the adapter's own)."""
    lora: bool = derived(False)  # --lora-target-modules or --lora-load given
    lora_r: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_dropout: Optional[float] = None
    lora_target_modules: Optional[Tuple[str, ...]] = None  # validate_args: without repeats
    lora_load: Optional[str] = None
    allow_base_mismatch: bool = False
    seed: int = 1234  # the adapters' initial values are drawn from (seed, role)


@dataclass(frozen=True)
class MoESettings:
    """The mixture-of-experts flags (`rl/update/moe.py`) and the shape flags checked against a checkpoint's experts."""
    moe_routing_replay: bool = False
    expert_model_parallel_size: int = 1
    expert_parallel_size: int = derived(1)  # ranks the experts are split over (EP x TP with --moe-tp-extend-ep)
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False  # validate_args: off at TP 1
    moe_aux_loss_coeff: Optional[float] = None  # None: the checkpoint's
    moe_token_dispatcher_type: Optional[str] = None  # validate_args: alltoall with EP or PP, else allgather
    moe_router_load_balancing_type: str = "aux_loss"
    moe_grouped_gemm: bool = False
    # checked against the checkpoint (None: not given)
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None


@dataclass(frozen=True)
class RecomputeSettings:
    """Activation recompute of the trained roles (`rl/update/recompute.py`), as `validate_args` resolved Megatron-LM's
    flags: granularity None (off), "full" (method and layers) or "selective" (modules)."""
    recompute_granularity: Optional[str] = None  # validate_args: --recompute-activations / --moe-layer-recompute
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: bool = False
    recompute_modules: Optional[Tuple[str, ...]] = None  # validate_args: core_attn by default with selective
    moe_layer_recompute: bool = False
    pipeline_model_parallel_size: int = 1  # --recompute-num-layers counts the layers of one stage
