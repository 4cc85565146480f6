"""What a checkpoint holds of a role's optimizer beyond megatron's `state_dict()`: with --use-distributed-optimizer,
the fp32 main weights and Adam moments sharded over the DP ranks (Megatron-LM's `distrib_optim.pt`).

`parameter_state` gathers them to DP rank 0 for a save; `parameter_state_problem` says why a read state does not fit
this model; `load_parameter_state` scatters one to the DP ranks (at the saved DP size or another) and checks that the
main weights and moments were restored. `rl/update/trainable.py`'s `TrainableModel` calls these for its optimizer
(`TrainableModel.parameter_state`, `load_state_dict(parameter_state=...)`), `checkpoint/training.py` writes and reads
the file.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from mindspeed_llm.checkpoint.errors import CheckpointError
from mindspeed_llm.distributed import any_rank, gather_messages


def distributed_optimizers(optimizer) -> list:
    """Megatron's DistributedOptimizer(s) of `optimizer` (dense and expert parameters have one each); [] without
    --use-distributed-optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o for o in subs if isinstance(o, DistributedOptimizer)]


def parameter_state(subs: List) -> Optional[object]:
    """The distributed optimizers' (`subs`) fp32 main weights and Adam moments of the whole model shard, gathered
    from the DP ranks (a collective: every rank calls it). Megatron-LM's `distrib_optim.pt` content: per optimizer
    one `get_parameter_state_dp_zero()` dict (a list of them when dense and expert parameters have one each).
    Returns it on the ranks that are DP rank 0 of some optimizer, else None; None without the distributed
    optimizer."""
    if not subs:
        return None
    states = [o.get_parameter_state_dp_zero() for o in subs]
    if all(state is None for state in states):
        return None
    return states[0] if len(states) == 1 else states


def reads_parameter_state(subs: List) -> bool:
    """Whether this rank reads `distrib_optim.pt` on load (DP rank 0 of some distributed optimizer of `subs`)."""
    return any(o.data_parallel_group.rank() == 0 for o in subs)


def parameter_state_problem(subs: List, parameter_state, role: str) -> Optional[str]:
    """Why `parameter_state` (read by this rank) cannot be loaded into the distributed optimizers `subs` of the
    role named `role`, or None.

    Megatron's dp_zero format holds each grad buffer's values without the padding that depends on the DP size,
    so it loads at any DP size; it must hold every buffer of this model with the same number of values."""
    states = parameter_state if isinstance(parameter_state, list) else [parameter_state]
    if len(states) != len(subs):
        return (f"it holds the state of {len(states)} optimizer(s), this {role} has {len(subs)} (dense and "
                "expert parameters have one each)")
    for index, (optimizer, state) in enumerate(zip(subs, states)):
        if optimizer.data_parallel_group.rank() != 0:
            continue
        if state is None:
            return f"it has no state for optimizer {index} of {len(subs)}"
        for buffer_index, buffer in enumerate(optimizer.buffers):
            key = (buffer.param_dtype, buffer.grad_dtype)
            entry = state.get(buffer_index, {}).get(key) if isinstance(state, dict) else None
            if entry is None:
                return (f"it has no state for grad buffer {buffer_index} ({key[0]} weights, {key[1]} grads) of "
                        f"optimizer {index}")
            if entry.get("numel_unpadded") != buffer.numel_unpadded:
                return (f"grad buffer {buffer_index} ({key[0]} weights) holds {entry.get('numel_unpadded')} "
                        f"values there but {buffer.numel_unpadded} in this model (another model, or another "
                        "precision)")
    return None


def load_parameter_state(subs: List, parameter_state, role: str, source: str = "") -> None:
    """Scatters `parameter_state` (see `parameter_state`; None on the ranks that do not read it) to the DP ranks of
    the distributed optimizers `subs` (a collective), after their optimizer `state_dict` was loaded, then checks the
    restored state (`check_restored`): a resume never runs on stale fp32 main weights or uninitialised moments.
    `role` and `source` (the file) name them in messages."""
    states = parameter_state if isinstance(parameter_state, list) else [parameter_state] * len(subs)
    for optimizer, sub_state in zip(subs, states):
        _poison_moments(optimizer.optimizer)  # left NaN unless the load below sets them
        optimizer.load_parameter_state_from_dp_zero(sub_state)
        _own_steps(optimizer.optimizer)
    check_restored(subs, role, source)


def check_restored(subs: List, role: str, source: str) -> None:
    """After a distributed optimizer's load, on every rank: each fp32 main weight shard, rounded to the model's
    precision, equals the weights just loaded (the step copied it there), and no moment is left NaN. Any
    rank's failure stops every rank with `CheckpointError`."""
    stale = unset = 0
    with torch.no_grad():
        for optimizer in subs:
            for model_group, main_group in zip(optimizer.model_float16_groups,
                                               optimizer.shard_fp32_from_float16_groups):
                for model_param, main in zip(model_group, main_group):
                    where = optimizer._get_model_param_range_map(model_param)["param"]
                    weights = model_param.detach().view(-1)[where.start:where.end]
                    stale += int(not torch.equal(main.detach().to(weights.dtype), weights))
            for moments in optimizer.optimizer.state.values():
                unset += sum(int(not bool(torch.isfinite(v).all())) for k, v in moments.items()
                             if k != "step" and isinstance(v, torch.Tensor))
    found = f"{stale} fp32 main weight shards differ from the loaded weights" if stale else ""
    if unset:
        found += ("; " if found else "") + f"{unset} optimizer moments were not restored"
    if any_rank(bool(found)):
        problems = gather_messages(found or None)
        raise CheckpointError(
            f"{role}: the distributed optimizer's state{' from ' + source if source else ''} was not "
            f"restored ({'; '.join(problems)}); resuming would train from stale main weights. Pass "
            "--no-load-optim to restart the optimizer from the checkpoint's weights")


def _poison_moments(inner: torch.optim.Optimizer) -> None:
    """NaN in every moment, so that one the load does not set shows (megatron allocates them with torch.empty)."""
    for moments in inner.state.values():
        for key, value in moments.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                value.fill_(float("nan"))


def _own_steps(inner: torch.optim.Optimizer) -> None:
    """Give every parameter its own Adam `step` tensor: megatron's DistributedOptimizer.load_state_dict puts one
    tensor in every parameter's state, which torch's fused / foreach Adam then increments once per parameter
    (measured: the resumed loss drifts, shared/MEGATRON_ON_CPU.md)."""
    for moments in inner.state.values():
        step = moments.get("step")
        if isinstance(step, torch.Tensor):
            moments["step"] = step.clone()
