"""Checking a parsed command line and resolving it into the run's typed settings (`rl/settings.py`).

`validate_args` turns every inconsistent combination into an `ArgumentError` whose message names the flags
and the fix, before any model is built or any compute is spent, and returns the settings: the stage defaults and
the values that follow from several flags are resolved into them (model building's too: `rl/model_settings.py`),
and so is what Megatron-LM's own `validate_args` works out on its args (the process grid, the experts' layout and
dispatcher, the precision, sequence parallelism off at TP 1, recompute from --recompute-activations), LoRA's switch
and the startup report's ignored flags and notes (`settings.startup`). Nothing is written back onto the Namespace
but `args.settings`: it keeps the flags as given. No name has to stay there for megatron: megatron's global args
are never set (`models.build_model` hands megatron-core its TransformerConfig field by field), so megatron-core
reads nothing of this Namespace (tests/unit/test_settings.py, tests/unit/test_namespace_boundary.py).
"""

from __future__ import annotations

import math

from mindspeed_llm import compat_flags
from mindspeed_llm.argument_ranges import check_ranges
from mindspeed_llm.arguments.parser import (
    LLAMA3_FIXED,
    LOCAL_ATTENTION_BACKENDS,
    RECOMPUTE_MODULES,
    REFUSED_RECOMPUTE_MODULES,
    build_parser,
)
from mindspeed_llm.arguments.distill import check_distill
from mindspeed_llm.arguments.evaluation import check_evaluation
from mindspeed_llm.arguments.judge import check_judge
from mindspeed_llm.arguments.observability import check_profiling, check_rollout_records
from mindspeed_llm.arguments.rollouts import (check_dynamic_sampling, check_multi_turn, check_partial_rollout,
                                              check_rollout_pair)
from mindspeed_llm.arguments.wandb_flags import check_wandb
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.expert_layout import (
    EP_NOT_MULTIPLE_OF_TP,
    EXPERT_TP_NOT_1_OR_TP,
    EXTEND_WITH_EXPERT_TP,
    ExpertLayoutError,
    resolve_expert_layout,
)
from mindspeed_llm.rl import settings as run_settings

STAGE_DEFAULTS = {
    "trl_ppo": dict(kl_coef=0.3, kl_penalty="k1", n_samples_per_prompt=1),
    "grpo": dict(kl_coef=0.001, kl_penalty="low_var_kl", n_samples_per_prompt=8),
}


def _check_expert_parallel(run, world_size: int) -> None:
    """Resolve the experts' layout into `expert_parallel_size` (ranks the experts are split over, EP x TP with
    --moe-tp-extend-ep), `expert_tensor_parallel_size` (1 or TP) and the token dispatcher."""
    tp, pp, ep = run.tensor_model_parallel_size, run.pipeline_model_parallel_size, run.expert_model_parallel_size
    try:
        ep, etp = resolve_expert_layout(tp, ep, run.expert_tensor_parallel_size, run.moe_tp_extend_ep)
    except ExpertLayoutError as exc:
        raise ArgumentError({
            EXTEND_WITH_EXPERT_TP: f"--moe-tp-extend-ep splits the experts over the TP ranks instead of inside each "
                                   f"expert; it cannot be combined with --expert-tensor-parallel-size {exc.etp} (drop "
                                   f"one)",
            EXPERT_TP_NOT_1_OR_TP: f"--expert-tensor-parallel-size {exc.etp} must be 1 or --tensor-model-parallel-size "
                                   f"{tp} (checkpoints keep experts either whole or split like the dense layers)",
            EP_NOT_MULTIPLE_OF_TP: f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {tp} needs an "
                                   f"expert-parallel size that is a multiple of {tp} (the expert ranks run over the "
                                   f"TP ranks), not {ep}; use --moe-tp-extend-ep or --expert-model-parallel-size "
                                   f"{tp * max(1, ep // tp)}",
        }[exc.rule]) from None
    if world_size % (etp * ep * pp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by expert tensor parallel {etp} x expert parallel {ep}"
            f"{' (--expert-model-parallel-size x TP, --moe-tp-extend-ep)' if run.moe_tp_extend_ep else ''} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {etp * ep * pp} processes or lower "
            f"--expert-model-parallel-size")
    if run.moe_token_dispatcher_type is None:
        run.moe_token_dispatcher_type = "alltoall" if ep > 1 or pp > 1 else "allgather"
    elif run.moe_token_dispatcher_type == "allgather" and ep > 1:
        raise ArgumentError(
            f"--moe-token-dispatcher-type allgather cannot run expert parallel {ep}: megatron's all-gather "
            f"dispatcher needs the same number of tokens on every expert-parallel rank, and RL micro-batches differ "
            f"in length from rank to rank; use --moe-token-dispatcher-type alltoall (the default with experts split)")
    elif run.moe_token_dispatcher_type == "allgather" and pp > 1:
        raise ArgumentError(
            f"--moe-token-dispatcher-type allgather cannot run --pipeline-model-parallel-size {pp}: micro-batches "
            "are cut to their own length, so the pipeline stages exchange variable shapes, which megatron allows "
            "with the all-to-all dispatcher only; use --moe-token-dispatcher-type alltoall (the default with PP)")
    run.expert_parallel_size = ep
    run.expert_tensor_parallel_size = etp


def _check_attention_backend(run) -> None:
    """`settings.model.attention`, the core attention every model is built with (`build_model(attention=...)`):
    "sdpa" (the device's fused kernel) unless --attention-backend local / unfused asks for megatron's local
    attention, which is said at startup (it is not the default)."""
    backend = run.attention_backend
    if run.use_flash_attn and backend in LOCAL_ATTENTION_BACKENDS:
        raise ArgumentError(f"--use-flash-attn and --attention-backend {backend} contradict each other: the first asks "
                            "for the fused attention kernel, the second for megatron's local attention; drop one")
    run.attention = "local" if backend in LOCAL_ATTENTION_BACKENDS else "sdpa"
    if run.attention == "local":
        run.startup_notes.append(f"--attention-backend {backend}: megatron's local DotProductAttention (the "
                                  "reference; its memory grows with the square of the sequence length)")


def _check_fused_ops(run) -> None:
    """`settings.model.fused_ops`, the `device.FUSED_OPS` every model is built with (`build_model(fused_ops=...)`):
    those whose --use-fused-* flag is given and that this device runs, said at startup with what runs them; a flag
    this device has no fused op for (RoPE off the NPU) is listed with the ignored flags."""
    from mindspeed_llm import device

    given = {"rmsnorm": run.use_fused_rmsnorm, "swiglu": run.use_fused_swiglu,
             "rope": run.use_fused_rotary_pos_emb}
    run.fused_ops = tuple(op for op in device.fused_ops_here() if given[op])
    if given["rope"] and "rope" not in run.fused_ops:
        run.ignored_flags[device.FUSED_OPS["rope"]] = device.NO_FUSED_ROPE
    if run.fused_ops:
        flags = ", ".join(device.FUSED_OPS[op] for op in run.fused_ops)
        run.startup_notes.append(f"{flags}: {device.fused_ops_line(run.fused_ops)}")


def _check_sequence_and_context_parallel(run) -> None:
    """--sequence-parallel needs TP > 1 (Megatron-LM turns it off at TP 1, and so does this, saying so);
    --context-parallel-size > 1 needs the fused core attention, whose CP path gathers the keys and values over the
    CP group (megatron's local attention has none). A mixture of experts under CP is refused when its checkpoint
    is read (`rl/update/moe.model_options`)."""
    if run.sequence_parallel and run.tensor_model_parallel_size == 1:
        run.sequence_parallel = False
        run.startup_notes.append("--sequence-parallel is off: it splits activations over the tensor-parallel ranks, "
                                  "and --tensor-model-parallel-size is 1 (Megatron-LM's rule)")
    if run.context_parallel_size > 1 and run.attention == "local":
        raise ArgumentError(
            f"--context-parallel-size {run.context_parallel_size} needs the fused core attention (its context-"
            f"parallel path gathers keys and values over the CP ranks); --attention-backend {run.attention_backend} "
            "runs megatron's local attention, which has none: drop --attention-backend or use auto / flash / fused")


class _Resolving:
    """The Namespace seen through what validation resolves for the settings: a read gives the resolved value when
    there is one, else the Namespace's; a write is recorded in `resolved` and leaves the Namespace as given."""

    def __init__(self, args):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "resolved", {})

    def __getattr__(self, name):
        return self.resolved[name] if name in self.resolved else getattr(self._args, name)

    def __setattr__(self, name, value):
        self.resolved[name] = value


def validate_args(args, world_size: int) -> run_settings.Settings:
    """Reject inconsistent combinations with messages that name the flags, and resolve the run's settings (stage
    defaults, derived values): returns the typed parts the stages pass around (`rl/settings.py`), also attached as
    `args.settings`, the one thing written onto the Namespace (its flags stay as given)."""
    check_ranges(args, build_parser())  # every numeric flag in its range (argument_ranges.RANGES), floats finite
    run = _Resolving(args)  # the settings' values: the stage defaults and what follows from several flags
    _check_world(run, world_size)
    _check_model_flags(args)
    _check_recompute(run)
    run.ignored_flags = compat_flags.ignored_flags(run)  # printed once at startup (compat_flags.startup_lines)
    run.startup_notes = []
    _check_attention_backend(run)
    _check_fused_ops(run)
    _check_sequence_and_context_parallel(run)
    for name, value in STAGE_DEFAULTS[args.stage].items():
        if getattr(args, name) is None:
            setattr(run, name, value)
    if args.clip_ratio_high is None:
        run.clip_ratio_high = args.clip_ratio
    _check_learning_rates(run)
    _resolve_lengths(run)
    _check_batches(run)
    if args.optimizer == "sgd" and args.use_distributed_optimizer:
        raise ArgumentError("--optimizer sgd does not work with --use-distributed-optimizer (megatron refuses it); "
                            "drop one of them")
    _check_token_budgets(run)
    if args.dynamic_sampling and (args.stage != "grpo" or run.n_samples_per_prompt < 2):
        raise ArgumentError("--dynamic-sampling keeps grpo groups whose rewards differ: it needs --stage grpo and "
                            "--n-samples-per-prompt >= 2")
    check_dynamic_sampling(run)
    check_partial_rollout(run)
    check_multi_turn(run)
    if run.custom_reward_function is not None or run.custom_reward_weight is not None:
        from mindspeed_llm.rl.reward_functions import check_flags  # loads the user's file: errors before any model

        run.custom_reward_weight = check_flags(run.custom_reward_function, run.custom_reward_weight,
                                               run.verifier_function)
    check_judge(run)
    check_distill(run)
    _check_roles(run)
    _check_checkpoint_flags(args)
    check_evaluation(run)
    check_profiling(run)
    check_rollout_records(run)
    _check_algorithm(run)
    _check_lora(run)
    check_wandb(run)
    if args.lr_warmup_fraction is not None:
        run.lr_warmup_iters = int(args.lr_warmup_fraction * args.train_iters)
    if args.lr_decay_iters is None:
        run.lr_decay_iters = args.train_iters
    run.ignored_flags = tuple(run.ignored_flags.items())  # frozen in the settings, in table order
    args.settings = run_settings.from_args(args, **run.resolved)
    check_rollout_pair(args.settings)
    return args.settings


def _check_world(run, world_size: int) -> None:
    """The process grid against the world size; Megatron-LM's derived values (`world_size`, `data_parallel_size`,
    the experts' layout, `params_dtype`) resolved for the settings."""
    tp, pp, cp = run.tensor_model_parallel_size, run.pipeline_model_parallel_size, run.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp}; launch a multiple of "
            f"{tp * pp * cp} processes"
        )
    run.world_size = world_size
    run.data_parallel_size = world_size // (tp * pp * cp)  # megatron's: the CP ranks are not in it
    _check_expert_parallel(run, world_size)
    if run.bf16 and run.fp16:
        raise ArgumentError("--bf16 and --fp16 are exclusive; pick one")
    run.params_dtype = "bf16" if run.bf16 else ("fp16" if run.fp16 else "fp32")


def _check_learning_rates(run) -> None:
    """--critic-lr (default --lr) and --min-lr below both."""
    if run.critic_lr is None:
        run.critic_lr = run.lr
    for flag, lr in (("--lr", run.lr), ("--critic-lr", run.critic_lr)):
        if run.min_lr > lr:  # Megatron-LM's scheduler asserts min_lr <= max_lr
            raise ArgumentError(f"--min-lr {run.min_lr:g} is above {flag} {lr:g}: the LR schedule decays from "
                                f"{flag} down to --min-lr; lower --min-lr")


def _resolve_lengths(run) -> None:
    """--max-length and --max-prompt-length, each from the other and --max-new-tokens when not given."""
    if run.max_length is None:
        run.max_length = 256 if run.max_prompt_length is None else run.max_prompt_length + run.max_new_tokens
    if run.max_new_tokens >= run.max_length:
        raise ArgumentError(
            f"--max-new-tokens {run.max_new_tokens} must be smaller than --max-length {run.max_length} "
            "(--max-length bounds prompt + response)"
        )
    if run.max_prompt_length is None:
        run.max_prompt_length = run.max_length - run.max_new_tokens
    if run.max_prompt_length + run.max_new_tokens > run.max_length:
        raise ArgumentError(
            f"--max-prompt-length {run.max_prompt_length} + --max-new-tokens {run.max_new_tokens} exceeds "
            f"--max-length {run.max_length}"
        )


def _check_batches(run) -> None:
    """Batch arithmetic: every DP rank gets whole micro-batches of whole prompt groups; --ppo-mini-batch-size
    defaults to the whole batch."""
    world_size, dp = run.world_size, run.data_parallel_size
    tp, pp, cp = run.tensor_model_parallel_size, run.pipeline_model_parallel_size, run.context_parallel_size
    n = run.n_samples_per_prompt
    sequences = run.global_batch_size * n
    if run.global_batch_size % dp:
        raise ArgumentError(
            f"--global-batch-size {run.global_batch_size} is not divisible by the data-parallel size {dp} "
            f"(world {world_size} / (TP {tp} x CP {cp} x PP {pp})); each DP rank needs whole prompts"
        )
    if run.global_batch_size % (dp * cp):
        raise ArgumentError(
            f"--global-batch-size {run.global_batch_size} is not divisible by data-parallel size {dp} x "
            f"--context-parallel-size {cp}: the CP ranks of a DP rank generate its prompts as data-parallel "
            "replicas, each whole prompts")
    per_rank = sequences // dp
    if per_rank % run.micro_batch_size:
        raise ArgumentError(
            f"--global-batch-size {run.global_batch_size} x --n-samples-per-prompt {n} = {sequences} sequences is "
            f"not divisible by data-parallel size {dp} x --micro-batch-size {run.micro_batch_size}"
        )
    if run.ppo_mini_batch_size is None:
        run.ppo_mini_batch_size = sequences
    mini = run.ppo_mini_batch_size
    if sequences % mini or mini % (dp * run.micro_batch_size):
        raise ArgumentError(
            f"--ppo-mini-batch-size {mini} must divide the {sequences} sequences of an iteration and be a multiple "
            f"of data-parallel size {dp} x --micro-batch-size {run.micro_batch_size}"
        )
    if mini % (n * dp):
        raise ArgumentError(
            f"--ppo-mini-batch-size {mini} must be a multiple of --n-samples-per-prompt {n} x data-parallel size {dp}: "
            "a prompt's samples stay in one mini-batch, and every DP rank holds whole prompts of each"
        )
    if run.offload_train_param and run.params_dtype == "fp32" and run.stage == "grpo":
        run.startup_notes.append("--offload-train-param offloads nothing here: an fp32 actor has no separate main "
                                 "weights, and its weights generate (with --bf16 it offloads the fp32 main weights)")


def _check_roles(run) -> None:
    """The checkpoints each stage's roles load and the reward's sources; --verifier-weight 1.0 each by default."""
    if run.stage == "trl_ppo":
        if not run.ref_model:
            raise ArgumentError("--ref-model is required for --stage trl_ppo (actor and reference weights)")
        if not run.reward_model:
            raise ArgumentError(
                "--reward-model is required for --stage trl_ppo (critic initialisation; convert it with --orm)"
            )
    else:
        if not run.ref_model and not run.load:
            raise ArgumentError("--stage grpo needs the initial actor: pass --ref-model (or --load to resume)")
        if not (run.verifier_function or run.reward_model or run.custom_reward_function or run.judge_load
                or run.teacher_load):  # with a teacher alone: pure distillation (every score 0)
            raise ArgumentError("--stage grpo needs a reward: --verifier-function NAME ..., --custom-reward-function "
                                "PATH:NAME, --reward-model DIR, --judge-load DIR and/or a teacher (--teacher-load "
                                "PATH)")
    if run.verifier_weight and len(run.verifier_weight) != len(run.verifier_function):
        raise ArgumentError(
            f"--verifier-weight has {len(run.verifier_weight)} values for {len(run.verifier_function)} "
            "--verifier-function names; give one weight per verifier"
        )
    if run.verifier_function and not run.verifier_weight:
        run.verifier_weight = [1.0] * len(run.verifier_function)


def _check_checkpoint_flags(args) -> None:
    if args.save_interval and not args.save:
        raise ArgumentError("--save-interval needs --save DIR")
    if args.ckpt_step is not None and (not args.load or args.ckpt_step < 1):
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} needs --load DIR and an iteration >= 1")
    if getattr(args, "allow_reference_change", False) and not args.load:
        raise ArgumentError("--allow-reference-change applies to a resume: it needs --load DIR")
    if args.save_hf and not args.save:
        raise ArgumentError("--save-hf writes a Hugging Face folder beside each checkpoint: it needs --save DIR")
    if args.save_hf_merge_lora and not (args.save_hf and (args.lora_target_modules or args.lora_load)):
        raise ArgumentError("--save-hf-merge-lora merges a LoRA actor's adapters into the --save-hf folder: it needs "
                            "--save-hf and a LoRA run (--lora-target-modules or --lora-load); drop it otherwise")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                            "other; pass one")


def _check_token_budgets(run) -> None:
    """--max-tokens-per-micro-batch / --forward-max-tokens-per-micro-batch hold at least the widest model row: a
    sample (prompt + response), or a packed prompt group (prompt + n responses)."""
    n, cp = run.n_samples_per_prompt, run.context_parallel_size
    packed = n > 1 and run.micro_batch_size % n == 0
    row = run.max_prompt_length + (n if packed else 1) * run.max_new_tokens
    widest = -(-row // cp)  # a budget counts the tokens one rank holds: 1 / CP of each row
    what = (f"a packed prompt group (--max-prompt-length {run.max_prompt_length} + --n-samples-per-prompt {n} x "
            f"--max-new-tokens {run.max_new_tokens}; --micro-batch-size {run.micro_batch_size} packs groups, a "
            f"size that is not a multiple of {n} lays out one row per sample)" if packed
            else f"one sample (--max-prompt-length {run.max_prompt_length} + --max-new-tokens "
                 f"{run.max_new_tokens})")
    if run.forward_max_tokens_per_micro_batch is not None and run.max_tokens_per_micro_batch is None:
        run.startup_notes.append("--forward-max-tokens-per-micro-batch: the forward-only passes cut micro-batches "
                                  "by tokens; the update's are --micro-batch-size samples each")
    for flag, budget in (("--max-tokens-per-micro-batch", run.max_tokens_per_micro_batch),
                         ("--forward-max-tokens-per-micro-batch", run.forward_max_tokens_per_micro_batch)):
        if budget is not None and budget < widest:
            share = f" (1/{cp} of {row} on each of --context-parallel-size {cp} ranks)" if cp > 1 else ""
            raise ArgumentError(f"{flag} {budget} is smaller than the widest model row, {widest} tokens{share} for "
                                f"{what}; give at least {widest}")


def _check_model_flags(args) -> None:
    """Model and precision flags, as far as they can be checked without the checkpoint (`rl/update/roles._checked_spec`
    compares the model flags with it)."""
    if args.normalization is not None and args.normalization != "RMSNorm":
        raise ArgumentError(f"--normalization {args.normalization}: the supported models (llama, qwen2, qwen3, "
                            "mistral) use RMSNorm; pass --normalization RMSNorm or drop the flag")
    if args.position_embedding_type is not None and args.position_embedding_type != "rope":
        raise ArgumentError(f"--position-embedding-type {args.position_embedding_type}: the supported models use "
                            "rotary embeddings; pass --position-embedding-type rope or drop the flag")
    if args.rope_scaling_type is not None and args.rope_scaling_type != "llama3":
        raise ArgumentError(f"--rope-scaling-type {args.rope_scaling_type}: megatron-core implements only llama3 "
                            "frequency scaling; pass --rope-scaling-type llama3 or drop the flag")
    for flag, fixed in LLAMA3_FIXED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value != fixed:
            raise ArgumentError(f"{flag} {value}: megatron-core's llama3 RoPE scaling is implemented for {flag} "
                                f"{fixed} only; a model trained with another value cannot be run here")


def _check_recompute(run) -> None:
    """Megatron-LM's recompute flags, resolved into `recompute_granularity` (None: off), `recompute_method`,
    `recompute_num_layers` (full) and `recompute_modules` (selective), refusing what megatron-core's
    TransformerConfig or Megatron-LM's validate_args refuse, and flags that would have no effect.
    `rl/update/recompute.model_options` checks the rest against each trained model's layers."""
    granularity = run.recompute_granularity
    if run.recompute_activations:
        if granularity == "full":
            raise ArgumentError("--recompute-activations is Megatron-LM's --recompute-granularity selective, which "
                                "contradicts --recompute-granularity full; pass one of them")
        granularity = "selective"
    modules = list(dict.fromkeys(run.recompute_modules)) if run.recompute_modules is not None else None
    if run.moe_layer_recompute:
        if granularity == "full":
            raise ArgumentError("--moe-layer-recompute is selective recompute of the MoE layers; megatron-core refuses "
                                "it with --recompute-granularity full (which recomputes whole layers): drop one")
        granularity = "selective"
        modules = (modules or ["core_attn"]) + ([] if "moe" in (modules or []) else ["moe"])  # megatron-core's rule
    method, layers = run.recompute_method, run.recompute_num_layers
    if granularity is None:
        given = [flag for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers),
                                          ("--recompute-modules", modules),
                                          ("--distribute-saved-activations", run.distribute_saved_activations))
                 if value not in (None, False)]
        if given:
            raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                "--recompute-granularity full or selective; add one or drop them")
    elif granularity == "full":
        if method is None or layers is None:
            raise ArgumentError(
                "--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
                "(megatron-core refuses full recompute without them): uniform checkpoints each pipeline stage's "
                "layers in groups of N, block the first N layers of each stage; e.g. --recompute-method uniform "
                "--recompute-num-layers 1")
        if layers < 1:
            raise ArgumentError(f"--recompute-num-layers {layers} must be >= 1")
        if modules is not None:
            raise ArgumentError("--recompute-modules chooses selective recompute's submodules; "
                                "--recompute-granularity full recomputes whole layers: drop one of them")
        if run.distribute_saved_activations and run.tensor_model_parallel_size < 2:
            raise ArgumentError("--distribute-saved-activations splits the checkpointed activations over the tensor-"
                                "parallel ranks: it needs --tensor-model-parallel-size > 1 (Megatron-LM's rule)")
    else:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            if value is not None:
                raise ArgumentError(f"{flag} applies to --recompute-granularity full; selective recompute (of the "
                                    "--recompute-modules of every layer) takes neither: drop it")
        if run.distribute_saved_activations:
            raise ArgumentError("--distribute-saved-activations applies to --recompute-granularity full only "
                                "(Megatron-LM's rule)")
        modules = modules or ["core_attn"]  # megatron-core's default
        for name in modules:
            if name in REFUSED_RECOMPUTE_MODULES:
                raise ArgumentError(f"--recompute-modules {name} {REFUSED_RECOMPUTE_MODULES[name]}")
            if name not in RECOMPUTE_MODULES:
                raise ArgumentError(f"--recompute-modules {name}: unknown; choose from {', '.join(RECOMPUTE_MODULES)}")
    run.recompute_granularity = granularity
    run.recompute_modules = modules if granularity == "selective" else None


def _check_lora(run) -> None:
    """`lora`: whether the run trains LoRA adapters (--lora-target-modules or --lora-load); the LoRA numbers
    checked. r / alpha / dropout stay None when not given: with --lora-load the adapter's own apply and a flag that
    disagrees with it is an error (`rl/update/lora.lora_config`)."""
    from mindspeed_llm.models.lora import check_targets

    run.lora = bool(run.lora_target_modules or run.lora_load)
    if run.lora_modules_to_save:
        raise ArgumentError(f"--lora-modules-to-save {' '.join(run.lora_modules_to_save)}: training whole modules "
                            "beside the adapters is not supported here (the critic's value head trains fully on its "
                            "own); drop the flag")
    given = [flag for flag, value in (("--lora-r", run.lora_r), ("--lora-alpha", run.lora_alpha),
                                      ("--lora-dropout", run.lora_dropout)) if value is not None]
    if run.allow_base_mismatch and not run.lora_load:
        raise ArgumentError("--allow-base-mismatch applies to the adapter of --lora-load: add it or drop the flag")
    if not run.lora:
        if given:
            raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                "--lora-target-modules (LoRA is on when target modules, or --lora-load, are given)")
        return
    if run.lora_target_modules:
        try:
            check_targets(run.lora_target_modules)
        except ValueError as exc:
            raise ArgumentError(f"--lora-target-modules {exc}") from None
        run.lora_target_modules = list(dict.fromkeys(run.lora_target_modules))
    # --sequence-parallel: the adapters gather and reduce-scatter the sequence as their linears do (models/lora.py).
    # Under context parallelism each rank holds a part of every sequence and the adapters act per token, which
    # should need nothing, but no run has compared them (attention, the loss and the gradients over CP); refused.
    if getattr(run, "context_parallel_size", 1) > 1:
        raise ArgumentError(f"LoRA (--lora-target-modules / --lora-load) with --context-parallel-size "
                            f"{run.context_parallel_size} is not supported (not checked yet); use "
                            "--context-parallel-size 1")
    if run.lora_r is not None and run.lora_r < 1:
        raise ArgumentError(f"--lora-r {run.lora_r} must be >= 1")
    if run.lora_alpha is not None and not (math.isfinite(run.lora_alpha) and run.lora_alpha > 0):
        raise ArgumentError(f"--lora-alpha {run.lora_alpha} must be a finite number > 0")
    if run.lora_dropout is not None and not 0.0 <= run.lora_dropout < 1.0:
        raise ArgumentError(f"--lora-dropout {run.lora_dropout} must be in [0, 1)")
    if run.offload_ref_reward:
        shared = "the reference and the reward model are" if run.stage == "trl_ppo" else "the reference is"
        own = (["grpo's --reward-model"] if run.stage == "grpo" and run.reward_model else []) + (
            ["the teacher (--teacher-load)"] if run.teacher_load else [])  # models of their own
        rest = (f"only {' and '.join(own)} {'is' if len(own) == 1 else 'are'} offloaded" if own
                else "nothing is offloaded")
        run.startup_notes.append(f"--offload-ref-reward: with LoRA {shared} the trained models' bases with their "
                                  f"adapters off, not models of their own: {rest}")


def _check_algorithm(run) -> None:
    """--adv-estimator / --policy-loss against the registries of `rl/core_algos` (a registered method is a valid
    name), which stage takes which estimator, and the overlong and rollout-correction flags."""
    from mindspeed_llm.rl import core_algos

    if run.adv_estimator is None:
        run.adv_estimator = "gae" if run.stage == "trl_ppo" else "grpo"
    estimator = core_algos.ADV_ESTIMATORS.get(run.adv_estimator)
    fits = [name for name, e in core_algos.ADV_ESTIMATORS.items() if (e.kind == "critic") == (run.stage == "trl_ppo")]
    if estimator is None:
        raise ArgumentError(f"--adv-estimator {run.adv_estimator}: unknown; valid names for --stage {run.stage}: "
                            f"{', '.join(fits)}")
    if run.stage == "trl_ppo" and estimator.kind != "critic":
        raise ArgumentError(f"--adv-estimator {run.adv_estimator} is critic-free: --stage trl_ppo trains a critic "
                            f"and estimates with {', '.join(fits)}; use --stage grpo for {run.adv_estimator}")
    if run.stage != "trl_ppo" and estimator.kind == "critic":
        raise ArgumentError(f"--adv-estimator {run.adv_estimator} needs a critic: --stage trl_ppo only (grpo "
                            f"takes {', '.join(fits)})")
    # with a teacher the distillation term trains a group of one (its group advantage is 0)
    if estimator.kind == "outcome" and run.n_samples_per_prompt < 2 and not run.teacher_load:
        raise ArgumentError(f"--adv-estimator {run.adv_estimator} compares the samples of a prompt with each other: "
                            f"with --n-samples-per-prompt {run.n_samples_per_prompt} every advantage is 0 and "
                            "nothing trains; give --n-samples-per-prompt 2 or more")
    if run.adv_scale is not None and estimator.kind != "outcome":
        raise ArgumentError(f"--adv-scale {run.adv_scale} applies to the group estimators (grpo, dr_grpo, rloo), "
                            f"not to --adv-estimator {run.adv_estimator}; drop it")
    if run.policy_loss not in core_algos.POLICY_LOSSES:
        raise ArgumentError(f"--policy-loss {run.policy_loss}: unknown; valid names: "
                            f"{', '.join(core_algos.POLICY_LOSSES)}")
    if run.loss_agg_mode is None:
        # GSPO (Zheng et al. 2025) averages its sequence-level losses over sequences, as verl runs it
        run.loss_agg_mode = "seq-mean-token-mean" if run.policy_loss == "gspo" else "token-mean"
        if run.policy_loss == "gspo":
            run.startup_notes.append("--policy-loss gspo: losses averaged per sequence (--loss-agg-mode "
                                      "seq-mean-token-mean, the aggregation GSPO is defined with); pass "
                                      "--loss-agg-mode to choose another")
    if run.policy_loss == "gspo" and run.dual_clip is not None:
        raise ArgumentError("--dual-clip applies to --policy-loss vanilla; gspo has no dual clip")
    if run.overlong_buffer_len is not None and not 1 <= run.overlong_buffer_len <= run.max_new_tokens:
        raise ArgumentError(f"--overlong-buffer-len {run.overlong_buffer_len} must be in [1, --max-new-tokens "
                            f"{run.max_new_tokens}]")
    if run.rollout_is != "none":
        run.recompute_old_logprobs = True  # the weights compare the sampler with the training forward
