"""Megatron shards -> Hugging Face tensors, streamed one layer at a time, and the files of `--save-hf`'s folder.

`stage_hf_groups(info, stage)` is the one Megatron -> HF path: `convert.convert_mg_to_hf` collects it into one
dict, `--save-hf` (`save_hf.py`) writes each group as it comes (`write_stage`). A stage's shards are memory-mapped
and merged over TP (and EP) one layer at a time, so a writer holds one layer's full tensors at a time.

`--save-hf`'s folder, `<save>/actor/iter_N/hf/`:

    model-00001-of-000NN.safetensors          the embeddings (first stage)
    model-000KK-of-000NN.safetensors          decoder layer KK-2, written by its pipeline stage's writer rank
    model-000NN-of-000NN.safetensors          the final norm and output layer (last stage)
    model.safetensors.index.json, config.json, tokenizer files
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterator, Tuple

import torch

from mindspeed_llm.checkpoint import hf_files
from mindspeed_llm.checkpoint import hf_mapping as hfm
from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint import megatron_names, sharding

HF_DIR = "hf"  # the folder's name inside a checkpoint's iteration directory
PARTIAL = "hf.partial"
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------------------------- streaming
def _stage_shards(info, stage: int) -> Dict[Tuple[int, int], Dict[str, torch.Tensor]]:
    """{(tp_rank, ep_rank): model state} of one stage, memory-mapped (nothing is read until a tensor is used)."""
    tp, pp, ep = info["tp"], info["pp"], info.get("ep", 1)
    etp = info.get("etp", tp)
    out = {}
    for t, p, e in layout.expected_shards(tp, pp, ep, etp):
        if p == stage:
            path = layout.shard_path(info["dir"], t, stage, pp, ep_rank=e, ep_size=ep)
            out[(t, e)] = layout.load_file(path, mmap=True)["model"]  # unreadable: CheckpointReadError names it
    return out


def _merge(info, shards, names) -> Dict[str, torch.Tensor]:
    """The unsplit tensors `names` (local names) of one stage."""
    subset = {key: {n: state[n] for n in names} for key, state in shards.items()}
    if not info["spec"].is_moe:
        return sharding.merge_stage([subset[k] for k in sorted(subset)], info["value_head"])
    return sharding.merge_stage_experts(subset, info["spec"], info["tp"], info.get("ep", 1),
                                        info.get("etp", info["tp"]), info["value_head"])


def stage_hf_groups(info, stage: int, transform=None, finite=None) -> Iterator[Tuple[object, Dict[str, torch.Tensor]]]:
    """(key, {HF name: tensor}) of pipeline stage `stage` of the checkpoint `info` (`layout.checkpoint_info`): one
    group per decoder layer (key: its global index), then the stage's other tensors (key: "embed" for the word
    embeddings, "final" for the final norm and the head). `transform(full)` sees each group's full Megatron tensors
    (global names) first (a LoRA merge); `finite` (`convert._FiniteCheck`) checks them."""
    spec, pp, value_head = info["spec"], info["pp"], info["value_head"]
    shards = _stage_shards(info, stage)
    first = shards[min(shards)]
    layers: Dict[int, list] = {}
    rest = []
    for name in first:
        if sharding.is_extra_state(name):
            continue
        match = _LOCAL_LAYER.match(name)
        (layers.setdefault(int(match.group(1)), []) if match else rest).append(name)

    def full_of(names):
        full = sharding.stage_to_full(_merge(info, shards, names), spec, pp, stage, value_head)
        if transform is not None:
            transform(full)
        if finite is not None:
            finite.check_all(full)
        return full

    for local in sorted(layers):
        full = full_of(layers[local])
        index = sharding.stage_layers(spec.num_layers, pp, stage)[local]
        layer = {rel: full.pop(megatron_names.layer_key(index, rel))
                 for rel in megatron_names.mg_layer_names(spec, index)}
        yield index, hfm.mg_layer_to_hf(layer, spec, index)
    if rest:
        hf = hfm.mg_nonlayer_to_hf(full_of(rest), spec, value_head)
        embed = {n: t for n, t in hf.items() if n.endswith(hf_files.HF_EMBED)}
        if embed:
            yield "embed", embed
        final = {n: t for n, t in hf.items() if n not in embed}
        if final:
            yield "final", final


def cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exported dtype: the checkpoint's, except DeepSeek-V3's expert bias (fp32 in transformers too)."""
    return tensor.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)


# ------------------------------------------------------------------------------------------- --save-hf
def file_name(key, num_layers: int) -> str:
    """The safetensors file of a group: the embeddings first, the layers in order, the final norm and head last."""
    total = num_layers + 2
    number = 1 if key == "embed" else total if key == "final" else int(key) + 2
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def write_stage(info, stage: int, out_dir: str, transform=None) -> Tuple[Dict[str, str], int]:
    """Write stage `stage`'s groups into `out_dir`, one file each (temp name, then renamed; a failure names the
    file); returns ({HF name: file}, bytes written). A later stage leaves out the word embeddings the first one
    writes (the tied copy a last stage may hold)."""
    from safetensors.torch import save_file

    from mindspeed_llm.files import write_atomically

    weight_map: Dict[str, str] = {}
    nbytes = 0
    for key, tensors in stage_hf_groups(info, stage, transform):
        if key == "embed" and stage != 0:
            continue
        file = file_name(key, info["spec"].num_layers)
        names = list(tensors)
        state = dict(zip(names, hf_files._independent(cast(n, tensors[n], info["params_dtype"]) for n in names)))
        write_atomically(os.path.join(out_dir, file), lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        weight_map.update({n: file for n in state})
        nbytes += sum(t.numel() * t.element_size() for t in state.values())
        del state, tensors
    return weight_map, nbytes


def finish(out_dir: str, info, weight_map: Dict[str, str], nbytes: int) -> None:
    """The index and config.json of a folder whose weights `write_stage` wrote."""
    ordered = dict(sorted(weight_map.items(), key=lambda item: (item[1], item[0])))
    hf_files.write_json_atomic(os.path.join(out_dir, "model.safetensors.index.json"),
                               {"metadata": {"total_size": nbytes}, "weight_map": ordered})
    write_config(out_dir, info)


def write_config(out_dir: str, info) -> None:
    """config.json of the checkpoint's model, in its dtype (a converted source's pad_token_id kept)."""
    config = info["spec"].to_hf_config(torch_dtype=_DTYPE_NAMES[info["params_dtype"]], value_head=info["value_head"])
    source = info.get("hf_config") or {}
    if source.get("pad_token_id") is not None:
        config["pad_token_id"] = source["pad_token_id"]  # a reward model's pooling position depends on it
    hf_files.write_json_atomic(os.path.join(out_dir, "config.json"), config)


def dir_info(ckpt_dir: str):
    """What `layout.checkpoint_info` says of a checkpoint directory itself (a staging directory has no tracker)."""
    from mindspeed_llm.models.architecture import ArchitectureSpec

    tp, pp, ep, etp = layout.read_layout(ckpt_dir)
    payload = layout.load_file(layout.shard_path(ckpt_dir, 0, 0, pp, 0, ep), mmap=True, weights_only=False)
    args = payload.get("args")
    dtype = getattr(args, "params_dtype", torch.float32)
    return {"dir": ckpt_dir, "tp": tp, "pp": pp, "ep": ep, "etp": etp,
            "spec": ArchitectureSpec.from_dict(payload["model_spec"]),
            "params_dtype": dtype if isinstance(dtype, torch.dtype) else torch.float32,
            "value_head": bool(getattr(args, "value_head", False)), "hf_config": payload.get("hf_config"),
            "hf_source": payload.get("hf_source"), "lora": payload.get("lora") is not None}
