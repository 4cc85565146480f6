"""Megatron-LM's on-disk checkpoint layout, with atomic publication. Shared by convert_ckpt.py and training.

    <root>/latest_checkpointed_iteration.txt          "release" or the iteration number; written LAST
    <root>/release/mp_rank_TT/model_optim_rng.pt      PP == 1
    <root>/iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt   PP > 1 (TT = tp rank, PPP = pp rank)
    <root>/iter_0000010/mp_rank_TT[_PPP]_EEE/...            expert parallel EP > 1 (EEE = expert-parallel rank)

A mixture-of-experts shard holds the dense tensors of its (tp, pp) rank and only the experts of its EP rank,
under their local indices (local expert j of EP rank e is global expert e * num_experts / EP + j), split
like the dense layers when the expert TP size equals TP and whole when it is 1 (MindSpeed's
--moe-tp-extend-ep). With expert TP 1 and TP > 1, megatron's ranks have tp rank = ep rank % TP, so only
those shards exist (`expected_shards`).

Every `model_optim_rng.pt` is a dict (see `make_payload`):

    model               state dict of this rank's GPTModel (local layer indices; `_extra_state` entries None)
    checkpoint_version  3.0
    iteration           0 for release, else the training iteration
    model_spec          ArchitectureSpec.to_dict() of the whole model
    args                argparse.Namespace with Megatron-LM's names: tensor_model_parallel_size,
                        pipeline_model_parallel_size, params_dtype (torch.dtype), bf16, fp16, value_head,
                        num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
                        kv_channels, padded_vocab_size, untie_embeddings_and_output_weights, ...
    tp_rank, pp_rank    where this shard belongs (ep_rank too; args record expert_model_parallel_size
                        and expert_tensor_parallel_size)
    hf_config           (conversions only) the source config.json, so an export can keep e.g. pad_token_id
Training checkpoints add optimizer / scheduler / RNG entries next to these; with --use-distributed-optimizer
each shard folder also holds `distrib_optim.pt` (Megatron-LM's layout: the sharded fp32 main weights and Adam
moments of the whole model shard, gathered from its data-parallel ranks in megatron's dp_zero format, which
loads at any DP size; `args.use_distributed_optimizer` and `args.data_parallel_size` record how it was saved).

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
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from mindspeed_llm.errors import UserError
from mindspeed_llm import files
from mindspeed_llm.files import WriteError, fsync_dir

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
OPTIMIZER_STATE_FILE = "distrib_optim.pt"  # Megatron-LM's name: the distributed optimizer's sharded state
CHECKPOINT_VERSION = 3.0
RELEASE = "release"

Iteration = Union[int, str]


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """No checkpoint where one was asked for; the message names the directory."""


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


def shard_dirname(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return name


def shard_path(ckpt_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """<ckpt_dir>/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt"""
    return os.path.join(os.fspath(ckpt_dir), shard_dirname(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        CHECKPOINT_FILE)


def optimizer_state_path(ckpt_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                         ep_size: int = 1) -> str:
    """<ckpt_dir>/mp_rank_TT[_PPP][_EEE]/distrib_optim.pt, beside the shard's model_optim_rng.pt."""
    return os.path.join(os.fspath(ckpt_dir), shard_dirname(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        OPTIMIZER_STATE_FILE)


class ShardLayout(NamedTuple):
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1  # expert tensor parallel: TP (experts split like the dense layers) or 1 (whole experts)


def model_expert_layout(model) -> Tuple[int, int, int]:
    """(EP, expert TP, EP rank) of a built model under megatron's parallel state; (1, TP, 0) when dense."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    spec = getattr(model, "model_spec", None)
    if spec is None or not spec.is_moe:
        return 1, tp, 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size() if ep > 1 else tp
    return ep, etp, parallel_state.get_expert_model_parallel_rank()


def expected_shards(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> List[Tuple[int, int, int]]:
    """(tp_rank, pp_rank, ep_rank) of every shard of a layout.

    Megatron orders both decompositions with TP innermost, so with expert TP == TP every (tp, ep) pair has a
    rank; with expert TP 1 the EP ranks run over the TP ranks too and tp_rank = ep_rank % TP.
    """
    etp = tp if etp is None else etp
    if ep == 1 or etp == tp:
        return [(t, p, e) for p in range(pp) for e in range(ep) for t in range(tp)]
    if etp != 1 or ep % tp:
        raise ValueError(f"expert tensor parallel {etp} with TP {tp} and EP {ep} is not a layout this package "
                         f"writes (expert TP must be 1 or TP; with 1, EP must be a multiple of TP)")
    return [(e % tp, p, e) for p in range(pp) for e in range(ep)]


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
    files.write_text_atomically(os.path.join(root, TRACKER_FILE), text + "\n", error=CheckpointWriteError)
    fsync_dir(root)


def remove_latest(root: str) -> None:
    """Drop the tracker (before overwriting the checkpoint it points to), so a kill leaves nothing 'complete'."""
    path = os.path.join(os.fspath(root), TRACKER_FILE)
    if os.path.exists(path):
        os.remove(path)
        fsync_dir(os.fspath(root))


def checkpoint_traces(root: str, role_names=("actor", "critic")) -> List[str]:
    """What under `root` belongs to a checkpoint of any kind, as paths relative to it: tracker files, `iter_*` and
    `release` directories, at the top and in each role's folder (staging leftovers, `.iter_*`, are not)."""
    traces = []
    for sub in ("", *dict.fromkeys((*role_names, "actor", "critic"))):
        folder = os.path.join(root, sub)
        if not os.path.isdir(folder):
            continue
        for entry in sorted(os.listdir(folder)):
            if entry == TRACKER_FILE or entry == RELEASE or (
                    entry.startswith("iter_") and entry[5:].isdigit()):
                traces.append(os.path.join(sub, entry))
    return traces


def conversion_target_problem(save_dir: str, save_model_type: str) -> Optional[str]:
    """Why convert_ckpt.py must not write into `save_dir` (None: it may): a training checkpoint there (its
    tracker would be replaced, and the next resume would start over its iterations) or anything but an earlier
    conversion of the same kind (a Megatron `release` model, or a Hugging Face folder)."""
    if not os.path.exists(save_dir):
        return None
    if not os.path.isdir(save_dir):
        return f"--save-dir {save_dir} is a file; pass a directory"
    entries = [e for e in os.listdir(save_dir) if not e.startswith(".")]
    if not entries:
        return None
    traces = checkpoint_traces(save_dir)
    training = [t for t in traces if t not in (TRACKER_FILE, RELEASE)]
    try:
        tracker = read_latest(save_dir) if TRACKER_FILE in traces else RELEASE
    except CheckpointNotFoundError:  # a tracker holding something else: not a conversion's
        tracker = None
    if training or tracker != RELEASE:
        return (f"--save-dir {save_dir} holds a training checkpoint ({', '.join(traces[:4])}"
                f"{' ...' if len(traces) > 4 else ''}): converting into it would replace its tracker and a later "
                "--load of it would start over; pass a new --save-dir")
    earlier = (set(traces) == {TRACKER_FILE, RELEASE}) if save_model_type == "mg" else \
        os.path.isfile(os.path.join(save_dir, "config.json"))
    if not earlier:
        return (f"--save-dir {save_dir} holds {', '.join(sorted(entries)[:4])}{' ...' if len(entries) > 4 else ''}, "
                f"not an earlier {save_model_type} conversion; pass a new or empty --save-dir")
    return None


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

def read_layout(ckpt_dir: str) -> ShardLayout:
    """The (tp, pp, ep, expert tp) of a checkpoint directory, from its mp_rank_* folders (which must hold every
    shard of that layout). `mp_rank_TT_NNN` is PP or EP by the shard's own args, as in Megatron-LM."""
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    ranks = []
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.startswith("mp_rank_"):
            continue
        try:
            ranks.append(tuple(int(part) for part in name[len("mp_rank_"):].split("_")))
        except ValueError:
            continue
    ranks = [r for r in ranks if 1 <= len(r) <= 3]
    if not ranks:
        raise CheckpointNotFoundError(f"no mp_rank_* shard folders in {ckpt_dir}")
    widths = {len(r) for r in ranks}
    if len(widths) > 1:
        raise CheckpointNotFoundError(f"{ckpt_dir} mixes shard folder names of different layouts (mp_rank_*)")
    width = widths.pop()
    tp = max(r[0] for r in ranks) + 1
    pp = ep = 1
    args = _shard_args(os.path.join(ckpt_dir, "mp_rank_" + "_".join(
        f"{v:02d}" if i == 0 else f"{v:03d}" for i, v in enumerate(ranks[0])), CHECKPOINT_FILE))
    if width == 3:
        pp, ep = max(r[1] for r in ranks) + 1, max(r[2] for r in ranks) + 1
    elif width == 2:
        if int(args("expert_model_parallel_size", 1) or 1) > 1 and int(args("pipeline_model_parallel_size", 1) or 1) == 1:
            ep = max(r[1] for r in ranks) + 1
        else:
            pp = max(r[1] for r in ranks) + 1
    # the shard's own TP / PP: a lost last folder (mp_rank_01 of a TP2 checkpoint) is a missing shard, not TP1
    tp = max(tp, int(args("tensor_model_parallel_size", tp) or tp))
    if width > 1 and ep == 1:
        pp = max(pp, int(args("pipeline_model_parallel_size", pp) or pp))
    etp = int(args("expert_tensor_parallel_size", tp) or tp) if ep > 1 else tp
    try:
        shards = expected_shards(tp, pp, ep, etp)
    except ValueError as exc:
        raise CheckpointNotFoundError(f"{ckpt_dir}: {exc}") from None
    for t, p, e in shards:
        path = shard_path(ckpt_dir, t, p, pp, e, ep)
        if not os.path.isfile(path):
            kind = f"TP={tp} x PP={pp}" + (f" x EP={ep}" if ep > 1 else "")
            raise CheckpointNotFoundError(f"{ckpt_dir} looks like a {kind} checkpoint but {path} is missing")
    return ShardLayout(tp, pp, ep, etp)


def _shard_args(path: str):
    """A getter of `args` entries of the shard at `path` (memory-mapped; missing file or key -> default)."""
    try:
        args = load_file(path, mmap=True).get("args")
    except Exception:  # unreadable shards are reported by whoever loads them, with the file named
        args = None
    if isinstance(args, dict):
        return lambda key, default=None: args.get(key, default)
    return lambda key, default=None: getattr(args, key, default)


def find_layout(ckpt_dir: str) -> Tuple[int, int]:
    """(tp, pp) of a checkpoint directory (see `read_layout` for expert parallelism)."""
    found = read_layout(ckpt_dir)
    return found.tp, found.pp


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


class CheckpointReadError(UserError, ValueError):
    """A checkpoint file exists but cannot be read (truncated, zero-filled, overwritten); the message names it."""


def load_file(path: str, map_location="cpu", weights_only: bool = True, mmap: bool = False) -> Dict[str, Any]:
    """torch.load of a checkpoint file; a missing one raises `CheckpointNotFoundError`, a damaged one
    `CheckpointReadError`, both naming the file."""
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"checkpoint shard {path} does not exist")
    try:
        with _safe_globals():
            return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except Exception as exc:  # torch raises any of several types for a damaged file
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointReadError(f"{path} cannot be read: it is truncated or corrupt ({detail}); copy it again or "
                                  "convert from another checkpoint") from exc


def load_shard(root: str, tp_rank: int, pp_rank: int, iteration: Optional[Iteration] = None, ep_rank: int = 0, *,
               map_location="cpu", weights_only: bool = True, mmap: bool = False) -> Dict[str, Any]:
    """The `model_optim_rng.pt` dict of (tp_rank, pp_rank, ep_rank) of `iteration` (default: latest) under
    `root`.

    The checkpoint's layout is read from its folder names, so the path is right for any layout; a rank
    outside that layout raises, naming both.
    """
    path, _ = resolve_dir(root, iteration)
    found = read_layout(path)
    if (tp_rank, pp_rank, ep_rank) not in expected_shards(*found):
        raise CheckpointNotFoundError(
            f"{path} holds a TP={found.tp} x PP={found.pp}" + (f" x EP={found.ep}" if found.ep > 1 else "") +
            f" checkpoint; there is no shard for tp_rank={tp_rank}, pp_rank={pp_rank}" +
            (f", ep_rank={ep_rank}" if found.ep > 1 or ep_rank else "")
        )
    return load_file(shard_path(path, tp_rank, pp_rank, found.pp, ep_rank, found.ep), map_location, weights_only,
                     mmap)


class CheckpointWriteError(WriteError):
    """A checkpoint file could not be written; the message names the file and the cause (a full disk by name)."""


def write_atomically(path: str, write) -> None:
    """`write(tmp)` to a temp name beside `path`, then renamed into place; a failure removes the temp file and raises
    `CheckpointWriteError` naming `path` (the previous file, if any, stays): `files.write_atomically`."""
    files.write_atomically(path, write, error=CheckpointWriteError)


def save_file(payload: Dict[str, Any], path: str) -> None:
    """torch.save `payload` to `path` (creating its folder) through a temp name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomically(path, lambda tmp: torch.save(payload, tmp))


# ------------------------------------------------------------------------------------------- payloads

def make_args(spec, tp: int, pp: int, params_dtype: torch.dtype, value_head: bool, ep: int = 1,
              etp: Optional[int] = None, **extra) -> argparse.Namespace:
    """Megatron-LM style `args` for a checkpoint of `spec` (what its loaders and our stages read)."""
    values = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
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
    if spec.is_moe:
        values.update(
            num_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk,
            moe_router_pre_softmax=spec.moe_router_pre_softmax,
            moe_router_score_function=spec.moe_router_score_function,
            moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            moe_layer_freq=spec.moe_layers(),
        )
    values.update(extra)
    return argparse.Namespace(**values)


def make_payload(model_state: Dict[str, Any], spec, tp: int, pp: int, tp_rank: int, pp_rank: int,
                 params_dtype: torch.dtype, value_head: bool, iteration: Iteration = RELEASE, *,
                 ep: int = 1, etp: Optional[int] = None, ep_rank: int = 0, **extra) -> Dict[str, Any]:
    """The dict saved as one rank's model_optim_rng.pt (extra keys, e.g. optimizer, are added as given)."""
    payload = {
        "model": model_state,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0 if iteration == RELEASE else int(iteration),
        "model_spec": spec.to_dict(),
        "args": make_args(spec, tp, pp, params_dtype, value_head, ep=ep, etp=etp),
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "ep_rank": ep_rank,
    }
    payload.update(extra)
    return payload


def checkpoint_info(root: str, iteration: Optional[Iteration] = None) -> Dict[str, Any]:
    """What a checkpoint is, read from its first shard without loading tensors (mmap):
    {'dir', 'iteration', 'tp', 'pp', 'ep', 'etp', 'spec' (ArchitectureSpec), 'params_dtype', 'value_head', 'hf_config',
    'hf_source', 'lora' (whether it holds LoRA adapters only)}."""
    from mindspeed_llm.models.architecture import ArchitectureSpec

    path, iteration = resolve_dir(root, iteration)
    tp, pp, ep, etp = read_layout(path)
    first = shard_path(path, 0, 0, pp, 0, ep)
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
        "ep": ep,
        "etp": etp,
        "spec": ArchitectureSpec.from_dict(payload["model_spec"]),
        "params_dtype": dtype if isinstance(dtype, torch.dtype) else torch.float32,
        "value_head": bool(get("value_head", False)),
        "hf_config": payload.get("hf_config"),
        "hf_source": payload.get("hf_source"),  # the Hugging Face folder convert_ckpt.py read (checkpoint/lora.py)
        "lora": payload.get("lora") is not None,  # a LoRA run's checkpoint: adapters only (checkpoint/lora.py)
    }


def load_spec(root: str, iteration: Optional[Iteration] = None):
    """The ArchitectureSpec stored in the checkpoint under `root` (nothing is built, tensors are not read)."""
    return checkpoint_info(root, iteration)["spec"]
