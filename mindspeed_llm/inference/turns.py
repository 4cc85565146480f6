"""Multi-turn generation's seam in the continuous engine: what the engine asks of whoever answers a model's turn (a
tool loop, `rl/rollouts/tool_turns.py`), and how the answers reach every rank of a model-parallel group.

A `TurnHandler` is asked each sample's whole budget when the sample starts (`trajectory_budget`, every rank), and is
consulted at two places:

* `wants_observation(sample, known, prompt_length, turn_start)`, on every rank when a sample's turn ends (EOS or a stop
  token): whether the sample waits for an observation (a tool's answer) instead of finishing. It must decide from
  the tokens alone (every rank of the group has the same tokens and must take the same decision).
* `begin(...)` and `ready(wait)`, on the token-picking rank only (`engine_inputs.source_rank`; the only rank without a
  model-parallel group): start producing sample's observation (e.g. submit its tool calls to a worker pool) and
  collect those that are done, as token ids to append (token-in / token-out: nothing the model sampled is decoded
  and re-tokenized). `ready(wait=True)` blocks until at least one is done: the engine asks so only when every
  unfinished sample is parked.

`TurnExchange` runs `ready` on the token-picking rank before each scheduling decision and broadcasts what came back
to the group (a fixed header, then the ids only when there are any: every rank makes the same calls in the same
order, whatever the tools did). Data-parallel replicas never meet here: each model-parallel group has its own tools.
"""

from __future__ import annotations

import time
from typing import List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist


class TurnHandler(Protocol):
    turn_token_limit: Optional[int]  # the most tokens of one model turn (None: only the sample's budget)

    def trajectory_budget(self, sample: int) -> Optional[int]:
        """Every rank: the most tokens after `sample`'s prompt of its whole trajectory, when it is more than this
        call's budget of the sample (a partial rollout's round continues it later; None: this call's budget)."""

    def wants_observation(self, sample: int, known: Sequence[int], prompt_length: int, turn_start: int) -> bool:
        """Every rank: the turn of `sample` (its tokens `known[prompt_length + turn_start:]`) just ended; whether the
        sample waits for an observation."""

    def begin(self, sample: int, known: Sequence[int], prompt_length: int, turn_start: int) -> None:
        """Token-picking rank: start producing `sample`'s observation."""

    def ready(self, wait: bool) -> List[Tuple[int, List[int]]]:
        """Token-picking rank: the observations done since the last call, as (sample, token ids); with `wait`, at
        least one (blocks)."""


class TurnExchange:
    """The engine's side of a `TurnHandler` on one rank (module docstring)."""

    def __init__(self, handler: TurnHandler, source: Optional[int], group, device):
        self.handler, self.source, self.group, self.device = handler, source, group, device
        self.picks = source is None or dist.get_rank() == source
        self.wait_seconds = 0.0  # blocked with nothing to decode, waiting for observations

    def begin(self, samples: Sequence[int], scheduler) -> None:
        if not self.picks:
            return
        for s in samples:
            sample = scheduler.samples[s]
            self.handler.begin(s, sample.known, sample.prompt_length, sample.turn_start)

    def exchange(self, wait: bool) -> List[Tuple[int, List[int]]]:
        """The observations done now (waiting for one when `wait`), the same on every rank of the group."""
        start = time.perf_counter()
        items = self.handler.ready(wait) if self.picks else []
        if self.source is not None:
            items = self._broadcast(items)
        if wait:
            self.wait_seconds += time.perf_counter() - start
        return items

    def _broadcast(self, items: List[Tuple[int, List[int]]]) -> List[Tuple[int, List[int]]]:
        header = torch.zeros(2, dtype=torch.long, device=self.device)
        if self.picks:
            header[0], header[1] = len(items), sum(len(ids) for _, ids in items)
        dist.broadcast(header, src=self.source, group=self.group)
        count, total = header.tolist()
        if count == 0:
            return []
        if self.picks:
            flat = [x for s, ids in items for x in (s, len(ids))] + [t for _, ids in items for t in ids]
            payload = torch.tensor(flat, dtype=torch.long, device=self.device)
        else:
            payload = torch.zeros(2 * count + total, dtype=torch.long, device=self.device)
        dist.broadcast(payload, src=self.source, group=self.group)
        values = payload.tolist()
        out, at = [], 2 * count
        for k in range(count):
            s, n = values[2 * k], values[2 * k + 1]
            out.append((s, values[at:at + n]))
            at += n
        return out


__all__ = ["TurnHandler", "TurnExchange"]
