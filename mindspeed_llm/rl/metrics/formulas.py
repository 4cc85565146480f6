"""The figures an iteration logs that are computed from its batch: throughputs (MindSpeed-RL's formulas),
mean / min / max of per-sample values and of masked per-token values, and a role's metrics under its name."""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from mindspeed_llm.rl.metrics.timers import TIMING_PREFIX


def throughput_metrics(prompt_tokens: float, response_tokens: float, world_size: int,
                       timings: Mapping[str, float]) -> Dict[str, float]:
    """Tokens per second per device, as MindSpeed-RL's GRPO trainer logs them.

    With ``tokens = prompt_tokens + response_tokens``, the total over all samples of the global batch
    (a prompt counts once per sample generated from it, i.e. ``n_samples_per_prompt`` times):

    * ``e2e_tps     = tokens / world_size / timing/all``
    * ``update_tps  = tokens / world_size / timing/update``
    * ``vllm_tps    = tokens / world_size / timing/rollout``  (MindSpeed-RL's name; also logged as
      ``rollout_tps``, since the rollout here is Megatron's own generation, not vLLM)

    Source: MindSpeed-RL ``mindspeed_rl/utils/utils.py::compute_tps`` as called by
    ``mindspeed_rl/trainer/grpo_trainer_hybrid.py`` (``e2e_tps`` with the iteration time,
    ``update_tps`` with ``timing/update``, ``vllm_tps`` with ``timing/rollout``), where tokens are
    ``(response_length/mean + prompt_length/mean) * global_batch_size * n_samples_per_prompt``; the
    metric names are documented in its ``docs/features/log_metrics.md``.

    The trainer calls this on every rank with that rank's own samples (its share of the global batch) and
    ``world_size`` = TP x PP, the devices that hold one model replica, then averages over the DP ranks: with
    equal times on every rank that is the global batch's tokens / all devices / time, MindSpeed-RL's figure.
    ``prompt_tokens`` / ``response_tokens``: totals; ``timings`` holds ``timing/<stage>`` keys. A throughput
    whose timing is missing or not positive is left out.
    """
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens = float(prompt_tokens) + float(response_tokens)
    out: Dict[str, float] = {}
    for name, stage in (("e2e_tps", "all"), ("update_tps", "update"), ("vllm_tps", "rollout")):
        seconds = timings.get(TIMING_PREFIX + stage)
        if seconds is not None and float(seconds) > 0:
            out[name] = tokens / int(world_size) / float(seconds)
    if "vllm_tps" in out:
        out["rollout_tps"] = out["vllm_tps"]
    return out


def prefixed(prefix: str, metrics: Mapping[str, float]) -> Dict[str, float]:
    """``{prefix/key: value}``: a role's metrics under its name (``actor/pg_loss``)."""
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def mean_min_max(prefix: str, values) -> Dict[str, float]:
    """``{prefix/mean, prefix/min, prefix/max}`` of per-sample values (lengths, scores); empty input gives
    ``{}``."""
    if hasattr(values, "detach"):
        values = [float(v) for v in values.detach().double().reshape(-1).tolist()]
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = [float(v) for v in values.reshape(-1).tolist()]
    else:
        values = [float(v) for v in values]
    if not values:
        return {}
    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def masked_mean_min_max(prefix: str, values, mask, sum_across: Optional[Callable] = None) -> Dict[str, float]:
    """``{prefix/mean, prefix/min, prefix/max}`` of the per-token `values` where `mask` is set (MindSpeed-RL's PPO
    ``critic/advantages`` etc.). The mean is over the tokens of the whole batch: `sum_across` sums the masked sum
    and the token count over the ranks that hold shards of it, so it does not depend on how the rows are dealt; min
    and max are this rank's, for the metric reduction's MIN / MAX. A rank without tokens reports +inf / -inf there
    (the others' decide); a batch without any, 0."""
    import torch

    mask = mask.to(torch.bool)
    picked = values.detach().double()[mask]
    totals = torch.stack([picked.sum(), picked.new_tensor(float(picked.numel()))])
    if sum_across is not None:
        totals = sum_across(totals)
    total, count = float(totals[0]), float(totals[1])
    if not count:
        return {f"{prefix}/mean": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    if not picked.numel():
        return {f"{prefix}/mean": total / count, f"{prefix}/min": float("inf"), f"{prefix}/max": float("-inf")}
    return {f"{prefix}/mean": total / count, f"{prefix}/min": float(picked.min()), f"{prefix}/max": float(picked.max())}


def tool_response_length(tool_mask) -> Dict[str, float]:
    """``{tool/response_length/mean}``: the tool-response tokens per trajectory (``tool_mask`` ``[B, R]``, 1 on them;
    the mean over the rows), for a multi-turn rollout's metrics; ``{}`` without rows."""
    if tool_mask is None or tool_mask.shape[0] == 0:
        return {}
    return {"tool/response_length/mean": float(tool_mask.detach().double().sum(-1).mean())}
