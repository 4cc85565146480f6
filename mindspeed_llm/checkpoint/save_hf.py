"""`--save-hf`: the actor of a checkpoint as a Hugging Face folder, `<save>/actor/iter_N/hf/` (its files:
`hf_export.py`), written into the checkpoint's staging directory and published with it.

Each pipeline stage's layers are written by one rank (the one writing that stage's TP-rank-0 shard), one layer
at a time from the just-written shards; rank 0 writes the index, config.json and tokenizer and renames
`hf.partial/` to `hf/`. A LoRA actor (a checkpoint of adapters only) gives PEFT's adapter folder, or with
--save-hf-merge-lora its adapters merged into the base it was trained on. A failed write names the file and
leaves nothing of the folder.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from mindspeed_llm.checkpoint import hf_files, lora, run_record
from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint.hf_export import HF_DIR, PARTIAL, dir_info, finish, write_stage
from mindspeed_llm.distributed import broadcast_object, gather_messages, is_rank_0
from mindspeed_llm.errors import UserError
from mindspeed_llm.files import write_error_message


@dataclass(frozen=True)
class SaveHF:
    """`--save-hf`: where the tokenizer files may be (the first folder holding some is copied in: the run's
    tokenizer, else the converted model's); `merge_lora` (--save-hf-merge-lora): a LoRA actor's adapters merged into
    full weights instead of a PEFT adapter folder."""
    tokenizers: Tuple[str, ...] = ()
    merge_lora: bool = False


def write_folder(ckpt_dir: str, stages: Sequence[int], options: SaveHF, lora_base: str = "") -> Tuple[dict, Optional[str]]:
    """`ckpt_dir/hf/` from the (staged) checkpoint in `ckpt_dir`: this rank writes the pipeline stages `stages` (one
    rank per stage: the stage's TP rank 0 of its writing DP rank; all of them in a single process), rank 0 the rest
    and the rename. A collective. Returns (what the run record notes of it, the error naming the file or None); on
    an error nothing of the folder is left."""
    partial = os.path.join(ckpt_dir, PARTIAL)
    problem = None
    if is_rank_0():
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as exc:  # a read-only checkpoint directory
            problem = write_error_message(partial, exc)
    problem = broadcast_object(problem)
    if problem:
        return {}, problem
    info = dir_info(ckpt_dir)
    kind = "model" if not info["lora"] else "merged" if options.merge_lora else "peft"
    mine: Tuple[Dict[str, str], int] = ({}, 0)
    error = None
    try:
        if kind == "peft":
            if is_rank_0():
                _write_peft(ckpt_dir, info, partial, lora_base)
        elif stages:
            source, transform = info, None
            if kind == "merged":
                adapter = lora.read_checkpoint_dir(ckpt_dir)
                source = layout.checkpoint_info(lora_base)
                transform = lambda full: lora.merge_into(full, adapter.tensors, adapter.scaling, strict=False)  # noqa: E731
            maps, total = {}, 0
            for stage in stages:
                weight_map, nbytes = write_stage(source, stage, partial, transform)
                maps.update(weight_map)
                total += nbytes
            mine = (maps, total)
    except Exception as exc:  # noqa: BLE001 (a WriteError naming the file; anything else named by its type)
        error = _message(exc)
    parts = _gather(mine)
    errors = gather_messages(error)
    if not errors and is_rank_0():
        try:
            if kind != "peft":
                weight_map = {name: file for part, _ in parts for name, file in part.items()}
                finish(partial, info if kind == "model" else layout.checkpoint_info(lora_base), weight_map,
                       sum(n for _, n in parts))
            for source in options.tokenizers:
                if hf_files.copy_tokenizer_files(source, partial):
                    break
            shutil.rmtree(os.path.join(ckpt_dir, HF_DIR), ignore_errors=True)  # (a staging directory has none)
            os.replace(partial, os.path.join(ckpt_dir, HF_DIR))
        except Exception as exc:  # noqa: BLE001
            errors = [_message(exc)]
    if is_rank_0() and errors:
        shutil.rmtree(partial, ignore_errors=True)
    problem = broadcast_object("; ".join(errors) if errors else None)
    return {"dir": HF_DIR, "format": kind}, problem


def _write_peft(ckpt_dir: str, info, out_dir: str, lora_base: str) -> None:
    adapter = lora.read_checkpoint_dir(ckpt_dir)
    base_name = None
    if lora_base:  # the Hugging Face folder the base was converted from, which peft loads the adapter onto
        base_name = layout.checkpoint_info(lora_base).get("hf_source") or os.path.abspath(lora_base)
    lora.write_peft(adapter, info["spec"], out_dir, base_name=base_name)


def _message(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (UserError, OSError)) else f"{type(exc).__name__}: {exc}"


def _gather(obj) -> list:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_actor(staging_dir: str, stages: Sequence[int], options: SaveHF, lora_base: str,
                record: Optional[dict]) -> Optional[str]:
    """The actor's folder inside its staging directory (`write_folder`); on success the actor's run record notes it
    ({"hf": {"dir", "format"}}). A collective; returns the error (the same on every rank) or None."""
    entry, problem = write_folder(staging_dir, stages, options, lora_base)
    if problem is None and record is not None and is_rank_0():
        try:
            run_record.write(staging_dir, {**record, "hf": entry})
        except OSError as exc:  # a CheckpointWriteError naming the file
            problem = str(exc)
            shutil.rmtree(os.path.join(staging_dir, HF_DIR), ignore_errors=True)
    return broadcast_object(problem)
