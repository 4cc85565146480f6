"""The run config's key tables: one per section (`MEGATRON`, `RL`, `SAMPLING`, `GENERATE`), each key a `Flag`,
an `Ignored` key, an `Accept`ed fixed value, a `Slot` the mappings resolve (`mapping.py`, `checkpoints.py`) or a
`Nested` mapping; the sections and the values MindSpeed-RL spells its own way (stage, KL estimator, top_k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from mindspeed_llm.errors import ArgumentError


class ConfigError(ArgumentError):
    """A run config this program cannot map; the message names the file, the section and the key."""


# ------------------------------------------------------------------------------------------ table entries
@dataclass(frozen=True)
class Flag:
    """The value of one of this program's flags, typed and checked as the parser does; `convert` maps
    MindSpeed-RL's spelling of a value to ours first (a ValueError there refuses the value)."""
    flag: str
    convert: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class Ignored:
    """No meaning for an in-process Megatron stage; listed once at start-up."""
    reason: str


@dataclass(frozen=True)
class Accept:
    """A setting this program always has: accepted when `ok(value)`, any other value is an error."""
    ok: Callable[[Any], bool]
    reason: str


@dataclass(frozen=True)
class Slot:
    """Read by `mapping.resolve` (checkpoints, stage-dependent keys); `kind` is the YAML type it must have."""
    name: str
    kind: str  # "path", "bool", "number", "names"


@dataclass(frozen=True)
class Nested:
    """A mapping inside a section, with its own table."""
    table: Dict[str, Any]


def _is(expected) -> Callable[[Any], bool]:
    def ok(value) -> bool:
        if isinstance(expected, bool) or isinstance(value, bool):
            return isinstance(value, bool) and isinstance(expected, bool) and value == expected
        if isinstance(expected, (int, float)):
            try:
                return float(value) == float(expected)
            except (TypeError, ValueError):
                return False
        return value == expected
    return ok


STAGES = {"ray_grpo": "grpo", "grpo": "grpo", "ray_dapo": "grpo", "ray_ppo": "trl_ppo", "trl_ppo": "trl_ppo"}


def stage_of(value):
    """This program's stage for MindSpeed-RL's `stage` (ray_dapo: grpo with DAPO's features, `run_config/dapo.py`)."""
    if value not in STAGES:
        raise ValueError(f"{value!r} is not a stage of this program; use one of {', '.join(STAGES)} "
                         "(ray_grpo -> grpo, ray_dapo -> grpo with DAPO's features, ray_ppo -> trl_ppo)")
    return STAGES[value]


_KL_NAMES = {"kl": "k1", "mse": "k2", "abs": "abs", "low_var_kl": "low_var_kl", "k1": "k1", "k2": "k2", "k3": "k3"}


def _kl_penalty(value):
    if value not in _KL_NAMES:
        raise ValueError(f"{value!r} is not a KL estimator of this program; use one of {', '.join(_KL_NAMES)}")
    return _KL_NAMES[value]


def _top_k(value):
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        return 0  # vLLM's "off"
    return value


# MindSpeed's sequence-keeping all-to-all is megatron's all-to-all dispatcher here.
_DISPATCHERS = {"alltoall_seq": "alltoall"}

_RAY = "Ray scheduling: every role runs in this one torchrun process group"
_NO_SAMPLE_CAP = "no cap on samples per micro-batch: with use_dynamic_bsz the token budget alone bounds one"
# MindSpeed-RL's default max_packing_token_size
PACKING_DEFAULT = 4096
_VLLM = "a vLLM engine setting: generation runs on the training model in place, without vLLM"
_RESOURCES = "the process count is torchrun's (--nproc_per_node x --nnodes)"

# Megatron's keys: megatron_training, actor_config, critic_config, reward_config, ref_config and the entries of
# `model` share this table. A key that is not here is this program's Megatron flag of the same name
# (`num_layers` -> --num-layers, typed and checked by the parser) when the parser has one.
MEGATRON: Dict[str, Any] = {
    "stage": Slot("stage", "name"),  # mapping.resolve: --stage (and, for ray_dapo, run_config/dapo.py)
    # models and checkpoints: see the module doc
    "model": Slot("model", "path"),
    "load": Slot("load", "path"),
    "save": Slot("save", "path"),
    "finetune": Slot("finetune", "bool"),
    "no_load_optim": Slot("no_load_optim", "bool"),
    "no_load_rng": Slot("no_load_rng", "bool"),
    # no_save_optim is the flag of its name (--no-save-optim, Megatron-LM's)
    "no_save_rng": Accept(_is(False), "this program always saves the RNG state (a few KB per rank): it is what "
                                      "makes a resume bit for bit, and a resume at another data-parallel size takes "
                                      "DP rank 0's, as Megatron-LM does; set no_save_rng: false (a resume that should "
                                      "start the random states from the seed sets no_load_rng: true)"),
    # sequence_parallel / context_parallel_size are the flags of their names; how the CP ranks attend is one
    # algorithm here (keys and values gathered over them: the same attention as megatron's ring or Ulysses)
    "context_parallel_algo": Ignored("context parallelism here all-gathers the keys and values over the CP ranks "
                                     "(the same attention as megatron_cp_algo's ring; models/context_parallel.py)"),
    "attention_mask_type": Accept(_is("causal"), "the models here are causal decoders; set attention_mask_type: "
                                                 "causal"),
    "num_layer_list": Accept(lambda v: len({int(x) for x in str(v).replace(",", " ").split()}) == 1,
                             "the layers are split evenly over the pipeline stages here (as convert_ckpt.py shards "
                             "them); drop num_layer_list or give equal counts"),
    "no_pad_to_seq_lengths": Ignored("micro-batches are always cut to their own longest row here, never padded to "
                                     "seq_length"),
    "reset_position_ids": Ignored("every sample's positions are its own here (rows, or packed prompt groups whose "
                                  "responses continue at their prompt's end)"),
    "reset_attention_mask": Ignored("every sample attends to its own tokens only here (rows, or packed prompt groups "
                                    "described to the attention, models/attention.py)"),
    "reuse_fp32_param": Accept(_is(False), "MindSpeed's fp32 main-weight reuse is not implemented (megatron keeps "
                                           "its fp32 main weights); set reuse_fp32_param: false"),
    # expert_model_parallel_size / moe_* keys map to the flags of their names (mixture of experts)
    "moe_token_dispatcher_type": Flag("--moe-token-dispatcher-type", convert=lambda v: _DISPATCHERS.get(v, v)),
    "norm_topk_prob": Ignored("the router's normalisation is the checkpoint's (config.json's norm_topk_prob)"),
    "enable_expert_parallel": Ignored("expert parallelism is --expert-model-parallel-size > 1"),
    "gemm_gradient_accumulation_fusion": Ignored("a fused kernel switch: the local layer spec runs plain torch"),
    "no_shuffle": Flag("--no-shuffle"),
    # without a flag here (ignored only while the parser has no flag of that name)
    "use_mc2": Ignored("an NPU communication-overlap kernel; the local torch layers are used here"),
    "attention_bias": Ignored("the architecture is read from the checkpoint"),
    "full_shuffle_instruction_dataset": Ignored("prompts are drawn from the whole dataset here, shuffled every "
                                                "epoch or, with no_shuffle, in dataset order"),
    "dataset_additional_keys": Ignored("the preprocessed dataset carries its labels (preprocess_data.py "
                                       "--map-keys); the verifiers check they are there"),
    # LoRA: lora_r, lora_alpha, lora_dropout, lora_target_modules, lora_load, lora_fusion, lora_ckpt_filter are the
    # flags of their names (the last two listed as ignored at start-up); MindSpeed-RL's grpo_lora.md spells the
    # filter lora_filter
    "lora_filter": Flag("--lora-ckpt-filter"),
}
# Optimizer keys: a frozen role's (reward_config, ref_config) are ignored; the critic's must be the actor's,
# except its lr (critic_config.lr -> --critic-lr).
OPTIM = {"lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "weight_decay",
         "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "optimizer", "sgd_momentum", "loss_scale",
         "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "use_distributed_optimizer"}

# Activation recompute keys (recompute_granularity, recompute_method, recompute_num_layers, recompute_activations, ...
# map to the flags of their names): a frozen role's (reward_config, ref_config) are ignored, it runs no backward;
# the critic's must be the actor's (one set of flags for both trained roles).
RECOMPUTE = {"recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_activations",
             "recompute_modules", "distribute_saved_activations", "moe_layer_recompute"}

# LoRA keys: a frozen role's (reward_config, ref_config) are ignored, it trains no adapters (with LoRA it is a trained
# model's base); the critic's must be the actor's (one set of flags for both trained roles).
LORA = {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_load", "lora_fusion", "lora_ckpt_filter",
        "lora_filter", "lora_register_forward_hook"}

# verl's custom_reward_function ({path, name, reward_kwargs}; MindSpeed-RL has no such key): under rl_config, or as
# a top-level section of that name as verl writes it -> --custom-reward-function PATH:NAME (mapping.py). verl's
# default, `path: null`, sets nothing.
# Keys whose null means something documented (the file's last keys; any other null is refused as the file is read,
# `loader._load_yaml`): verl's `custom_reward_function.path: null`, no function.
DOCUMENTED_NULLS = (("custom_reward_function", "path"),)
CUSTOM_REWARD: Dict[str, Any] = {
    "path": Slot("custom_reward_path", "path"),
    "name": Slot("custom_reward_name", "name"),
    "reward_kwargs": Accept(lambda v: not v, "extra keyword arguments are not passed to the reward function here; "
                                             "give its parameters defaults instead and drop reward_kwargs"),
}

# rl_config also takes this program's own RL flags by name (the parser's "RL: ..." groups), e.g.
# missing_eos_penalty, loss_agg_mode, adv_scale, vf_coef.
RL: Dict[str, Any] = {
    "guarantee_order": Ignored(_RAY),
    "use_integrated_worker": Ignored("all roles share one process group here (as MindSpeed-RL's integrated worker)"),
    "blocking": Ignored(_RAY),
    "num_cpus_for_local_task": Ignored(_RAY),
    "num_cpus_for_placement_group": Ignored(_RAY),
    "runtime_env_path": Ignored(_RAY),
    "actor_resource": Ignored(_RESOURCES),
    "critic_resource": Ignored(_RESOURCES),
    "reference_resource": Ignored(_RESOURCES),
    "reward_resource": Ignored(_RESOURCES),
    "actor_forward_micro_batch_size": Ignored("forward passes use --micro-batch-size"),
    "hccl_buffersize": Ignored("an NPU collective setting (export HCCL_BUFFSIZE in the launch shell)"),
    "actor_logprob_dispatch_size": Ignored(_RAY),
    "ref_dispatch_size": Ignored(_RAY),
    "reward_dispatch_size": Ignored(_RAY),
    "adv_dispatch_size": Ignored(_RAY),
    "actor_update_dispatch_size": Ignored(_RAY),
    "ref_forward_micro_batch_size": Ignored("forward passes use --micro-batch-size"),
    # dynamic batch size: see _resolve_token_budgets
    "use_dynamic_bsz": Slot("use_dynamic_bsz", "bool"),
    "max_packing_token_size": Slot("max_packing_token_size", "number"),
    "update_max_packing_token_size": Slot("update_max_packing_token_size", "number"),
    "actor_max_packing_token_size": Slot("actor_max_packing_token_size", "number"),
    "ref_max_packing_token_size": Slot("ref_max_packing_token_size", "number"),
    "dynamic_max_batch_size": Ignored(_NO_SAMPLE_CAP),
    "update_dynamic_max_batch_size": Ignored(_NO_SAMPLE_CAP),
    "actor_dynamic_max_batch_size": Ignored(_NO_SAMPLE_CAP),
    "ref_dynamic_max_batch_size": Ignored(_NO_SAMPLE_CAP),
    "use_remove_padding": Ignored("micro-batches are cut to their own longest row (and packed prompt groups hold a "
                                  "prompt once); there is no flattened (thd) layout"),
    "use_dp_batch_balance": Ignored("every DP rank holds an equal share of the prompts, and the ranks run as many "
                                    "micro-batches as the one with the most"),
    "verifier_parallel": Ignored("the verifiers run in this program's own worker"),
    "verifier_timeout": Ignored("the verifiers bound their own time (math_acc's timeout)"),
    "gamma": Flag("--gamma"),
    "lam": Flag("--lam"),
    "adv_estimator": Slot("adv_estimator", "name"),
    "advantage_whiten": Accept(_is(True), "trl_ppo always whitens the advantages (as TRL's PPO)"),
    "kl_penalty": Flag("--kl-penalty", convert=_kl_penalty),
    "kl_ctrl_type": Accept(_is("fixed"), "the KL coefficient is fixed here (--kl-coef); set kl_ctrl_type: fixed"),
    "kl_horizon": Ignored("adaptive KL control only; the coefficient is fixed here"),
    "kl_target": Ignored("adaptive KL control only; the coefficient is fixed here"),
    "init_kl_coef": Flag("--kl-coef"),
    "mini_batch_size": Flag("--ppo-mini-batch-size"),
    "max_prompt_length": Flag("--max-prompt-length"),
    "epochs": Flag("--ppo-epochs"),
    "clip_ratio": Flag("--clip-ratio"),
    "cliprange_value": Flag("--cliprange-value"),
    "entropy_coeff": Flag("--entropy-coeff"),
    "shuffle_mini_batch": Accept(_is(False), "mini-batches are taken in order here; set it to false"),
    "shuffle_minibatch": Accept(_is(False), "mini-batches are taken in order here; set it to false"),
    "n_samples_per_prompt": Flag("--n-samples-per-prompt"),
    "rule_reward": Slot("rule_reward", "bool"),
    "verifier_function": Slot("verifier_function", "names"),
    "verifier_weight": Flag("--verifier-weight"),
    "use_tensorboard": Slot("use_tensorboard", "bool"),
    "use_wandb": Slot("use_wandb", "bool"),  # with wandb_project: see mapping.resolve
    "log_max_throughput": Accept(_is(False), "the throughputs are logged per device (README, Metrics); set "
                                             "log_max_throughput: false"),
    "use_kl_in_reward": Slot("use_kl_in_reward", "bool"),
    "wandb_project": Flag("--wandb-project"),
    "wandb_exp_name": Flag("--wandb-exp-name"),
    "wandb_save_dir": Flag("--wandb-save-dir"),
    "integrated_mode_config": Nested({"ref_model_load_path": Slot("ref_model_load_path", "path")}),
    # true: the reference shares the actor's base (its adapters off), which a LoRA run always does (see mapping.resolve)
    "share_backbone": Slot("share_backbone", "bool"),
    "partial_rollout_max_split": Slot("partial_rollout_max_split", "number"),
    # multi-turn tool use (rl/rollouts/tool_turns.py)
    "multi_turn_enable": Flag("--multi-turn"),
    "tool_config_path": Flag("--tool-config"),
    "max_tool_calls": Flag("--max-tool-calls"),
    "max_parallel_calls": Flag("--max-parallel-calls"),
    "max_total_response_length": Flag("--max-total-response-length"),
    "max_tool_response_length": Flag("--max-tool-response-length"),
    "tool_response_truncate_side": Flag("--tool-response-truncate-side"),
    "tool_parser_format": Flag("--tool-parser-format"),
    "zmq_communication": Ignored(_RAY),
    # DAPO's keys (MindSpeed-RL's ray_dapo): run_config/dapo.py maps them by their switches
    **{name: Slot(name, kind) for name, kind in (
        ("token_level_loss", "bool"), ("clip_higher_enable", "bool"), ("clip_ratio_low", "number"),
        ("clip_ratio_high", "number"), ("overlong_buffer_enable", "bool"), ("rollout_max_tokens", "number"),
        ("overlong_buffer", "number"), ("overlong_buffer_penalty_factor", "number"), ("filter_groups_enable", "bool"),
        ("filter_groups_metric", "name"), ("filter_groups_max_batches", "number"),
        ("filter_groups_train_batch_size", "number"))},
    "async_engine": Ignored("generation runs in this process; tools run in a thread pool beside it (--tool-workers)"),
    "custom_reward_function": Nested(CUSTOM_REWARD),
}

SAMPLING: Dict[str, Any] = {
    "logprobs": Ignored("log-probs come from the training model's own forward passes"),
    "max_tokens": Flag("--max-new-tokens"),
    "top_p": Flag("--top-p"),
    "top_k": Flag("--top-k", convert=_top_k),
    "min_p": Accept(_is(0.0), "min-p sampling is not supported; set min_p: 0"),
    "temperature": Slot("temperature", "number"),
    "detokenize": Ignored(_VLLM),
    "seed": Slot("sampling_seed", "number"),
}

GENERATE: Dict[str, Any] = {
    "trust_remote_code": Ignored("the models are Megatron checkpoints built by this program"),
    "offload_train_optimizer": Flag("--offload-train-optimizer"),
    "offload_train_grad": Flag("--offload-train-grad"),
    "offload_train_param": Flag("--offload-train-param"),
    "infer_tensor_parallel_size": Slot("infer_tensor_parallel_size", "number"),
    "infer_pipeline_parallel_size": Slot("infer_pipeline_parallel_size", "number"),
    "infer_expert_parallel_size": Slot("infer_expert_parallel_size", "number"),
    "max_num_seqs": Flag("--rollout-max-num-seqs"),
    "max_num_batched_tokens": Flag("--rollout-max-num-batched-tokens"),
    "max_model_len": Flag("--max-length"),
    "dtype": Slot("dtype", "name"),
    "gpu_memory_utilization": Ignored(_VLLM),
    "enforce_eager": Ignored(_VLLM),
    "enable_expert_parallel": Ignored(_VLLM),
    "enable_prefix_caching": Ignored(_VLLM),
    "ascend_scheduler_config_enabled": Ignored(_VLLM),
    "sampling_config": Nested(SAMPLING),
}

ROLE_SECTIONS = ("critic_config", "reward_config", "ref_config")
SECTIONS = ("defaults", "model", "megatron_training", "actor_config", *ROLE_SECTIONS, "rl_config", "generate_config",
            "custom_reward_function")
# Exclusive flags: the command line's choice of one drops the file's other.
EXCLUSIVE = (("bf16", "fp16"), ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"))
DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}
