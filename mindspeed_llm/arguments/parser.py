"""The parser: Megatron-LM's flag names for what we support, plus the RL flags of the stages, one
`_add_<group>_args(parser)` function per argument group (Megatron-LM's shape). Checking and resolving them is
`validation.py`'s."""

from __future__ import annotations

import argparse
from typing import List

from mindspeed_llm import compat_flags

# megatron-core 0.16.1's selective recompute modules that run on the local layer spec (TransformerConfig's
# recompute_modules); the other two are refused by name (`_check_recompute`)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "mla_up_proj")
REFUSED_RECOMPUTE_MODULES = {
    "moe_act": "recomputes the grouped-GEMM experts' activation (megatron-core needs --moe-grouped-gemm's GroupedMLP), "
               "but the experts run as SequentialMLP here: use moe (the whole MoE layer) instead",
    # CheckpointWithoutOutput() sets fp8 = (False is not None) and then reads Transformer Engine's FP8 state
    "layernorm": "fails without Transformer Engine in megatron-core 0.16.1 (its CheckpointWithoutOutput reads TE's "
                 "FP8 state even when fp8 is off: NameError), and the local spec runs without TE; the norms' "
                 "outputs are small next to core_attn's",
}
# Megatron-LM's --attention-backend choices; local / unfused mean megatron's local attention here, the others the
# fused one (mindspeed_llm/models/attention.py).
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
LOCAL_ATTENTION_BACKENDS = ("unfused", "local")
# llama3 RoPE scaling: the values megatron-core hard-codes (its only implementation).
LLAMA3_FIXED = {"--low-freq-factor": 1.0, "--high-freq-factor": 4.0, "--original-max-position-embeddings": 8192}


def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    # The --stage choices are the stage registry's; it imports its stages (and megatron-core) only when one is built.
    from mindspeed_llm.rl.stages import STAGES

    p = argparse.ArgumentParser(
        prog="posttrain_gpt.py",
        description="In-process RL post-training (trl_ppo, grpo) for Megatron core models.",
        allow_abbrev=False,
    )
    p.add_argument("--stage", choices=tuple(STAGES), required=True)
    _add_model_args(p)
    _add_parallel_args(p)
    _add_moe_args(p)
    _add_training_args(p)
    _add_recompute_args(p)
    _add_lora_args(p)
    _add_checkpointing_args(p)
    _add_data_args(p)
    _add_logging_args(p)
    _add_wandb_args(p)
    _add_profiling_args(p)
    _add_rl_models_args(p)
    _add_judge_args(p)
    _add_distill_args(p)
    _add_rollout_args(p)
    _add_multi_turn_args(p)
    _add_algorithm_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Model shape flags (the checkpoint decides; given ones must match it) and the core attention."""
    g = p.add_argument_group("model (read from the checkpoint; when given, they must match it)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--padded-vocab-size", type=int, dest="vocab_size")
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--rotary-base", type=float)
    g.add_argument("--norm-epsilon", type=float)
    g.add_argument("--rope-scaling-type", help="llama3 (the only frequency scaling megatron-core implements)")
    g.add_argument("--rope-scaling-factor", type=float)
    for flag, kind in (("--low-freq-factor", float), ("--high-freq-factor", float),
                       ("--original-max-position-embeddings", int)):
        g.add_argument(flag, type=kind, help=f"llama3 scaling: must be {LLAMA3_FIXED[flag]} (megatron-core's)")
    g.add_argument("--num-experts", type=int)
    g.add_argument("--moe-router-topk", type=int)
    g.add_argument("--moe-ffn-hidden-size", "--moe-intermediate-size", type=int, dest="moe_ffn_hidden_size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int)
    g.add_argument("--normalization", help="RMSNorm (the only one the supported models use)")
    g.add_argument("--position-embedding-type", help="rope (the only one the supported models use)")
    for flag in ("--disable-bias-linear", "--untie-embeddings-and-output-weights", "--add-qkv-bias", "--qk-layernorm"):
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout of the trained models' attention probabilities in their training forward "
                        "(default 0, not Megatron-LM's 0.1; rollouts and frozen models never drop out)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout after the trained models' attention and MLP blocks in their training forward "
                        "(default 0, not Megatron-LM's 0.1)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="core attention of every model: auto / flash / fused (default auto) run the device's fused "
                        "attention kernel (torch's scaled_dot_product_attention on CPU / CUDA, npu_fusion_attention "
                        "on NPU; memory linear in the sequence length); local / unfused run megatron's local "
                        "DotProductAttention (the reference; memory grows with the square of the sequence length)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="the fused attention kernel (the default here); refused with --attention-backend local / "
                        "unfused")
    # MindSpeed-LLM's fused-op switches (device.FUSED_OPS; validation._check_fused_ops -> settings.model.fused_ops)
    g.add_argument("--use-fused-rmsnorm", action="store_true",
                   help="every RMSNorm on the device's fused norm (npu_rms_norm on NPU, torch's rms_norm on CUDA, a "
                        "backward that saves the input and rstd only on CPU): fewer saved activations")
    g.add_argument("--use-fused-swiglu", action="store_true",
                   help="the MLPs' SwiGLU on the device's fused op (npu_swiglu on NPU; elsewhere a backward that "
                        "saves the input only)")
    g.add_argument("--use-fused-rotary-pos-emb", action="store_true",
                   help="rotary embedding on the device's fused op (npu_rotary_position_embedding on NPU; elsewhere "
                        "a backward that saves cos / sin instead of the query / key); not multi-latent attention")
    compat_flags.add_ignored_arguments(g)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """The process grid: tensor, pipeline, context and expert parallelism."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="mixture of experts: ranks the experts of each MoE layer are split over")
    g.add_argument("--expert-tensor-parallel-size", type=int,
                   help="mixture of experts: tensor parallelism inside each expert (default: "
                        "--tensor-model-parallel-size; 1 or that size)")
    g.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="MindSpeed: the TP ranks also split the experts (expert parallel = EP x TP, experts not "
                        "tensor-split)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo", "hccl"),
                   help="accepted for compatibility: the device decides (hccl on NPU, nccl on CUDA, gloo on CPU)")


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    """Mixture-of-experts routing and dispatch."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="accepted: the experts run as megatron's SequentialMLP (the same math; the grouped kernel "
                        "path is not wired in this build, see models/builder.grouped_gemm_kernel)")
    g.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
                   default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float,
                   help="load-balancing loss coefficient (default: the checkpoint's, i.e. HF router_aux_loss_coef)")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"),
                   help="default: alltoall with expert parallelism, else allgather (Megatron-LM's default); "
                        "allgather needs equal token counts on the expert-parallel ranks, which RL batches lack")
    g.add_argument("--moe-routing-replay", action="store_true",
                   help="route response tokens in the training forwards by the experts the rollout chose")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """Batches, the optimizer and its LR schedule, precision, the NaN and divergence checks."""
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="samples per micro-batch (a multiple of --n-samples-per-prompt packs prompt groups); with "
                        "--max-tokens-per-micro-batch it only picks that layout")
    g.add_argument("--max-tokens-per-micro-batch", type=int,
                   help="token budget of each update micro-batch (verl's dynamic batch size): samples (or prompt "
                        "groups) sorted by length share micro-batches of at most this many padded tokens")
    g.add_argument("--forward-max-tokens-per-micro-batch", type=int,
                   help="the same for the forward-only passes (old / reference log-probs, values, reward; no "
                        "activations kept, so usually larger; default: --max-tokens-per-micro-batch)")
    g.add_argument("--global-batch-size", type=int, required=True,
                   help="prompts per iteration (grpo: each is sampled --n-samples-per-prompt times)")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="with --optimizer sgd (Megatron-LM's default)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-shuffle", action="store_true",
                   help="prompts in dataset order (of --split's train part), epoch after epoch, instead of a fresh "
                        "--seed permutation each epoch (MindSpeed-LLM's flag; MindSpeed-RL's no_shuffle)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="--fp16: a constant loss scale instead of the dynamic one")
    g.add_argument("--initial-loss-scale", type=float, help="--fp16: the dynamic loss scale's start (2^32)")
    g.add_argument("--min-loss-scale", type=float, help="--fp16: the dynamic loss scale's floor (1)")
    g.add_argument("--loss-scale-window", type=float, help="--fp16: steps without overflow before it grows (1000)")
    g.add_argument("--hysteresis", type=int, help="--fp16: overflows tolerated before it shrinks (2)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop (before the optimizer step) when a loss or gradient is NaN or inf (default: on)")
    g.add_argument("--check-for-divergence", action=argparse.BooleanOptionalAction, default=True,
                   help="stop, before the iteration is saved, when an optimizer step moves the weights by more than "
                        "half their norm or the policy's entropy rises to the uniform maximum (default: on)")


def _add_recompute_args(p: argparse.ArgumentParser) -> None:
    """Activation recompute (Megatron-LM's flags)."""
    g = p.add_argument_group("activation recompute (Megatron-LM's flags; the trained models' update forwards only)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"),
                   help="full: whole transformer layers are recomputed in the backward (needs --recompute-method and "
                        "--recompute-num-layers); selective: the --recompute-modules of every layer (default "
                        "core_attn). The actor's and critic's update forwards only: generation, the log-prob, value "
                        "and reward passes and the frozen models run without it")
    g.add_argument("--recompute-method", choices=("uniform", "block"),
                   help="full recompute: uniform checkpoints each pipeline stage's layers in groups of "
                        "--recompute-num-layers; block checkpoints the first --recompute-num-layers layers of each "
                        "stage and keeps the others' activations")
    g.add_argument("--recompute-num-layers", type=int,
                   help="full recompute: layers per group (uniform) or checkpointed layers (block), counted per "
                        "pipeline stage (megatron's num_layers / --pipeline-model-parallel-size layers of a stage)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-modules", nargs="+", metavar="MODULE",
                   help="selective recompute: the submodules recomputed in every layer, of "
                        f"{', '.join(RECOMPUTE_MODULES)} (default core_attn; megatron's moe_act and layernorm do not "
                        "run on the local spec and are refused)")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="full recompute with TP > 1: each TP rank keeps 1/TP of every checkpointed layer input")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="megatron-core's (deprecated) switch: selective recompute with the moe module added "
                        "(core_attn and moe unless --recompute-modules names others)")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (MindSpeed-LLM's flags)."""
    g = p.add_argument_group("LoRA (MindSpeed-LLM's flags; on when --lora-target-modules or --lora-load is given)")
    g.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                   help="megatron-core linears that get adapters, in the actor and the critic: linear_qkv, "
                        "linear_proj, linear_fc1, linear_fc2 (dense, shared-expert and expert MLPs), MLA's "
                        "linear_q_proj, linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj. "
                        "The base is frozen; only the adapters train (and the critic's value head)")
    g.add_argument("--lora-r", type=int, help="adapter rank (default 16)")
    g.add_argument("--lora-alpha", type=float, help="adapter scaling alpha / r (default 32)")
    g.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input in the training forward (0)")
    g.add_argument("--lora-load", metavar="DIR",
                   help="the actor's adapter to continue from: a PEFT folder (adapter_config.json) or an adapter "
                        "checkpoint of a LoRA run (<save>/actor); its r, alpha and targets apply")
    g.add_argument("--allow-base-mismatch", action="store_true",
                   help="start from --lora-load even though the actor's model is not the base the adapter was "
                        "trained on (its recorded base fingerprint, or a PEFT folder's base_model_name_or_path); "
                        "without it such an adapter is refused by name")
    g.add_argument("--lora-modules-to-save", nargs="+", help=argparse.SUPPRESS)  # refused by name (validate_args)


def _add_checkpointing_args(p: argparse.ArgumentParser) -> None:
    """Save, load and resume."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--finetune", action="store_true",
                   help="load weights only from --load: iteration, optimizer, RNG and data position start fresh")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save weights, RNG and data position only (Megatron-LM's): no optimizer state or LR schedule; "
                        "resume such a checkpoint with --no-load-optim")
    g.add_argument("--save-hf", action="store_true",
                   help="at every save also write the actor as a Hugging Face folder, <save>/actor/iter_N/hf/ "
                        "(config, tokenizer, safetensors; a LoRA actor: a PEFT adapter folder), published with the "
                        "checkpoint")
    g.add_argument("--save-hf-merge-lora", action="store_true",
                   help="with --save-hf and a LoRA actor: its adapters merged into full weights instead of a PEFT "
                        "adapter folder")
    g.add_argument("--ckpt-step", type=int, help="resume from this iteration of --load instead of its latest")
    g.add_argument("--allow-reference-change", action="store_true",
                   help="resume with another --ref-model or --reward-model than the checkpoint was trained with "
                        "(the KL term or the scores change from the resumed iteration on); without it such a resume "
                        "is refused")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, take the LR schedule (lr, min-lr, warmup, decay) from the command line")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, keep the checkpoint's LR schedule whatever the command line says")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save a checkpoint (with --save) and exit cleanly")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Prompts, held-out prompts, the tokenizer."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", required=True, help="output prefix written by preprocess_data.py")
    g.add_argument("--eval-data-path", nargs="+", metavar="[NAME=]PREFIX",
                   help="held-out prompts (preprocessed prefixes) for --eval-interval: one PREFIX, or several named "
                        "sets NAME=PREFIX, each reported as eval/NAME/...")
    g.add_argument("--split", help="train,valid,test weights of --data-path, e.g. 98,2,0 (Megatron-LM's): "
                                   "--eval-interval evaluates on the valid part (default: all prompts train)")
    g.add_argument("--tokenizer-type", default="PretrainedFromHF")
    g.add_argument("--tokenizer-name-or-path")
    g.add_argument("--tokenizer-not-use-fast", action="store_true", help="load the slow (Python) tokenizer")
    g.add_argument("--max-prompt-length", type=int)


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """Logging and evaluation intervals."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-jsonl", help="write one JSON object of metrics per iteration")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int,
                   help="held-out prompts per evaluation = this x --global-batch-size (Megatron-LM's); 0 = off")
    g.add_argument("--eval-samples", type=int, default=0,
                   help="held-out prompts per evaluation (0 = all, or --eval-iters x --global-batch-size)")
    g.add_argument("--eval-n-samples", type=int, default=1,
                   help="responses per held-out prompt: mean@N, best@N, pass@k, maj@N (1: greedy, eval/score/mean)")
    g.add_argument("--eval-temperature", type=float,
                   help="the held-out samples' temperature (default 1.0 with --eval-n-samples > 1; given with 1 "
                        "sample, that sample is drawn instead of greedy)")
    g.add_argument("--eval-top-p", type=float, default=1.0, help="the held-out samples' nucleus (1.0: none)")
    g.add_argument("--eval-pass-threshold", type=float, default=1.0,
                   help="a held-out sample is correct (pass@k, maj@N) when its score is >= this")
    g.add_argument("--eval-before-train", action="store_true",
                   help="evaluate at iteration 0, before the first update (the baseline)")
    g.add_argument("--log-samples", type=int, default=0, metavar="N",
                   help="write N rollout samples (prompt, response, scores, label, length, finish reason, turns) to "
                        "samples.jsonl beside --metrics-jsonl and as a TensorBoard text table every "
                        "--log-samples-interval, and N held-out samples of each evaluation to eval_samples.jsonl "
                        "(0: off)")
    g.add_argument("--log-samples-interval", type=int,
                   help="iterations between sample tables (default: --log-interval)")
    g.add_argument("--rollout-dump-dir", metavar="DIR",
                   help="write each iteration's scored rollout (token ids, masks, rollout log-probs, scores, sample "
                        "data) under DIR (docs/monitoring.md, \"Rollout dump and replay\")")
    g.add_argument("--rollout-replay-dir", metavar="DIR",
                   help="train on the rollouts a --rollout-dump-dir run wrote to DIR instead of generating and "
                        "scoring them: the same updates, bit for bit")


def _add_wandb_args(p: argparse.ArgumentParser) -> None:
    """Weights & Biases (Megatron-LM's flags): rank 0 logs every metric of the other writers, step = iteration."""
    g = p.add_argument_group("Weights & Biases (on with --wandb-project; needs `pip install wandb`)")
    g.add_argument("--wandb-project", help="log the run's metrics to this wandb project (offline when "
                                           "WANDB_MODE=offline or no API key is configured: `wandb sync` uploads "
                                           "it later)")
    g.add_argument("--wandb-exp-name", help="the wandb run's name (default: wandb's)")
    g.add_argument("--wandb-save-dir", help="where wandb writes its files (default: --save/wandb, else ./wandb)")
    g.add_argument("--wandb-entity", help="the wandb team or user (default: the API key's)")


def _add_profiling_args(p: argparse.ArgumentParser) -> None:
    """Profiling and the timing / throughput lines (Megatron-LM's flags; rl/profiling.py, docs/monitoring.md)."""
    g = p.add_argument_group("profiling (Megatron-LM's flags; docs/monitoring.md)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start + 1 .. --profile-step-end as logged (Megatron-LM's "
                        "window; 0 1: the first iteration) on --profile-ranks: with "
                        "--use-pytorch-profiler torch.profiler traces (TensorBoard / Perfetto), else nsys's capture "
                        "range (cudaProfilerStart / Stop; CUDA only; on NPU torch_npu.profiler)")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="iterations done before the window opens (10: iteration 11 is the first profiled)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="iterations done when it closes (12: the last profiled)")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="global ranks profiled (0)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler, traces written to <--tensorboard-dir, else --save>/profile")
    g.add_argument("--pytorch-profiler-collect-shapes", "--profile-record-shapes", action="store_true",
                   help="the trace records each op's input shapes (Megatron-LM's flag; MindSpeed's "
                        "--profile-record-shapes); off: a smaller trace")
    g.add_argument("--pytorch-profiler-collect-callstack", "--profile-with-stack", action="store_true",
                   help="the trace records each op's Python call stack (Megatron-LM's flag; MindSpeed's "
                        "--profile-with-stack); off: a much smaller trace")
    g.add_argument("--profile-with-memory", action="store_true",
                   help="the trace records each op's tensor allocations (MindSpeed's flag)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="CUDA: record the allocator's history on the last rank and dump it to "
                        "--memory-snapshot-path every --log-interval (torch.cuda.memory._dump_snapshot)")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history dumps the snapshot (snapshot.pickle)")
    g.add_argument("--log-throughput", action="store_true",
                   help="accepted: the throughputs (e2e_tps, update_tps, vllm_tps / rollout_tps) are always logged")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2),
                   help="0: the stdout line shows timing/all alone; 1, 2 (or not given): every phase timing/*. The "
                        "JSONL and TensorBoard always get every phase")
    g.add_argument("--timing-log-option", choices=("flatten", "max", "minmax", "all"),
                   help="accepted: timing/* are the mean over the data-parallel ranks here")


def _add_rl_models_args(p: argparse.ArgumentParser) -> None:
    """The RL roles' checkpoints, the reward mixing and what waits in host memory."""
    g = p.add_argument_group("RL: models and rewards")
    g.add_argument("--ref-model", help="Megatron checkpoint of the initial actor / reference policy")
    g.add_argument("--reward-model", help="value-head Megatron checkpoint (convert_ckpt.py --orm)")
    g.add_argument("--verifier-function", nargs="+", default=[], help="rule verifiers, e.g. math_acc format")
    g.add_argument("--verifier-weight", nargs="+", type=float, default=[])
    g.add_argument("--custom-reward-function", metavar="PATH[:NAME]",
                   help="a reward function of your own: function NAME (default compute_score) of the Python file "
                        "PATH, verl's compute_score(data_source, solution_str, ground_truth, extra_info) or "
                        "fn(text, label, *, row, trajectory); scored as the verifier 'custom'")
    g.add_argument("--custom-reward-weight", type=float,
                   help="the weight of --custom-reward-function's score in the reward (default 1.0)")
    g.add_argument("--reward-model-weight", type=float, default=1.0)
    g.add_argument("--missing-eos-penalty", type=float)
    g.add_argument("--offload-ref-reward", action="store_true",
                   help="keep reference and reward models in host memory between uses")
    g.add_argument("--offload-train-optimizer", action="store_true",
                   help="keep the actor's and critic's optimizer moments (Adam's exp_avg / exp_avg_sq) in host memory "
                        "from one update to the next (MindSpeed-RL's offload_train_optimizer)")
    g.add_argument("--offload-train-grad", action="store_true",
                   help="free the actor's and critic's grad buffers from one update to the next")
    g.add_argument("--offload-train-param", action="store_true",
                   help="keep the fp32 main weights of bf16 / fp16 models in host memory from one update to the next, "
                        "and the critic's weights during the rollout (the actor's weights generate: they stay)")


def _add_judge_args(p: argparse.ArgumentParser) -> None:
    """An LLM judge's reward (`rl/judge.py`; checked by `arguments/judge.py`)."""
    g = p.add_argument_group("RL: LLM-as-judge rewards (on with --judge-load; docs/algorithms.md)")
    g.add_argument("--judge-load", metavar="PATH",
                   help="a frozen judge: a Megatron checkpoint of any supported family and size (its architecture "
                        "is read from the checkpoint) that writes a verdict on every sample, greedily")
    g.add_argument("--judge-tokenizer-name-or-path", metavar="PATH",
                   help="the judge's tokenizer, a local folder (default: the run's tokenizer)")
    g.add_argument("--judge-template", metavar="FILE",
                   help="the judge's prompt, a text file with the placeholders {prompt} and {response} (and "
                        "optionally {label}); a literal brace is written {{ or }}")
    g.add_argument("--judge-parser", metavar="PATH[:NAME]",
                   help="a function verdict_text -> float or None of your own (NAME defaults to parse_verdict); "
                        "default: the number after the verdict's last 'Score:'")
    g.add_argument("--judge-weight", type=float, default=1.0,
                   help="the weight of the judge's score in the reward (default 1.0)")
    g.add_argument("--judge-max-new-tokens", type=int, default=256,
                   help="the longest verdict, in the judge's tokens (default 256)")
    g.add_argument("--judge-unparsed-score", type=float, default=0.0,
                   help="the judge's score of a verdict its parser reads no number from (default 0.0; counted as "
                        "judge/unparsed)")


def _add_distill_args(p: argparse.ArgumentParser) -> None:
    """On-policy distillation: a frozen teacher scores the student's sampled tokens (`rl/distillation.py`,
    docs/algorithms.md). The defaults are resolved by `arguments/distill.py`, which refuses these flags without
    --teacher-load."""
    from mindspeed_llm.rl.core_algos.distill import DISTILL_LOSSES, DISTILL_MODES

    g = p.add_argument_group("RL: on-policy distillation (on with --teacher-load)")
    g.add_argument("--teacher-load", metavar="PATH",
                   help="Megatron checkpoint of the teacher, a frozen model of the same vocabulary (its architecture "
                        "is read from the checkpoint: another size needs no model flags), at the run's TP / PP, "
                        "offloaded with --offload-ref-reward")
    g.add_argument("--distill-loss", choices=tuple(DISTILL_LOSSES),
                   help="k1 / k3: reverse KL on the sampled tokens; topk_forward_kl: forward KL over the teacher's "
                        "top --distill-topk tokens (default k1)")
    g.add_argument("--distill-mode", choices=DISTILL_MODES,
                   help="reward: -coef x KL per token added to the advantages (grpo) or token rewards (trl_ppo); "
                        "loss: coef x the distillation loss added to the policy loss (grpo; k3 or topk_forward_kl) "
                        "(default reward)")
    g.add_argument("--distill-topk", type=int, help="--distill-loss topk_forward_kl: the teacher's k tokens per "
                                                    "position (default 32; the vocabulary size: the exact forward KL)")
    g.add_argument("--distill-coef", type=float, help="the distillation term's weight (default 1.0)")


def _add_rollout_args(p: argparse.ArgumentParser) -> None:
    """Generation: lengths, sampling, the engine's limits, the old log-probs' source."""
    g = p.add_argument_group("RL: rollout")
    g.add_argument("--max-length", type=int, help="prompt + response tokens (default: --max-prompt-length + "
                                                   "--max-new-tokens when --max-prompt-length is given, else 256)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop-token-ids", type=_int_list, default=[])
    g.add_argument("--rollout-max-num-seqs", type=int,
                   help="samples in flight at once in generation (vLLM's / MindSpeed-RL's max_num_seqs): a finished "
                        "sample's slot takes the next one, and the KV cache holds this many rows (default: the "
                        "whole local batch)")
    g.add_argument("--rollout-max-num-batched-tokens", type=int,
                   help="tokens of one generation forward (vLLM's max_num_batched_tokens): a decode step's rows, a "
                        "prefill's rows x padded width (longer prompts are prefilled in chunks; default: no limit)")
    g.add_argument("--n-samples-per-prompt", type=int)
    g.add_argument("--recompute-old-logprobs", action="store_true",
                   help="take the old log-probs from a training forward pass, not from the rollout's sampler (trl_ppo's "
                        "default when one step covers the batch) nor from the update's own forward (grpo's); logs the "
                        "rollout mismatch (rollout_mismatch/*)")
    g.add_argument("--rollout-is", choices=("none", "tis", "mis"), default="none",
                   help="per-token correction of the sampler/training mismatch, w = exp(old_logp - rollout_logp): tis "
                        "weights the policy loss by min(w, C); mis by w where w <= C, and tokens with w > C leave it "
                        "(token level). Implies --recompute-old-logprobs")
    g.add_argument("--rollout-is-threshold", type=float, default=2.0, help="C of --rollout-is (default 2.0)")


def _add_multi_turn_args(p: argparse.ArgumentParser) -> None:
    """Multi-turn tool use (verl's `multi_turn.*`, MindSpeed-RL's `rl_config` keys of the same names)."""
    g = p.add_argument_group("RL: multi-turn tool use (on with --tool-config; rl/rollouts/tool_turns.py)")
    g.add_argument("--tool-config", help="a tool config YAML in verl's / MindSpeed-RL's schema (`tools:` of "
                                         "class_name, config, tool_schema): the rollouts call these tools between "
                                         "turns")
    g.add_argument("--multi-turn", action="store_true",
                   help="MindSpeed-RL's multi_turn_enable: needs --tool-config (which alone turns it on)")
    g.add_argument("--tool-parser-format", default=None,
                   help="how tool calls are read from the model's turn (default hermes; only with --tool-config)")
    g.add_argument("--max-assistant-turns", type=int, help="model turns per trajectory (default: the budgets only)")
    g.add_argument("--max-tool-calls", type=int, help="tool calls per trajectory (default: no limit)")
    g.add_argument("--max-parallel-calls", type=int, default=1, help="tool calls run from one turn (default 1)")
    g.add_argument("--max-tool-response-length", type=int, default=256,
                   help="tokens of one tool's answer; longer ones are cut (default 256)")
    g.add_argument("--tool-response-truncate-side", choices=("left", "right", "middle"), default="middle",
                   help="which part of a long tool answer is kept (verl's): left its start, right its end, middle "
                        "both ends (default middle)")
    g.add_argument("--max-total-response-length", type=int,
                   help="model + tool tokens of a trajectory (default: --max-length - --max-prompt-length); "
                        "--max-new-tokens is then one model turn's limit")
    g.add_argument("--tool-rewards", choices=("add", "record"),
                   help="what becomes of the rewards a tool returns with its answers: add them to the score (default) "
                        "or only record them (verl's behaviour: metrics and the samples' score parts as tool_recorded)")
    g.add_argument("--tool-timeout", type=float, default=30.0, help="seconds one tool call may take (default 30)")
    g.add_argument("--tool-workers", type=int, default=8, help="tool calls running at once per rollout rank")
    g.add_argument("--parked-kv", choices=("auto", "keep", "free"), default="auto",
                   help="a sample waiting on its tools keeps its KV cache rows (keep: only the tool's tokens are "
                        "prefilled after), frees them for other samples (free: its prefix is prefilled again), or "
                        "keeps them until a waiting sample needs the slot (auto, the default)")


def _add_algorithm_args(p: argparse.ArgumentParser) -> None:
    """The RL algorithm: KL, advantages, the policy and value losses, update schedule, filters, partial rollouts."""
    from mindspeed_llm.rl import core_algos  # its registries are the choice lists (it brings torch in)

    g = p.add_argument_group("RL: algorithm")
    g.add_argument("--kl-coef", type=float, help="trl_ppo: 0.3 (reward penalty); grpo: 0.001 (KL loss); 0 = off")
    g.add_argument("--kl-penalty", choices=core_algos.KL_KINDS, help="trl_ppo: k1; grpo: low_var_kl")
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lam", type=float, default=0.95)
    g.add_argument("--clip-ratio", type=float, default=0.2)
    g.add_argument("--clip-ratio-high", type=float, help="DAPO clip-higher (default: --clip-ratio)")
    g.add_argument("--dual-clip", type=float, help="dual-clip constant c > 1 for negative advantages")
    g.add_argument("--cliprange-value", type=float, default=0.2)
    g.add_argument("--vf-coef", type=float, default=0.1)
    g.add_argument("--entropy-coeff", type=float, default=0.0)
    g.add_argument("--loss-agg-mode", choices=core_algos.AGG_MODES,
                   help="how token losses are averaged (default: token-mean; seq-mean-token-mean with --policy-loss "
                        "gspo, the sequence-level mean GSPO is defined with)")
    g.add_argument("--adv-estimator",
                   help="advantage estimator by name (rl/core_algos ADV_ESTIMATORS): trl_ppo takes gae (the critic's; "
                        "default); grpo takes the critic-free ones: grpo (default), dr_grpo, rloo, reinforce_plus_plus "
                        "(KL in the reward: --kl-coef, --kl-penalty, --gamma; no KL loss), reinforce_plus_plus_baseline")
    g.add_argument("--policy-loss", default="vanilla",
                   help="policy-loss surrogate by name (rl/core_algos POLICY_LOSSES): vanilla (PPO's clip, with "
                        "--dual-clip) or gspo (sequence-level ratio, clipped by --gspo-clip-ratio[-high])")
    g.add_argument("--gspo-clip-ratio", type=float, default=3e-4, help="gspo's lower clip range (GSPO paper: 3e-4)")
    g.add_argument("--gspo-clip-ratio-high", type=float, default=4e-4, help="gspo's upper clip range (4e-4)")
    g.add_argument("--adv-scale", choices=core_algos.GROUP_SCALES,
                   help="grpo: std scaling of the advantages (default: the estimator's: group for grpo, none for rloo)")
    g.add_argument("--whiten-rewards", action="store_true")
    g.add_argument("--ppo-epochs", type=int, default=1)
    g.add_argument("--ppo-mini-batch-size", type=int,
                   help="sequences per optimizer step over all DP ranks (default: the whole batch)")
    g.add_argument("--critic-lr", type=float, help="default: --lr")
    g.add_argument("--filter-groups", action="store_true",
                   help="grpo: leave groups whose rewards are all equal (no signal) out of the loss")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="grpo: DAPO's dynamic sampling: generate more prompt groups until the batch holds "
                        "--global-batch-size groups whose rewards differ (the others are left out)")
    g.add_argument("--dynamic-sampling-metric", default="reward",
                   help="with --dynamic-sampling: what must differ within a group for it to be kept: its rewards "
                        "(reward, the default, verl's seq_final_reward) or the scores of one verifier of "
                        "--verifier-function (its own score, before weights: MindSpeed-RL's filter_groups_metric)")
    g.add_argument("--max-num-gen-batches", type=int, default=10,
                   help="with --dynamic-sampling or --partial-rollout: at most this many generation batches per "
                        "iteration (10; with --dynamic-sampling 0 means no limit, MindSpeed-RL's -1)")
    g.add_argument("--partial-rollout", action="store_true",
                   help="slime's switch: an iteration gives each sample at most --partial-rollout-max-split's share of "
                        "--max-new-tokens; unfinished samples carry their tokens and log-probs into the next "
                        "generation batch, which continues them under the weights of then; an iteration trains on "
                        "the oldest --global-batch-size finished prompt groups. Implies --recompute-old-logprobs")
    g.add_argument("--partial-rollout-max-split", type=int,
                   help="with --partial-rollout: MindSpeed-RL's partial_rollout_max_split N, a generation batch adds "
                        "at most ceil(--max-new-tokens / N) tokens to a sample, so the longest response completes "
                        "within N of them (default 2)")
    g.add_argument("--mask-truncated-completions", action="store_true",
                   help="responses cut by --max-new-tokens / --max-length (no EOS or stop token) leave the losses")
    g.add_argument("--overlong-buffer-len", type=int,
                   help="DAPO overlong penalty: a response of n > --max-new-tokens - L tokens scores "
                        "(M - L - n) / L x --overlong-penalty-factor less (M = --max-new-tokens; off by default)")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0, help="see --overlong-buffer-len (1.0)")
