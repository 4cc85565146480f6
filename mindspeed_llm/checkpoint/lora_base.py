"""Whether an adapter meets the base it was trained on (issue 39): wherever an adapter is applied -- a training run's
`--lora-load`, `convert_ckpt.py --lora-load` merging to either format, `--save-lora-to-hf` -- its base is checked.

The base fingerprint (`fingerprint`): sha256 over each frozen tensor's local name, shape and a strided sample of at
most 4096 of its values as float32, per rank (what `rl/update/lora.base_fingerprint` records in every shard). `BaseCheck`
recomputes it from the base's full tensors for each shard of an adapter checkpoint (its TP / PP / EP slices, cast
to the precision it trained in), so that a conversion and a `--lora-load` at another layout refuse another base;
a PEFT folder carries no fingerprint, so its `base_model_name_or_path` is compared with the base's names
(`peft_base_problem`). `--allow-base-mismatch` (both programs) applies an adapter to another base anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from mindspeed_llm.checkpoint import hf_files
from mindspeed_llm.checkpoint import hf_mapping as hfm
from mindspeed_llm.checkpoint import megatron_names, sharding

FINGERPRINT_SAMPLES = 4096


def _sample(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> bytes:
    """A strided sample of at most FINGERPRINT_SAMPLES values of `tensor` (cast to `dtype` first: the values a model
    in that precision holds) as float32 bytes."""
    flat = tensor.detach().reshape(-1)
    picked = flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
    if dtype is not None:
        picked = picked.to(dtype)
    # a copy: `.numpy()` of a view would mark the weight's own storage non-resizable (offload resizes it)
    return picked.float().cpu().clone().numpy().tobytes()


def _digest(samples: Dict[str, Tuple[tuple, bytes]]) -> str:
    digest = hashlib.sha256()
    for name in sorted(samples):
        shape, sample = samples[name]
        digest.update(f"{name}:{shape}:".encode())
        digest.update(sample)
    return digest.hexdigest()


def fingerprint(named_tensors) -> str:
    """The base fingerprint of one rank's frozen tensors ((local name, tensor) pairs): the module docstring's."""
    return _digest({name: (tuple(t.shape), _sample(t)) for name, t in named_tensors})


class BaseCheck:
    """The fingerprint each shard of an adapter checkpoint (`lora.Adapter`) recorded for its base, recomputed from a base's full
    tensors (global names, as a conversion streams them: `add` before anything is merged into them)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.tp, self.pp, self.ep, self.etp = adapter.layout
        self.spec = adapter.spec
        self.samples: Dict[tuple, Dict[str, Tuple[tuple, bytes]]] = {key: {} for key in adapter.shard_bases}

    def _placements(self, name: str):
        """(pipeline stage, local name) of every copy a model at the adapter's layout holds of full tensor `name`."""
        spec, pp = self.spec, self.pp
        if name == megatron_names.EMBED:
            yield 0, name
            if spec.tie_word_embeddings and not self.adapter.value_head and pp > 1:
                yield pp - 1, megatron_names.OUTPUT  # the last stage's copy of the tied embeddings
            return
        if name in (megatron_names.FINAL_NORM, megatron_names.OUTPUT):
            yield pp - 1, name
            return
        match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if not match:
            return
        per = spec.num_layers // pp
        index = int(match.group(1))
        yield index // per, f"decoder.layers.{index % per}.{match.group(2)}"

    def add(self, full: Dict[str, torch.Tensor]) -> None:
        dtype = self.adapter.params_dtype
        for name, tensor in full.items():
            if name.endswith(megatron_names.EXPERT_BIAS) or (self.adapter.value_head and name == megatron_names.OUTPUT):
                continue  # a buffer, not a parameter; a critic's head trains
            for stage, local in self._placements(name):
                keys = [k for k in self.samples if k[1] == stage]
                if not keys:
                    continue
                j = sharding.expert_index(local)
                if j is None:
                    pieces = sharding.split_tensor(local, tensor, self.tp, self.adapter.value_head)
                    for t, _, e in keys:
                        self.samples[(t, stage, e)][local] = (tuple(pieces[t].shape), _sample(pieces[t], dtype))
                    continue
                per_rank = self.spec.num_experts // self.ep
                e = j // per_rank
                local = sharding.with_expert_index(local, j % per_rank)
                pieces = [tensor] * self.tp if self.etp == 1 else sharding.split_tensor(local, tensor, self.etp)
                for t, _, e2 in keys:
                    if e2 == e:
                        self.samples[(t, stage, e)][local] = (tuple(pieces[t].shape), _sample(pieces[t], dtype))

    def problem(self, base: str) -> Optional[str]:
        """None when every shard's recorded fingerprint is the one of `base` (named in the message), else why not."""
        differ = [key for key, samples in sorted(self.samples.items())
                  if self.adapter.shard_bases[key].get("fingerprint") != _digest(samples)]
        if not differ:
            return None
        return base_mismatch(self.adapter, base)


def base_mismatch(adapter, base: str) -> str:
    recorded = (adapter.base or {}).get("path") or "a base it does not name"
    return (f"--lora-load {adapter.source}: its adapters were trained on {recorded}, whose weights differ from "
            f"{base}'s (another model of the same shape, or another precision than the adapter's "
            f"{str(adapter.params_dtype).replace('torch.', '')}); pass the base they were trained on, or "
            "--allow-base-mismatch to apply them to this one anyway")


def base_names(root: str, info: Optional[dict] = None, hf_config: Optional[dict] = None) -> List[str]:
    """What a base model is called: its folder, the Hugging Face folder a Megatron base was converted from, the
    `_name_or_path` of its config.json (what a PEFT folder's `base_model_name_or_path` may hold)."""
    names = [os.path.abspath(root)]
    if info and info.get("hf_source"):
        names.append(info["hf_source"])
    config = hf_config if hf_config is not None else (info or {}).get("hf_config") or {}
    if config.get("_name_or_path"):
        names.append(str(config["_name_or_path"]))
    return names


def _name_tail(name: str) -> str:
    return os.path.normpath(name).rstrip("/").rsplit("/", 1)[-1].lower()


def peft_base_problem(adapter, names: List[str], base: str) -> Optional[str]:
    """A PEFT folder's `base_model_name_or_path` against the base's `names` (`base_names`): the same folder when it
    names one on this machine, else the same last component (a Hub id `org/Model` for a local `.../Model`); None
    when it matches or names nothing."""
    wanted = (adapter.base or {}).get("name")
    if not wanted:
        return None
    local = os.path.exists(wanted)  # a folder on this machine is that folder; a Hub id matches by its last part
    for name in names:
        if local and os.path.exists(name) and os.path.samefile(wanted, name):
            return None
        if not local and _name_tail(wanted) == _name_tail(name):
            return None
    return (f"--lora-load {adapter.source}: its adapter_config.json names the base {wanted!r}, not {base} "
            f"({', '.join(repr(n) for n in names[1:]) or 'no other name'} known for it); pass the base it was "
            "trained on, or --allow-base-mismatch to apply it to this one anyway")


def base_stages(load_dir: str, hf: bool, spec, value_head: bool, iteration=None):
    """The full tensors (global Megatron names) of a base model, one pipeline stage (Megatron) or layer (Hugging
    Face) at a time: what an adapter's base check reads when nothing is converted (`--save-lora-to-hf`, a
    `--lora-load` at another layout)."""
    from mindspeed_llm.checkpoint.convert import _checkpoint_info, _load_stage

    if not hf:
        info = _checkpoint_info(load_dir, iteration)
        for stage in range(info["pp"]):
            yield sharding.stage_to_full(_load_stage(info, stage), spec, info["pp"], stage, info["value_head"])
        return
    weights = hf_files.HFWeights(load_dir)
    weights.expose_fused_experts(spec)
    yield hfm.hf_nonlayer_to_mg(weights, spec, value_head, first=True, last=True)
    for index in range(spec.num_layers):
        yield {megatron_names.layer_key(index, rel): tensor
               for rel, tensor in hfm.hf_layer_to_mg(weights.get, spec, index).items()}
