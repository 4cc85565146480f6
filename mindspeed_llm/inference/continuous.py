"""Continuous batching with a bounded KV cache: the default engine of `generation.generate`.

Why not megatron's static cache: `StaticInferenceContext` (megatron-core 0.16.1) writes every row at one
`sequence_len_offset`, so all rows advance in lock-step, a finished row keeps its place (and its compute) until the
last row stops, and the cache is sized by the whole batch. Here:

* **Own KV cache** (`_KVCache`): per attention layer of this stage a key and a value tensor
  `[T slots, N rows, kv heads / TP, head dim]` (zeros at first: a masked slot is multiplied by a zero weight, and
  0 x NaN would be NaN), T = max over the samples of prompt + response budget, N = the rows in flight
  (`SamplingConfig.max_num_seqs`, default the whole batch). Each row has its own length.
* **Plain eval forwards** (`inference_context=None`): a forward pre-hook on every core-attention module
  (`self_attention.core_attention`: megatron's `DotProductAttention` or any module with its arguments, explicit
  boolean masks `[b, 1, sq, sk]`, True = masked, included) writes the forward's new keys / values into the cache at
  each row's positions and hands the core attention the cached keys / values of its rows with a per-row mask
  (causal within the new tokens + keys past the row's own length). Keys arrive already rotated by megatron's
  `Attention.forward`, at their true positions (`models/forward_layout.py`'s position-id hook; `rotary_length`
  makes megatron's rotary table T long, per model or per MLA layer).
* **Slots**: when a row finishes, its slot takes the next pending sample (samples are admitted in batch order).
  Rows in flight are kept packed at the front of their group's slot range (a finished row's hole is filled by the
  new sample or by moving a tail row), so a decode step reads a view of the cache, never a gather.
* **Prefill**: a new sample's known tokens (prompt, and for a continuation its old response) but the last are
  prefilled (right-padded forwards of several new rows, no logits computed); the last known token is fed in the
  next decode step together with the other rows, whose logits give the sample's next token. A sample whose
  prefill window equals that of a sample in flight (GRPO's n samples of a prompt) copies that row's KV instead of
  a forward; among the new samples of one step, one prefills and the others copy it. `max_num_batched_tokens`
  bounds a prefill forward's rows x width (a longer prompt is prefilled in chunks) and a decode step's rows; the
  padding of a prefill forward is at most its real tokens (a long window among short ones gets a forward of its
  own).
* **Tokens**: the last stage picks the tokens of a decode step (`sampling.choose_tokens`, the uniform of sample b's
  j-th response token as in the static engine: the same prefix gives the same draw) and broadcasts them with their
  log-probs from one source rank (last stage, TP rank 0) to the model-parallel group, as the static engine does;
  every rank then takes the same decisions (`continuous_plan.Scheduler` is plain host-side bookkeeping,
  identical on every rank of a model-parallel group).
* **Groups**: megatron's parallel state, or the explicit groups of a model built on them (a generator rank of
  asynchronous RL, `models.explicit_groups`: PP 1, its own TP group; `engine_inputs.source_rank(model)`).
* **Pipeline parallelism**: the slots are split into PP groups, one "unit" (moves, prefills, KV copies and one
  decode step) per group in turn; stage s runs unit t - s, i.e. group (t - s) mod PP, at tick t, so every stage
  works on every tick while the groups have rows. A group's next unit is decided as soon as its previous one left
  the last stage (its tokens are known). Unit k starts at tick tau(k) = k with PP groups; in general
  tau(k) = (k // G) * max(G, PP) + k % G for G groups (G = 1: the whole batch passes the stages in turn, as
  megatron's wrapper does).
  Hidden states go stage to stage with megatron's `communication_utils` helpers (receive, then send: a chain,
  no cycle); their shapes follow from the units, which every rank knows.
* **Expert parallelism**: the expert-parallel peers hold other rollouts but exchange tokens in every MoE layer of
  every forward, so after each decision they agree (one all-reduce) on the unit's number of prefill forwards and
  whether it decodes, and run 1-token dummy forwards (no cache) where they have fewer; they tick until all are done.
* **Multi-turn** (`turns`, a `turns.TurnExchange`): a sample whose turn ends and whose handler wants an observation
  (a tool's answer) is parked (`continuous_plan`), its slot and KV kept or freed; the others decode meanwhile. The
  observation's ids are written into the sample's response as they are (never re-tokenized) and only they are
  prefilled; they are fed, not sampled (`Result.observed`, zero log-probs). A decode step whose rows have parked ones
  between them gathers its rows' keys instead of reading a view.
* **Partial rollouts**: `max_decode_steps` bounds each group's decode steps; what is left is returned unfinished
  (`Rollout.continuations`), and a later call continues it from its prompt + response so far.

Equality with the static engine: the same tokens (greedy and sampled) and log-probs to float rounding (another
batch shape, true positions instead of left-padded slots, another reduction length; tests/dist/test_generate.py,
tests/dist/test_continuous_batching_dist.py). Not bitwise in general.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank
from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model

from mindspeed_llm.inference.continuous_plan import Decode, Prefill, Sample, Scheduler, Unit, split_capacity
from mindspeed_llm.inference.sampling import SamplingConfig, choose_tokens
from mindspeed_llm.models import explicit_groups, routing
from mindspeed_llm.models.forward_layout import forward_layout


# ---------------------------------------------------------------------------------------------- device side
class _KVCache:
    """Per attention layer (keyed by its core-attention module) keys and values `[slots, rows, heads, dim]`,
    allocated at the layer's first write with the dtype and device of its keys."""

    def __init__(self, rows: int, slots: int):
        self.rows, self.slots = rows, slots
        self.layers: Dict[torch.nn.Module, Tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, module, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        entry = self.layers.get(module)
        if entry is None:
            entry = (key.new_zeros((self.slots, self.rows, *key.shape[2:])),
                     value.new_zeros((self.slots, self.rows, *value.shape[2:])))
            self.layers[module] = entry
        return entry

    def copy(self, src: int, dst: int, length: int) -> None:
        for keys, values in self.layers.values():
            keys[:length, dst] = keys[:length, src]
            values[:length, dst] = values[:length, src]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers.values())


@dataclass
class _Layout:
    """One forward's rows in the cache, read by the core-attention hooks. `dummy`: no cache at all."""

    dummy: bool = False
    write_positions: Optional[torch.Tensor] = None  # [S, b]
    write_rows: Optional[torch.Tensor] = None  # [S, b]
    mask: Optional[torch.Tensor] = None  # [b, 1, S, key_len], True = masked
    key_len: int = 0
    own_keys: bool = False  # the forward's keys are all there is (a prefill from position 0)
    row_slice: Optional[Tuple[int, int]] = None  # the rows are the slots [a, b): read a view
    rows: Optional[torch.Tensor] = None  # else: gather these slots


def core_attention_modules(model) -> List[torch.nn.Module]:
    """This stage's core-attention modules (`...self_attention.core_attention`), in layer order."""
    return [m for name, m in unwrap_model(model).named_modules() if name.endswith("self_attention.core_attention")]


class _AttentionHooks:
    """Forward pre-hooks (with kwargs) on the core attention: cache write + cached keys / values + mask."""

    def __init__(self, model, cache: _KVCache):
        self.cache = cache
        self.layout: Optional[_Layout] = None
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                        for m in core_attention_modules(model)]

    def _hook(self, module, args, kwargs):
        layout = self.layout
        if layout is None or layout.dummy:
            return None
        query, key, value = args[:3]
        keys, values = self.cache.layer(module, key, value)
        index = (layout.write_positions, layout.write_rows)
        keys.index_put_(index, key)
        values.index_put_(index, value)
        if layout.own_keys:
            keys, values = key, value
        elif layout.row_slice is not None:
            a, b = layout.row_slice
            keys, values = keys[:layout.key_len, a:b], values[:layout.key_len, a:b]
        else:
            keys = keys[:layout.key_len].index_select(1, layout.rows)
            values = values[:layout.key_len].index_select(1, layout.rows)
        if len(args) >= 4:
            return (query, keys, values, layout.mask, *args[4:]), kwargs
        return (query, keys, values), {**kwargs, "attention_mask": layout.mask}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass
class Result:
    """What the engine hands back to `generation.generate` (device tensors on every rank of the group)."""

    responses: torch.Tensor  # [B, R]
    log_probs: Optional[torch.Tensor]  # [B, R]
    routing: Optional[torch.Tensor]  # [B, layers, T, topk] by position, -1 where not run
    stats: Dict[str, int]


class ContinuousEngine:
    """Runs a `Scheduler`'s units on this rank's stage (module docstring)."""

    def __init__(self, model, samples: List[Sample], sampling: SamplingConfig, *, uniforms: Optional[torch.Tensor],
                 vocab_size: Optional[int], source: Optional[int], group, peers, record_routing: bool,
                 share_prefill: bool, max_decode_steps: Optional[int], pipeline_groups: Optional[int], device,
                 turns=None, parked_kv: str = "auto"):
        self.model, self.sampling, self.uniforms, self.vocab_size = model, sampling, uniforms, vocab_size
        self.source, self.group, self.peers, self.device = source, group, peers, device
        config = get_model_config(model)
        self.hidden_size = config.hidden_size
        self.comm_dtype = torch.float32 if config.fp32_residual_connection else config.params_dtype
        groups = explicit_groups(model)  # a generator rank's model: its own groups, not megatron's parallel_state
        if groups is not None:
            self.pp, self.stage = groups.pp.size(), groups.pp.rank()
        else:
            initialized = parallel_state.model_parallel_is_initialized()
            self.pp = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
            self.stage = parallel_state.get_pipeline_model_parallel_rank() if initialized else 0
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        B = len(samples)
        self.groups = int(pipeline_groups or self.pp)
        token_cap = sampling.max_num_batched_tokens
        rows = min(sampling.max_num_seqs or B, B, (token_cap or B) * self.groups)
        self.slots = max(s.prompt_length + s.whole_budget for s in samples)  # max_b L_b + R_b: every position used
        self.scheduler = Scheduler(samples, split_capacity(rows, self.groups, token_cap), token_cap=token_cap,
                                   share_prefill=share_prefill, pad_id=sampling.pad_id, eos_ids=sampling.eos_ids,
                                   stop_ids=sampling.stop_ids, max_decode_steps=max_decode_steps,
                                   wants_observation=self._wants_observation if turns is not None else None,
                                   turn_token_limit=getattr(turns.handler, "turn_token_limit", None) if turns else None,
                                   parked_kv=parked_kv)
        self.turns = turns
        self.cache = _KVCache(rows, self.slots)
        R = max([s.whole_budget for s in samples] + [0])
        self.responses = torch.full((B, R), sampling.pad_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros((B, R), dtype=torch.float32, device=device) if sampling.return_log_probs else None
        for b, s in enumerate(samples):  # a continuation's response so far
            carried = s.known[s.prompt_length:]
            if carried:
                self.responses[b, :len(carried)] = torch.tensor(carried, dtype=torch.long, device=device)
        self.capture = self.routing = None
        if record_routing and routing.moe_routers(model):
            self.capture = routing.RoutingCapture(model)
            self.routing = torch.full((B, len(self.capture.routers), self.slots, routing.router_topk(model)), -1,
                                      dtype=routing.ROUTING_DTYPE, device=device)
        self.busy = False
        self.dummy_forwards = 0

    # ------------------------------------------------------------------ forwards
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: _Layout, logits: bool,
                 hidden: Optional[torch.Tensor]) -> torch.Tensor:
        get_attr_wrapped_model(self.model, "set_input_tensor")(hidden)
        width = tokens.size(1)
        with forward_layout(self.model, position_ids=positions, logits_from=0 if logits else width,
                            rotary_length=self.slots):
            self.hooks.layout = layout
            try:
                return self.model(tokens, positions, None, runtime_gather_output=True)
            finally:
                self.hooks.layout = None

    def _dummy_forward(self) -> None:
        """One token at position 0, attending to itself only (no cache): an expert-parallel peer's pairing forward."""
        zeros = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        hidden = None if self.first else torch.zeros((1, 1, self.hidden_size), dtype=self.comm_dtype,
                                                      device=self.device)
        self._forward(zeros, zeros, _Layout(dummy=True), False, hidden)
        if self.capture is not None:
            self.capture.clear()
        self.dummy_forwards += 1

    def _prefill_forward(self, p: Prefill, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        dev, b, w, a = self.device, len(p.slots), p.width, p.start
        tokens = torch.tensor(p.tokens, dtype=torch.long, device=dev)
        positions = (a + torch.arange(w, device=dev)).unsqueeze(0).expand(b, w)
        slots = torch.tensor(p.slots, dtype=torch.long, device=dev)
        counts = torch.tensor(p.counts, dtype=torch.long, device=dev)
        keys = torch.arange(a + w, device=dev)
        causal = keys[None, :] > (a + torch.arange(w, device=dev))[:, None]  # [w, a + w]
        past_row = keys[None, None, :] >= (a + counts)[:, None, None]  # [b, 1, a + w]: padding keys
        layout = _Layout(write_positions=positions.t(), write_rows=slots[None, :].expand(w, b),
                         mask=(causal[None] | past_row).view(b, 1, w, a + w), key_len=a + w, own_keys=a == 0,
                         rows=slots)
        out = self._forward(tokens, positions, layout, False, hidden)
        if self.capture is not None:
            real = torch.arange(w, device=dev)[:, None] < counts[None, :]  # [w, b]
            i, r = real.nonzero(as_tuple=True)
            sample = torch.tensor(p.samples, dtype=torch.long, device=dev)[r]
            for layer, ids in enumerate(self.capture.last()):
                self.routing[sample, layer, a + i] = ids.view(w, b, -1)[i, r].to(self.routing.dtype)
            self.capture.clear()
        return out

    def _decode_forward(self, d: Decode, hidden: Optional[torch.Tensor]) -> torch.Tensor:
        dev, n = self.device, len(d.samples)
        positions = torch.tensor(d.positions, dtype=torch.long, device=dev)
        tokens = torch.tensor(d.tokens, dtype=torch.long, device=dev).view(n, 1)
        key_len = max(d.positions) + 1
        if d.slots is None:  # rows base .. base + n - 1: a view of the cache
            rows, row_slice = d.base + torch.arange(n, device=dev), (d.base, d.base + n)
        else:  # parked rows between them (multi-turn): gather
            rows, row_slice = torch.tensor(d.slots, dtype=torch.long, device=dev), None
        layout = _Layout(write_positions=positions.view(1, n), write_rows=rows.view(1, n),
                         mask=(torch.arange(key_len, device=dev)[None, :] > positions[:, None]).view(n, 1, 1, key_len),
                         key_len=key_len, row_slice=row_slice, rows=None if row_slice else rows)
        out = self._forward(tokens, positions.view(n, 1), layout, True, hidden)
        if self.capture is not None:
            sample = torch.tensor(d.samples, dtype=torch.long, device=dev)
            for layer, ids in enumerate(self.capture.last()):
                self.routing[sample, layer, positions] = ids.to(self.routing.dtype)
            self.capture.clear()
        return out

    def _execute(self, unit: Unit, inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
        """Runs `unit` on this stage: (hidden states to send on, decode logits on the last stage)."""
        received = iter(inputs)
        outputs, logits = [], None
        for src, dst, length in unit.moves:
            self.cache.copy(src, dst, length)
        for p in unit.prefills:
            out = self._prefill_forward(p, None if self.first else next(received))
            if not self.last:
                outputs.append(out)
        for src, dst, length, src_sample, dst_sample in unit.copies:
            self.cache.copy(src, dst, length)
            if self.routing is not None:
                self.routing[dst_sample, :, :length] = self.routing[src_sample, :, :length]
        for _ in range(unit.extra_prefills):
            self._dummy_forward()
        if unit.decode is not None:
            out = self._decode_forward(unit.decode, None if self.first else next(received))
            if self.last:
                logits = out[:, -1, :]
            else:
                outputs.append(out)
        elif unit.dummy_decode:
            self._dummy_forward()
        return outputs, logits

    # ------------------------------------------------------------------ tokens
    def _pick(self, d: Decode, logits: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The decode step's tokens [n] (+ log-probs) chosen on the source rank, the same on every rank after."""
        n, dev = len(d.samples), self.device
        with_log_probs = self.sampling.return_log_probs
        samples = torch.tensor(d.samples, dtype=torch.long, device=dev)
        steps = torch.tensor(d.steps, dtype=torch.long, device=dev)
        tokens = log_probs = None
        if self.last and (self.source is None or dist.get_rank() == self.source):
            u = self.uniforms[samples, steps] if self.uniforms is not None else None
            tokens, log_probs = choose_tokens(logits, self.sampling, u, sample_below=self.vocab_size,
                                              with_log_probs=with_log_probs)
        if self.source is not None:
            packed = torch.empty((2 if with_log_probs else 1, n), dtype=torch.float64, device=dev)
            if dist.get_rank() == self.source:
                packed[0] = tokens.to(torch.float64)
                if with_log_probs:
                    packed[1] = log_probs.to(torch.float64)
            dist.broadcast(packed, src=self.source, group=self.group)
            tokens, log_probs = packed[0].long(), (packed[1].float() if with_log_probs else None)
        self.responses[samples, steps] = tokens
        if self.log_probs is not None:
            self.log_probs[samples, steps] = log_probs
        return tokens

    # ------------------------------------------------------------------ schedule
    def _wants_observation(self, s: int, sample) -> bool:
        return self.turns.handler.wants_observation(s, sample.known, sample.prompt_length, sample.turn_start)

    def _take_observations(self) -> None:
        """Multi-turn: the observations done now (waiting for one when nothing else can decode) go into their samples'
        responses; the same on every rank of the group."""
        for s, ids in self.turns.exchange(wait=self.scheduler.only_parked()):
            start = self.scheduler.samples[s].response_length
            if self.scheduler.resume(s, ids):
                self.responses[s, start:start + len(ids)] = torch.tensor(ids, dtype=torch.long, device=self.device)

    def _decide(self, index: int) -> Unit:
        """The next unit of group index % G, padded to the expert-parallel peers' forwards; updates `busy`."""
        if self.turns is not None:
            self._take_observations()
        unit = self.scheduler.decide(index, index % self.groups)
        prefills, decode, busy = len(unit.prefills), int(unit.decode is not None), int(self.scheduler.busy())
        if self.peers is not None:
            agreed = torch.tensor([prefills, decode, busy], dtype=torch.long, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.peers)
            prefills, decode, busy = agreed.tolist()
        unit.extra_prefills = prefills - len(unit.prefills)
        unit.dummy_decode = bool(decode) and unit.decode is None
        self.busy = bool(busy)
        return unit

    def _unit_at(self, tick: int) -> Optional[int]:
        """The unit whose first stage runs at `tick` (tau(k) = (k // G) * max(G, PP) + k % G), if any."""
        if tick < 0:
            return None
        span = max(self.groups, self.pp)
        q, r = divmod(tick, span)
        return q * self.groups + r if r < self.groups else None

    def run(self) -> Result:
        """Ticks until every group (and every expert-parallel peer) is done."""
        model = self.model
        was_training = model.training
        model.eval()
        self.hooks = _AttentionHooks(model, self.cache)
        try:
            with torch.no_grad():
                self._run_ticks()
        finally:
            self.hooks.close()
            get_attr_wrapped_model(model, "set_input_tensor")(None)
            model.train(was_training)
            if self.capture is not None:
                self.capture.close()
        stats = dict(self.scheduler.stats, dummy_forwards=self.dummy_forwards, kv_cache_bytes=self.cache.nbytes,
                     kv_rows=self.cache.rows, kv_slots=self.cache.slots, pipeline_groups=self.groups)
        if self.turns is not None:
            stats["observation_wait_seconds"] = self.turns.wait_seconds
        return Result(self.responses, self.log_probs, self.routing, stats)

    def _run_ticks(self) -> None:
        units = {k: self._decide(k) for k in range(self.groups)}
        inputs: Dict[int, List[torch.Tensor]] = {}
        tick = 0
        while self.busy:
            k = self._unit_at(tick - self.stage)
            outputs, logits = self._execute(units[k], inputs.pop(k, [])) if k in units else ([], None)
            # p2p: receive the unit the previous stage just ran (this stage runs it next tick), then send this one's
            following = self._unit_at(tick + 1 - self.stage)
            if not self.first and following in units:
                buffers = [torch.empty(shape, dtype=self.comm_dtype, device=self.device)
                           for shape in units[following].hidden_shapes(self.hidden_size)]
                for buffer in buffers:
                    recv_from_prev_pipeline_rank_(buffer)
                inputs[following] = buffers
            if not self.last:
                for out in outputs:
                    send_to_next_pipeline_rank(out.to(self.comm_dtype).contiguous())
            done = self._unit_at(tick - (self.pp - 1))  # the unit the last stage ran this tick
            if done in units:
                unit = units.pop(done)
                if unit.decode is not None:
                    tokens = self._pick(unit.decode, logits)
                    parked = self.scheduler.apply(unit, tokens.tolist())
                    if parked:
                        self.turns.begin(parked, self.scheduler)
                units[done + self.groups] = self._decide(done + self.groups)
            tick += 1
