"""MindSpeed-RL run configs: ``posttrain_gpt.py --config FILE.yaml [flags ...]``.

The file's sections are mapped onto this program's flags (`arguments.build_parser`), and the flags on the
command line override the file: a flag given there drops what the file says for it (for ``--bf16`` / ``--fp16``
and the two LR-schedule-on-resume flags, giving one drops the file's other). The file becomes command-line
tokens that go in front of the user's, so the parser types and checks both the same way. A switch the file
turns on cannot be turned off from the command line (this program's switches, Megatron's, have no ``--no-``
form): edit the file.

Every key is in a table below (one per section; a Megatron key that is not there is this program's flag of the
same name, and ``rl_config`` takes this program's RL flags by name too): it maps to a flag (typed and checked
as the parser does it), is *ignored* with a reason (vLLM, Ray and NPU settings that mean nothing to an in-process Megatron
stage; listed once at start-up), is accepted only with the one value this program always has (any other
value is an error naming the fix), or feeds the mappings of the stage, the checkpoints, the verifiers and
the sampler (``_resolve``). An unknown key is an error naming the key, its section and the file (and the
nearest known key); a value of the wrong type is an error naming the key and the file.

Sections: ``defaults`` (hydra: ``- model: [NAME]``), ``model`` (``NAME: {Megatron keys}``; a name it lacks is
read from ``model/NAME.yaml`` next to the file when there), ``megatron_training`` (the base),
``actor_config`` (overrides the base), ``critic_config``, ``reward_config``, ``ref_config``, ``rl_config``,
``generate_config``. This program trains every role with one layout and one optimizer setting: the keys of
``critic_config`` / ``reward_config`` / ``ref_config`` must agree with the actor's (``critic_config.lr``
becomes ``--critic-lr``; frozen roles' optimizer and activation recompute keys are ignored). The recompute keys
(``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, MindSpeed-RL's documented
``recompute_activations``) are the flags of their names, applied to the actor and the critic, as are the LoRA keys
(``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``, ``lora_load``; ``lora_fusion`` and
``lora_ckpt_filter`` / ``lora_filter`` are listed as ignored; frozen roles' LoRA keys are ignored;
``rl_config.share_backbone: true`` is what a LoRA run does and needs LoRA, ``false`` is refused with it). The
architecture keys (``model``) become the model flags, which are checked against every checkpoint, only when all
roles use one model.

Checkpoints. Here ``--ref-model`` is the initial actor and the reference; ``--reward-model`` is the reward
model and (trl_ppo) the critic's initial weights; ``--load`` / ``--save`` hold every trained role under one
root (``ROOT/actor``, ``ROOT/critic``); ``--finetune`` loads weights only from a ``--save`` root. So:

* ``actor_config.load`` (or ``megatron_training.load``) is the actor's initial weights, mapped to
  ``--ref-model``, when it is a converted model (``latest_checkpointed_iteration.txt`` and no role folders)
  or when ``finetune: true`` and it is not a save root; ``no_load_optim`` / ``no_load_rng`` mean nothing
  then. Otherwise it is a previous ``--save`` root: ``--load`` (with ``--finetune``, ``--no-load-optim``,
  ``--no-load-rng`` as given), and the reference needs the original weights:
  ``rl_config.integrated_mode_config.ref_model_load_path`` or ``ref_config.load`` (they must agree), mapped
  to ``--ref-model``. With an initial actor, a reference path must equal it (one model starts both).
* ``actor_config.save`` is ``--save``; ``critic_config.save``, when given, must be the same directory.
* ``critic_config.load`` (trl_ppo) is either the actor's ``load`` root (the critic resumes with the actor)
  or the critic's initial weights, a value-head checkpoint, mapped to ``--reward-model``; another save root is
  an error (one root holds both roles). ``reward_config.load`` is ``--reward-model`` too, so the two must
  agree. When neither gives the critic's initial weights, the critic resumes and rule verifiers
  score, ``ROOT/critic`` (its own latest weights) is its starting point. A trl_ppo with rule verifiers and no ``reward_config.load`` gets
  ``--reward-model-weight 0``: the value-head model only starts the critic.

Other mappings: ``stage`` ``ray_grpo``/``grpo`` -> grpo, ``ray_ppo``/``trl_ppo`` -> trl_ppo;
``adv_estimator`` ``group_norm`` -> ``--adv-estimator grpo`` (grpo), ``gae`` is trl_ppo's, other names pass;
``kl_penalty`` ``kl``/``mse``/``abs``/``low_var_kl`` -> k1/k2/abs/low_var_kl; ``init_kl_coef`` -> ``--kl-coef``;
``mini_batch_size`` (sequences per optimizer step) -> ``--ppo-mini-batch-size``; ``epochs`` -> ``--ppo-epochs``;
``rule_reward: true`` without ``verifier_function`` -> MindSpeed-RL's default ``[base_acc]``, ``false`` drops
the verifier lists; verifier names must be registered here (`rl/verifiers`); ``sampling_config``
``temperature`` > 0 -> ``--do-sample --temperature T`` (0: greedy), ``top_k: -1`` -> ``--top-k 0``,
``max_tokens`` -> ``--max-new-tokens``; ``max_model_len`` -> ``--max-length`` (at least
``max_prompt_length + max_tokens``); ``generate_config.max_num_seqs`` / ``max_num_batched_tokens`` ->
``--rollout-max-num-seqs`` / ``--rollout-max-num-batched-tokens`` (the generation engine's limits, vLLM's
meaning); ``rl_config.partial_rollout_max_split`` N > 1 -> ``--partial-rollout --partial-rollout-max-split N``
(1, MindSpeed-RL's default, leaves partial rollouts off); ``use_tensorboard`` -> ``--tensorboard-dir``
(``megatron_training.tensorboard_dir``, else ``SAVE/tensorboard``). ``infer_tensor_parallel_size`` / ``_pipeline_`` / ``_expert_`` other than the training
layout are listed as ignored (generation runs on the training model in place, with its layout); ``dtype`` must be
the training precision. ``sampling_config.seed`` must equal the run's seed (``--seed``: each sample's random stream
is keyed by it); ``use_kl_in_reward`` must match the stage (trl_ppo puts the KL in the reward, grpo in the loss).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mindspeed_llm.arguments import build_parser
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
    """Read by `_resolve` (checkpoints, stage-dependent keys); `kind` is the YAML type it must have."""
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


def _stage(value):
    names = {"ray_grpo": "grpo", "grpo": "grpo", "ray_ppo": "trl_ppo", "trl_ppo": "trl_ppo"}
    if value not in names:
        raise ValueError(f"{value!r} is not a stage of this program; use one of {', '.join(names)} "
                         "(ray_grpo -> grpo, ray_ppo -> trl_ppo)")
    return names[value]


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
_PACKING_DEFAULT = 4096
_VLLM = "a vLLM engine setting: generation runs on the training model in place, without vLLM"
_RESOURCES = "the process count is torchrun's (--nproc_per_node x --nnodes)"

# Megatron's keys: megatron_training, actor_config, critic_config, reward_config, ref_config and the entries of
# `model` share this table. A key that is not here is this program's Megatron flag of the same name
# (`num_layers` -> --num-layers, typed and checked by the parser) when the parser has one.
MEGATRON: Dict[str, Any] = {
    "stage": Flag("--stage", convert=_stage),
    # models and checkpoints: see the module doc
    "model": Slot("model", "path"),
    "load": Slot("load", "path"),
    "save": Slot("save", "path"),
    "finetune": Slot("finetune", "bool"),
    "no_load_optim": Slot("no_load_optim", "bool"),
    "no_load_rng": Slot("no_load_rng", "bool"),
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
    "use_wandb": Accept(_is(False), "wandb is not supported; use use_tensorboard or --metrics-jsonl"),
    "log_max_throughput": Accept(_is(False), "the throughputs are logged per device (README, Metrics); set "
                                             "log_max_throughput: false"),
    "use_kl_in_reward": Slot("use_kl_in_reward", "bool"),
    "wandb_project": Ignored("wandb is not supported"),
    "wandb_exp_name": Ignored("wandb is not supported"),
    "wandb_save_dir": Ignored("wandb is not supported"),
    "integrated_mode_config": Nested({"ref_model_load_path": Slot("ref_model_load_path", "path")}),
    # true: the reference shares the actor's base (its adapters off), which a LoRA run always does (see _resolve)
    "share_backbone": Slot("share_backbone", "bool"),
    "partial_rollout_max_split": Slot("partial_rollout_max_split", "number"),
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
    "enable_prefix_caching": Ignored(_VLLM),
    "ascend_scheduler_config_enabled": Ignored(_VLLM),
    "sampling_config": Nested(SAMPLING),
}

ROLE_SECTIONS = ("critic_config", "reward_config", "ref_config")
SECTIONS = ("defaults", "model", "megatron_training", "actor_config", *ROLE_SECTIONS, "rl_config", "generate_config")
# Exclusive flags: the command line's choice of one drops the file's other.
EXCLUSIVE = (("bf16", "fp16"), ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"))
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


# ------------------------------------------------------------------------------------------ reading
@dataclass
class _Value:
    """One typed flag value: its parser action, the value argparse would produce, its tokens, where from."""
    action: argparse.Action
    value: Any
    tokens: List[str]
    origin: str

    @property
    def dest(self) -> str:
        return self.action.dest


@dataclass
class _Role:
    """What the file says for one role (or, for the actor, the run)."""
    flags: Dict[str, _Value] = field(default_factory=dict)
    slots: Dict[str, Tuple[Any, str]] = field(default_factory=dict)

    def slot(self, name, default=None):
        return self.slots[name][0] if name in self.slots else default

    def origin(self, name) -> str:
        return self.slots[name][1] if name in self.slots else name


@dataclass
class RunConfig:
    """The mapping of one file: `argv` goes in front of the command line's (see `config_argv`)."""
    path: str
    argv: List[str]
    ignored: List[Tuple[str, str]]
    notes: List[str]

    def report(self) -> str:
        lines = []
        if self.ignored:
            lines.append(f"--config {self.path}: {len(self.ignored)} keys have no meaning here and are ignored:")
            lines += [f"  {key}: {reason}" for key, reason in self.ignored]
        lines += [f"--config {self.path}: {note}" for note in dict.fromkeys(self.notes)]
        return "\n".join(lines)


class _Reader:
    def __init__(self, path: str, parser: argparse.ArgumentParser, given: set):
        self.path = path
        self.parser = parser
        self.given = given
        self.actions = parser._option_string_actions
        self.ignored: List[Tuple[str, str]] = []
        self.notes: List[str] = []
        groups = {g.title or "": g._group_actions for g in parser._action_groups}
        # the model flags (checked against every checkpoint) and this program's RL flags, by action
        self.arch = {id(a) for title, acts in groups.items() if title.startswith("model") for a in acts}
        self.rl_flags = {a.dest: a.option_strings[0] for title, acts in groups.items() if title.startswith("RL:")
                         for a in acts}

    def is_arch(self, v: "_Value") -> bool:
        return id(v.action) in self.arch

    def lookup(self, key: str, table: Dict[str, Any], fallback: Optional[str]):
        """The table's entry for `key`; else, for `fallback` "megatron", this program's flag of that name, for
        "rl" its RL flag of that name; Ignored entries only while the parser has no such flag."""
        entry = table.get(key)
        if isinstance(entry, (Ignored, type(None))) and fallback is not None:
            flag = "--" + key.replace("_", "-")
            if fallback == "megatron" and flag in self.actions:
                return Flag(flag)
            if fallback == "rl" and key in self.rl_flags:
                return Flag(self.rl_flags[key])
        return entry

    def known(self, table: Dict[str, Any], fallback: Optional[str]) -> List[str]:
        keys = set(table)
        if fallback == "megatron":
            keys |= {a.dest for a in self.parser._actions if a.option_strings and a.dest != "help"}
        elif fallback == "rl":
            keys |= set(self.rl_flags)
        return sorted(keys)

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"--config {self.path}: {where}: {message}")

    # -- keys
    def entries(self, section: str, mapping, table: Dict[str, Any], fallback: Optional[str] = None):
        """[(qualified key, entry, value)] of `mapping`; unknown keys and nested non-mappings refused."""
        if not isinstance(mapping, dict):
            raise self.error(section, f"must be a mapping of keys to values, not {type(mapping).__name__}")
        out = []
        for key, value in mapping.items():
            where = f"{section}.{key}"
            entry = self.lookup(key, table, fallback) if isinstance(key, str) else None
            if entry is None:
                known = self.known(table, fallback)
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.7)
                hint = f" (did you mean '{near[0]}'?)" if near else \
                    f"; the known keys of '{section}' are: {', '.join(known)}"
                raise ConfigError(f"--config {self.path}: unknown key '{key}' in section '{section}'{hint}")
            if value is None:  # `key:` or `key: null`: not set
                continue
            if isinstance(entry, Nested):
                out += self.entries(where, value, entry.table)
            else:
                out.append((where, entry, value))
        return out

    # -- typing
    def typed(self, flag: str, value, where: str) -> _Value:
        """`value` for `flag` as argparse would produce it from the tokens returned with it."""
        action = self.actions[flag]
        opt = action.option_strings[0]

        def wrong(kind: str) -> ConfigError:
            return self.error(where, f"{value!r} is not {kind} (it sets {opt})")

        if action.nargs == 0:
            if not isinstance(value, bool):
                raise wrong("true or false")
            if isinstance(action, argparse.BooleanOptionalAction):
                return _Value(action, value, [opt if value else "--no-" + opt[2:]], where)
            if value and action.const is not True:  # store_const
                return _Value(action, action.const, [opt], where)
            return _Value(action, bool(value), [opt] if value else [], where)
        if isinstance(action, argparse._AppendAction):  # e.g. --seq-length, which a command line may repeat
            converted, text = self._scalar(action, value, wrong)
            return _Value(action, [converted], [f"{opt}={text}"], where)
        if action.nargs in ("+", "*"):
            items = value if isinstance(value, list) else [value]
            if not items and action.nargs == "+":
                raise wrong("a non-empty list")
            converted = [self._scalar(action, item, wrong) for item in items]
            return _Value(action, [c for c, _ in converted], [opt] + [t for _, t in converted], where)
        if isinstance(value, list) and action.type not in (None, str, int, float):  # e.g. --stop-token-ids
            value = ",".join(str(v) for v in value)
        converted, text = self._scalar(action, value, wrong)
        return _Value(action, converted, [f"{opt}={text}"], where)

    @staticmethod
    def _scalar(action, value, wrong):
        if isinstance(value, (list, dict)):
            raise wrong("a single value")
        kind = {int: "an integer", float: "a number"}.get(action.type, "a valid value")
        text = str(value)  # what a command line would give (a YAML bool reads "True": no number)
        try:
            converted = action.type(text) if action.type is not None else text
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise wrong(kind) from None
        if action.choices is not None and converted not in action.choices:
            raise wrong(f"one of {', '.join(map(str, action.choices))}")
        return converted, text

    def slot_value(self, slot: Slot, value, where: str):
        ok = {
            "path": isinstance(value, str) and bool(value.strip()),
            "bool": isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "name": isinstance(value, str),
            "names": isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
        }[slot.kind]
        if not ok:
            kind = {"path": "a path", "bool": "true or false", "number": "a number", "name": "a name",
                    "names": "a list of names"}[slot.kind]
            raise self.error(where, f"{value!r} is not {kind}")
        if slot.kind == "names" and isinstance(value, str):
            return [value]
        return value

    # -- a layer of keys into a role
    def read(self, role: _Role, entries, frozen: bool = False) -> None:
        for where, entry, value in entries:
            if isinstance(entry, Ignored):
                self.ignored.append((where, entry.reason))
            elif isinstance(entry, Accept):
                if not entry.ok(value):
                    raise self.error(where, f"{value!r} cannot be honoured: {entry.reason}")
            elif isinstance(entry, Slot):
                role.slots[entry.name] = (self.slot_value(entry, value, where), where)
            elif frozen and where.rsplit(".", 1)[-1] in OPTIM:
                self.ignored.append((where, "a frozen model has no optimizer"))
            elif frozen and where.rsplit(".", 1)[-1] in RECOMPUTE:
                self.ignored.append((where, "a frozen model runs no backward: nothing to recompute"))
            elif frozen and where.rsplit(".", 1)[-1] in LORA:
                self.ignored.append((where, "a frozen model trains no adapters (with LoRA it is a trained model's "
                                            "base with its adapters off)"))
            else:
                if entry.convert is not None:
                    try:
                        value = entry.convert(value)
                    except ValueError as exc:
                        raise self.error(where, str(exc)) from None
                typed = self.typed(entry.flag, value, where)
                role.flags[typed.action.dest] = typed


# ------------------------------------------------------------------------------------------ the file
def _load_yaml(path: str):
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a directory; pass a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {exc}") from None
    return {} if data is None else data


def _default_models(reader: _Reader, defaults) -> List[str]:
    """The model names of hydra's `defaults: [{model: [NAME, ...]}]` (`_self_` entries are fine)."""
    names = []
    for item in defaults if isinstance(defaults, list) else [defaults]:
        if item == "_self_":
            continue
        if not isinstance(item, dict) or set(item) - {"model"}:
            raise reader.error("defaults", f"{item!r}: only '- model: [NAME]' entries (and _self_) are understood")
        listed = item.get("model")
        listed = listed if isinstance(listed, list) else [listed]
        if not all(isinstance(n, str) for n in listed):
            raise reader.error("defaults", f"{item!r}: model names must be strings")
        names += listed
    return names


def _model_entries(reader: _Reader, models: Dict[str, Any], name: Optional[str]):
    """The keys of model `name`: the file's `model` section, else `model/NAME.yaml` next to the file."""
    if name is None:
        return []
    if name in models:
        return reader.entries(f"model.{name}", models[name], MEGATRON, "megatron")
    here = os.path.dirname(os.path.abspath(reader.path))
    for candidate in (os.path.join(here, "model", f"{name}.yaml"), os.path.join(here, "..", "model", f"{name}.yaml")):
        if os.path.isfile(candidate):
            data = _load_yaml(candidate)
            if not isinstance(data, dict) or name not in data:
                raise ConfigError(f"--config {reader.path}: model '{name}': {candidate} has no top-level '{name}' key")
            return _Reader(candidate, reader.parser, reader.given).entries(f"model.{name}", data[name], MEGATRON, "megatron")
    reader.notes.append(f"model '{name}' is not defined in the file (nor model/{name}.yaml): its architecture is "
                        "read from the checkpoints")
    return []


def load_run_config(path: str, cli_argv: Sequence[str] = (), parser: Optional[argparse.ArgumentParser] = None
                    ) -> RunConfig:
    """Map the MindSpeed-RL run config at `path`; `cli_argv` (the command line without --config) decides what
    the file may not set (what it gives wins) and completes what the file leaves out (e.g. --ref-model)."""
    parser = parser or build_parser()
    given = _given_dests(parser, cli_argv)
    reader = _Reader(path, parser, given)
    data = _load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of sections (megatron_training, actor_config, "
                          f"rl_config, ...), not {type(data).__name__}")
    for section in data:
        if section not in SECTIONS:
            near = difflib.get_close_matches(str(section), SECTIONS, n=1, cutoff=0.7)
            hint = f" (did you mean '{near[0]}'?)" if near else f"; the sections are: {', '.join(SECTIONS)}"
            raise ConfigError(f"--config {path}: unknown section '{section}'{hint}")
    sections = {name: (data.get(name) or {}) for name in SECTIONS if name != "defaults"}
    models = sections["model"]
    if not isinstance(models, dict):
        raise reader.error("model", "must map model names to their keys")
    for name in _default_models(reader, data.get("defaults") or []):
        if name not in models:
            _model_entries(reader, models, name)  # a note when it is nowhere
    for name, keys in models.items():
        reader.entries(f"model.{name}", keys, MEGATRON, "megatron")  # every entry is checked, used or not

    run = _Role()
    base = reader.entries("megatron_training", sections["megatron_training"], MEGATRON, "megatron")
    actor = reader.entries("actor_config", sections["actor_config"], MEGATRON, "megatron")
    actor_model = _model_name(reader, base + actor)
    reader.read(run, _model_entries(reader, models, actor_model))
    reader.read(run, base)
    reader.read(run, actor)
    reader.read(run, reader.entries("rl_config", sections["rl_config"], RL, "rl"))
    reader.read(run, reader.entries("generate_config", sections["generate_config"], GENERATE))

    roles: Dict[str, Tuple[_Role, List]] = {}
    for section in ROLE_SECTIONS:
        if section not in data:
            continue
        entries = reader.entries(section, sections[section], MEGATRON, "megatron")
        name = _model_name(reader, entries)
        own = _model_entries(reader, models, name) if name not in (None, actor_model) else []
        role = _Role()
        frozen = section != "critic_config"
        reader.read(role, own, frozen)
        reader.read(role, entries, frozen)
        roles[section] = (role, name)

    flags = _resolve(reader, run, roles, cli_argv)
    for group in EXCLUSIVE:
        if given & set(group):
            given = given | set(group)
    argv = [token for dest, v in flags.items() if dest not in given for token in v.tokens]
    return RunConfig(path, argv, reader.ignored, reader.notes)


def _model_name(reader: _Reader, entries) -> Optional[str]:
    """The last `model:` of these entries (a role section's overrides the base's)."""
    name = None
    for where, entry, value in entries:
        if isinstance(entry, Slot) and entry.name == "model":
            name = reader.slot_value(entry, value, where)
    return name


# ------------------------------------------------------------------------------------------ the mappings
def _same_path(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def _checkpoint_kind(path: str) -> str:
    """'save' (a --save root: role folders), 'model' (a converted model), 'none' (missing or empty)."""
    if any(os.path.isdir(os.path.join(path, role)) for role in ("actor", "critic")):
        return "save"
    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        return "model"
    return "none"


def _resolve(reader: _Reader, run: _Role, roles: Dict[str, Tuple[_Role, Optional[str]]], cli_argv) -> Dict[str, _Value]:
    """The flags of the whole file: the run's, then those of the stage-dependent mappings (module doc)."""
    flags = dict(run.flags)
    given = reader.given

    def put(flag: str, value, where: str) -> None:
        typed = reader.typed(flag, value, where)
        flags[typed.action.dest] = typed

    def effective(dest: str):
        """The run's value of `dest` as far as the file decides it (else the parser's default)."""
        if dest in flags:
            return flags[dest].value
        return reader.parser.get_default(dest)

    stage = _cli_value(cli_argv, "--stage") or effective("stage")

    # -- the other roles: one layout and one optimizer setting for all (module doc)
    for section, (role, name) in roles.items():
        if section == "critic_config" and stage == "grpo":
            raise reader.error(section, "grpo trains no critic: drop critic_config (or use stage: ray_ppo)")
        for dest, v in role.flags.items():
            if section == "critic_config" and dest == "lr":
                flags["critic_lr"] = reader.typed("--critic-lr", v.value, v.origin)
                continue
            if v.action.dest in given or v.value == effective(dest):
                continue
            if (name not in (None, run.slot("model"))) and reader.is_arch(v):
                continue  # another model: its architecture is its checkpoint's
            opt = v.action.option_strings[0]
            raise reader.error(v.origin, f"{v.value!r} differs from the run's {opt} {effective(dest)!r}: this "
                                         "program runs every role with the actor's layout and settings (only "
                                         "critic_config.lr is the critic's own, as --critic-lr); make them equal or "
                                         "drop the key")
    models = {run.slot("model")} | {name for _, name in roles.values() if name is not None}
    if len(models - {None}) > 1:
        dropped = [dest for dest, v in flags.items() if reader.is_arch(v)]
        for dest in dropped:
            del flags[dest]
        if dropped:
            reader.notes.append(f"the roles use different models ({', '.join(sorted(m for m in models if m))}): "
                                "each architecture is read from its checkpoint, the model keys are not passed")

    split = run.slot("partial_rollout_max_split")
    if split is not None:  # MindSpeed-RL: N > 1 turns partial rollouts on, 1 (its default) leaves them off
        where = run.origin("partial_rollout_max_split")
        if split != int(split) or split < 1:
            raise reader.error(where, f"{split} must be an integer >= 1 (1: no partial rollouts)")
        if split > 1:
            put("--partial-rollout", True, where)
            put("--partial-rollout-max-split", int(split), where)
    rule_verifiers = _resolve_verifiers(reader, run, put, flags)
    _resolve_checkpoints(reader, run, roles, stage, put, flags, given, rule_verifiers, cli_argv)
    _resolve_sampling(reader, run, put, flags, effective, given)
    _resolve_token_budgets(reader, run, put)
    _resolve_kl_placement(reader, run, stage, effective)

    if run.slot("use_tensorboard") and "tensorboard_dir" not in flags:
        save = flags["save"].value if "save" in flags else _cli_value(cli_argv, "--save")
        if save is None:
            raise reader.error(run.origin("use_tensorboard"), "true needs a directory: set "
                                                              "megatron_training.tensorboard_dir or actor_config.save")
        put("--tensorboard-dir", os.path.join(save, "tensorboard"), run.origin("use_tensorboard"))

    share = run.slot("share_backbone")
    if share is not None:
        lora = "lora_target_modules" in flags or "lora_load" in flags or any(
            token.split("=", 1)[0] in ("--lora-target-modules", "--lora-load") for token in cli_argv)
        if share and not lora:
            raise reader.error(run.origin("share_backbone"), "true shares the actor's base with the reference, which "
                                                             "needs LoRA adapters to switch off: set "
                                                             "lora_target_modules, or share_backbone: false")
        if not share and lora:
            raise reader.error(run.origin("share_backbone"), "false would load the reference as a model of its own; "
                                                             "with LoRA the reference here is always the actor's "
                                                             "base with its adapters off: set it to true or drop it")
    estimator = run.slot("adv_estimator")
    if estimator is not None:
        where = run.origin("adv_estimator")
        if estimator == "gae":  # trl_ppo's own (its default: nothing to pass)
            if stage != "trl_ppo":
                raise reader.error(where, f"gae needs a critic, but the stage is {stage}; use group_norm")
        elif estimator == "group_norm":
            if stage == "trl_ppo":
                raise reader.error(where, "group_norm is critic-free (grpo's); trl_ppo estimates with gae")
            put("--adv-estimator", "grpo", where)
        else:  # this program's own estimator names: the parser / stage checks them
            put("--adv-estimator", estimator, where)
    return flags


def _resolve_checkpoints(reader, run, roles, stage, put, flags, given, rule_verifiers: bool, cli_argv) -> None:
    load, where_load = run.slot("load"), run.origin("load")
    finetune = bool(run.slot("finetune", False))
    ref_paths = [(run.slot("ref_model_load_path"), run.origin("ref_model_load_path"))]
    if "ref_config" in roles:
        ref_role = roles["ref_config"][0]
        ref_paths.append((ref_role.slot("load"), ref_role.origin("load")))
        for name in ("save", "finetune", "no_load_optim", "no_load_rng"):
            if name in ref_role.slots:
                reader.ignored.append((ref_role.origin(name), "the reference model is frozen: weights only, never saved"))
    ref_paths = [(p, w) for p, w in ref_paths if p is not None]
    if len(ref_paths) == 2 and not _same_path(ref_paths[0][0], ref_paths[1][0]):
        raise reader.error(ref_paths[1][1], f"{ref_paths[1][0]!r} differs from {ref_paths[0][1]} "
                                            f"{ref_paths[0][0]!r}: the reference has one checkpoint; make them equal")
    ref, where_ref = ref_paths[0] if ref_paths else (None, None)

    resumes = False
    if load is not None:
        kind = _checkpoint_kind(load)
        if kind == "model" or (finetune and kind != "save"):  # the actor's initial weights
            if ref is not None and not _same_path(ref, load) and "ref_model" not in given:
                raise reader.error(where_ref, f"{ref!r} differs from the actor's initial weights {where_load} "
                                              f"{load!r}: this program starts actor and reference from one model "
                                              "(--ref-model); to fine-tune a previous run of this program against "
                                              "the original reference, set the actor's load to that run's save "
                                              "directory (finetune: true)")
            put("--ref-model", load, where_load)
        else:  # a previous --save root: resume (or, with finetune, its weights only)
            resumes = True
            put("--load", load, where_load)
            for name, flag in (("finetune", "--finetune"), ("no_load_optim", "--no-load-optim"),
                               ("no_load_rng", "--no-load-rng")):
                if name in run.slots:
                    put(flag, run.slot(name), run.origin(name))
            if ref is not None:
                put("--ref-model", ref, where_ref)
            elif "ref_model" not in given:
                how = "fine-tunes the weights of" if finetune else "resumes"
                raise reader.error(where_load, f"{load!r} {how} a previous run (a --save directory of this program): "
                                               "set rl_config.integrated_mode_config.ref_model_load_path (or "
                                               "ref_config.load) to the original weights, which the reference model "
                                               "keeps (and the actor's initial weights when nothing is saved there yet)")
    elif ref is not None:
        put("--ref-model", ref, where_ref)
    save = run.slot("save")
    if save is not None:
        if load is not None and not resumes and _same_path(save, load) and _checkpoint_kind(load) == "model":
            raise reader.error(run.origin("save"), f"{save!r} is the directory of the initial weights ({where_load}): "
                                                   "this program writes SAVE/actor, SAVE/critic and "
                                                   "SAVE/latest_checkpointed_iteration.txt, which would replace that "
                                                   "model's own; save to another directory")
        put("--save", save, run.origin("save"))

    # -- critic (trl_ppo) and reward model
    critic = roles.get("critic_config", (None, None))[0]
    critic_init = critic_from_command_line = None
    root = _cli_value(cli_argv, "--load") if "load" in given else (load if resumes else None)  # the resume root
    if critic is not None:
        save = critic.slot("save")
        if save is not None and "save" not in given:
            if "save" in flags and not _same_path(save, flags["save"].value):
                raise reader.error(critic.origin("save"), f"{save!r} differs from {run.origin('save')} "
                                                          f"{flags['save'].value!r}: this program saves actor and critic "
                                                          "under one --save (DIR/actor, DIR/critic); set both to the same "
                                                          "directory")
            put("--save", save, critic.origin("save"))
        c_load, where = critic.slot("load"), critic.origin("load")
        if c_load is not None:
            if _same_path(c_load, root):  # the critic resumes with the actor
                for name in ("finetune", "no_load_optim", "no_load_rng"):
                    mine, actors = critic.slot(name), bool(run.slot(name, False))
                    if resumes and mine is not None and mine != actors:
                        raise reader.error(critic.origin(name), f"{mine} differs from the actor's {actors}: this "
                                                                "program resumes actor and critic together from one "
                                                                "--load, with one setting; make them equal")
            elif _checkpoint_kind(c_load) == "save":
                actor_side = f"resumes from {root!r}" if root else "starts from its initial weights"
                raise reader.error(where, f"{c_load!r} is a --save directory of this program, but the actor "
                                          f"{actor_side}: this program saves and resumes actor and critic under one "
                                          "directory (DIR/actor, DIR/critic); set actor_config.load and "
                                          "critic_config.load to the same directory")
            elif _same_path(c_load, load) and "reward_model" in given:
                reader.notes.append(f"{where} {c_load!r} is the policy's checkpoint; the critic starts from the "
                                    "command line's --reward-model (a value-head checkpoint)")
                critic_from_command_line = where
            elif _same_path(c_load, load):
                raise reader.error(where, f"{c_load!r} is the policy's checkpoint, but the critic starts from a "
                                          "value-head checkpoint here (--reward-model): convert one with "
                                          "convert_ckpt.py --orm (e.g. the policy with a zero value head) and set "
                                          "critic_config.load to it")
            elif resumes and critic.slot("finetune") is True:
                raise reader.error(critic.origin("finetune"), "the critic would start afresh while the actor "
                                                              f"resumes from {load!r}: this program resumes both "
                                                              "together; set critic_config.finetune: false")
            else:
                critic_init = (c_load, where)
    reward = roles.get("reward_config", (None, None))[0]
    reward_load = (reward.slot("load"), reward.origin("load")) if reward is not None and "load" in reward.slots else None
    if reward is not None:
        for name in ("save", "finetune", "no_load_optim", "no_load_rng"):
            if name in reward.slots:
                reader.ignored.append((reward.origin(name), "the reward model is frozen: weights only, never saved"))
    if "reward_model" in given:
        if critic_from_command_line and rule_verifiers and reward_load is None and "reward_model_weight" not in given:
            put("--reward-model-weight", 0.0, critic_from_command_line)  # it only starts the critic; verifiers score
        return
    if critic_init and reward_load and stage == "trl_ppo" and not _same_path(critic_init[0], reward_load[0]):
        raise reader.error(critic_init[1], f"{critic_init[0]!r} differs from {reward_load[1]} {reward_load[0]!r}: "
                                           "this program starts the critic from the reward model (--reward-model); "
                                           "make them equal, or drop reward_config to score with rule verifiers only")
    chosen = reward_load or critic_init
    if chosen is not None:
        put("--reward-model", chosen[0], chosen[1])
    elif stage == "trl_ppo" and critic is not None and _same_path(critic.slot("load"), root) and rule_verifiers:
        start = os.path.join(root, "critic")  # the reward is the verifiers': this model only starts the critic
        put("--reward-model", start, critic.origin("load"))
        reader.notes.append(f"the critic starts from {start} (its own latest weights; no reward_config.load)")
    elif stage == "trl_ppo" and (critic is not None or reward is not None):
        raise ConfigError(f"--config {reader.path}: trl_ppo needs the critic's initial weights, a value-head "
                          "checkpoint (convert_ckpt.py --orm), which this program also scores with unless rule "
                          "verifiers do: set reward_config.load (or critic_config.load to the critic's initial "
                          "weights)")
    if stage == "trl_ppo" and rule_verifiers and reward_load is None and "reward_model" in flags \
            and "reward_model_weight" not in flags:
        put("--reward-model-weight", 0.0, flags["reward_model"].origin)  # it only starts the critic


def _resolve_verifiers(reader, run, put, flags) -> bool:
    """--verifier-function from rule_reward / verifier_function; whether rule verifiers score the run."""
    rule, names = run.slot("rule_reward"), run.slot("verifier_function")
    if rule is False:
        for name in ("verifier_function", "verifier_weight"):
            where = run.origin(name) if name in run.slots else (flags[name].origin if name in flags else None)
            if where is not None:
                reader.ignored.append((where, "rule_reward is false"))
        flags.pop("verifier_weight", None)
        return False
    if names is None and rule is True:
        names = ["base_acc"]  # MindSpeed-RL's default
    if names is None:
        return bool(flags.get("verifier_function") and flags["verifier_function"].value)
    from mindspeed_llm.rl.verifiers import available_verifiers

    valid = available_verifiers()
    for name in names:
        if name not in valid:
            where = run.origin("verifier_function") if "verifier_function" in run.slots else run.origin("rule_reward")
            raise reader.error(where, f"'{name}' is not a verifier of this program; the valid names are: "
                                      f"{', '.join(valid)}")
    where = run.origin("verifier_function") if "verifier_function" in run.slots else run.origin("rule_reward")
    put("--verifier-function", names, where)
    return bool(names)


def _resolve_token_budgets(reader, run, put) -> None:
    """MindSpeed-RL's dynamic batch size: with ``use_dynamic_bsz: true``, ``update_max_packing_token_size`` (else
    ``max_packing_token_size``, else MindSpeed-RL's 4096) -> ``--max-tokens-per-micro-batch``, and the smaller of
    ``actor_max_packing_token_size`` / ``ref_max_packing_token_size`` (each else ``max_packing_token_size``) ->
    ``--forward-max-tokens-per-micro-batch`` (one budget serves every forward-only pass here). MindSpeed-RL counts a
    micro-batch's real tokens (its rows flattened); here rows x its longest row (sorted by length, the padding is
    small). Without it the budgets are ignored."""
    names = ("max_packing_token_size", "update_max_packing_token_size", "actor_max_packing_token_size",
             "ref_max_packing_token_size")
    if not run.slot("use_dynamic_bsz", False):
        for name in names:
            if name in run.slots:
                reader.ignored.append((run.origin(name), "use_dynamic_bsz is not true: micro-batches are "
                                                         "--micro-batch-size samples each"))
        return
    where = run.origin("use_dynamic_bsz")
    base = run.slot("max_packing_token_size", _PACKING_DEFAULT)
    update = run.slot("update_max_packing_token_size", base)
    forward = {name: run.slot(name, base) for name in ("actor_max_packing_token_size", "ref_max_packing_token_size")}
    put("--max-tokens-per-micro-batch", int(update), run.origin("update_max_packing_token_size")
        if "update_max_packing_token_size" in run.slots else where)
    smallest = min(forward, key=forward.get)
    if len(set(forward.values())) > 1:
        reader.notes.append(f"{', '.join(f'{k} {v}' for k, v in forward.items())}: every forward-only pass here takes "
                            f"one budget, the smaller ({int(forward[smallest])})")
    put("--forward-max-tokens-per-micro-batch", int(forward[smallest]),
        run.origin(smallest) if smallest in run.slots else where)


def _resolve_kl_placement(reader, run, stage, effective) -> None:
    """MindSpeed-RL's `use_kl_in_reward`: where the KL to the reference goes, which here follows from the stage
    (trl_ppo: a per-token reward penalty, TRL's; grpo: a loss, or the reward with reinforce_plus_plus). Accepted
    when it says the same, or when the KL coefficient is 0 (no KL at all)."""
    use_kl = run.slot("use_kl_in_reward")
    if use_kl is None:
        return
    coef = effective("kl_coef")
    in_reward = stage == "trl_ppo" or effective("adv_estimator") == "reinforce_plus_plus"
    if coef != 0 and bool(use_kl) != in_reward:
        where = "a per-token reward penalty (trl_ppo)" if in_reward else "a loss term (grpo)"
        raise reader.error(run.origin("use_kl_in_reward"), f"{use_kl} cannot be honoured: the KL to the reference "
                                                           f"is {where} in this run; set it to {in_reward} or set "
                                                           "init_kl_coef: 0")


def _resolve_sampling(reader, run, put, flags, effective, given) -> None:
    temperature = run.slot("temperature")
    if temperature is not None:
        where = run.origin("temperature")
        if temperature < 0:
            raise reader.error(where, f"{temperature} must be >= 0 (0: greedy)")
        if temperature > 0:
            put("--do-sample", True, where)
            put("--temperature", temperature, where)
    if all(dest in flags for dest in ("max_length", "max_prompt_length", "max_new_tokens")) \
            and not given & {"max_length", "max_prompt_length", "max_new_tokens"}:
        length, prompt, new = (flags[d].value for d in ("max_length", "max_prompt_length", "max_new_tokens"))
        if length < prompt + new:
            raise reader.error(flags["max_length"].origin,
                               f"{length} is less than {flags['max_prompt_length'].origin} {prompt} + "
                               f"{flags['max_new_tokens'].origin} {new} (it bounds prompt + response); raise it")
    # vLLM's own layout for generation: here generation runs on the training model in place, with its layout
    for key, training in (("infer_tensor_parallel_size", "tensor_model_parallel_size"),
                          ("infer_pipeline_parallel_size", "pipeline_model_parallel_size"),
                          ("infer_expert_parallel_size", "expert_model_parallel_size")):
        value, size = run.slot(key), effective(training)
        if value is not None and value != size:
            reader.ignored.append((run.origin(key), f"{value}: generation runs on the training model in place, "
                                                    f"with its layout ({training} {size}); no vLLM resharding"))
    sampling_seed = run.slot("sampling_seed")
    if sampling_seed is not None:  # vLLM's sampler seed; here every sample's stream is keyed by --seed
        where = run.origin("sampling_seed")
        if "seed" not in flags and "seed" not in given:
            put("--seed", int(sampling_seed), where)
        elif int(sampling_seed) != effective("seed") and "seed" not in given:
            raise reader.error(where, f"{sampling_seed} differs from {flags['seed'].origin} {effective('seed')}: the "
                                      "samples' random streams are keyed by the run's one seed here; make them equal")
    dtype = run.slot("dtype")
    if dtype is not None:
        where = run.origin("dtype")
        if dtype not in _DTYPES:
            raise reader.error(where, f"{dtype!r} is not one of {', '.join(_DTYPES)}")
        precision = "bf16" if effective("bf16") else ("fp16" if effective("fp16") else "fp32")
        if _DTYPES[dtype] != precision and not given & {"bf16", "fp16"}:
            raise reader.error(where, f"{dtype} differs from the training precision ({precision}): generation runs "
                                      "on the training model in place; set bf16 / fp16 and dtype alike")


# ------------------------------------------------------------------------------------------ the hook
def _given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set:
    """The dests of the options on a command line (values are never taken for options: this parser's values
    do not start with '--')."""
    given = set()
    for token in argv:
        if token.startswith("--"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                given.add(action.dest)
    return given


def _cli_value(argv: Sequence[str], flag: str) -> Optional[str]:
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def split_config(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """(the --config path or None, the command line without it)."""
    path, rest, it = None, [], iter(range(len(argv)))
    for i in it:
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if path is not None:
                raise ConfigError("--config is given twice; pass one run config")
            if token == "--config":
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError("--config needs a YAML file")
                path = argv[i + 1]
                next(it, None)
            else:
                path = token.split("=", 1)[1]
        else:
            rest.append(token)
    return path, rest


def config_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The command line with `--config FILE.yaml` replaced by the file's flags (put first: what the command line
    gives wins). Without --config, the command line unchanged. Rank 0 lists the ignored keys once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = split_config(argv)
    if path is None:
        return argv
    config = load_run_config(path, rest)
    report = config.report()
    if report and os.environ.get("RANK", "0") == "0":
        print(report, flush=True)
    return config.argv + rest
