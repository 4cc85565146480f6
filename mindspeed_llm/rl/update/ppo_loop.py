"""Epochs x mini-batches of a PPO-style update over one iteration's `Experience`, for any trained role.

The update's result depends on the data and the flags, never on the parallel layout (docs/parallelism.md,
"Layout invariance"):

* the mini-batches are the same sets of samples at every DP size (`mini_batch_units`);
* each micro-batch's loss is its share of the mini-batch's loss, normalised by the mini-batch's global token
  and sequence counts (`loss_totals`, summed over DP ranks), so the shares add up to the same loss for any
  micro-batch size and DP size (`TrainableModel.train_step` sums them).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np
import torch
from megatron.core import parallel_state

from mindspeed_llm.distributed import sum_over_data_parallel
from mindspeed_llm.rl.update import moe
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.core_algos import critic_mask
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.settings import UpdateSchedule


def mini_batch_units(local_units: int, dp_rank: int, mini_batches: int, seed: int, iteration: int,
                     epoch: int) -> List[torch.Tensor]:
    """This rank's units (local indices) of each mini-batch of one epoch.

    A unit is a sample, or a prompt's group of samples (they stay together). DP rank r holds the global units
    [r * local_units, (r + 1) * local_units). The global units are dealt in chunks of `mini_batches`
    consecutive units: each chunk gives one unit to every mini-batch, in an order drawn from (seed,
    iteration, epoch, chunk index). A rank holds whole chunks, so every rank has the same number of units in
    each mini-batch, and a mini-batch is the same set of global units at every DP size.
    """
    if local_units % mini_batches:
        raise ValueError(f"{local_units} units per rank do not deal into {mini_batches} mini-batches")
    chunks = local_units // mini_batches
    first = dp_rank * chunks
    order = np.stack([
        np.random.default_rng([seed, iteration, epoch, first + c]).permutation(mini_batches) for c in range(chunks)
    ])  # [chunks, mini_batches]: the position in its chunk of each mini-batch's unit
    units = torch.from_numpy(np.arange(chunks)[:, None] * mini_batches + order)
    return [units[:, k] for k in range(mini_batches)]


def loss_totals(mask: torch.Tensor, response_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The counts a mini-batch's losses divide by, over all DP ranks, from its loss and response masks on this
    rank: loss tokens, sequences in the loss, and value tokens (`core_algos.critic_mask`, TRL's critic mask)."""
    local = torch.stack([mask.sum(), mask.bool().any(dim=-1).sum(), critic_mask(mask, response_mask).sum()]).double()
    tokens, sequences, value_tokens = sum_over_data_parallel(local).float().unbind()
    return {"total_tokens": tokens, "total_sequences": sequences, "total_value_tokens": value_tokens}


def ppo_update(model, exp: Experience, plan: MicroBatchPlan, schedule: UpdateSchedule, loss_fn: Callable,
               iteration: int, group_size: int = 1) -> Dict[str, float]:
    """`schedule.ppo_epochs` passes over the iteration's samples in `schedule.ppo_mini_batch_size` mini-batches, one
    optimizer step each, cut into micro-batches by `plan`. A prompt's `group_size` samples stay in one
    mini-batch.

    The mini-batches are drawn from (seed, iteration, epoch), so a resumed run replays them exactly. Returns each
    metric's mean over the steps (`lr` of the last step), and a MoE model's `moe/*` metrics over the whole update.
    """
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local_units = exp.batch_size // group_size
    mini_batches = exp.batch_size * dp_size // schedule.ppo_mini_batch_size
    within_unit = torch.arange(group_size)
    steps: List[Dict[str, float]] = []
    with moe.update_stats(model.module) as moe_stats:  # nothing for a dense model
        for epoch in range(schedule.ppo_epochs):
            for units in mini_batch_units(local_units, dp_rank, mini_batches, schedule.seed, iteration, epoch):
                samples = (units[:, None] * group_size + within_unit[None, :]).reshape(-1).to(exp.tokens.device)
                totals = loss_totals(exp.loss_mask[samples], exp.response_mask[samples])
                micro_batches = [dict(mb, **totals) for mb in plan.micro_batches(exp, samples, update=True)]
                moe_stats.micro_batches(len(micro_batches))
                steps.append(model.train_step(micro_batches, loss_fn))
    result = {k: steps[-1][k] if k == "lr" else sum(s[k] for s in steps) / len(steps) for k in steps[0]}
    result.update(moe_stats.metrics())  # over the whole update (module doc of rl/update/moe.py)
    return result


def old_logp_is_current(schedule: UpdateSchedule, exp: Experience) -> bool:
    """True when the update is one optimizer step over the whole batch (`--ppo-epochs 1`, one mini-batch):
    every micro-batch's forward then runs on the weights that generated the rollout, so the old log-probs
    equal the update's own (detached) and need no pass of their own (TRL does the same)."""
    global_samples = exp.batch_size * parallel_state.get_data_parallel_world_size()
    return schedule.ppo_epochs == 1 and global_samples <= schedule.ppo_mini_batch_size
