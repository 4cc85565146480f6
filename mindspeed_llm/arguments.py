"""One parser: Megatron-LM's flag names for what we support, plus the RL flags of the stages.

`validate_args` turns every inconsistent combination into an `ArgumentError` whose message names the flags
and the fix, before any model is built or any compute is spent.
"""

from __future__ import annotations

import argparse
import math
from typing import List, Optional, Sequence, Tuple

from mindspeed_llm import compat_flags
from mindspeed_llm.argument_ranges import check_ranges
from mindspeed_llm.errors import ArgumentError  # noqa: F401  (re-exported: users import the parser's error from here)
from mindspeed_llm.expert_layout import (
    EP_NOT_MULTIPLE_OF_TP,
    EXPERT_TP_NOT_1_OR_TP,
    EXTEND_WITH_EXPERT_TP,
    ExpertLayoutError,
    resolve_expert_layout,
)
from mindspeed_llm.rl import settings as run_settings

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
    # The choice lists are the registries' own (--stage, --kl-penalty, --loss-agg-mode, --adv-scale). core_algos
    # brings torch in; the stage registry imports its stages (and megatron-core) only when one is built.
    from mindspeed_llm.rl import core_algos
    from mindspeed_llm.rl.stages import STAGES

    p = argparse.ArgumentParser(
        prog="posttrain_gpt.py",
        description="In-process RL post-training (trl_ppo, grpo) for Megatron core models.",
        allow_abbrev=False,
    )
    p.add_argument("--stage", choices=tuple(STAGES), required=True)

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
    compat_flags.add_ignored_arguments(g)

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
    g.add_argument("--lora-modules-to-save", nargs="+", help=argparse.SUPPRESS)  # refused by name (validate_args)

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
    g.add_argument("--ckpt-step", type=int, help="resume from this iteration of --load instead of its latest")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, take the LR schedule (lr, min-lr, warmup, decay) from the command line")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, keep the checkpoint's LR schedule whatever the command line says")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save a checkpoint (with --save) and exit cleanly")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", required=True, help="output prefix written by preprocess_data.py")
    g.add_argument("--eval-data-path", help="held-out prompts (preprocessed prefix) for --eval-interval")
    g.add_argument("--split", help="train,valid,test weights of --data-path, e.g. 98,2,0 (Megatron-LM's): "
                                   "--eval-interval evaluates on the valid part (default: all prompts train)")
    g.add_argument("--tokenizer-type", default="PretrainedFromHF")
    g.add_argument("--tokenizer-name-or-path")
    g.add_argument("--tokenizer-not-use-fast", action="store_true", help="load the slow (Python) tokenizer")
    g.add_argument("--max-prompt-length", type=int)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-jsonl", help="write one JSON object of metrics per iteration")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int,
                   help="held-out prompts per evaluation = this x --global-batch-size (Megatron-LM's); 0 = off")
    g.add_argument("--eval-samples", type=int, default=0,
                   help="held-out prompts per evaluation (0 = all, or --eval-iters x --global-batch-size)")

    g = p.add_argument_group("RL: models and rewards")
    g.add_argument("--ref-model", help="Megatron checkpoint of the initial actor / reference policy")
    g.add_argument("--reward-model", help="value-head Megatron checkpoint (convert_ckpt.py --orm)")
    g.add_argument("--verifier-function", nargs="+", default=[], help="rule verifiers, e.g. math_acc format")
    g.add_argument("--verifier-weight", nargs="+", type=float, default=[])
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
    g.add_argument("--max-num-gen-batches", type=int, default=10,
                   help="with --dynamic-sampling or --partial-rollout: at most this many generation batches per "
                        "iteration (10)")
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
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1):
    """Parse and check a command line. A `--config FILE.yaml` is resolved before, by the caller
    (`run_config.config_argv`: the file's flags in front of the command line's)."""
    args = build_parser().parse_args(argv)
    validate_args(args, world_size)
    return args


def _check_expert_parallel(args, world_size: int) -> None:
    """Resolve the experts' layout into `args.expert_parallel_size` (ranks the experts are split over,
    EP x TP with --moe-tp-extend-ep) and `args.expert_tensor_parallel_size` (1 or TP)."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    try:
        ep, etp = resolve_expert_layout(tp, ep, args.expert_tensor_parallel_size, args.moe_tp_extend_ep)
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
            f"{' (--expert-model-parallel-size x TP, --moe-tp-extend-ep)' if args.moe_tp_extend_ep else ''} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {etp * ep * pp} processes or lower "
            f"--expert-model-parallel-size")
    if args.moe_token_dispatcher_type is None:
        args.moe_token_dispatcher_type = "alltoall" if ep > 1 or pp > 1 else "allgather"
    elif args.moe_token_dispatcher_type == "allgather" and ep > 1:
        raise ArgumentError(
            f"--moe-token-dispatcher-type allgather cannot run expert parallel {ep}: megatron's all-gather "
            f"dispatcher needs the same number of tokens on every expert-parallel rank, and RL micro-batches differ "
            f"in length from rank to rank; use --moe-token-dispatcher-type alltoall (the default with experts split)")
    elif args.moe_token_dispatcher_type == "allgather" and pp > 1:
        raise ArgumentError(
            f"--moe-token-dispatcher-type allgather cannot run --pipeline-model-parallel-size {pp}: micro-batches "
            "are cut to their own length, so the pipeline stages exchange variable shapes, which megatron allows "
            "with the all-to-all dispatcher only; use --moe-token-dispatcher-type alltoall (the default with PP)")
    args.expert_parallel_size = ep
    args.expert_tensor_parallel_size = etp


def _check_attention_backend(args) -> None:
    """`args.attention`, the core attention every model is built with (`build_model(attention=...)`): "sdpa" (the
    device's fused kernel) unless --attention-backend local / unfused asks for megatron's local attention, which is
    said at startup (it is not the default)."""
    backend = args.attention_backend
    if args.use_flash_attn and backend in LOCAL_ATTENTION_BACKENDS:
        raise ArgumentError(f"--use-flash-attn and --attention-backend {backend} contradict each other: the first asks "
                            "for the fused attention kernel, the second for megatron's local attention; drop one")
    args.attention = "local" if backend in LOCAL_ATTENTION_BACKENDS else "sdpa"
    if args.attention == "local":
        args.startup_notes.append(f"--attention-backend {backend}: megatron's local DotProductAttention (the "
                                  "reference; its memory grows with the square of the sequence length)")


def _check_sequence_and_context_parallel(args) -> None:
    """--sequence-parallel needs TP > 1 (Megatron-LM turns it off at TP 1, and so does this, saying so);
    --context-parallel-size > 1 needs the fused core attention, whose CP path gathers the keys and values over the
    CP group (megatron's local attention has none). A mixture of experts under CP is refused when its checkpoint
    is read (`rl/moe.model_options`)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
        args.startup_notes.append("--sequence-parallel is off: it splits activations over the tensor-parallel ranks, "
                                  "and --tensor-model-parallel-size is 1 (Megatron-LM's rule)")
    if args.context_parallel_size > 1 and args.attention == "local":
        raise ArgumentError(
            f"--context-parallel-size {args.context_parallel_size} needs the fused core attention (its context-"
            f"parallel path gathers keys and values over the CP ranks); --attention-backend {args.attention_backend} "
            "runs megatron's local attention, which has none: drop --attention-backend or use auto / flash / fused")


def validate_args(args, world_size: int) -> run_settings.Settings:
    """Fill stage defaults and reject inconsistent combinations with messages that name the flags. Returns the typed
    settings the stages pass around (`rl/settings.py`), also attached as `args.settings`."""
    check_ranges(args, build_parser())  # every numeric flag in its range (argument_ranges.RANGES), floats finite
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp}; launch a multiple of "
            f"{tp * pp * cp} processes"
        )
    args.world_size = world_size
    args.data_parallel_size = dp = world_size // (tp * pp * cp)  # megatron's: the CP ranks are not in it
    _check_expert_parallel(args, world_size)
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are exclusive; pick one")
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    _check_model_flags(args)
    _check_recompute(args)
    args.ignored_flags = compat_flags.ignored_flags(args)  # printed once at startup (compat_flags.startup_lines)
    args.startup_notes = []
    _check_attention_backend(args)
    _check_sequence_and_context_parallel(args)

    stage_defaults = {
        "trl_ppo": dict(kl_coef=0.3, kl_penalty="k1", n_samples_per_prompt=1),
        "grpo": dict(kl_coef=0.001, kl_penalty="low_var_kl", n_samples_per_prompt=8),
    }[args.stage]
    for name, value in stage_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.clip_ratio_high is None:
        args.clip_ratio_high = args.clip_ratio
    if args.critic_lr is None:
        args.critic_lr = args.lr
    for flag, lr in (("--lr", args.lr), ("--critic-lr", args.critic_lr)):
        if args.min_lr > lr:  # Megatron-LM's scheduler asserts min_lr <= max_lr
            raise ArgumentError(f"--min-lr {args.min_lr:g} is above {flag} {lr:g}: the LR schedule decays from "
                                f"{flag} down to --min-lr; lower --min-lr")

    # Rollout lengths.
    if args.max_length is None:
        args.max_length = 256 if args.max_prompt_length is None else args.max_prompt_length + args.max_new_tokens
    if args.max_new_tokens >= args.max_length:
        raise ArgumentError(
            f"--max-new-tokens {args.max_new_tokens} must be smaller than --max-length {args.max_length} "
            "(--max-length bounds prompt + response)"
        )
    if args.max_prompt_length is None:
        args.max_prompt_length = args.max_length - args.max_new_tokens
    if args.max_prompt_length + args.max_new_tokens > args.max_length:
        raise ArgumentError(
            f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens {args.max_new_tokens} exceeds "
            f"--max-length {args.max_length}"
        )

    # Batch arithmetic: every DP rank gets whole micro-batches of whole prompt groups.
    n = args.n_samples_per_prompt
    sequences = args.global_batch_size * n
    if args.global_batch_size % dp:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by the data-parallel size {dp} "
            f"(world {world_size} / (TP {tp} x CP {cp} x PP {pp})); each DP rank needs whole prompts"
        )
    if args.global_batch_size % (dp * cp):
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel size {dp} x "
            f"--context-parallel-size {cp}: the CP ranks of a DP rank generate its prompts as data-parallel "
            "replicas, each whole prompts")
    per_rank = sequences // dp
    if per_rank % args.micro_batch_size:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} x --n-samples-per-prompt {n} = {sequences} sequences is "
            f"not divisible by data-parallel size {dp} x --micro-batch-size {args.micro_batch_size}"
        )
    if args.ppo_mini_batch_size is None:
        args.ppo_mini_batch_size = sequences
    mini = args.ppo_mini_batch_size
    if sequences % mini or mini % (dp * args.micro_batch_size):
        raise ArgumentError(
            f"--ppo-mini-batch-size {mini} must divide the {sequences} sequences of an iteration and be a multiple "
            f"of data-parallel size {dp} x --micro-batch-size {args.micro_batch_size}"
        )
    if mini % (n * dp):
        raise ArgumentError(
            f"--ppo-mini-batch-size {mini} must be a multiple of --n-samples-per-prompt {n} x data-parallel size {dp}: "
            "a prompt's samples stay in one mini-batch, and every DP rank holds whole prompts of each"
        )
    if args.offload_train_param and args.params_dtype == "fp32" and args.stage == "grpo":
        args.startup_notes.append("--offload-train-param offloads nothing here: an fp32 actor has no separate main "
                                  "weights, and its weights generate (with --bf16 it offloads the fp32 main weights)")
    if args.optimizer == "sgd" and args.use_distributed_optimizer:
        raise ArgumentError("--optimizer sgd does not work with --use-distributed-optimizer (megatron refuses it); "
                            "drop one of them")
    _check_token_budgets(args)
    if args.dynamic_sampling and (args.stage != "grpo" or args.n_samples_per_prompt < 2):
        raise ArgumentError("--dynamic-sampling keeps grpo groups whose rewards differ: it needs --stage grpo and "
                            "--n-samples-per-prompt >= 2")
    _check_partial_rollout(args)

    # Models and rewards.
    if args.stage == "trl_ppo":
        if not args.ref_model:
            raise ArgumentError("--ref-model is required for --stage trl_ppo (actor and reference weights)")
        if not args.reward_model:
            raise ArgumentError(
                "--reward-model is required for --stage trl_ppo (critic initialisation; convert it with --orm)"
            )
    else:
        if not args.ref_model and not args.load:
            raise ArgumentError("--stage grpo needs the initial actor: pass --ref-model (or --load to resume)")
        if not args.verifier_function and not args.reward_model:
            raise ArgumentError("--stage grpo needs a reward: --verifier-function NAME ... and/or --reward-model DIR")
    if args.verifier_weight and len(args.verifier_weight) != len(args.verifier_function):
        raise ArgumentError(
            f"--verifier-weight has {len(args.verifier_weight)} values for {len(args.verifier_function)} "
            "--verifier-function names; give one weight per verifier"
        )
    if args.verifier_function and not args.verifier_weight:
        args.verifier_weight = [1.0] * len(args.verifier_function)

    # Checkpoints and logging.
    if args.save_interval and not args.save:
        raise ArgumentError("--save-interval needs --save DIR")
    if args.ckpt_step is not None and (not args.load or args.ckpt_step < 1):
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} needs --load DIR and an iteration >= 1")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                            "other; pass one")
    _check_evaluation(args)
    _check_algorithm(args)
    _check_lora(args)
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.train_iters)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.settings = run_settings.from_args(args)
    return args.settings


def _check_partial_rollout(args) -> None:
    """--partial-rollout and its budget (`rl/partial_rollout.py`): what does not combine with it is refused."""
    if not args.partial_rollout:
        if args.partial_rollout_max_split is not None:
            raise ArgumentError(f"--partial-rollout-max-split {args.partial_rollout_max_split} has no effect without "
                                "--partial-rollout; add it or drop the budget")
        return
    if args.partial_rollout_max_split is None:
        args.partial_rollout_max_split = 2
    if args.dynamic_sampling:
        raise ArgumentError("--partial-rollout and --dynamic-sampling both draw further generation batches, by "
                            "different rules (finished groups / groups whose rewards differ), and are not combined "
                            "here; drop one of them")
    if args.context_parallel_size > 1:  # the buffers are per DP rank; CP ranks share a DP rank's rollouts
        raise ArgumentError(f"--partial-rollout with --context-parallel-size {args.context_parallel_size} is not "
                            "supported (its buffers are kept per data-parallel rank, not checked under CP); use "
                            "--context-parallel-size 1 or drop --partial-rollout")
    # the carried tokens' log-probs are an earlier policy's: the update's old log-probs come from a training forward
    # under the weights of the update (and --rollout-is weighs the carried tokens against the sampler's)
    args.recompute_old_logprobs = True


def _check_token_budgets(args) -> None:
    """--max-tokens-per-micro-batch / --forward-max-tokens-per-micro-batch hold at least the widest model row: a
    sample (prompt + response), or a packed prompt group (prompt + n responses)."""
    n, cp = args.n_samples_per_prompt, args.context_parallel_size
    packed = n > 1 and args.micro_batch_size % n == 0
    row = args.max_prompt_length + (n if packed else 1) * args.max_new_tokens
    widest = -(-row // cp)  # a budget counts the tokens one rank holds: 1 / CP of each row
    what = (f"a packed prompt group (--max-prompt-length {args.max_prompt_length} + --n-samples-per-prompt {n} x "
            f"--max-new-tokens {args.max_new_tokens}; --micro-batch-size {args.micro_batch_size} packs groups, a "
            f"size that is not a multiple of {n} lays out one row per sample)" if packed
            else f"one sample (--max-prompt-length {args.max_prompt_length} + --max-new-tokens "
                 f"{args.max_new_tokens})")
    if args.forward_max_tokens_per_micro_batch is not None and args.max_tokens_per_micro_batch is None:
        args.startup_notes.append("--forward-max-tokens-per-micro-batch: the forward-only passes cut micro-batches "
                                  "by tokens; the update's are --micro-batch-size samples each")
    for flag, budget in (("--max-tokens-per-micro-batch", args.max_tokens_per_micro_batch),
                         ("--forward-max-tokens-per-micro-batch", args.forward_max_tokens_per_micro_batch)):
        if budget is not None and budget < widest:
            share = f" (1/{cp} of {row} on each of --context-parallel-size {cp} ranks)" if cp > 1 else ""
            raise ArgumentError(f"{flag} {budget} is smaller than the widest model row, {widest} tokens{share} for "
                                f"{what}; give at least {widest}")


def _check_model_flags(args) -> None:
    """Model and precision flags, as far as they can be checked without the checkpoint (`rl/roles._checked_spec`
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


def _check_recompute(args) -> None:
    """Megatron-LM's recompute flags, resolved into `args.recompute_granularity` (None: off), `recompute_method`,
    `recompute_num_layers` (full) and `recompute_modules` (selective), refusing what megatron-core's
    TransformerConfig or Megatron-LM's validate_args refuse, and flags that would have no effect.
    `rl/recompute.model_options` checks the rest against each trained model's layers."""
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ArgumentError("--recompute-activations is Megatron-LM's --recompute-granularity selective, which "
                                "contradicts --recompute-granularity full; pass one of them")
        granularity = "selective"
    modules = list(dict.fromkeys(args.recompute_modules)) if args.recompute_modules is not None else None
    if args.moe_layer_recompute:
        if granularity == "full":
            raise ArgumentError("--moe-layer-recompute is selective recompute of the MoE layers; megatron-core refuses "
                                "it with --recompute-granularity full (which recomputes whole layers): drop one")
        granularity = "selective"
        modules = (modules or ["core_attn"]) + ([] if "moe" in (modules or []) else ["moe"])  # megatron-core's rule
    method, layers = args.recompute_method, args.recompute_num_layers
    if granularity is None:
        given = [flag for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers),
                                          ("--recompute-modules", modules),
                                          ("--distribute-saved-activations", args.distribute_saved_activations))
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
        if args.distribute_saved_activations and args.tensor_model_parallel_size < 2:
            raise ArgumentError("--distribute-saved-activations splits the checkpointed activations over the tensor-"
                                "parallel ranks: it needs --tensor-model-parallel-size > 1 (Megatron-LM's rule)")
    else:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            if value is not None:
                raise ArgumentError(f"{flag} applies to --recompute-granularity full; selective recompute (of the "
                                    "--recompute-modules of every layer) takes neither: drop it")
        if args.distribute_saved_activations:
            raise ArgumentError("--distribute-saved-activations applies to --recompute-granularity full only "
                                "(Megatron-LM's rule)")
        modules = modules or ["core_attn"]  # megatron-core's default
        for name in modules:
            if name in REFUSED_RECOMPUTE_MODULES:
                raise ArgumentError(f"--recompute-modules {name} {REFUSED_RECOMPUTE_MODULES[name]}")
            if name not in RECOMPUTE_MODULES:
                raise ArgumentError(f"--recompute-modules {name}: unknown; choose from {', '.join(RECOMPUTE_MODULES)}")
    args.recompute_granularity = granularity
    args.recompute_modules = modules if granularity == "selective" else None


def _check_lora(args) -> None:
    """`args.lora`: whether the run trains LoRA adapters (--lora-target-modules or --lora-load); the LoRA numbers
    checked. r / alpha / dropout stay None when not given: with --lora-load the adapter's own apply and a flag that
    disagrees with it is an error (`rl/lora.lora_config`)."""
    from mindspeed_llm.models.lora import check_targets

    args.lora = bool(args.lora_target_modules or args.lora_load)
    if args.lora_modules_to_save:
        raise ArgumentError(f"--lora-modules-to-save {' '.join(args.lora_modules_to_save)}: training whole modules "
                            "beside the adapters is not supported here (the critic's value head trains fully on its "
                            "own); drop the flag")
    given = [flag for flag, value in (("--lora-r", args.lora_r), ("--lora-alpha", args.lora_alpha),
                                      ("--lora-dropout", args.lora_dropout)) if value is not None]
    if not args.lora:
        if given:
            raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                "--lora-target-modules (LoRA is on when target modules, or --lora-load, are given)")
        return
    if args.lora_target_modules:
        try:
            check_targets(args.lora_target_modules)
        except ValueError as exc:
            raise ArgumentError(f"--lora-target-modules {exc}") from None
        args.lora_target_modules = list(dict.fromkeys(args.lora_target_modules))
    # --sequence-parallel: the adapters gather and reduce-scatter the sequence as their linears do (models/lora.py).
    # Under context parallelism each rank holds a part of every sequence and the adapters act per token, which
    # should need nothing, but no run has compared them (attention, the loss and the gradients over CP); refused.
    if getattr(args, "context_parallel_size", 1) > 1:
        raise ArgumentError(f"LoRA (--lora-target-modules / --lora-load) with --context-parallel-size "
                            f"{args.context_parallel_size} is not supported (not checked yet); use "
                            "--context-parallel-size 1")
    if args.lora_r is not None and args.lora_r < 1:
        raise ArgumentError(f"--lora-r {args.lora_r} must be >= 1")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        raise ArgumentError(f"--lora-alpha {args.lora_alpha} must be a finite number > 0")
    if args.lora_dropout is not None and not 0.0 <= args.lora_dropout < 1.0:
        raise ArgumentError(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    if args.offload_ref_reward:
        shared = "the reference and the reward model are" if args.stage == "trl_ppo" else "the reference is"
        rest = ("only grpo's --reward-model is offloaded" if args.stage == "grpo" and args.reward_model
                else "nothing is offloaded")
        args.startup_notes.append(f"--offload-ref-reward: with LoRA {shared} the trained models' bases with their "
                                  f"adapters off, not models of their own: {rest}")


def _split_weights(text: str) -> Tuple[float, float, float]:
    """Megatron-LM's --split: up to three train,valid,test weights ("98,2,0", "98 2 0", "969/30/1"), missing
    ones 0, normalised by their sum."""
    try:
        weights = [float(x) for x in text.replace("/", ",").replace(",", " ").split()]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ArgumentError(f"--split {text!r}: expected up to three weights >= 0 for train,valid,test with a "
                            "positive sum, e.g. --split 98,2,0")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)


def _check_evaluation(args) -> None:
    """Where held-out prompts come from (`args.eval_source`: "eval-data-path", "split" or None) and how many an
    evaluation takes (`args.eval_prompts`, 0 = all)."""
    args.split_weights = _split_weights(args.split) if args.split is not None else None
    if args.split_weights is not None and args.split_weights[0] == 0:
        raise ArgumentError(f"--split {args.split} leaves nothing to train on; give the train part a weight")
    valid = args.split_weights is not None and args.split_weights[1] > 0
    if args.eval_data_path and valid:
        raise ArgumentError(f"--eval-data-path and --split {args.split} both give held-out prompts; pick one "
                            "(drop --eval-data-path, or give --split a valid weight of 0)")
    args.eval_source = "eval-data-path" if args.eval_data_path else ("split" if valid else None)
    args.eval_prompts = args.eval_samples or (args.eval_iters or 0) * args.global_batch_size
    if not args.eval_interval:
        if valid:
            args.startup_notes.append(f"--split {args.split} holds out a valid part, but no --eval-interval is "
                                      "given: it is never evaluated")
        return
    if args.eval_source is None:
        if args.split_weights is None:
            raise ArgumentError("--eval-interval needs held-out prompts: --eval-data-path (a preprocessed prompt "
                                "set) or --split with a valid part (e.g. --split 98,2,0)")
        args.startup_notes.append(f"evaluation is off: --split {args.split} has no valid part (--eval-interval "
                                  f"{args.eval_interval} is ignored; e.g. --split 98,2,0 evaluates)")
        args.eval_interval = None
    elif args.eval_iters == 0 and not args.eval_samples:
        args.startup_notes.append("evaluation is off: --eval-iters 0 (Megatron-LM's way to skip it)")
        args.eval_interval = None


def _check_algorithm(args) -> None:
    """--adv-estimator / --policy-loss against the registries of `rl/core_algos` (a registered method is a valid
    name), which stage takes which estimator, and the overlong and rollout-correction flags."""
    from mindspeed_llm.rl import core_algos

    if args.adv_estimator is None:
        args.adv_estimator = "gae" if args.stage == "trl_ppo" else "grpo"
    estimator = core_algos.ADV_ESTIMATORS.get(args.adv_estimator)
    fits = [name for name, e in core_algos.ADV_ESTIMATORS.items() if (e.kind == "critic") == (args.stage == "trl_ppo")]
    if estimator is None:
        raise ArgumentError(f"--adv-estimator {args.adv_estimator}: unknown; valid names for --stage {args.stage}: "
                            f"{', '.join(fits)}")
    if args.stage == "trl_ppo" and estimator.kind != "critic":
        raise ArgumentError(f"--adv-estimator {args.adv_estimator} is critic-free: --stage trl_ppo trains a critic "
                            f"and estimates with {', '.join(fits)}; use --stage grpo for {args.adv_estimator}")
    if args.stage != "trl_ppo" and estimator.kind == "critic":
        raise ArgumentError(f"--adv-estimator {args.adv_estimator} needs a critic: --stage trl_ppo only (grpo "
                            f"takes {', '.join(fits)})")
    if estimator.kind == "outcome" and args.n_samples_per_prompt < 2:
        raise ArgumentError(f"--adv-estimator {args.adv_estimator} compares the samples of a prompt with each other: "
                            f"with --n-samples-per-prompt {args.n_samples_per_prompt} every advantage is 0 and "
                            "nothing trains; give --n-samples-per-prompt 2 or more")
    if args.adv_scale is not None and estimator.kind != "outcome":
        raise ArgumentError(f"--adv-scale {args.adv_scale} applies to the group estimators (grpo, dr_grpo, rloo), "
                            f"not to --adv-estimator {args.adv_estimator}; drop it")
    if args.policy_loss not in core_algos.POLICY_LOSSES:
        raise ArgumentError(f"--policy-loss {args.policy_loss}: unknown; valid names: "
                            f"{', '.join(core_algos.POLICY_LOSSES)}")
    if args.loss_agg_mode is None:
        # GSPO (Zheng et al. 2025) averages its sequence-level losses over sequences, as verl runs it
        args.loss_agg_mode = "seq-mean-token-mean" if args.policy_loss == "gspo" else "token-mean"
        if args.policy_loss == "gspo":
            args.startup_notes.append("--policy-loss gspo: losses averaged per sequence (--loss-agg-mode "
                                      "seq-mean-token-mean, the aggregation GSPO is defined with); pass "
                                      "--loss-agg-mode to choose another")
    if args.policy_loss == "gspo" and args.dual_clip is not None:
        raise ArgumentError("--dual-clip applies to --policy-loss vanilla; gspo has no dual clip")
    if args.overlong_buffer_len is not None and not 1 <= args.overlong_buffer_len <= args.max_new_tokens:
        raise ArgumentError(f"--overlong-buffer-len {args.overlong_buffer_len} must be in [1, --max-new-tokens "
                            f"{args.max_new_tokens}]")
    if args.rollout_is != "none":
        args.recompute_old_logprobs = True  # the weights compare the sampler with the training forward
