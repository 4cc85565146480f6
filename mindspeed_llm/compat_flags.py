"""Flags of MindSpeed-LLM / Megatron-LM launch scripts that parse here but change nothing, each with the reason.

`posttrain_gpt.py` accepts them so that published scripts run unchanged, keeps the ones a command line gave in its
settings (`settings.startup.ignored_flags`, (flag, reason) pairs) and prints them once at startup on rank 0
(`startup_lines`, which `rl.startup` prints with the other startup lines). Adding a switch is one line of
`IGNORED_SWITCHES`.
`convert_ckpt.py` registers its own tables (`CONVERT_IGNORED`, MindSpeed-LLM's conversion scripts) the same way.
"""

from __future__ import annotations

import argparse
from typing import Dict, List

PERFORMANCE = ("performance switches with no effect here: the models run megatron-core's local layer spec in "
               "plain torch, without these fused kernels (attention: --attention-backend)")
MOE_PERFORMANCE = ("MindSpeed's MoE overlap / fusion / memory switches with no effect here: the experts run "
                   "megatron-core's token dispatchers (--moe-token-dispatcher-type) in plain torch")
ALWAYS = "what this code always does"
CHECKPOINT = "the checkpoint decides"
FP16_ONLY = "loss scaling applies to --fp16 only"
SEQ_LENGTH = "--max-length bounds prompt + response"
SHARED_STORAGE = "checkpoints are published by rank 0, so --save must be a folder every node sees"
LORA_FUSION = ("MindSpeed's CCLoRA kernel (communication overlapped with the adapters' matmuls): the adapters run as "
               "plain torch matmuls beside megatron's linears")
LORA_CKPT_FILTER = "checkpoints of a LoRA run always hold the adapters (and their optimizer state) only"
LORA_HOOK = ("MindSpeed-LLM's fix of the gradient chain with a frozen base (recompute, PP): here the embedding's "
             "output always requires grad in a LoRA training forward and later pipeline stages receive inputs that "
             "do, so no module needs naming")

# Switches (no value): flag -> why it has no effect.
IGNORED_SWITCHES: Dict[str, str] = {
    "--no-masked-softmax-fusion": PERFORMANCE,
    "--no-gradient-accumulation-fusion": PERFORMANCE,
    "--no-bias-swiglu-fusion": PERFORMANCE,
    "--no-bias-dropout-fusion": PERFORMANCE,
    "--no-rope-fusion": PERFORMANCE,
    "--no-persist-layer-norm": PERFORMANCE,
    "--overlap-grad-reduce": PERFORMANCE,
    "--overlap-param-gather": PERFORMANCE,
    # MindSpeed's MoE communication / memory switches: the experts run megatron-core's own dispatchers here
    "--moe-permutation-async-comm": MOE_PERFORMANCE,
    "--moe-alltoall-overlap-comm": MOE_PERFORMANCE,
    "--moe-fb-overlap": MOE_PERFORMANCE,
    "--moe-permute-fusion": MOE_PERFORMANCE,
    "--use-fused-moe-token-permute-and-unpermute": MOE_PERFORMANCE,
    "--use-mcore-models": ALWAYS,  # the models are megatron-core GPTModels
    "--swiglu": ALWAYS,  # every supported model's MLP is SwiGLU (models/builder.py: gated_linear_unit, silu)
    "--use-rotary-position-embeddings": ALWAYS,  # and its positions rotary (--position-embedding-type rope)
    "--attention-softmax-in-fp32": ALWAYS,  # megatron-core's default (TransformerConfig.attention_softmax_in_fp32)
    "--is-instruction-dataset": ALWAYS,  # the data are preprocess_data.py's prompt datasets
    "--variable-seq-lengths": ALWAYS,  # micro-batches are padded to their own longest sequence
    "--no-shared-storage": SHARED_STORAGE,
    "--lora-fusion": LORA_FUSION,
    "--lora-ckpt-filter": LORA_CKPT_FILTER,
}

# Flags with a value, ignored whenever given: flag -> (argparse type, reason).
IGNORED_VALUES: Dict[str, tuple] = {
    "--transformer-impl": (str, PERFORMANCE),
    "--make-vocab-size-divisible-by": (int, CHECKPOINT),  # the vocabulary (padding included) is the checkpoint's
    # Every weight, the value heads included, is loaded from a checkpoint (convert reward models with --orm);
    # nothing is initialised fresh, so there is nothing for an init std to apply to.
    "--init-method-std": (float, CHECKPOINT),
    "--seq-length": (int, SEQ_LENGTH),
    "--moe-zero-memory": (str, MOE_PERFORMANCE),  # level0 / level1: recomputation to save activation memory
    "--moe-zero-memory-num-layers": (int, MOE_PERFORMANCE),
}

# Flags with a list of values (nargs +), ignored whenever given: flag -> reason.
IGNORED_LISTS: Dict[str, str] = {
    "--lora-register-forward-hook": LORA_HOOK,
}

# Megatron's fp16 grad-scaler flags: honoured with --fp16 (model_settings.OptimizerSettings), ignored otherwise.
LOSS_SCALE_FLAGS = ("--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
                    "--hysteresis")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# convert_ckpt.py: MindSpeed-LLM's conversion flags that change nothing here, as (switches, values, lists).
CONVERT_ALWAYS_MCORE = "Megatron checkpoints here are always megatron-core's"
CONVERT_IGNORED = (
    {
        "--use-mcore-models": CONVERT_ALWAYS_MCORE,
        # the checkpoint holds each expert's weights apart either way; the training run's flag picks the kernel
        "--moe-grouped-gemm": "the checkpoint stores each expert apart either way, the run's --moe-grouped-gemm "
                              "picks the kernel",
        "--mla-mm-split": "the checkpoint keeps megatron-core's MLA projections (linear_q_up_proj, "
                          "linear_kv_up_proj), which the stages here build",
        "--save-layer-by-layer": "conversions here stream one pipeline stage at a time",
    },
    {
        "--mtp-num-layers": (int, "DeepSeek's multi-token-prediction layers are not converted (the stages here "
                                  "train without MTP)"),
        "--transformer-impl": (str, "the checkpoint layout is the same for both implementations"),
        "--make-vocab-size-divisible-by": (int, "the vocabulary is the config's vocab_size, unpadded"),
    },
    {
        "--spec": "the layer spec follows from the model_type (config.json or the checkpoint)",
    },
)


def add_ignored_arguments(parser: argparse.ArgumentParser, tables=None) -> None:
    """Register every ignored flag (hidden from --help) of `tables` ((switches, values, lists); default: the
    training flags)."""
    switches, values, lists = tables or (IGNORED_SWITCHES, IGNORED_VALUES, IGNORED_LISTS)
    for flag in switches:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, (kind, _reason) in values.items():
        parser.add_argument(flag, type=kind, action="append", help=argparse.SUPPRESS)  # may repeat (--seq-length)
    for flag in lists:
        parser.add_argument(flag, nargs="+", help=argparse.SUPPRESS)


def ignored_flags(args, tables=None) -> Dict[str, str]:
    """{flag: reason} of the ignored flags of `tables` this command line gave, in table order."""
    switches, values, lists = tables or (IGNORED_SWITCHES, IGNORED_VALUES, IGNORED_LISTS)
    found = {flag: reason for flag, reason in switches.items() if getattr(args, _dest(flag), False)}
    found.update({flag: reason for flag, (_, reason) in values.items()
                  if getattr(args, _dest(flag), None) is not None})
    found.update({flag: reason for flag, reason in lists.items() if getattr(args, _dest(flag), None)})
    if tables is None and not getattr(args, "fp16", False):
        found.update({flag: FP16_ONLY for flag in LOSS_SCALE_FLAGS if getattr(args, _dest(flag), None) is not None})
    return found


def ignored_line(found: Dict[str, str]) -> str:
    """'ignored flags: ...' of {flag: reason}, grouped by reason ('' when none)."""
    by_reason: Dict[str, List[str]] = {}
    for flag, reason in found.items():
        by_reason.setdefault(reason, []).append(flag)
    return ("ignored flags: " + "; ".join(f"{', '.join(flags)} ({reason})" for reason, flags in by_reason.items())
            if by_reason else "")


def startup_lines(report, backend: str) -> List[str]:
    """The parser's part of what rank 0 prints once before training (`rl.startup.startup_lines` adds the
    rest), from the run's `settings.startup` (`rl.settings.StartupReport`): the ignored flags (one line, grouped by
    reason), a --distributed-backend the device overrides and the notes `validate_args` left."""
    lines = []
    line = ignored_line(dict(report.ignored_flags))
    if line:
        lines.append(line)
    wanted = report.distributed_backend
    if wanted and wanted != backend:
        lines.append(f"--distributed-backend {wanted}: this device's collectives use {backend}; using {backend}")
    lines.extend(report.startup_notes)
    return lines
