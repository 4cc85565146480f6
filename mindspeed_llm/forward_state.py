"""Per-forward settings of a model that a recomputed forward must see again.

Some options of one forward are set on modules for its duration by context managers: the position ids the
rotary hooks index by (`forward_layout`) and the recorded routing the routers replay (`routing.replay_routing`).
With activation recompute (`--recompute-granularity`, `--moe-layer-recompute`) megatron runs a checkpointed
region again inside the backward, after those contexts have closed and, under pipeline parallelism, after later
micro-batches' forwards set their own values (1F1B keeps several micro-batches in flight). Left alone, the
recomputed forward would route live and rotate by slot: another function than the one whose activations it
replaces.

So each such setting is made with `per_forward(obj, attr, value)`, which also lists it as live; `snapshot()` is
every live setting with its current value; `restored(snapshot)` puts a snapshot back for a block and then the
values found. `patches/recompute.py` wraps megatron's `tensor_parallel.checkpoint` so that the checkpointed
function runs inside `restored(the snapshot taken when the region was checkpointed)`: in the forward that changes
nothing, in the backward's recompute it is exactly the state of that region's own micro-batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

# (id(obj), attr) -> [obj, attr, depth]: the settings live now (depth: nested per_forward blocks of the same one)
_LIVE: Dict[Tuple[int, str], list] = {}

Snapshot = List[Tuple[Any, str, Any]]


@contextlib.contextmanager
def per_forward(obj, attr: str, value):
    """`obj.attr = value` for the block (the previous value after it), listed as live meanwhile."""
    key = (id(obj), attr)
    previous = getattr(obj, attr, None)
    entry = _LIVE.setdefault(key, [obj, attr, 0])
    entry[2] += 1
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, previous)
        entry[2] -= 1
        if entry[2] == 0:
            _LIVE.pop(key, None)


def snapshot() -> Snapshot:
    """Every live per-forward setting with its current value."""
    return [(obj, attr, getattr(obj, attr, None)) for obj, attr, _ in _LIVE.values()]


@contextlib.contextmanager
def restored(saved: Snapshot):
    """The settings of `saved` for the block; the values found are put back after it."""
    found = [(obj, attr, getattr(obj, attr, None)) for obj, attr, _ in saved]
    for obj, attr, value in saved:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in reversed(found):
            setattr(obj, attr, value)
