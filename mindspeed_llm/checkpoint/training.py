"""Training checkpoints of a stage: every trained role (actor, critic) plus the loop's own state.

Layout (Megatron-LM's, one tree per role)::

    <save>/<role>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/<role>/latest_checkpointed_iteration.txt
    <save>/latest_checkpointed_iteration.txt          <- written last of all: the resume point

Each shard holds `model`, `optimizer`, `opt_param_scheduler`, `iteration`, `model_spec` and, in the same
file, the loop state (`rng_state` of every DP rank, `data_position` of the prompt sampler).

Crash safety: ranks write into `iter_XXXXXXX.tmp` directories; after a barrier rank 0 renames each to its
final name, then replaces each role's latest file, then the top-level one (temp file + `os.replace`). A
run killed at any moment leaves the previous complete checkpoint as the resume point.
"""

from __future__ import annotations

import os
import shutil
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


def save(root: str, iteration: int, roles: Dict[str, object], loop_state: dict) -> None:
    """Write `roles` ({name: TrainableModel}) and `loop_state` (sampler position etc.) for `iteration`."""
    rng_states = _gather_dp(_rng_state())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    writer = parallel_state.get_data_parallel_rank() == 0  # DP replicas hold identical weights
    final_dirs = {name: layout.checkpoint_dir(os.path.join(root, name), iteration) for name in roles}
    tmp_dirs = {name: d + ".tmp" for name, d in final_dirs.items()}
    if is_rank_0():
        for tmp in tmp_dirs.values():
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
    barrier()
    if writer:
        for name, trainable in roles.items():
            state = trainable.state_dict()
            state.update(
                iteration=iteration,
                checkpoint_version=3.0,
                model_spec=trainable.module.model_spec.to_dict(),
                value_head=bool(getattr(trainable.module, "is_value_model", False)),
                rng_state=rng_states,
                data_position=loop_state,
            )
            path = layout.shard_path(tmp_dirs[name], tp_rank, pp_rank, pp_size)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    barrier()
    if is_rank_0():
        for name in roles:
            layout.publish(tmp_dirs[name], final_dirs[name])
        for name in roles:
            layout.write_latest(os.path.join(root, name), iteration)
        layout.write_latest(root, iteration)
    barrier()


def latest_iteration(root: str) -> Optional[int]:
    """The iteration of the last complete stage checkpoint under `root`, or None when there is none."""
    try:
        value = layout.read_latest(root)
    except FileNotFoundError:
        return None
    return None if value == "release" else int(value)


def load(root: str, roles: Dict[str, object], load_optim: bool = True, load_rng: bool = True) -> tuple:
    """Restore `roles` from the last complete checkpoint; returns (iteration, loop_state)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"--load {root}: no latest_checkpointed_iteration.txt there; pass a --save directory of an earlier "
            "run (or drop --load to start from --ref-model)"
        )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    loop_state = None
    for name, trainable in roles.items():
        path = layout.shard_path(layout.checkpoint_dir(os.path.join(root, name), iteration), tp_rank, pp_rank, pp_size)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"--load {root}: {path} is missing; the checkpoint was written with another TP/PP layout or for "
                f"another stage (role {name!r})"
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        trainable.load_state_dict(state, load_optim=load_optim)
        loop_state = state["data_position"]
        if load_rng:
            _set_rng_state(state["rng_state"][parallel_state.get_data_parallel_rank()])
    return iteration, loop_state
