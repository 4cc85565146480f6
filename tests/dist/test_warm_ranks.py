"""The warm gloo ranks of `tests.helpers.multiproc.run_distributed`: a body gets what a fresh process would have
(no megatron parallel state, one process group, the start-up environment, float32, an empty project cache), and a
body that leaves a project function, a method of a project class or a stage of the registry replaced retires its
ranks (the next body runs in new processes), while one that puts them back keeps them warm."""

import os

import pytest

from tests.helpers.multiproc import run_distributed

def _dirty(rank, world_size):
    """Leaves behind what a body may change: megatron's groups, an environment variable, the default dtype, the
    working directory, a filled project cache, torch's generator advanced."""
    import torch
    from mindspeed_llm import device, distributed

    draw = float(torch.rand(()))
    distributed.initialize(1, 1)
    os.environ["MINDSPEED_WARM_RANKS_PROBE"] = "1"
    torch.set_default_dtype(torch.float64)
    os.chdir("/")
    device.accelerator()
    return os.getpid(), device.accelerator.cache_info().currsize, draw


def _state(rank, world_size):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    from mindspeed_llm import device

    return dict(pid=os.getpid(), parallel=parallel_state.model_parallel_is_initialized(),
                groups=len(distributed_c10d._world.pg_map), world=dist.get_world_size(),
                probe=os.environ.get("MINDSPEED_WARM_RANKS_PROBE"), dtype=str(torch.get_default_dtype()),
                cwd=os.getcwd(), cache=device.accelerator.cache_info().currsize, draw=float(torch.rand(())))


def test_a_warm_rank_is_reset_between_bodies():
    first = run_distributed(_state, 2)
    dirty = run_distributed(_dirty, 2)
    after = run_distributed(_state, 2)
    assert [d[0] for d in dirty] == [s["pid"] for s in first] == [s["pid"] for s in after]  # the same processes
    assert all(d[1] == 1 for d in dirty)  # the body filled the cache ...
    assert [s["draw"] for s in after] == [s["draw"] for s in first] == [d[2] for d in dirty]  # ... and re-seeded
    for state in after:
        assert (state["parallel"], state["groups"], state["world"]) == (False, 1, 2)
        assert state["probe"] is None and state["dtype"] == "torch.float32" and state["cache"] == 0
        assert state["cwd"] == first[0]["cwd"]


def _replace(rank, world_size, what, put_back):
    """Replaces a project function, a method of a project class or a stage; puts it back if `put_back`."""
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.rl import rollout, stages

    stand_in = lambda *a, **k: None  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        if what == "stage":
            (patch.setitem if put_back else type(stages.STAGES).__setitem__)(stages.STAGES, "grpo", stand_in)
        else:
            owner, name = {"function": (rollout, "generate"), "method": (PromptDataset, "__getitem__")}[what]
            (patch.setattr if put_back else setattr)(owner, name, stand_in)
    return os.getpid()


@pytest.mark.parametrize("what", ["function", "method", "stage"])
def test_a_body_that_leaves_a_replacement_retires_its_ranks(what):
    (pid,) = run_distributed(_replace, 1, what, True)
    (kept,) = run_distributed(_state, 1)
    assert kept["pid"] == pid  # put back: the ranks stay warm
    (pid,) = run_distributed(_replace, 1, what, False)
    (fresh,) = run_distributed(_state, 1)
    assert fresh["pid"] != pid  # left replaced: the next body runs in a new process
