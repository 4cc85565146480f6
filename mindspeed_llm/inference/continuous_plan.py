"""Continuous batching's host-side plan (`inference/continuous.py` runs it on the device): the samples (`Sample`), the
units of work one pipeline group runs per tick (`Unit`: slot moves, `Prefill` forwards, KV copies, one `Decode` step)
and the `Scheduler` that decides them (admission, slot layout, prefill sharing). Plain bookkeeping, identical on
every rank of a model-parallel group: it sees only the prompts, the plan and the broadcast tokens.

Multi-turn (`inference/turns.py`): a sample whose turn ends (EOS / stop) and whose handler wants an observation (a
tool's answer) is *parked*: it leaves the decode steps and waits. `parked_kv="keep"`: its slot and KV stay and,
once the observation's token ids arrive (`resume`), only they are prefilled into its slot (a delta prefill);
`"free"`: its slot is freed at once and, on resumption, it queues again to be prefilled from its whole prefix;
`"auto"`: kept, until a pending sample finds no free slot in its group, which then takes a parked sample's (the
longest parked first). Either way the other samples keep decoding meanwhile. The observation's tokens are recorded
as spans of the response (`Sample.observed`): they are fed to the model, never sampled."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple


@dataclass
class Sample:
    """One sample's tokens and state (host side)."""

    known: List[int]  # prompt + response so far
    prompt_length: int
    budget: int  # the most response tokens, carried ones included
    reason: Optional[str] = None  # "eos" | "stop" | "length" once finished
    # multi-turn: token positions, the engine's own (not the turn handler's record, which holds what the turns mean):
    # only the scheduler knows where an answer lands or that it does not fit (`resume`), the spans make the tool mask,
    # and the turn's start is read at every decode step for the per-turn limit (it is the last span's end; kept as
    # a field so that the step does not derive it)
    turn_start: int = 0  # the response length when the current model turn began
    observed: List[Tuple[int, int]] = field(default_factory=list)  # response spans [a, b) fed, not sampled
    # multi-turn under partial rollouts: the trajectory's whole budget when `budget` is this call's share of it; a
    # sample that reaches `budget` first is cut (`cut`: no reason, to be continued by a later call)
    total_budget: Optional[int] = None
    cut: bool = False

    @property
    def whole_budget(self) -> int:
        return self.budget if self.total_budget is None else self.total_budget

    @property
    def response_length(self) -> int:
        return len(self.known) - self.prompt_length

    @property
    def finished(self) -> bool:
        return self.reason is not None

    @property
    def cached(self) -> int:
        """Positions whose keys / values are in the cache while the sample is in flight: all known tokens but the
        last, which the next decode step feeds."""
        return len(self.known) - 1


@dataclass
class Prefill:
    """One prefill forward: rows `slots` (samples `samples`) get positions [start, start + counts[r]) of their known
    tokens, right-padded to `width`."""

    slots: List[int]
    samples: List[int]
    start: int
    width: int
    counts: List[int]
    tokens: List[List[int]]  # [rows][width]


@dataclass
class Decode:
    """One decode step of a group: rows base .. base + n - 1 feed their last known token at their length."""

    base: int
    samples: List[int]
    positions: List[int]
    tokens: List[int]
    steps: List[int]  # the response index j of the token each row produces
    slots: Optional[List[int]] = None  # the rows' slots when not base .. base + n - 1 (parked rows between them)


@dataclass
class Unit:
    """What every stage does for one group at one step, in this order: moves (slot, slot, length), prefill forwards,
    KV copies (src slot, dst slot, length, src sample, dst sample), `extra_prefills` dummy forwards (expert-parallel
    padding), the decode step (or a dummy one)."""

    index: int
    group: int
    moves: List[Tuple[int, int, int]] = field(default_factory=list)
    prefills: List[Prefill] = field(default_factory=list)
    copies: List[Tuple[int, int, int, int, int]] = field(default_factory=list)
    decode: Optional[Decode] = None
    extra_prefills: int = 0
    dummy_decode: bool = False

    def hidden_shapes(self, hidden_size: int) -> List[Tuple[int, int, int]]:
        """[S, b, H] of each real forward, in order: what goes from stage to stage."""
        shapes = [(p.width, len(p.slots), hidden_size) for p in self.prefills]
        if self.decode is not None:
            shapes.append((1, len(self.decode.samples), hidden_size))
        return shapes


@dataclass
class _Group:
    base: int  # first slot
    capacity: int
    rows: List[Optional[int]] = field(default_factory=list)  # slot - base -> sample (None: free)
    steps: int = 0  # decode steps run
    stopped: bool = False  # the decode budget is spent


PARKED_KV = ("auto", "keep", "free")  # what a parked sample's slot and KV do (module docstring)
PREFILL_PADDING_BOUND = 2  # a prefill forward computes at most twice its windows' tokens


class Scheduler:
    """Admission, slot layout and prefill sharing; identical on every rank of a model-parallel group (it sees only
    the prompts, the plan and the broadcast tokens)."""

    def __init__(self, samples: List[Sample], capacities: Sequence[int], *, token_cap: Optional[int],
                 share_prefill: bool, pad_id: int, eos_ids: Sequence[int], stop_ids: Sequence[int],
                 max_decode_steps: Optional[int] = None,
                 wants_observation: Optional[Callable[[int, Sample], bool]] = None,
                 turn_token_limit: Optional[int] = None, parked_kv: str = "keep"):
        self.samples = samples
        self.pending = deque(b for b, s in enumerate(samples) if not s.finished and not s.cut)
        self.groups, base = [], 0
        for cap in capacities:
            self.groups.append(_Group(base, cap, [None] * cap))
            base += cap
        self.token_cap, self.share_prefill, self.pad_id = token_cap, share_prefill, pad_id
        self.eos_ids, self.stop_ids = set(eos_ids), set(stop_ids)
        self.max_decode_steps = max_decode_steps
        self.wants_observation, self.turn_token_limit = wants_observation, turn_token_limit
        if parked_kv not in PARKED_KV:
            raise ValueError(f"parked_kv={parked_kv!r}: use one of {', '.join(PARKED_KV)}")
        self.parked_kv = parked_kv
        self.parked: Dict[int, None] = {}  # samples waiting for an observation (ordered)
        self.delta_prefills: Dict[int, int] = {}  # resumed sample in its kept slot -> first position to prefill
        self.slot_of: Dict[int, int] = {}
        self.sources: Dict[tuple, Dict[int, None]] = {}  # prefill window -> samples in flight holding it (ordered)
        self.window_of: Dict[int, tuple] = {}
        self.stats = dict(decode_forwards=0, decode_row_steps=0, finished_row_steps=0, prefill_forwards=0,
                          prefill_tokens=0, prefill_shared_rows=0, kv_row_moves=0, max_rows_in_flight=0,
                          parked_turns=0, observation_tokens=0, delta_prefill_tokens=0, parked_evictions=0)

    def busy(self) -> bool:
        """Whether a group can still decode: rows in flight, pending samples and room, or parked samples."""
        if self.parked:
            return True
        for g in self.groups:
            if g.stopped:
                continue
            if any(s is not None for s in g.rows) or (self.pending and g.capacity > 0):
                return True
        return False

    def in_flight(self) -> int:
        return sum(s is not None for g in self.groups for s in g.rows)

    def only_parked(self) -> bool:
        """Every unfinished sample waits for an observation: nothing can decode until one arrives."""
        if not self.parked or self.pending:
            return False
        return all(s is None or s in self.parked for g in self.groups for s in g.rows)

    def decide(self, index: int, group: int) -> Unit:
        """The next unit of `group`: admit pending samples into its free slots, pack its rows, plan their prefill."""
        g = self.groups[group]
        unit = Unit(index, group)
        if g.stopped:
            return unit
        if self.max_decode_steps is not None and g.steps >= self.max_decode_steps:
            g.stopped = True
            return unit
        if self.parked_kv == "auto" and self.pending:
            self._evict_parked(g)
        survivors = [(off, s) for off, s in enumerate(g.rows) if s is not None]
        new = [self.pending.popleft() for _ in range(min(g.capacity - len(survivors), len(self.pending)))]
        n = len(survivors) + len(new)
        kept = {off for off, _ in survivors if off < n}
        free = [off for off in range(n) if off not in kept]
        rows: List[Optional[int]] = [None] * g.capacity
        for off, s in survivors:
            if off >= n:  # pack the rows in flight at the front: a tail row moves into a hole
                dst = free.pop(0)
                unit.moves.append((g.base + off, g.base + dst, self.samples[s].cached))
                off = dst
            rows[off] = s
            self.slot_of[s] = g.base + off
        for s in new:
            off = free.pop(0)
            rows[off] = s
            self.slot_of[s] = g.base + off
        g.rows = rows
        self.stats["kv_row_moves"] += len(unit.moves)
        leaders = []
        for s in new:
            window = tuple(self.samples[s].known[:-1])
            if not window:  # a one-token prompt: the decode step feeds it, nothing to prefill
                continue
            holders = self.sources.get(window) if self.share_prefill else None
            if holders:
                src = next(iter(holders))
                unit.copies.append((self.slot_of[src], self.slot_of[s], len(window), src, s))
                self.stats["prefill_shared_rows"] += 1
            else:
                leaders.append(s)
            if self.share_prefill:
                self.sources.setdefault(window, {})[s] = None
                self.window_of[s] = window
        unit.prefills = self._pack(leaders) + self._delta_prefills(rows[:n])
        offsets = [off for off in range(n) if rows[off] not in self.parked]
        if offsets:
            order = [rows[off] for off in offsets]
            slots = None if len(offsets) == n else [g.base + off for off in offsets]
            unit.decode = Decode(g.base, order, [self.samples[s].cached for s in order],
                                 [self.samples[s].known[-1] for s in order],
                                 [self.samples[s].response_length for s in order], slots)
            g.steps += 1
            self.stats["decode_forwards"] += 1
            self.stats["decode_row_steps"] += len(order)
        self.stats["prefill_forwards"] += len(unit.prefills)
        self.stats["prefill_tokens"] += sum(p.width * len(p.slots) for p in unit.prefills)
        self.stats["max_rows_in_flight"] = max(self.stats["max_rows_in_flight"], self.in_flight())
        return unit

    def _pack(self, leaders: List[int]) -> List[Prefill]:
        """Prefill forwards for `leaders`: by ascending window length, as many rows as keep rows x width within the
        token cap and the padding within the real tokens (rows x width <= PREFILL_PADDING_BOUND x the windows'
        tokens: one long continuation among short prompts gets its own forward instead of padding them all to its
        length); a window longer than the cap alone, in chunks."""
        order = sorted(leaders, key=lambda s: self.samples[s].cached)
        cap = self.token_cap
        out, batch, real = [], [], 0
        for s in order:
            length = self.samples[s].cached
            if cap is not None and length > cap:
                for start in range(0, length, cap):
                    out.append(self._prefill([s], start, min(cap, length - start)))
                continue
            padded = (len(batch) + 1) * length  # the windows so far are no longer: `length` is the width
            if batch and ((cap is not None and padded > cap) or padded > PREFILL_PADDING_BOUND * (real + length)):
                out.append(self._prefill(batch, 0, self.samples[batch[-1]].cached))
                batch, real = [], 0
            batch.append(s)
            real += length
        if batch:
            out.append(self._prefill(batch, 0, self.samples[batch[-1]].cached))
        return out

    def _delta_prefills(self, rows: List[int]) -> List[Prefill]:
        """Prefill forwards of the resumed samples among `rows` (kept slots): their observation's positions only,
        one row per forward (their starts differ), in chunks of the token cap."""
        out = []
        for s in rows:
            start = self.delta_prefills.pop(s, None)
            if start is None:
                continue
            length = self.samples[s].cached - start
            step = self.token_cap or length
            for a in range(start, start + length, step):
                out.append(self._prefill([s], a, min(step, start + length - a)))
            self.stats["delta_prefill_tokens"] += length
        return out

    def _prefill(self, samples: List[int], start: int, width: int) -> Prefill:
        counts = [min(width, self.samples[s].cached - start) for s in samples]
        tokens = [self.samples[s].known[start:start + c] + [self.pad_id] * (width - c) for s, c in zip(samples, counts)]
        return Prefill([self.slot_of[s] for s in samples], list(samples), start, width, counts, tokens)

    def apply(self, unit: Unit, tokens: List[int]) -> List[int]:
        """Appends the decode step's tokens; finished rows free their slots. Returns the samples parked by this
        step (their turn ended and the handler wants an observation)."""
        parked = []
        for s, token in zip(unit.decode.samples, tokens):
            sample = self.samples[s]
            sample.known.append(int(token))
            reason = None
            if token in self.eos_ids:
                reason = "eos"
            elif token in self.stop_ids:
                reason = "stop"
            elif sample.response_length >= sample.budget:
                reason = "length" if sample.response_length >= sample.whole_budget else "cut"
            elif self.turn_token_limit is not None and sample.response_length - sample.turn_start >= \
                    self.turn_token_limit:
                reason = "length"  # the model's turn ran out of --max-new-tokens: the trajectory ends
            if reason in ("eos", "stop") and self.wants_observation is not None and self.wants_observation(s, sample):
                self.parked[s] = None
                self.stats["parked_turns"] += 1
                parked.append(s)
                if self.parked_kv == "free":
                    self._release(s)
            elif reason == "cut":  # this call's share of a longer trajectory is spent: a later call continues it
                sample.cut = True
                self._release(s)
            elif reason is not None:
                sample.reason = reason
                self._release(s)
        return parked

    def resume(self, s: int, observation: Sequence[int]) -> bool:
        """Sample `s`'s observation arrived: its token ids follow its response, and it decodes again (from its
        kept slot after a delta prefill, or queued for a whole prefill). When they would leave no room for one more
        model token within its budget the trajectory ends instead ("length"). Returns whether it resumed."""
        sample = self.samples[s]
        del self.parked[s]
        if not observation or len(observation) > sample.whole_budget - sample.response_length - 1:
            sample.reason = "length"
            if s in self.slot_of:
                self._release(s)
            return False
        first_uncached = sample.cached  # the turn's last token (EOS / stop) was never fed
        a = sample.response_length
        sample.known.extend(int(t) for t in observation)
        sample.observed.append((a, sample.response_length))
        sample.turn_start = sample.response_length
        self.stats["observation_tokens"] += len(observation)
        if sample.response_length >= sample.budget:  # past this call's share: a later call prefills and continues
            sample.cut = True
            if s in self.slot_of:
                self._release(s)
        elif s in self.slot_of:
            self.delta_prefills[s] = first_uncached
        else:
            self.pending.append(s)
        return True

    def _evict_parked(self, g: _Group) -> None:
        """`parked_kv="auto"`: as many of the group's parked samples as pending samples lack free slots give theirs
        up (the longest parked first); they are prefilled again when they resume."""
        free = sum(s is None for s in g.rows)
        in_group = [s for s in self.parked if s in self.slot_of and g.base <= self.slot_of[s] < g.base + g.capacity]
        for s in in_group[:max(0, len(self.pending) - free)]:
            self._release(s)
            self.stats["parked_evictions"] += 1

    def _release(self, s: int) -> None:
        """Frees sample `s`'s slot (finished, or parked without its KV) and its prefill-sharing window."""
        slot = self.slot_of.pop(s)
        g = next(g for g in self.groups if g.base <= slot < g.base + g.capacity)
        g.rows[slot - g.base] = None
        window = self.window_of.pop(s, None)
        if window is not None:
            holders = self.sources[window]
            del holders[s]
            if not holders:
                del self.sources[window]


def split_capacity(rows: int, groups: int, token_cap: Optional[int]) -> List[int]:
    """`rows` slots over `groups` groups as evenly as possible, each at most `token_cap` (a decode step's tokens)."""
    caps = [rows // groups + (g < rows % groups) for g in range(groups)]
    return [min(c, token_cap) if token_cap is not None else c for c in caps]
