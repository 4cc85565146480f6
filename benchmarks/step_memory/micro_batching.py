"""Micro-batch padding at a skewed length mix: computed per batching rule (`micro_batch_costs`) and measured on the real
`MicroBatchPlan` (`plan_micro_batch_tokens`)."""

from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence


# ---------------------------------------------------------------------------------------------- micro-batching
def skewed_mix(samples: int, group: int, prompt_cap: int, response_cap: int, seed: int = 0):
    """The skewed length mix: 10% of the responses (rounded up) at the cap, the rest uniform in 10-50% of it; one
    prompt per group of `group` samples, uniform in 5-15% of the prompt cap (DeepScaleR-like short prompts).
    Returns (prompt lengths, response lengths), one per sample, a group's samples consecutive."""
    rng = random.Random(seed)
    at_cap = set(rng.sample(range(samples), math.ceil(samples / 10)))
    responses = [response_cap if i in at_cap else rng.randint(max(1, response_cap // 10), max(1, response_cap // 2))
                 for i in range(samples)]
    prompts = []
    for _ in range(samples // group):
        p = rng.randint(max(1, prompt_cap // 20), max(1, (3 * prompt_cap) // 20))
        prompts.extend([p] * group)
    return prompts, responses


def _cost(batches: List[List[int]], lengths: Sequence[int], width=None):
    """(processed tokens, attention work sum s^2, largest micro-batch tokens) of rows padded to `width` (None: each
    micro-batch's own longest)."""
    tokens = work = largest = 0
    for mb in batches:
        w = width if width is not None else max(lengths[i] for i in mb)
        tokens += len(mb) * w
        work += len(mb) * w * w
        largest = max(largest, len(mb) * w)
    return tokens, work, largest


def _drawn_order(units: int, seed: int) -> List[int]:
    """The order `ppo_loop` deals prompt groups (units) to mini-batches: a drawn permutation."""
    order = list(range(units))
    random.Random(seed).shuffle(order)
    return order


def micro_batch_costs(prompts: Sequence[int], responses: Sequence[int], group: int, micro_batch_size: int,
                      budget: int, seed: int = 0) -> dict:
    """Processed tokens / real tokens and attention work (sum of s^2 over model rows) / real, computed, for:
    `padded` (every micro-batch at the whole local batch's longest sequence: the micro-batches before
    `batch_plan` cut them to their own length, the 2.4x of the first memory run), `by_count` (`--micro-batch-size`
    samples in the update's drawn order, each micro-batch at its own longest: `MicroBatchPlan` without a budget)
    and `token_budget` (`--max-tokens-per-micro-batch budget`: the units sorted by length, grouped by
    `batch_plan.token_budget_groups`, the rule `MicroBatchPlan` runs); with prompt groups (group > 1) also the
    packed rows `[prompt | r1 .. rn]` (each response slot at the group's longest) by count and by the budget."""
    from mindspeed_llm.rl.update.batch_plan import token_budget_groups

    lengths = [p + r for p, r in zip(prompts, responses)]
    real_tokens, real_work = sum(lengths), sum(s * s for s in lengths)
    units = _drawn_order(len(lengths) // group, seed)
    order = [u * group + k for u in units for k in range(group)]
    chunks = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    modes = {
        "padded": _cost(chunks, lengths, width=max(lengths)),
        "by_count": _cost(chunks, lengths),
        "token_budget": _cost(token_budget_groups(lengths, budget), lengths),
    }
    if group > 1:
        packed = [prompts[g * group] + group * max(responses[g * group:(g + 1) * group])
                  for g in range(len(lengths) // group)]
        groups_per_mb = max(1, micro_batch_size // group)
        packed_chunks = [units[i:i + groups_per_mb] for i in range(0, len(units), groups_per_mb)]
        modes["packed_by_count"] = _cost(packed_chunks, packed)
        if budget >= max(packed):
            modes["packed_token_budget"] = _cost(token_budget_groups(packed, budget), packed)
    out = dict(samples=len(lengths), group=group, micro_batch_size=micro_batch_size, budget=budget,
               real_tokens=real_tokens, real_attention_work=real_work, longest=max(lengths),
               mean_length=real_tokens / len(lengths))
    for name, (tokens, work, largest) in modes.items():
        out[name] = dict(processed_tokens=tokens, tokens_ratio=tokens / real_tokens, attention_work=work,
                         attention_ratio=work / real_work, largest_micro_batch_tokens=largest)
    return out


def skewed_experience(prompts: Sequence[int], responses: Sequence[int]):
    """An `Experience` of these prompt and response lengths (token ids 1, a group's samples sharing their prompt's
    length), laid out as the rollout lays one out: prompt, response, padding to the batch's longest."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.rl.experience import Experience

    dev = device.current_device()
    b, width, total = len(prompts), max(responses), max(p + r for p, r in zip(prompts, responses))
    prompt_lengths = torch.tensor(prompts, device=dev)
    response_lengths = torch.tensor(responses, device=dev)
    response_mask = (torch.arange(width, device=dev)[None, :] < response_lengths[:, None]).float()
    tokens = (torch.arange(total, device=dev)[None, :] < (prompt_lengths + response_lengths)[:, None]).long()
    return Experience(tokens=tokens, position_ids=torch.arange(total, device=dev).expand(b, -1).clone(),
                      prompt_lengths=prompt_lengths, responses=response_mask.long(), response_mask=response_mask,
                      ended_with_eos=torch.ones(b, dtype=torch.bool, device=dev))


def plan_micro_batch_tokens(prompts: Sequence[int], responses: Sequence[int], group: int, micro_batch_size: int,
                            budget: Optional[int], seed: int = 0) -> dict:
    """Measured on the real path: the update's micro-batches of a `MicroBatchPlan` (`micro_batches(...,
    update=True)`, the samples in `ppo_loop`'s drawn prompt-group order) of an Experience of these lengths, by
    count (`budget` None) or by `max_tokens=budget`; packed when `micro_batch_size` holds whole groups. Returns
    the model rows' processed tokens (sum of each micro-batch's `tokens` numel), sum of s^2 over its rows, the
    largest micro-batch's tokens and the count."""
    import torch

    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan

    exp = skewed_experience(prompts, responses)
    plan = MicroBatchPlan.build(exp, micro_batch_size, group, max_tokens=budget)
    units = _drawn_order(len(prompts) // group, seed)
    samples = torch.tensor([u * group + k for u in units for k in range(group)])
    mbs = plan.micro_batches(exp, samples, update=True)
    real = sum(p + r for p, r in zip(prompts, responses))
    processed = sum(mb["tokens"].numel() for mb in mbs)
    work = sum(mb["tokens"].shape[0] * mb["tokens"].shape[1] ** 2 for mb in mbs)
    return dict(packed=plan.packed, micro_batches=len(mbs), processed_tokens=processed,
                tokens_ratio=processed / real, attention_work=work,
                largest_micro_batch_tokens=max(mb["tokens"].numel() for mb in mbs))
