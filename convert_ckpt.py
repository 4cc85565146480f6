#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and Megatron-core (Megatron-LM layout), or reshard Megatron ones.

    python convert_ckpt.py --load-model-type hf --save-model-type mg --load-dir hf/qwen2 --save-dir mg/qwen2 \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1 --params-dtype bf16
    python convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir mg/qwen2 --save-dir hf/out
    python convert_ckpt.py --load-model-type hf --save-model-type mg --orm ...   # reward / critic value head
    python convert_ckpt.py --load-model-type mg --save-model-type mg --target-pipeline-parallel-size 2 ...

Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 in bf16 (FP8 checkpoints: dequantise first);
the family comes from config.json's model_type):

    python convert_ckpt.py --load-model-type hf --save-model-type mg --load-dir hf/qwen3_moe --save-dir mg/moe \
        --target-tensor-parallel-size 2 --target-expert-parallel-size 4      # experts over 4 EP ranks, expert TP 2
    ... --target-tensor-parallel-size 2 --target-expert-parallel-size 2 --moe-tp-extend-ep   # over 2 x 2 ranks, whole
    python convert_ckpt.py --load-model-type mg --save-model-type hf ...     # every EP / expert-TP shard gathered

LoRA adapters (a LoRA run's `<save>/actor` or `<save>/critic`, or a PEFT folder), on the base they belong to:

    python convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir mg/base --lora-load ckpt/actor \
        --save-dir hf/merged                                # merged weights (or --save-model-type mg, any TP / PP)
    python convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir mg/base --lora-load ckpt/actor \
        --save-lora-to-hf --save-dir hf/adapter             # the adapter alone, as PEFT loads it

An adapter meets only the base it was trained on: an adapter checkpoint's recorded base fingerprints are recomputed
from --load-dir, a PEFT folder's base_model_name_or_path must name it; another base is refused unless
--allow-base-mismatch.

MindSpeed-LLM's published commands run as published: --model-type-hf llama2 --add-qkv-bias on a Qwen2.5 folder,
--lora-r / --lora-alpha / --lora-target-modules beside --lora-load (checked against the adapter), --hf-cfg-dir,
--tokenizer-model PATH (its folder's tokenizer files are copied, as --tokenizer-dir); flags that change nothing
here (--use-mcore-models, --model-type GPT, --moe-grouped-gemm, ...) are listed at startup with the reason
(mindspeed_llm/checkpoint/published_flags.py).
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from mindspeed_llm.checkpoint import published_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # "--model-type GPT" must not pass for --model-type-hf
    p.add_argument("--load-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--save-model-type", choices=("hf", "mg"), required=True)
    p.add_argument("--load-dir", required=True, help="HF model folder, or Megatron checkpoint root")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="mixture of experts: expert-parallel ranks the experts of each MoE layer are split over (the "
                        "run's --expert-model-parallel-size); times TP with --moe-tp-extend-ep")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="mixture of experts: tensor parallelism inside each expert, 1 or the TP size (default: the "
                        "TP size, experts split like the dense MLP)")
    p.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="MindSpeed: the experts are split over EP x TP ranks and kept whole (expert TP 1); the "
                        "checkpoint stores expert parallel = --target-expert-parallel-size x TP")
    p.add_argument("--model-type-hf", default=None,
                   help="llama2, llama3, qwen2, qwen25, qwen3, mistral, qwen3-moe, qwen2-moe, mixtral, deepseek3, ... "
                        "(config.json's model_type decides the mapping; a name of the same layout, e.g. llama2 for "
                        "qwen2, is accepted with a note, one of another layout is refused)")
    p.add_argument("--params-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="dtype of the saved weights (default: that of the loaded checkpoint)")
    p.add_argument("--orm", action="store_true", default=None,
                   help="value head (reward / critic): HF *ForSequenceClassification score.weight <-> "
                        "Megatron output_layer (fp32)")
    p.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here into the output")
    p.add_argument("--tokenizer-model", default=None,
                   help="MindSpeed-LLM's tokenizer flag: a tokenizer file (e.g. HF/tokenizer.json) or folder; its "
                        "folder's tokenizer files are copied, as with --tokenizer-dir")
    p.add_argument("--model-type", default=None,
                   help="MindSpeed-LLM's model type: only GPT (decoder-only) is converted here")
    p.add_argument("--load-iteration", default=None,
                   help="Megatron iteration to read ('release' or a number; default: latest_checkpointed_iteration)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="convert weights that hold NaN / inf (or overflow --params-dtype) anyway, with a warning "
                        "naming them; without it such a checkpoint is refused")
    p.add_argument("--lora-load", default=None, metavar="DIR",
                   help="LoRA adapters of --load-dir's model (a LoRA run's <save>/actor or <save>/critic, or a PEFT "
                        "folder): merged into the converted weights")
    p.add_argument("--save-lora-to-hf", action="store_true",
                   help="with --lora-load and --save-model-type hf: write the adapter alone as a PEFT folder "
                        "(adapter_config.json + adapter_model.safetensors, Hugging Face module names)")
    p.add_argument("--allow-base-mismatch", action="store_true",
                   help="with --lora-load: apply the adapter even though --load-dir is not the base it was trained "
                        "on (its recorded base fingerprint, or a PEFT folder's base_model_name_or_path); without it "
                        "such an adapter is refused")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    published_flags.add_arguments(p)  # MindSpeed-LLM's other conversion flags: checked, ignored or refused
    return p


def _mindspeed_flags(args):
    """Checks MindSpeed-LLM's --model-type; returns the tokenizer folder: --tokenizer-dir, or the folder of
    MindSpeed-LLM's --tokenizer-model (a file in it, or the folder)."""
    import os

    from mindspeed_llm.checkpoint.errors import ConversionError

    if args.model_type is not None and args.model_type.upper() != "GPT":
        raise ConversionError(f"--model-type {args.model_type}: only GPT (decoder-only) models are converted here; "
                              "pass --model-type GPT (or drop it) and name the family with --model-type-hf")
    if args.tokenizer_model is None:
        return args.tokenizer_dir
    if not os.path.exists(args.tokenizer_model):
        raise ConversionError(f"--tokenizer-model {args.tokenizer_model} does not exist")
    folder = args.tokenizer_model if os.path.isdir(args.tokenizer_model) else os.path.dirname(args.tokenizer_model)
    folder = folder or "."
    if args.tokenizer_dir is not None and os.path.realpath(args.tokenizer_dir) != os.path.realpath(folder):
        raise ConversionError(f"--tokenizer-dir {args.tokenizer_dir} and --tokenizer-model {args.tokenizer_model} "
                              "name different tokenizers; pass one of them")
    if args.load_model_type == "mg" and args.save_model_type == "mg":
        print("convert_ckpt.py: --tokenizer-model is not used for mg -> mg (the tokenizer files of --load-dir are "
              "copied)", file=sys.stderr)
    return folder


def _no_target_layout(args) -> None:
    """mg -> hf gathers every shard; expert-layout flags would be silently meaningless there."""
    from mindspeed_llm.checkpoint.errors import ConversionError

    given = [flag for flag, set_ in (
        (f"--target-expert-parallel-size {args.target_expert_parallel_size}", args.target_expert_parallel_size != 1),
        (f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}",
         args.expert_tensor_parallel_size is not None),
        ("--moe-tp-extend-ep", args.moe_tp_extend_ep)) if set_]
    if given:
        raise ConversionError(f"{', '.join(given)}: the Hugging Face export gathers every shard of the checkpoint "
                              f"(its layout is read from it); drop the flag")


def _lora_flags(args) -> None:
    """The --lora-load / --save-lora-to-hf combinations refused before any model is read."""
    from mindspeed_llm.checkpoint.errors import ConversionError

    if args.save_lora_to_hf and not args.lora_load:
        raise ConversionError("--save-lora-to-hf writes the adapter of --lora-load DIR: add --lora-load")
    if not args.lora_load:
        return
    if args.save_lora_to_hf and args.save_model_type != "hf":
        raise ConversionError("--save-lora-to-hf writes a Hugging Face (PEFT) adapter: use --save-model-type hf")
    if args.load_model_type == "hf" and args.save_model_type == "hf" and not args.save_lora_to_hf:
        raise ConversionError("--lora-load with --load-model-type hf --save-model-type hf: merge into a Megatron "
                              "checkpoint (--save-model-type mg) and export that, or merge a PEFT adapter with "
                              "peft's merge_and_unload")


def _lora(args, iteration):
    """--lora-load / --save-lora-to-hf: None (no adapter), a Merger for the conversion, or "written" when
    --save-lora-to-hf wrote the PEFT folder (nothing else to do). The base is --load-dir (its ArchitectureSpec and
    whether it is a value model check the adapter); --load-iteration picks the base's iteration, the adapter's latest
    is read."""
    import os

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import lora_base, published_flags
    from mindspeed_llm.checkpoint.convert import _checkpoint_info
    from mindspeed_llm.checkpoint.errors import ConversionError
    from mindspeed_llm.checkpoint.hf_files import read_hf_config
    from mindspeed_llm.models.architecture import ArchitectureSpec

    if not args.lora_load:
        if args.allow_base_mismatch:
            raise ConversionError("--allow-base-mismatch applies to the adapter of --lora-load: add it or drop the "
                                  "flag")
        return None
    info = None
    if args.load_model_type == "mg":
        info = _checkpoint_info(args.load_dir, iteration)
        spec, value_head = info["spec"], info["value_head"]
        names = lora_base.base_names(args.load_dir, info)
    else:
        config = read_hf_config(args.load_dir)
        spec, value_head = ArchitectureSpec.from_hf_config(config), bool(args.orm)
        names = lora_base.base_names(args.load_dir, hf_config=config)
    if args.orm is not None and bool(args.orm) != value_head:
        raise ConversionError(f"--orm: --load-dir {args.load_dir} {'is' if value_head else 'is not'} a value model")
    adapter = lora_files.adapter_for_base(args.lora_load, spec, value_head)
    published_flags.check_adapter(args, adapter)
    base = f"--load-dir {args.load_dir}"
    check = lora_base.BaseCheck(adapter) if adapter.shard_bases else None
    merger = lora_files.Merger(adapter, check, base, allow=args.allow_base_mismatch)
    if check is None:  # a PEFT folder: its base's name (the shapes are checked as it merges)
        problem = lora_base.peft_base_problem(adapter, names, base)
        if problem and not args.allow_base_mismatch:
            raise ConversionError(problem)
        if problem:
            print(f"convert_ckpt.py: warning: --allow-base-mismatch: {problem.split('; pass')[0]}", file=sys.stderr)
    if args.save_lora_to_hf:
        _no_target_layout(args)
        if os.path.abspath(args.save_dir) in (os.path.abspath(args.load_dir), os.path.abspath(args.lora_load)):
            raise ConversionError(f"--save-dir {args.save_dir}: write the PEFT adapter to a folder of its own")
        if check is not None:
            hf_base = args.load_model_type == "hf"
            for full in lora_base.base_stages(args.load_dir, hf_base, spec, value_head, iteration):
                check.add(full)
            merger.check_base()
        # the Hugging Face model peft loads the adapter onto: the folder a Megatron base was converted from
        lora_files.write_peft(adapter, spec, args.save_dir,
                              base_name=(info or {}).get("hf_source") or os.path.abspath(args.load_dir))
        return "written"
    return merger


def _check_tokenizer_present(tokenizer_dir: str, args) -> None:
    """A tokenizer folder given by flag must hold a tokenizer: otherwise nothing would be copied, without a word."""
    from mindspeed_llm.checkpoint.errors import ConversionError
    from mindspeed_llm.checkpoint.hf_files import TOKENIZER_FILES

    flag = (f"--tokenizer-model {args.tokenizer_model} (its folder {tokenizer_dir})" if args.tokenizer_model
            else f"--tokenizer-dir {tokenizer_dir}")
    if not os.path.isdir(tokenizer_dir):
        raise ConversionError(f"{flag} is not a folder; pass the folder of the model's tokenizer")
    tokenizer = [n for n in os.listdir(tokenizer_dir) if n.endswith(".tiktoken") or (
        n in TOKENIZER_FILES and n not in ("generation_config.json", "chat_template.jinja", "chat_template.json"))]
    if not tokenizer:
        raise ConversionError(f"{flag} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:6])}, ...), so "
                              "nothing would be copied; pass the folder of the model's tokenizer, or drop the flag")


def _check_tokenizer_fits(tokenizer_dir: str, args) -> None:
    """A tokenizer given with --tokenizer-dir / --tokenizer-model travels with the weights: it must not produce ids
    the model's vocabulary lacks (they would index past the embedding at the first such token)."""
    import json

    from mindspeed_llm.checkpoint.errors import ConversionError

    if args.load_model_type == "hf":
        with open(os.path.join(args.load_dir, "config.json")) as f:
            vocab = json.load(f).get("vocab_size")
    else:
        from mindspeed_llm.checkpoint import load_spec

        vocab = load_spec(args.load_dir).vocab_size
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    except Exception:  # files transformers cannot read as a tokenizer: copied as given, the stage's load judges them
        return
    if vocab is not None and size > int(vocab):
        raise ConversionError(f"--tokenizer-dir {tokenizer_dir} has {size} tokens but the model's vocabulary has "
                              f"{vocab}: it is not this model's tokenizer; pass the model's own")


HF_OUTPUT_MARK = ".mindspeed_llm_hf_output"


def _keep_a_foreign_hf_model(args) -> None:
    """mg -> hf into a --save-dir holding a Hugging Face model this converter did not write (no HF_OUTPUT_MARK):
    MindSpeed-LLM's older scripts pass the original model there, and its converter wrote to `<save-dir>/mg2hf/`.
    So does this one, saying so, instead of writing over the original."""
    if args.save_model_type != "hf" or args.load_model_type != "mg":
        return
    if not os.path.isfile(os.path.join(args.save_dir, "config.json")) or \
            os.path.exists(os.path.join(args.save_dir, HF_OUTPUT_MARK)):
        return
    target = os.path.join(args.save_dir, "mg2hf")
    print(f"convert_ckpt.py: note: --save-dir {args.save_dir} holds a Hugging Face model this program did not write "
          f"(the original model, as MindSpeed-LLM's scripts pass it); the converted model goes to {target}, as "
          "MindSpeed-LLM's converter writes it", file=sys.stderr)
    args.save_dir = target


def run(args) -> None:
    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_hf, convert_mg_to_mg, published_flags
    from mindspeed_llm.checkpoint.errors import ConversionError

    from mindspeed_llm.checkpoint.megatron_layout import conversion_target_problem

    for line in published_flags.startup_lines(args):
        print(f"convert_ckpt.py: {line}", file=sys.stderr)
    published_flags.check_command(args)
    _lora_flags(args)
    tokenizer_dir = _mindspeed_flags(args)
    _keep_a_foreign_hf_model(args)
    problem = conversion_target_problem(args.save_dir, args.save_model_type)
    if problem:
        raise ConversionError(problem)
    if tokenizer_dir is not None:
        _check_tokenizer_present(tokenizer_dir, args)
        _check_tokenizer_fits(tokenizer_dir, args)
    progress = not args.no_progress
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    moe = dict(ep=args.target_expert_parallel_size, etp=args.expert_tensor_parallel_size,
               moe_tp_extend_ep=args.moe_tp_extend_ep)
    iteration = args.load_iteration
    if iteration is not None and iteration != "release":
        iteration = int(iteration)
    spec, info, where = published_flags.model_and_layout(args, iteration)
    for note in published_flags.check_model(args, spec, info, where):
        print(f"convert_ckpt.py: note: {note}", file=sys.stderr)
    lora = _lora(args, iteration)
    if lora == "written":
        return
    if args.load_model_type == "hf" and args.save_model_type == "mg":
        convert_hf_to_mg(args.load_dir, args.save_dir, tp=tp, pp=pp, params_dtype=args.params_dtype,
                         value_head=bool(args.orm), model_type_hf=args.model_type_hf,
                         tokenizer_dir=tokenizer_dir, progress=progress, allow_non_finite=args.allow_non_finite,
                         lora=lora, **moe)
    elif args.load_model_type == "mg" and args.save_model_type == "hf":
        _no_target_layout(args)
        convert_mg_to_hf(args.load_dir, args.save_dir, params_dtype=args.params_dtype, value_head=args.orm,
                         tokenizer_dir=tokenizer_dir, iteration=iteration, progress=progress,
                         allow_non_finite=args.allow_non_finite, lora=lora)
        from mindspeed_llm.files import write_text_atomically

        write_text_atomically(os.path.join(args.save_dir, HF_OUTPUT_MARK),
                              "a Hugging Face model written by convert_ckpt.py (it may convert into this folder "
                              "again)\n")
    elif args.load_model_type == "mg" and args.save_model_type == "mg":
        convert_mg_to_mg(args.load_dir, args.save_dir, tp=tp, pp=pp, params_dtype=args.params_dtype,
                         iteration=iteration, value_head=args.orm, progress=progress, tokenizer_dir=tokenizer_dir,
                         allow_non_finite=args.allow_non_finite, lora=lora, **moe)
    else:
        raise ConversionError("--load-model-type hf --save-model-type hf: nothing to convert")


def _os_error(err: OSError, args) -> str:
    """One line for a failed read or write: a full disk and a permission problem named as such, with the fix."""
    import errno

    from mindspeed_llm.files import WriteError

    if isinstance(err, WriteError) or not err.strerror:  # already a sentence naming the file
        text = str(err)
    else:
        text = f"{err.filename or args.save_dir}: {err.strerror}"
    if err.errno == errno.ENOSPC or "No space left" in text:
        return f"{text}; free space there or pass another --save-dir"
    if isinstance(err, PermissionError) or "permission denied" in text:
        return f"{text}; pass a --save-dir (and --load-dir) this user can write (and read)"
    return text


def main(argv=None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    from mindspeed_llm.checkpoint.errors import ConversionError
    from mindspeed_llm.models.architecture import UnsupportedModelError

    class _Stderr(logging.Handler):  # the current sys.stderr at each message
        def emit(self, record):
            print(self.format(record), file=sys.stderr)

    log = logging.getLogger("mindspeed_llm.checkpoint")
    if not log.handlers:  # warnings (e.g. --allow-non-finite) as one line each, like the errors
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("convert_ckpt.py: warning: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    try:
        run(args)
    except OSError as err:
        print(f"convert_ckpt.py: error: {_os_error(err, args)}", file=sys.stderr)
        return 1
    except (ConversionError, UnsupportedModelError, ValueError) as err:
        print(f"convert_ckpt.py: error: {err}", file=sys.stderr)
        return 1
    what = ("a PEFT LoRA adapter" if args.save_lora_to_hf else
            f"{args.save_model_type} checkpoint" + (" with the LoRA adapter merged" if args.lora_load else ""))
    print(f"convert_ckpt.py: wrote {what} to {args.save_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
