"""`tests.helpers.multiproc.run_distributed`: without the `warm_ranks` fixture every body runs in new processes;
under `warm_ranks()` (a module's fixture) a module's bodies share processes, each getting what a fresh process would
have (no megatron parallel state, one process group, the start-up environment, float32, an empty project cache), and
the processes end with the module: the next module's bodies never meet them."""

import os

from tests.helpers import multiproc
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
    with multiproc.warm_ranks():
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


def _path(rank, world_size):
    import sys

    sys.path.append("/a/path/a/body/added")
    return os.getpid(), list(sys.path)


def test_a_warm_body_runs_under_the_callers_sys_path_at_its_call(monkeypatch):
    with multiproc.warm_ranks():
        first_pid, _ = run_distributed(_path, 2)[0]
        monkeypatch.syspath_prepend("/a/path/the/caller/added")  # after the warm ranks started
        pid, path = run_distributed(_path, 2)[0]
        monkeypatch.undo()
        _, after = run_distributed(_path, 2)[0]
    assert pid == first_pid and path[0] == "/a/path/the/caller/added"
    assert "/a/path/the/caller/added" not in after and after.count("/a/path/a/body/added") == 1


def test_without_the_fixture_each_body_gets_new_processes():
    (first,) = run_distributed(_state, 1)
    (dirty,) = run_distributed(_dirty, 1)
    (after,) = run_distributed(_state, 1)
    assert len({first["pid"], dirty[0], after["pid"]}) == 3
    assert after["probe"] is None and after["dtype"] == "torch.float32" and after["cwd"] == first["cwd"]


def test_warm_ranks_end_with_their_module():
    """Two modules' blocks: the second's bodies run on processes of their own, and the first's are gone."""
    with multiproc.warm_ranks():
        one = [run_distributed(_state, 1)[0]["pid"] for _ in range(2)]
    with multiproc.warm_ranks():
        two = [run_distributed(_state, 1)[0]["pid"] for _ in range(2)]
    assert one[0] == one[1] and two[0] == two[1] and one[0] != two[0]
    for pid in one:  # the first module's process was stopped when its block ended
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/status").read().find("zombie") >= 0
