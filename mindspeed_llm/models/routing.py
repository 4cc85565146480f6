"""Record and replay the top-k expert choice of a mixture-of-experts model (rollout routing replay).

Why: the rollout and the training forwards of the same weights can route a token to different experts when the
router's logits differ in their last bits (another batch shape, KV cache against a full forward, bf16). A token
routed differently is computed by another function, so the training log-probs are not those of the policy that
sampled. With `--moe-routing-replay` the rollout records, for every token and MoE layer, the set of experts it
chose, and the old-log-prob, reference and update forwards route those tokens to the same experts; the gate
probabilities are still computed by the training forward (from its own router scores of the replayed experts),
so the router weights keep their gradient.

The routing of a model is read and set through its own `TopKRouter` modules (in layer order; each pipeline
stage has only its layers), never through megatron's class-level `RouterReplay` registry, which every model of
the process shares (actor, reference, critic):

* record: a forward hook on each router turns the `routing_map` it returns `[tokens, experts]` into the
  sorted expert ids `[tokens, topk]`;
* replay: megatron's top-k routing (`moe_utils.topk_routing_with_score_function`) asks `router.router_replay`
  for the top-k when it is set; `replay_routing` puts an object there that answers with the given ids (and,
  for the rows given as -1, megatron's own top-k), and restores the router's own afterwards. The gate probs
  are `scores.gather(1, ids)`, as megatron's REPLAY_FORWARD does. Under activation recompute a checkpointed
  router runs again inside the backward, outside this block and (1F1B pipelines) after later micro-batches'
  forwards: megatron's REPLAY_BACKWARD keeps a per-router queue of targets, consumed in forward order. Here the
  object is a `forward_state.per_forward` setting instead: the checkpoint wrapper of `patches/recompute.py`
  re-enters the settings that were live when its region was checkpointed, so the recomputed router gets its own
  micro-batch's target whichever layers are checkpointed (block recompute leaves some out, which a queue fed by
  every forward would misalign). The load-balancing loss keeps the live routing (megatron computes it apart).

Token order: a router sees the hidden states `[S, rows, H]` of its forward flattened sequence-first, token
`s * rows + r`. The stored routing is per sample and position, `[B, layers, T, topk]` in the Experience's
right-padded layout (`inference/results.py`), -1 where unknown; `replay_targets` maps it to one micro-batch's
router order, in either layout of `rl/update/batch_plan.py` (one row per sample, or packed prompt groups).
Expert ids are global (the router is replicated over TP and EP), so EP and TP change nothing; with PP every
stage records and replays its own layers. Under sequence parallelism a training forward's router sees its TP rank's
share of the (padded) positions: the targets are cut to it (`sequence_shard`), and the mismatch counts are summed
over TP. (Generation runs without sequence parallelism and records whole sequences.)
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import unwrap_model

from mindspeed_llm.forward_state import per_forward

ROUTING_DTYPE = torch.int16  # expert ids; -1 = unknown


def moe_routers(model) -> List[TopKRouter]:
    """This rank's top-k routers of `model` (wrapped or not), in layer order; empty for a dense model."""
    core = _core(model)
    return [m for m in core.modules() if isinstance(m, TopKRouter)]


def router_topk(model) -> int:
    routers = moe_routers(model)
    if not routers:
        raise ValueError("routing: this model has no MoE router")
    return int(routers[0].topk)


def _expert_ids(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[tokens, experts] bool -> the chosen expert ids [tokens, topk], ascending."""
    experts = routing_map.size(1)
    ids = torch.arange(experts, device=routing_map.device).expand_as(routing_map)
    chosen = torch.where(routing_map, ids, torch.full_like(ids, experts)).sort(dim=1).values[:, :topk]
    if bool((chosen >= experts).any()):
        raise RuntimeError("routing: a token was routed to fewer than top-k experts (token dropping with "
                           "moe_expert_capacity_factor?); recording needs dropless routing")
    return chosen


class RoutingCapture:
    """Forward hooks on a model's routers: `calls[layer]` lists the expert ids `[tokens, topk]` of every forward
    since the last `clear()`."""

    def __init__(self, model):
        self.routers = moe_routers(model)
        self.calls: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(router, args, output):
            routing_map = output[1]
            self.calls[layer].append(_expert_ids(routing_map.detach(), router.topk))
        return hook

    def last(self) -> List[torch.Tensor]:
        """Each layer's ids of the latest forward."""
        if any(not c for c in self.calls):
            raise RuntimeError("routing: a router did not run in this forward")
        return [c[-1] for c in self.calls]

    def clear(self) -> None:
        for c in self.calls:
            c.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@contextlib.contextmanager
def capture_routing(model):
    capture = RoutingCapture(model)
    try:
        yield capture
    finally:
        capture.close()


class _Replay:
    """Stands in for megatron's `RouterReplay` in `router.router_replay`: the top-k of this forward are `target`
    `[tokens, topk]`, megatron's own top-k on the rows given as -1."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        target = self.target.to(device=scores.device, dtype=torch.long)
        if tuple(target.shape) != (scores.size(0), topk):
            raise RuntimeError(f"routing replay: the router got {scores.size(0)} tokens x top-{topk} but the replay "
                               f"holds {tuple(target.shape)}; the micro-batch's routing does not match its layout")
        known = (target >= 0).all(dim=1, keepdim=True)
        if not bool(known.all()):
            _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = torch.where(known, target, live)
        return scores.gather(1, target), target


@contextlib.contextmanager
def replay_routing(model, targets: List[torch.Tensor]):
    """Forwards of `model` inside this block route token i of layer l to the experts `targets[l][i]` (rows of -1:
    the router's own choice). One target per router of this rank, in layer order."""
    routers = moe_routers(model)
    if len(targets) != len(routers):
        raise ValueError(f"routing replay: {len(targets)} layers of routing for {len(routers)} MoE layers on this "
                         "rank; the rollout was recorded by another model or pipeline layout")
    for router in routers:
        if router.config.moe_router_fusion or getattr(router, "routing_type", None) == "sinkhorn":
            raise ValueError("routing replay: fused or sinkhorn routing does not consult router_replay")
    with contextlib.ExitStack() as stack:
        # per_forward: a recomputed router (activation recompute, in the backward) replays this target too
        for router, target in zip(routers, targets):
            stack.enter_context(per_forward(router, "router_replay", _Replay(target)))
        yield


# ---------------------------------------------------------------------------------------------- layouts
def token_sources(micro_batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each model position `[rows, S]` of a micro-batch (`rl/update/batch_plan.py`), the micro-batch sample whose
    token sits there and that token's position in the sample's own sequence; (-1, -1) on padding.

    One row per sample: row r is sample r at its own positions. Packed prompt groups (`packed_groups` in the
    micro-batch): row g is `[prompt | response_1 | ... | response_n]`, each response slot as wide as the group's
    longest response; the prompt is taken from the group's first sample (all n share it)."""
    tokens = micro_batch["tokens"]
    rows, S = tokens.shape
    device = tokens.device
    P = micro_batch["prompt_lengths"].long()
    lengths = micro_batch["response_mask"].sum(-1).long()
    s = torch.arange(S, device=device)[None, :]
    if micro_batch.get("packed_groups") is None:
        if P.numel() != rows:
            raise ValueError(f"routing: {P.numel()} samples in {rows} rows, but no packed groups")
        valid = s < (P + lengths)[:, None]
        sample = torch.arange(rows, device=device)[:, None].expand(rows, S)
        return torch.where(valid, sample, -1), torch.where(valid, s.expand(rows, S), -1)
    row_index = micro_batch["row_index"].long()
    n = P.numel() // rows
    if n * rows != P.numel() or not bool((row_index == torch.arange(rows, device=device).repeat_interleave(n)).all()):
        raise ValueError("routing: a packed micro-batch whose samples are not whole consecutive groups")
    first = torch.arange(rows, device=device) * n
    Pg = P[first][:, None]
    W = lengths.view(rows, n).max(dim=1).values.clamp(min=1)[:, None]
    offset = s - Pg
    block = torch.div(offset, W, rounding_mode="floor").clamp(min=0)
    j = offset - block * W
    in_prompt = s < Pg
    slot_sample = first[:, None] + block.clamp(max=n - 1)
    in_response = (offset >= 0) & (block < n) & (j < lengths[slot_sample])
    sample = torch.where(in_prompt, first[:, None].expand(rows, S), torch.where(in_response, slot_sample, -1))
    position = torch.where(in_prompt, s.expand(rows, S), torch.where(in_response, Pg + j, -1))
    return sample, position


def replay_targets(micro_batch: Dict[str, torch.Tensor], routing: torch.Tensor) -> List[torch.Tensor]:
    """One target `[S * rows, topk]` per layer in the router's token order (sequence-first), from the samples'
    `routing` `[mb, layers, T, topk]`; -1 on padding and where the rollout did not record."""
    sample, position = token_sources(micro_batch)
    rows, S = sample.shape
    known = sample >= 0
    T = routing.shape[2]
    if bool((position[known] >= T).any()):
        raise ValueError(f"routing: a micro-batch position past the recorded routing ({T} positions)")
    picked = routing[sample.clamp(min=0), :, position.clamp(min=0, max=T - 1)]  # [rows, S, layers, topk]
    picked = torch.where(known[:, :, None, None], picked, torch.full_like(picked, -1))
    return [picked[:, :, l].transpose(0, 1).reshape(S * rows, -1) for l in range(routing.shape[1])]


def response_scope(micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[S * rows] bool, router order: the response tokens whose routing decides a read log-prob (every response
    token but the last, whose output predicts nothing read)."""
    sample, position = token_sources(micro_batch)
    P = micro_batch["prompt_lengths"].long()
    lengths = micro_batch["response_mask"].sum(-1).long()
    s_ = sample.clamp(min=0)
    scope = (sample >= 0) & (position >= P[s_]) & (position < P[s_] + lengths[s_] - 1)
    return scope.transpose(0, 1).reshape(-1)


def count_mismatch(observed: List[torch.Tensor], targets: List[torch.Tensor], scope: torch.Tensor) -> torch.Tensor:
    """[mismatched, compared] over the tokens in `scope` with a known target and all layers: a token-layer
    mismatches when its top-k SET differs (both sides are compared sorted)."""
    totals = torch.zeros(2, dtype=torch.float64, device=scope.device)  # summed on the device: no host sync per layer
    for seen, want in zip(observed, targets):
        want = want.to(seen.device).long()
        keep = scope.to(seen.device) & (want >= 0).all(dim=1)
        differ = (seen.long().sort(dim=1).values != want.sort(dim=1).values).any(dim=1)
        totals = totals.to(seen.device) + torch.stack([(differ & keep).sum(), keep.sum()]).double()
    return totals


# ---------------------------------------------------------------------------------------------- per-forward hook
_COMPARE = "_routing_compare"  # on the core model: a [mismatched, compared] accumulator while comparing


def _core(model):
    """The GPTModel of `model`: wrapped (DDP, Float16Module) or a one-chunk list (no virtual pipeline)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("routing: virtual pipeline parallelism (several model chunks) is not supported")
        model = model[0]
    return unwrap_model(model)


def is_moe(model) -> bool:
    """A mixture of experts (on any stage: the config is the whole model's)."""
    return getattr(_core(model).config, "num_moe_experts", None) is not None


def mismatch_fraction(counts: torch.Tensor, model=None) -> Optional[float]:
    """mismatched / compared response token-layers, summed over the pipeline stages (each has its own layers) and
    the data-parallel ranks (each its own samples); TP ranks hold the same counts, except under sequence
    parallelism (`model`'s), where each holds its share of the sequence: summed over them too. Collective over
    those groups."""
    from megatron.core import parallel_state
    import torch.distributed as dist

    from mindspeed_llm import device
    from mindspeed_llm.distributed import sum_over_data_parallel

    total = counts.to(device=device.current_device(), dtype=torch.float64)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    if model is not None and getattr(_core(model).config, "sequence_parallel", False):
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    total = sum_over_data_parallel(total)
    mismatched, compared = total.tolist()
    return mismatched / compared if compared else None  # nothing compared (e.g. one-token responses): no metric


def replays(model) -> bool:
    """Whether forwards of `model` replay the recorded routing: a policy MoE model built with
    `moe_enable_routing_replay=True` (`--moe-routing-replay`)."""
    core = _core(model)
    return (bool(getattr(core.config, "moe_enable_routing_replay", False))
            and not getattr(core, "is_value_model", False)
            and bool(moe_routers(core)))


def sequence_shard(per_token: torch.Tensor, rows: int, width: int, fill) -> torch.Tensor:
    """Under sequence parallelism a router sees this TP rank's share of the sequence: `per_token` in router order
    (`[S * rows, ...]`, sequence-first) padded to `width` positions with `fill` (the forward's padding, never real
    tokens) and cut to the rank's `width / TP` positions."""
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    by_position = per_token.view(-1, rows, *per_token.shape[1:])
    extra = width - by_position.size(0)
    if extra:
        by_position = torch.cat([by_position, by_position.new_full((extra, *by_position.shape[1:]), fill)])
    share = width // tp
    return by_position[rank * share:(rank + 1) * share].reshape(-1, *per_token.shape[1:])


@contextlib.contextmanager
def micro_batch_routing(model, micro_batch: Dict[str, torch.Tensor], width: Optional[int] = None):
    """Around one training forward of `micro_batch` (`rl/update/engine.py`): replays its samples' recorded routing when the
    model replays (`replays`), and counts mismatches when a comparison is open (`compare_routing`). A no-op
    without recorded routing or for a dense model. `width`: the forward's rows padded to it (sequence parallelism:
    each TP rank's routers see its share of those positions, `sequence_shard`)."""
    routing = micro_batch.get("routing")
    core = _core(model)
    counter = getattr(core, _COMPARE, None)
    replay = routing is not None and replays(core)
    if routing is None or not (replay or counter is not None):
        yield
        return
    targets, scope = replay_targets(micro_batch, routing), None
    if counter is not None:
        scope = response_scope(micro_batch)
    if getattr(core.config, "sequence_parallel", False):
        rows, width = micro_batch["tokens"].shape[0], width or micro_batch["tokens"].shape[1]
        targets = [sequence_shard(t, rows, width, -1) for t in targets]
        scope = None if scope is None else sequence_shard(scope, rows, width, False)
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routing(core)) if counter is not None else None
        if replay:
            stack.enter_context(replay_routing(core, targets))
        yield
    if capture is not None:
        counter += count_mismatch(capture.last(), targets, scope)


@contextlib.contextmanager
def compare_routing(model, enabled: bool = True):
    """Within this block, every forward of `model` of a micro-batch with recorded routing adds its
    [mismatched, compared] response token-layers to the yielded tensor (this rank's share)."""
    from mindspeed_llm import device

    core = _core(model)
    counter = torch.zeros(2, dtype=torch.float64, device=device.current_device())
    if not enabled or not moe_routers(core):
        yield counter
        return
    setattr(core, _COMPARE, counter)
    try:
        yield counter
    finally:
        setattr(core, _COMPARE, None)


__all__ = [
    "ROUTING_DTYPE", "moe_routers", "router_topk", "RoutingCapture", "capture_routing", "replay_routing",
    "token_sources", "replay_targets", "response_scope", "count_mismatch", "replays", "micro_batch_routing",
    "compare_routing", "is_moe", "mismatch_fraction",
]
