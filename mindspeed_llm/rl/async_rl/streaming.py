"""The weight stream: trainer sources send the actor's TP x PP slices in buckets with a weight version, generator
ranks receive them and copy their own TP slice in place.

Protocol of one sync, per source group (one trainer source and every generator, `placement.create_sync_groups`):
1. the source broadcasts a header: version, its (tp_rank, pp_rank) of the trainers' TP x PP, and its buckets'
   entries (global name, split name, shape, dtype) -- replicated tensors come from TP rank 0 alone;
2. one all-reduce (MIN) of a go flag: a generator whose actor does not fit (a missing or unexpected tensor, a
   shape or dtype that differs, a dim that does not divide over its TP, a version not newer than its own) says
   no, and every member raises, so no rank waits on a broadcast that never comes;
3. the source broadcasts its buckets, each one flat byte buffer (every tensor at a 16-byte offset, so its bytes
   view back to its dtype without a copy).
A generator takes the pipeline stages in order and, within a stage, one bucket from each TP source in turn, so it
holds at most about TP buckets of slices; a tensor whose slices are all in is merged and resliced
(`weights.reshard`) and copied into the generator's tensor. Buffers live on the host for gloo and on the device
for the device's backend (nccl / hccl).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mindspeed_llm import device
from mindspeed_llm.rl.async_rl.weights import (REPLICATED, WeightSyncError, full_shape, local_shape, parts_needed,
                                               plan_buckets, reshard, split_name)

ALIGN = 16  # bytes: every tensor of a bucket starts at a multiple of it
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # megatron's and verl's order of magnitude (hundreds of MB)


@dataclass(frozen=True)
class SyncStats:
    """One sync as one rank saw it: the version, the payload bytes it sent or received, wall seconds, buckets."""
    version: int
    bytes: int
    seconds: float
    buckets: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _buffer_device(group) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device.current_device()


def _agree(ok: bool, group, where: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=where)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class WeightSender:
    """A trainer source: the (tp_rank, pp_rank) slice of the actor of one data-parallel replica (DP rank 0, CP
    rank 0), sent over its own group (`group`: this rank and every generator)."""

    def __init__(self, group, tp: int, pp: int, tp_rank: int, pp_rank: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, version: int = 0):
        plan_buckets([], bucket_bytes)  # refuses a bucket size that is not positive
        self.group, self.tp, self.pp, self.tp_rank, self.pp_rank = group, tp, pp, tp_rank, pp_rank
        self.bucket_bytes = bucket_bytes
        self.version = version  # the last version sent; a resume sets it to the checkpoint's

    def send(self, tensors: Dict[str, torch.Tensor]) -> SyncStats:
        """Send `tensors` ({global name: this rank's slice}, `weights.model_tensors`) as the next version."""
        start = time.perf_counter()
        where = _buffer_device(self.group)
        names = [n for n in tensors if self.tp_rank == 0 or split_name(n) != REPLICATED]
        flat = [tensors[n].detach() for n in names]
        buckets = plan_buckets([_aligned(t.numel() * t.element_size()) for t in flat], self.bucket_bytes)
        version = self.version + 1
        header = {"version": version, "tp": self.tp, "pp": self.pp, "tp_rank": self.tp_rank,
                  "pp_rank": self.pp_rank,
                  "buckets": [[(names[i], split_name(names[i]), tuple(flat[i].shape), flat[i].dtype) for i in b]
                              for b in buckets]}
        me = dist.get_rank()
        dist.broadcast_object_list([header], src=me, group=self.group, device=where)
        if not _agree(True, self.group, where):
            raise WeightSyncError(f"a generator rank refused weight version {version} from trainer rank {me} "
                                  f"(tp_rank {self.tp_rank}, pp_rank {self.pp_rank}); its error names the tensors")
        sent = 0
        for bucket in buckets:
            payload = _pack([flat[i] for i in bucket], where)
            dist.broadcast(payload, src=me, group=self.group)
            sent += payload.numel()
        self.version = version
        return SyncStats(version, sent, time.perf_counter() - start, len(buckets))


def _pack(tensors: List[torch.Tensor], where: torch.device) -> torch.Tensor:
    sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
    payload = torch.zeros(sum(sizes), dtype=torch.uint8, device=where)
    offset = 0
    for tensor, size in zip(tensors, sizes):
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        payload[offset:offset + raw.numel()].copy_(raw)
        offset += size
    return payload


def _unpack(payload: torch.Tensor, entries) -> List[torch.Tensor]:
    out, offset = [], 0
    for _, _, shape, dtype in entries:
        nbytes = _nbytes(shape, dtype)
        out.append(payload[offset:offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return out


class WeightReceiver:
    """A generator rank: TP rank `tp_rank` of its own TP size `tp` (PP 1), a member of every source's group.
    `sources`: (global rank, group) of each trainer source, the same list in the same order on every generator."""

    def __init__(self, sources: Sequence[Tuple[int, object]], tp: int, tp_rank: int):
        self.sources, self.tp, self.tp_rank = list(sources), tp, tp_rank
        self.version = 0  # the version its tensors hold (0: none received)

    def receive(self, targets: Dict[str, torch.Tensor]) -> SyncStats:
        """Receive the next version into `targets` ({global name: this rank's tensor}), in place."""
        start = time.perf_counter()
        headers = []
        for src, group in self.sources:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=group, device=_buffer_device(group))
            headers.append(box[0])
        problem = self.problem(headers, targets)
        agreed = [_agree(problem is None, group, _buffer_device(group)) for _, group in self.sources]
        if problem:
            raise WeightSyncError(problem)
        if not all(agreed):
            raise WeightSyncError("another generator rank refused this weight sync; its error names the tensors")
        received, buckets = self._stream(headers, targets)
        self.version = headers[0]["version"]
        return SyncStats(self.version, received, time.perf_counter() - start, buckets)

    def _stream(self, headers, targets) -> Tuple[int, int]:
        by_source = list(zip(self.sources, headers))
        tp = headers[0]["tp"]
        received = count = 0
        pending: Dict[str, Dict[int, torch.Tensor]] = {}
        for stage in range(headers[0]["pp"]):
            row = sorted((h["tp_rank"], src, group, h["buckets"]) for (src, group), h in by_source
                         if h["pp_rank"] == stage)
            for k in range(max(len(r[3]) for r in row)):
                for tp_rank, src, group, buckets in row:
                    if k >= len(buckets):
                        continue
                    entries = buckets[k]
                    payload = torch.empty(sum(_aligned(_nbytes(s, d)) for _, _, s, d in entries),
                                          dtype=torch.uint8, device=_buffer_device(group))
                    dist.broadcast(payload, src=src, group=group)
                    received += payload.numel()
                    count += 1
                    for (name, rule, _, _), part in zip(entries, _unpack(payload, entries)):
                        parts = pending.setdefault(name, {})
                        parts[tp_rank] = part
                        if len(parts) == parts_needed(rule, tp):
                            value = reshard(rule, [parts[t] for t in sorted(parts)], self.tp, self.tp_rank)
                            with torch.no_grad():
                                targets[name].copy_(value)
                            del pending[name]
        return received, count

    def problem(self, headers: List[dict], targets: Dict[str, torch.Tensor]) -> Optional[str]:
        """Why this rank cannot take the sync the `headers` announce (None when it can)."""
        versions = sorted({h["version"] for h in headers})
        if len(versions) != 1:
            return f"the trainer sources announce different weight versions {versions}"
        if versions[0] <= self.version:
            return f"weight version {versions[0]} is not newer than the generator's {self.version}"
        tp, pp = headers[0]["tp"], headers[0]["pp"]
        grid = sorted((h["tp_rank"], h["pp_rank"]) for h in headers)
        if any((h["tp"], h["pp"]) != (tp, pp) for h in headers) or grid != [(t, p) for t in range(tp)
                                                                             for p in range(pp)]:
            return (f"the trainer sources do not make one TP={tp} x PP={pp} actor: they are (tp_rank, pp_rank) "
                    f"{grid}; pass every source of DP rank 0 once")
        sent: Dict[str, List[tuple]] = {}
        for h in headers:
            for entries in h["buckets"]:
                for entry in entries:
                    sent.setdefault(entry[0], []).append(entry)
        missing, unexpected = sorted(set(targets) - set(sent)), sorted(set(sent) - set(targets))
        if missing or unexpected:
            return (f"the trainers' actor and this generator's (TP={self.tp}) hold different tensors: not sent "
                    f"{missing[:4]} ({len(missing)}), sent but not held here {unexpected[:4]} ({len(unexpected)})")
        for name, entries in sent.items():
            _, rule, shape, dtype = entries[0]
            if len(entries) != parts_needed(rule, tp):
                return f"{name}: {len(entries)} TP slices sent, {parts_needed(rule, tp)} expected"
            try:
                want = local_shape(rule, full_shape(rule, shape, tp), self.tp)
            except WeightSyncError as error:
                return str(error)
            target = targets[name]
            if tuple(target.shape) != want or target.dtype != dtype:
                return (f"{name}: the generator's TP={self.tp} slice is {tuple(target.shape)} {target.dtype}, the "
                        f"trainers' TP={tp} slices make {want} {dtype}")
        return None
