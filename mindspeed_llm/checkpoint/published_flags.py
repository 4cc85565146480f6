"""MindSpeed-LLM's (and MindSpeed-RL's) published conversion flags on `convert_ckpt.py`: each one applied, checked
against the model, ignored with a reason printed at startup (`compat_flags.CONVERT_IGNORED`), or refused by name.

Here the model decides its own layout: config.json's model_type (or the checkpoint's spec) picks the mapping,
q/k/v biases, norms and experts. MindSpeed-LLM's flags that restate the model (--model-type-hf, --add-qkv-bias,
--num-layers, --first-k-dense-replace, --lora-r / --lora-alpha / --lora-target-modules, --source-*-parallel-size,
--hf-cfg-dir) are therefore checks: a value that contradicts the model is refused naming both, since ignoring it
would hide a mistake (the wrong folder, the wrong adapter). Layouts the stages here cannot load (virtual pipeline
chunks, noop layers, uneven pipeline stages) are refused.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import List

from mindspeed_llm import compat_flags
from mindspeed_llm.checkpoint import hf_mapping as hfm
from mindspeed_llm.checkpoint.errors import ConversionError

LORA_FLAGS = ("--lora-r", "--lora-alpha", "--lora-target-modules")


def add_arguments(p) -> None:
    p.add_argument("--add-qkv-bias", action="store_true",
                   help="MindSpeed-LLM: the model has q/k/v biases (Qwen2 / Qwen2.5 as llama2); checked against the "
                        "config, which decides here")
    p.add_argument("--lora-r", type=int, default=None, help="with --lora-load: checked against the adapter's r")
    p.add_argument("--lora-alpha", type=float, default=None, help="with --lora-load: checked against its alpha")
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="with --lora-load: checked against the adapter's target modules (linear_qkv linear_proj ...)")
    p.add_argument("--hf-cfg-dir", default=None,
                   help="mg -> hf: the original Hugging Face folder; its config.json must describe the checkpoint's "
                        "model (the written config.json is rebuilt from the checkpoint)")
    p.add_argument("--num-layers", type=int, default=None, help="checked against the model's layer count")
    p.add_argument("--first-k-dense-replace", type=int, default=None,
                   help="mixture of experts: checked against the model's leading dense layers")
    p.add_argument("--num-layer-list", default=None,
                   help="layers per pipeline stage (4,4,4,4): accepted when it is the even split, refused otherwise")
    # refused flags, parsed only to be named in the refusal (check_command)
    p.add_argument("--noop-layers", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None, help=argparse.SUPPRESS)
    for what in ("tensor", "pipeline", "expert"):
        p.add_argument(f"--source-{what}-parallel-size", type=int, default=None,
                       help=f"mg input: checked against the checkpoint's {what}-parallel size")
    compat_flags.add_ignored_arguments(p, compat_flags.CONVERT_IGNORED)


def check_command(args) -> None:
    """Refusals that need no model."""
    if args.noop_layers is not None:
        raise ConversionError(f"--noop-layers {args.noop_layers}: noop layers renumber the decoder layers and the "
                              "stages here build none; drop the flag")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ConversionError(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
                              ": the stages here run without virtual pipeline stages, so a checkpoint of VPP chunks "
                              "would not load; drop the flag")
    given = [f for f in LORA_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if given and not args.lora_load:
        raise ConversionError(f"{', '.join(given)}: no effect without --lora-load (the adapter records its r, alpha "
                              "and targets; these flags are checked against it); add --lora-load DIR or drop them")
    if args.hf_cfg_dir is not None and (args.load_model_type, args.save_model_type) != ("mg", "hf"):
        raise ConversionError(f"--hf-cfg-dir {args.hf_cfg_dir} names the Hugging Face config of an mg -> hf export "
                              "(--load-model-type mg --save-model-type hf); drop it")
    sources = [f"--source-{w}-parallel-size" for w in ("tensor", "pipeline", "expert")
               if getattr(args, f"source_{w}_parallel_size") is not None]
    if sources and args.load_model_type != "mg":
        raise ConversionError(f"{', '.join(sources)}: describe a Megatron --load-dir (--load-model-type mg); drop")


def _hf_config_spec(folder: str):
    from mindspeed_llm.checkpoint.hf_files import read_hf_config
    from mindspeed_llm.models.architecture import ArchitectureSpec

    config = read_hf_config(folder)
    hfm.resolve_family(None, config, where=os.path.join(folder, "config.json"))
    return ArchitectureSpec.from_hf_config(config)


def model_and_layout(args, iteration):
    """(ArchitectureSpec, checkpoint info or None, where) of --load-dir, the model every check compares with."""
    from mindspeed_llm.checkpoint.convert import _checkpoint_info
    from mindspeed_llm.checkpoint.hf_files import read_hf_config
    from mindspeed_llm.models.architecture import ArchitectureSpec

    if args.load_model_type == "mg":
        info = _checkpoint_info(args.load_dir, iteration)
        return info["spec"], info, f"the checkpoint {args.load_dir}"
    where = os.path.join(args.load_dir, "config.json")
    config = read_hf_config(args.load_dir)
    hfm.resolve_family(args.model_type_hf, config, where=where)
    return ArchitectureSpec.from_hf_config(config), None, where


def check_model(args, spec, info, where: str) -> List[str]:
    """Checks the model-describing flags against `spec` (and a Megatron input's layout `info`); returns the notes
    to print at startup."""
    notes = []
    note = hfm.model_type_note(args.model_type_hf, spec.family, where)
    if note:
        notes.append(note + (" (its q/k/v biases included)" if spec.add_qkv_bias else ""))
    if args.add_qkv_bias and not spec.add_qkv_bias:
        raise ConversionError(f"--add-qkv-bias: this {spec.family} model has no q/k/v biases ({where}); drop the "
                              f"flag (the model's own config decides its biases here)")
    if args.num_layers is not None and args.num_layers != spec.num_layers:
        raise ConversionError(f"--num-layers {args.num_layers}, but {where} has {spec.num_layers} layers")
    if args.first_k_dense_replace is not None:
        kinds = spec.moe_layers()
        dense = kinds.index(1) if 1 in kinds else len(kinds)
        if not spec.is_moe or dense != args.first_k_dense_replace:
            have = f"{dense} leading dense layers" if spec.is_moe else "a dense model"
            raise ConversionError(f"--first-k-dense-replace {args.first_k_dense_replace}, but {where} has {have}")
    if info is not None:
        for what, key in (("tensor", "tp"), ("pipeline", "pp"), ("expert", "ep")):
            given = getattr(args, f"source_{what}_parallel_size")
            if given is not None and given != info[key]:
                raise ConversionError(f"--source-{what}-parallel-size {given}, but {where} is stored at "
                                      f"{what}-parallel size {info[key]} (read from it; drop the flag)")
    if args.num_layer_list is not None:
        pp = info["pp"] if args.save_model_type == "hf" else args.target_pipeline_parallel_size
        _check_layer_list(args.num_layer_list, spec.num_layers, pp)
    if args.hf_cfg_dir is not None:
        _check_hf_cfg_dir(args.hf_cfg_dir, spec, where)
    return notes


def _check_layer_list(text: str, layers: int, pp: int) -> None:
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConversionError(f"--num-layer-list {text}: give layer counts separated by commas (4,4,4,4)") from None
    even = [layers // pp] * pp if layers % pp == 0 else None
    if counts != even:
        raise ConversionError(f"--num-layer-list {text}: pipeline stages here hold equal layer counts "
                              f"({','.join(map(str, even)) if even else f'{layers} layers do not split {pp} ways'} "
                              f"for {layers} layers over {pp} stages); drop the flag or make it even")


def _check_hf_cfg_dir(folder: str, spec, where: str) -> None:
    from mindspeed_llm.checkpoint.convert import spec_differences

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConversionError(f"--hf-cfg-dir {folder} has no config.json")
    diffs = spec_differences(spec, _hf_config_spec(folder))
    if diffs:
        listed = "; ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in list(diffs.items())[:4])
        raise ConversionError(f"--hf-cfg-dir {folder}: its config.json describes another model than {where} "
                              f"({listed})")


def check_adapter(args, adapter) -> None:
    """--lora-r / --lora-alpha / --lora-target-modules against what the adapter records."""
    config = adapter.config
    if args.lora_r is not None and args.lora_r != config.r:
        raise ConversionError(f"--lora-r {args.lora_r}, but the adapter {adapter.source} has r {config.r}")
    if args.lora_alpha is not None and not math.isclose(args.lora_alpha, config.alpha, rel_tol=1e-6):
        raise ConversionError(f"--lora-alpha {args.lora_alpha:g}, but the adapter {adapter.source} has alpha "
                              f"{config.alpha:g}")
    if args.lora_target_modules is not None and set(args.lora_target_modules) != set(config.target_modules):
        raise ConversionError(f"--lora-target-modules {' '.join(args.lora_target_modules)}, but the adapter "
                              f"{adapter.source} adapts {' '.join(config.target_modules)}")


def startup_lines(args) -> List[str]:
    """The 'ignored flags: ...' line (none when none was given)."""
    found = compat_flags.ignored_flags(args, compat_flags.CONVERT_IGNORED)
    if args.model_type is not None:  # only GPT gets here (convert_ckpt._mindspeed_flags refuses the rest)
        found["--model-type"] = "GPT is the only model type converted here"
    line = compat_flags.ignored_line(found)
    return [line] if line else []
