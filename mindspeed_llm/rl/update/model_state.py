"""What a trained role's model state is made of, how many bytes of it sit on the device, and moving parts of it
to host memory and back (`--offload-train-optimizer`, `--offload-train-grad`, `--offload-train-param`).

A `TrainableModel`'s state, by part (each a set of tensor *storages*, never views):

    weights   the model's parameters (bf16 / fp16 / fp32); with the distributed optimizer megatron's DDP keeps them
              in one contiguous param buffer per dtype, which every parameter is a view of
    grads     megatron DDP's grad buffers (one contiguous fp32 buffer per dtype; `param.main_grad` are views)
    masters   the optimizer's fp32 main copies of half-precision weights (none for fp32 weights, whose main
              params are the weights themselves); with the distributed optimizer only this DP rank's shard
    moments   the optimizer's state tensors (Adam's exp_avg / exp_avg_sq, SGD's momentum), this rank's shard with
              the distributed optimizer; Adam's scalar `step` is left alone

Megatron's grad and param buffers and the views into them share one storage: offloading frees the storage
(`untyped_storage().resize_(0)`), which every view sees, after copying its bytes into a host buffer (pinned where
`device.host_buffer` can pin); onloading re-allocates it and copies the bytes back, so every view, the optimizer's
own references included, reads the same values again. Grads are not copied: a step zeroes them before its first
backward, so they come back as zeros. The same code runs on every device; on the CPU the "device" storage is
freed just the same, so a test can see that nothing offloaded stays allocated.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

from mindspeed_llm import device

PARTS = ("weights", "grads", "masters", "moments")


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron optimizer (a ChainedOptimizer holds several)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in subs if getattr(o, "optimizer", None) is not None]


def unique_storages(tensors: Iterable[torch.Tensor]) -> List[torch.UntypedStorage]:
    """The storages of `tensors`, each once (views and tensors sharing a buffer count once)."""
    seen, out = set(), []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            out.append(storage)
    return out


def storages(trainable, part: str) -> List[torch.UntypedStorage]:
    """The storages of `part` (one of PARTS) of a TrainableModel, each once."""
    if part == "weights":
        return unique_storages(trainable.module.parameters())
    if part == "grads":
        return unique_storages(buffer.grad_data
                               for buffer in trainable.ddp.buffers + trainable.ddp.expert_parallel_buffers)
    inners = _inner_optimizers(trainable.optimizer)
    if part == "masters":
        weights = {s._cdata for s in storages(trainable, "weights")}
        params = (p for inner in inners for group in inner.param_groups for p in group["params"])
        return [s for s in unique_storages(params) if s._cdata not in weights]
    if part == "moments":
        return unique_storages(value for inner in inners for state in inner.state.values()
                               for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor))
    raise ValueError(f"unknown part {part!r}; one of {', '.join(PARTS)}")


def device_bytes(trainable) -> Dict[str, int]:
    """Bytes of each part allocated now (an offloaded part counts 0), and `parameters`: this rank's parameter
    count (the model's numel, all of it, whatever the optimizer shards)."""
    out = {part: sum(s.nbytes() for s in storages(trainable, part)) for part in PARTS}
    out["parameters"] = sum(p.numel() for p in trainable.module.parameters())
    return out


def bytes_per_parameter(trainable) -> Dict[str, float]:
    """`device_bytes` divided by this rank's parameter count (`total`: all parts together)."""
    counts = device_bytes(trainable)
    n = counts.pop("parameters")
    out = {part: value / n for part, value in counts.items()}
    out["total"] = sum(out.values())
    return out


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Moved:
    """One storage in host memory: its size, and its bytes (None for grads: they come back as zeros)."""

    def __init__(self, storage: torch.UntypedStorage, host: Optional[torch.Tensor]):
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host = host


class Offloader:
    """Moves parts of one TrainableModel's state to host memory (`offload`) and back (`onload`).

    Host buffers are kept from one offload to the next (pinned memory is slow to allocate); a part that is already
    where it is asked to go is left alone, so both calls are idempotent.
    """

    KEEPS_VALUES = {"weights": True, "masters": True, "moments": True, "grads": False}

    def __init__(self, trainable):
        self.trainable = trainable
        self.moved: Dict[str, List[_Moved]] = {}  # offloaded parts
        self._host: Dict[str, Dict[int, torch.Tensor]] = {}  # part -> storage identity -> its host buffer

    def offload(self, parts: Iterable[str]) -> None:
        todo = [part for part in parts if part not in self.moved]
        if not todo:
            return
        if "grads" in todo:  # the optimizer's own grad references are views into the buffers (or copies)
            self.trainable.optimizer.zero_grad(set_to_none=True)
        taken = set()
        for part in todo:
            moved, kept, host_buffers = [], self._host.get(part, {}), {}
            for storage in storages(self.trainable, part):
                if storage._cdata in taken or storage.nbytes() == 0:
                    continue
                taken.add(storage._cdata)
                host = None
                if self.KEEPS_VALUES[part]:
                    host = kept.get(storage._cdata)
                    if host is None or host.numel() != storage.nbytes():
                        host = device.host_buffer(storage.nbytes())
                    host.copy_(_bytes(storage), non_blocking=True)
                    host_buffers[storage._cdata] = host
                moved.append(_Moved(storage, host))
            self.moved[part], self._host[part] = moved, host_buffers
        device.synchronize()  # the copies are done before the device memory is released
        for part in todo:
            for entry in self.moved[part]:
                entry.storage.resize_(0)

    def onload(self, parts: Optional[Iterable[str]] = None) -> None:
        todo = [part for part in (self.moved if parts is None else parts) if part in self.moved]
        for part in todo:
            for entry in self.moved.pop(part):
                entry.storage.resize_(entry.nbytes)
                if entry.host is None:
                    _bytes(entry.storage).zero_()
                else:
                    _bytes(entry.storage).copy_(entry.host, non_blocking=True)

    @property
    def offloaded(self) -> List[str]:
        return list(self.moved)
