"""Megatron-LM's on-disk checkpoint layout, with atomic publication. Shared by convert_ckpt.py and training.

    <root>/latest_checkpointed_iteration.txt          "release" or the iteration number; written LAST
    <root>/release/mp_rank_TT/model_optim_rng.pt      PP == 1
    <root>/iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt   PP > 1 (TT = tp rank, PPP = pp rank)

Every `model_optim_rng.pt` is a dict (see `make_payload`):

    model               state dict of this rank's GPTModel (local layer indices; `_extra_state` entries None)
    checkpoint_version  3.0
    iteration           0 for release, else the training iteration
    model_spec          ModelSpec.to_dict() of the whole model
    args                argparse.Namespace with Megatron-LM's names: tensor_model_parallel_size,
                        pipeline_model_parallel_size, params_dtype (torch.dtype), bf16, fp16, value_head,
                        num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
                        kv_channels, padded_vocab_size, untie_embeddings_and_output_weights, ...
    tp_rank, pp_rank    where this shard belongs
    hf_config           (conversions only) the source config.json, so an export can keep e.g. pad_token_id
Training checkpoints add optimizer / scheduler / RNG entries next to these.

Publication: a checkpoint is written into `staging_dir(root, iteration)` (a dot-name no reader looks at),
moved into place with `publish` (os.replace of the whole directory), and only then is the tracker file
rewritten by `write_latest` (temp file + os.replace). A process killed at any point leaves either the
previous complete state or a dot-directory that nothing reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import uuid
from typing import Any, Dict, Optional, Tuple, Union

import torch

from mindspeed_llm.files import fsync_dir

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
RELEASE = "release"

Iteration = Union[int, str]


class CheckpointNotFoundError(FileNotFoundError):
    pass


# ------------------------------------------------------------------------------------------- names

def checkpoint_name(iteration: Iteration) -> str:
    """'release' or 'iter_0000010'."""
    if iteration == RELEASE:
        return RELEASE
    if isinstance(iteration, str) and iteration.isdigit():
        iteration = int(iteration)
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be 'release' or an int >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: Iteration) -> str:
    return os.path.join(os.fspath(root), checkpoint_name(iteration))


def shard_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def shard_path(ckpt_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """<ckpt_dir>/mp_rank_TT[_PPP]/model_optim_rng.pt"""
    return os.path.join(os.fspath(ckpt_dir), shard_dirname(tp_rank, pp_rank, pp_size), CHECKPOINT_FILE)


def staging_dir(root: str, iteration: Iteration) -> str:
    """Where a checkpoint is assembled before `publish` (same filesystem, so the move is a rename)."""
    return os.path.join(os.fspath(root), f".{checkpoint_name(iteration)}.staging")


# ------------------------------------------------------------------------------------------- atomic writes

def prepare_staging(root: str, iteration: Iteration) -> str:
    """A fresh, empty staging directory for `iteration` (a stale one from a killed run is removed)."""
    os.makedirs(os.fspath(root), exist_ok=True)
    path = staging_dir(root, iteration)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def publish(tmp_dir: str, final_dir: str) -> None:
    """Move the finished `tmp_dir` to `final_dir` (replacing an existing one) with directory renames.

    An existing `final_dir` is first renamed aside and removed after the new one is in place, so readers
    see the old directory, then (briefly) none, then the new one: never a mix.
    """
    tmp_dir, final_dir = os.fspath(tmp_dir), os.fspath(final_dir)
    if not os.path.isdir(tmp_dir):
        raise FileNotFoundError(f"cannot publish {tmp_dir}: it does not exist")
    parent = os.path.dirname(os.path.abspath(final_dir))
    old = None
    if os.path.lexists(final_dir):
        old = os.path.join(parent, f".{os.path.basename(final_dir)}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_latest(root: str, iteration: Iteration) -> None:
    """Point the tracker file at `iteration` ('release' or an int): temp file, fsync, os.replace."""
    root = os.fspath(root)
    text = RELEASE if iteration == RELEASE else str(int(iteration))
    tmp = os.path.join(root, f".{TRACKER_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER_FILE))
    fsync_dir(root)


def remove_latest(root: str) -> None:
    """Drop the tracker (before overwriting the checkpoint it points to), so a kill leaves nothing 'complete'."""
    path = os.path.join(os.fspath(root), TRACKER_FILE)
    if os.path.exists(path):
        os.remove(path)
        fsync_dir(os.fspath(root))


def read_latest(root: str) -> Iteration:
    """'release' or the int iteration named by <root>/latest_checkpointed_iteration.txt."""
    root = os.fspath(root)
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"no {TRACKER_FILE} in {root}: pass a directory written by convert_ckpt.py or --save"
        )
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointNotFoundError(f"{path} holds {text!r}: expected 'release' or an iteration number") from None


# ------------------------------------------------------------------------------------------- shards

def find_layout(ckpt_dir: str) -> Tuple[int, int]:
    """(tp, pp) of a checkpoint directory, from its mp_rank_* folders (which must form a full grid)."""
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    ranks = []
    for name in os.listdir(ckpt_dir):
        if not name.startswith("mp_rank_"):
            continue
        parts = name[len("mp_rank_"):].split("_")
        try:
            ranks.append((int(parts[0]), int(parts[1]) if len(parts) > 1 else None))
        except (ValueError, IndexError):
            continue
    if not ranks:
        raise CheckpointNotFoundError(f"no mp_rank_* shard folders in {ckpt_dir}")
    tp = max(r[0] for r in ranks) + 1
    pp = 1 if all(r[1] is None for r in ranks) else max(r[1] or 0 for r in ranks) + 1
    for t in range(tp):
        for p in range(pp):
            path = shard_path(ckpt_dir, t, p, pp)
            if not os.path.isfile(path):
                raise CheckpointNotFoundError(
                    f"{ckpt_dir} looks like a TP={tp} x PP={pp} checkpoint but {path} is missing"
                )
    return tp, pp


def resolve_dir(root: str, iteration: Optional[Iteration] = None) -> Tuple[str, Iteration]:
    """The checkpoint directory of `iteration` (default: the tracker's) under `root`."""
    if iteration is None:
        iteration = read_latest(root)
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"{os.path.join(os.fspath(root), TRACKER_FILE)} names iteration {iteration!r} but {path} does not exist"
        )
    return path, iteration


def _safe_globals():
    return torch.serialization.safe_globals([argparse.Namespace])


def load_file(path: str, map_location="cpu", weights_only: bool = True, mmap: bool = False) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"checkpoint shard {path} does not exist")
    with _safe_globals():
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)


def load_shard(root: str, tp_rank: int, pp_rank: int, iteration: Optional[Iteration] = None, *,
               map_location="cpu", weights_only: bool = True, mmap: bool = False) -> Dict[str, Any]:
    """The `model_optim_rng.pt` dict of (tp_rank, pp_rank) of `iteration` (default: latest) under `root`.

    The checkpoint's PP size is read from its folder names, so the path is right for any layout; a rank
    outside that layout raises, naming both.
    """
    path, _ = resolve_dir(root, iteration)
    tp, pp = find_layout(path)
    if tp_rank >= tp or pp_rank >= pp:
        raise CheckpointNotFoundError(
            f"{path} holds a TP={tp} x PP={pp} checkpoint; there is no shard for tp_rank={tp_rank}, "
            f"pp_rank={pp_rank}"
        )
    return load_file(shard_path(path, tp_rank, pp_rank, pp), map_location, weights_only, mmap)


def save_file(payload: Dict[str, Any], path: str) -> None:
    """torch.save `payload` to `path` (creating its folder) through a temp name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------- payloads

def make_args(spec, tp: int, pp: int, params_dtype: torch.dtype, value_head: bool, **extra) -> argparse.Namespace:
    """Megatron-LM style `args` for a checkpoint of `spec` (what its loaders and our stages read)."""
    values = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        value_head=value_head,
        orm=value_head,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        padded_vocab_size=spec.vocab_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rotary_base,
        normalization="RMSNorm",
        norm_epsilon=spec.norm_epsilon,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )
    values.update(extra)
    return argparse.Namespace(**values)


def make_payload(model_state: Dict[str, Any], spec, tp: int, pp: int, tp_rank: int, pp_rank: int,
                 params_dtype: torch.dtype, value_head: bool, iteration: Iteration = RELEASE,
                 **extra) -> Dict[str, Any]:
    """The dict saved as one rank's model_optim_rng.pt (extra keys, e.g. optimizer, are added as given)."""
    payload = {
        "model": model_state,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0 if iteration == RELEASE else int(iteration),
        "model_spec": spec.to_dict(),
        "args": make_args(spec, tp, pp, params_dtype, value_head),
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
    }
    payload.update(extra)
    return payload


def checkpoint_info(root: str, iteration: Optional[Iteration] = None) -> Dict[str, Any]:
    """What a checkpoint is, read from its first shard without loading tensors (mmap):
    {'dir', 'iteration', 'tp', 'pp', 'spec' (ModelSpec), 'params_dtype', 'value_head', 'hf_config'}."""
    from mindspeed_llm.models.spec import ModelSpec

    path, iteration = resolve_dir(root, iteration)
    tp, pp = find_layout(path)
    first = shard_path(path, 0, 0, pp)
    payload = load_file(first, mmap=True)
    if "model_spec" not in payload:
        raise ValueError(
            f"{first} has no model_spec: it was not written by convert_ckpt.py or this package's training "
            f"checkpoints, so the architecture cannot be known; convert the Hugging Face model with convert_ckpt.py"
        )
    args = payload.get("args")
    get = (lambda k, d=None: getattr(args, k, d)) if not isinstance(args, dict) else (lambda k, d=None: args.get(k, d))
    stored_tp, stored_pp = get("tensor_model_parallel_size", tp), get("pipeline_model_parallel_size", pp)
    if (stored_tp, stored_pp) != (tp, pp):
        raise ValueError(
            f"{path}: its shards say TP={stored_tp} x PP={stored_pp} but the folders form TP={tp} x PP={pp}"
        )
    dtype = get("params_dtype", torch.float32)
    return {
        "dir": path,
        "iteration": iteration,
        "tp": tp,
        "pp": pp,
        "spec": ModelSpec.from_dict(payload["model_spec"]),
        "params_dtype": dtype if isinstance(dtype, torch.dtype) else torch.float32,
        "value_head": bool(get("value_head", False)),
        "hf_config": payload.get("hf_config"),
    }


def load_spec(root: str, iteration: Optional[Iteration] = None):
    """The ModelSpec stored in the checkpoint under `root` (nothing is built, tensors are not read)."""
    return checkpoint_info(root, iteration)["spec"]
