"""What a rollout dump records of the run that made it, and what a replay checks with it (`rollout_dump.py`):

* the model: the --load / --ref-model paths and the layout (manifest), and a fingerprint of the actor's weights when
  each iteration's rollouts were made (`done.json`); a replay compares its actor's at its first iteration (the
  checkpoint it started from), where the layouts agree;
* the tokenizer: its vocabulary's size and a hash (manifest);
* the dataset: --data-path, its size (manifest), and a hash of the prompts each DP rank drew first at each
  iteration (their indices and token ids; the rank's first generation batch's `.json`), so another dataset of the
  same size is refused by name;
* each batch read back: a file that cannot be read (zero-filled, truncated) and tensors that disagree with each other
  or with the model's vocabulary are a `DumpError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Dict, Optional, Sequence

import torch

from mindspeed_llm.errors import UserError

# the tensors every batch has, and those that are response-aligned [B, R]
REQUIRED = ("tokens", "prompt_lengths", "responses", "response_mask", "ended_with_eos", "scores")
RESPONSE_ALIGNED = ("responses", "response_mask", "rollout_logp", "tool_mask")
_CHUNK = 1 << 22  # elements of a weight summed at once in float64 (32 MiB)
WEIGHTS_RTOL = 1e-9  # float64 sums of the same weights agree to rounding (thread counts may order them otherwise)


class DumpError(UserError):
    """A rollout dump's file cannot be read, or holds tensors that disagree: the message names the file."""


def _damaged(path: str, what: str) -> DumpError:
    return DumpError(f"--rollout-replay-dir: {path} {what}: the dump is damaged; dump that iteration again (rerun the "
                     "dumping run from the checkpoint before it), or replay only the iterations before it "
                     "(--train-iters)")


def read_json(path: str) -> dict:
    """A dump's JSON file (a batch's record, `done.json`), or a `DumpError` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise _damaged(path, "is missing") from None
    except (OSError, ValueError) as exc:  # a truncated or zero-filled file: JSONDecodeError / UnicodeDecodeError
        raise _damaged(path, f"cannot be read ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(value, dict):
        raise _damaged(path, f"holds a {type(value).__name__}, not a JSON object")
    return value


def read_tensors(path: str) -> Dict[str, torch.Tensor]:
    """A batch's `.pt` file, or a `DumpError` naming it (torch's own errors do not)."""
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _damaged(path, "is missing") from None
    except Exception as exc:  # noqa: BLE001 - zip, unpickling and EOF errors of a truncated or zero-filled file
        raise _damaged(path, f"cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise _damaged(path, "is not a dict of tensors")
    return tensors


def check_batch(path: str, tensors: Dict[str, torch.Tensor], record: dict, vocab_size: Optional[int]) -> None:
    """The tensors of `path` (and its record's per-sample lists) agree with each other and with the vocabulary
    (`vocab_size`: the model's; None: not checked): `DumpError` naming the file and what disagrees otherwise."""
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise _damaged(path, f"lacks the tensor{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    tokens, responses = tensors["tokens"], tensors["responses"]
    if tokens.dim() != 2 or responses.dim() != 2 or tokens.dtype.is_floating_point or \
            responses.dtype.is_floating_point:
        raise _damaged(path, f"holds tokens {list(tokens.shape)} and responses {list(responses.shape)}: both must be "
                             "[rows, length] token ids")
    rows, width = tokens.shape
    for name in ("prompt_lengths", "ended_with_eos", "scores"):
        if list(tensors[name].shape) != [rows]:
            raise _damaged(path, f"holds {name} of shape {list(tensors[name].shape)} for {rows} rows of tokens")
    for name in RESPONSE_ALIGNED:
        if name in tensors and list(tensors[name].shape) != list(responses.shape):
            raise _damaged(path, f"holds {name} of shape {list(tensors[name].shape)}, responses "
                                 f"{list(responses.shape)}: the response-aligned tensors disagree")
    if "routing" in tensors and (tensors["routing"].shape[0] != rows or tensors["routing"].dim() < 3 or
                                 tensors["routing"].shape[2] != width):
        raise _damaged(path, f"holds routing of shape {list(tensors['routing'].shape)} for tokens {[rows, width]}")
    if not bool(torch.isfinite(tensors["scores"].float()).all()):
        raise _damaged(path, "holds a score that is not a finite number")
    prompt_lengths = tensors["prompt_lengths"].long()
    lengths = (tensors["response_mask"] != 0).sum(-1).long()
    if bool((prompt_lengths < 1).any()) or bool((prompt_lengths + lengths > width).any()):
        row = int(((prompt_lengths < 1) | (prompt_lengths + lengths > width)).nonzero()[0])
        raise _damaged(path, f"row {row}: prompt length {int(prompt_lengths[row])} and response length "
                             f"{int(lengths[row])} (its response_mask) do not fit its {width} tokens")
    for row in range(rows):  # the responses are the tokens after the prompt (`experience.py`)
        start, count = int(prompt_lengths[row]), int(lengths[row])
        if not torch.equal(tokens[row, start:start + count], responses[row, :count]):
            raise _damaged(path, f"row {row}: its responses are not its tokens after the prompt (response length "
                                 f"{count} by its response_mask)")
    if vocab_size is not None and rows:
        low, high = int(min(tokens.min(), responses.min())), int(max(tokens.max(), responses.max()))
        if low < 0 or high >= vocab_size:
            raise _damaged(path, f"holds token id {low if low < 0 else high}, outside the model's vocabulary "
                                 f"(0 .. {vocab_size - 1}): the dump was made with another model or tokenizer")
    for name, values in dict(record.get("sample_data") or {}).items():
        lists = values.items() if name == "columns" and isinstance(values, dict) else [(name, values)]
        for key, column in lists:
            if column is not None and (not isinstance(column, list) or len(column) != rows):
                size = len(column) if isinstance(column, list) else type(column).__name__
                raise _damaged(os.path.splitext(path)[0] + ".json",
                               f"holds {key} for {size} rows, its tensors {rows} rows")


# ------------------------------------------------------------------------------------------------ identities
def tokenizer_identity(tokenizer) -> Optional[dict]:
    """The tokenizer's vocabulary: its size and a hash of its (token, id) pairs (None: not a `transformers` one)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = sorted(get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {"vocab_size": len(vocab), "sha256": digest[:16]}


def dataset_size(data_path: Optional[str]) -> Optional[int]:
    """The prompts at --data-path, from its manifest (`<prefix>_meta.json`; None: not readable there)."""
    from mindspeed_llm.data.writer import meta_path

    if not data_path:
        return None
    try:
        with open(meta_path(data_path), encoding="utf-8") as f:
            return int(json.load(f)["num_samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prompts_digest(rows: Sequence[dict]) -> str:
    """A hash of prompt rows (each one's dataset index and token ids): the same prompts give the same digest."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([row.get("index"), [int(i) for i in row.get("input_ids", ())]]).encode("ascii"))
    return h.hexdigest()[:16]


def layout() -> list:
    """[TP, PP, EP, CP] of this run (the weights' fingerprint is comparable between runs of one layout)."""
    try:
        from megatron.core import parallel_state as ps

        return [ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size()]
    except Exception:  # noqa: BLE001 - model parallelism not initialised (one process)
        return [1, 1, 1, 1]


def weights_fingerprint(module) -> Optional[list]:
    """[parameters, sum, sum of squares] of `module`'s weights in float64, over the model-parallel ranks (every
    rank gets the same; a collective where model parallelism is initialised). None without a module."""
    if module is None:
        return None
    total = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            total[0] += p.numel()
            for chunk in p.detach().reshape(-1).split(_CHUNK):  # float64 a chunk at a time: no copy of a whole weight
                chunk = chunk.double()
                total[1] += chunk.sum().item()
                total[2] += chunk.dot(chunk).item()
    try:
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group() if torch.distributed.is_initialized() else None
    except Exception:  # noqa: BLE001
        group = None
    if group is not None and torch.distributed.get_world_size(group) > 1:
        from mindspeed_llm import device

        on = total.to(device.current_device())
        torch.distributed.all_reduce(on, group=group)
        total = on.cpu()
    return [float(x) for x in total]


def same_weights(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) == 3 and a[0] == b[0] and all(
        math.isclose(x, y, rel_tol=WEIGHTS_RTOL, abs_tol=1e-12) for x, y in zip(a[1:], b[1:]))
