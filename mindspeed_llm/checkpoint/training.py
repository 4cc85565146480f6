"""Training checkpoints of a stage: every trained role (actor, critic) plus the loop's own state.

Layout (Megatron-LM's, one tree per role)::

    <save>/<role>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/<role>/latest_checkpointed_iteration.txt
    <save>/latest_checkpointed_iteration.txt          <- written last of all: the resume point

Each shard holds `model`, `optimizer`, `opt_param_scheduler`, `iteration`, `model_spec` and, in the same
file, the loop state (`rng_state` of every DP rank, `data_position` of the prompt sampler).

Crash safety: ranks write into staging directories (`.iter_XXXXXXX.staging`); after a barrier rank 0 renames each to its
final name, then replaces each role's latest file, then the top-level one (temp file + `os.replace`). A
run killed at any moment leaves the previous complete checkpoint as the resume point.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.distributed import barrier, is_rank_0


def _rng_state() -> dict:
    import random

    import numpy as np

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": _tracker_states(),
    }


def _tracker_states():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _gather_dp(obj):
    """Every DP rank's object, in DP-rank order (the RNG differs per rank)."""
    group = parallel_state.get_data_parallel_group()
    size = parallel_state.get_data_parallel_world_size()
    if not dist.is_initialized() or size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _layout():
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def save(root: str, iteration: int, roles: Dict[str, object], loop_state: dict) -> None:
    """Write `roles` ({name: TrainableModel}) and `loop_state` (sampler position etc.) for `iteration`."""
    rng_states = _gather_dp(_rng_state())
    tp_rank, pp_rank, tp, pp = _layout()
    staging = {name: layout.staging_dir(os.path.join(root, name), iteration) for name in roles}
    if is_rank_0():
        for name in roles:
            layout.prepare_staging(os.path.join(root, name), iteration)  # drops leftovers of a killed save
    barrier()
    if parallel_state.get_data_parallel_rank() == 0:  # DP replicas hold identical weights and optimizer
        for name, trainable in roles.items():
            module = trainable.module
            state = trainable.state_dict()
            payload = layout.make_payload(
                state.pop("model"), module.model_spec, tp, pp, tp_rank, pp_rank, module.config.params_dtype,
                bool(getattr(module, "is_value_model", False)), iteration,
                rng_state=rng_states, data_position=loop_state, **state,
            )
            layout.save_file(payload, layout.shard_path(staging[name], tp_rank, pp_rank, pp))
    barrier()
    if is_rank_0():
        for name in roles:
            layout.publish(staging[name], layout.checkpoint_dir(os.path.join(root, name), iteration))
        for name in roles:
            layout.write_latest(os.path.join(root, name), iteration)
        layout.write_latest(root, iteration)  # the resume point: only once every role is complete
    barrier()


def latest_iteration(root: str) -> Optional[int]:
    """The iteration of the last complete stage checkpoint under `root`, or None when there is none."""
    try:
        value = layout.read_latest(root)
    except layout.CheckpointNotFoundError:
        return None
    return None if value == layout.RELEASE else int(value)


def load(root: str, roles: Dict[str, object], load_optim: bool = True, load_rng: bool = True) -> tuple:
    """Restore `roles` from the last complete checkpoint; returns (iteration, loop_state)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise layout.CheckpointNotFoundError(
            f"--load {root}: no complete stage checkpoint there (latest_checkpointed_iteration.txt is missing); "
            "pass the --save directory of an earlier run, or use --finetune to start from weights only"
        )
    tp_rank, pp_rank, _, _ = _layout()
    loop_state = None
    for name, trainable in roles.items():
        state = layout.load_shard(os.path.join(root, name), tp_rank, pp_rank, iteration, weights_only=False)
        trainable.load_state_dict(state, load_optim=load_optim)
        loop_state = state["data_position"]
        if load_rng:
            _set_rng_state(state["rng_state"][parallel_state.get_data_parallel_rank()])
    return iteration, loop_state
