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
  and re-tokenized) and a note for the handler's record of the sample (e.g. the tools' reward and counts; None when
  there is nothing to note). `ready(wait=True)` blocks until at least one is done: the engine asks so only when every
  unfinished sample is parked.
* `observed(sample, note)`, on every rank, for each observation the exchange delivers (in the same order on every
  rank): the handler's record takes what the observation brought, so every rank's record is whole when generation
  ends and nothing crosses the ranks afterwards.

`TurnExchange` runs `ready` on the token-picking rank before each scheduling decision and broadcasts what came back
to the group, ids and notes together (a fixed header, then one payload only when there are observations: every rank
makes the same calls in the same order, whatever the tools did). Data-parallel replicas never meet here: each
model-parallel group has its own tools.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, List, Optional, Protocol, Sequence, Tuple

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

    def ready(self, wait: bool) -> List[Tuple[int, List[int], Any]]:
        """Token-picking rank: the observations done since the last call, as (sample, token ids, note for the
        record: a picklable value or None); with `wait`, at least one (blocks)."""

    def observed(self, sample: int, note: Any) -> None:
        """Every rank: the note of an observation of `sample` the exchange delivered (in `ready`'s order)."""


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
        """The observations done now (waiting for one when `wait`), the same on every rank of the group; their notes
        are handed to the handler's `observed` on every rank before they return."""
        start = time.perf_counter()
        items = self.handler.ready(wait) if self.picks else []
        if self.source is not None:
            items = self._broadcast(items)
        if wait:
            self.wait_seconds += time.perf_counter() - start
        for s, _, note in items:
            self.handler.observed(s, note)
        return [(s, ids) for s, ids, _ in items]

    def _broadcast(self, items: List[Tuple[int, List[int], Any]]) -> List[Tuple[int, List[int], Any]]:
        # header: observations, their ids, the bytes of their notes (pickled together; 0: every note is None)
        header = torch.zeros(3, dtype=torch.long, device=self.device)
        notes = b""
        if self.picks:
            if any(note is not None for _, _, note in items):
                notes = pickle.dumps([note for _, _, note in items])
            header[0], header[1], header[2] = len(items), sum(len(ids) for _, ids, _ in items), len(notes)
        dist.broadcast(header, src=self.source, group=self.group)
        count, total, note_bytes = header.tolist()
        if count == 0:
            return []
        words = -(-note_bytes // 8)  # the notes' bytes ride in the same long payload, 8 to a word
        if self.picks:
            flat = [x for s, ids, _ in items for x in (s, len(ids))] + [t for _, ids, _ in items for t in ids]
            packed = torch.zeros(words * 8, dtype=torch.uint8)
            if note_bytes:
                packed[:note_bytes] = torch.frombuffer(bytearray(notes), dtype=torch.uint8)
            payload = torch.cat([torch.tensor(flat, dtype=torch.long), packed.view(torch.long)]).to(self.device)
        else:
            payload = torch.zeros(2 * count + total + words, dtype=torch.long, device=self.device)
        dist.broadcast(payload, src=self.source, group=self.group)
        head = 2 * count + total
        values = payload[:head].tolist()
        received = [None] * count
        if note_bytes:
            received = pickle.loads(bytes(payload[head:].cpu().view(torch.uint8)[:note_bytes].tolist()))
        out, at = [], 2 * count
        for k in range(count):
            s, n = values[2 * k], values[2 * k + 1]
            out.append((s, values[at:at + n], received[k]))
            at += n
        return out


__all__ = ["TurnHandler", "TurnExchange"]
