"""Run a test body on N gloo processes, collecting each rank's return value.

The body must be a module-level function `fn(rank, world_size, *args)`; it runs after the process group
exists (MASTER_ADDR/PORT set to a free loopback port). Megatron parallel state is the body's business
(call `mindspeed_llm.distributed.initialize(tp, pp)`).

`run_distributed` runs each body in new processes, unless the test module asked for warm ranks with the
`warm_ranks` fixture (tests/conftest.py; `pytestmark = pytest.mark.usefixtures("warm_ranks")`): then the module's
bodies run one after another on processes kept for that module alone (`warm_ranks()`, one set per world size), and
closed when the module ends. Process start is slow (~5 s per rank with megatron on a quiet 2-core machine, more under
load), which is what a module of many bodies saves. Between bodies each warm rank puts back what a fresh process
would have: no megatron parallel state or process groups but the default one, empty functools caches in the
project's modules, the environment and working directory it started with (each body runs under the caller's `sys.path` at
its call, as a new rank does), float32 as the default dtype, its thread
count, and torch's default generator re-seeded with its start-up seed. What a body replaces in the project's modules
(a recording wrapper, a planted bug) it puts back itself (`pytest.MonkeyPatch.context()`): its module's next bodies
share its processes, and no other module does. A body that fails, or leaves the default process group destroyed,
retires its processes: the module's next body gets fresh ones. `MINDSPEED_TEST_FRESH_RANKS=1` runs every body in new
processes (to tell a leak between a module's bodies from a real failure). tests/dist/test_warm_ranks.py checks the
reset, the fresh default and the module boundary.

New ranks are forked from a forkserver that has imported torch, megatron-core and the trainer once per test session
(~0.05 s for two ranks instead of ~7 s of spawn-and-import on 2 cores); each rank then takes the test's environment,
working directory and `sys.path` as they are at the call (the forkserver holds those of its own start), and torch's
thread count of 1. `MINDSPEED_TEST_SPAWN=1` spawns plain new interpreters instead (to tell a forkserver effect from
a real failure).
"""

import contextlib
import gc
import os
import pickle
import queue as queue_module
import sys
import traceback

import torch.multiprocessing as mp

from tests.helpers.ports import free_port

WARM_WORLD_SIZES = 2  # world sizes kept warm at once (each rank holds a few hundred MB)
# What the forkserver imports once, so that a rank does not: the import of megatron-core and the trainer is most of a
# spawned rank's start. Nothing here reads the environment at import (a test's variables are set per rank).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core", "mindspeed_llm.rl.trainer"]


def _context():
    if os.environ.get("MINDSPEED_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _caller_state():
    """What a rank takes from the test at the call: a forked rank would otherwise see the forkserver's."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def _rank_env(rank, world_size, port, caller):
    env, cwd, path = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    if "torch" in sys.modules:  # forked with torch imported: OMP_NUM_THREADS came too late to count
        sys.modules["torch"].set_num_threads(1)


def _destroy_model_parallel():
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass


def _destroy_subgroups():
    """Destroy every process group but the default one: megatron's destroy_model_parallel forgets its groups
    without destroying them, and each gloo group keeps its threads (a warm rank gathered hundreds, polling)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    world = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not world:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass


def _entry(rank, world_size, port, caller, fn, args, queue):
    _rank_env(rank, world_size, port, caller)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Pickled to bytes here: tensors sent as such share memory by file descriptor, which races with
        # this process exiting.
        queue.put((rank, "ok", pickle.dumps(result), True))
    except BaseException:  # report the failure to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc(), True))
        raise
    finally:
        _destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _clear_project_caches():
    """Empty the functools caches of the project's modules (e.g. `device.accelerator`, which reads
    MINDSPEED_DEVICE): a fresh process starts with them empty."""
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.split(".")[0] == "mindspeed_llm":
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


def _release_memory():
    gc.collect()
    try:  # hand freed heap back to the system: a warm rank otherwise keeps its largest body's peak
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _warm_entry(rank, world_size, port, caller, inbox, outbox):
    """A warm rank: runs each (fn, args) sent to it until it gets None, a body fails or the group is gone."""
    _rank_env(rank, world_size, port, caller)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    env, cwd, threads, seed = dict(os.environ), os.getcwd(), torch.get_num_threads(), torch.initial_seed()
    path = list(sys.path)
    try:
        while True:
            message = inbox.get()
            if message is None:
                return
            torch.manual_seed(seed)
            try:
                fn, args, caller_path = pickle.loads(message)
                sys.path[:] = caller_path
                result = pickle.dumps(fn(rank, world_size, *args))  # bytes: see _entry
                status = "ok"
            except BaseException:
                result, status = traceback.format_exc(), "error"
            finally:
                _destroy_model_parallel()
                _destroy_subgroups()
                _clear_project_caches()
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                sys.path[:] = path
                torch.set_default_dtype(torch.float32)
                torch.set_num_threads(threads)
            retire = status == "error" or not dist.is_initialized()
            outbox.put((rank, status, result, retire))
            if retire:
                return
            _release_memory()
    finally:
        _destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, outbox, world_size):
    """{rank: (status, payload)} from `outbox`, and whether the processes retire; a rank that dies without a word
    is reported as failed (instead of waiting for it forever)."""
    results, retire = {}, False
    while len(results) < world_size:
        try:
            rank, status, payload, retired = outbox.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
            if dead:
                try:  # its last message may still be on the way
                    rank, status, payload, retired = outbox.get(timeout=5.0)
                except queue_module.Empty:
                    for r in dead:
                        results[r] = ("error", f"exited with code {procs[r].exitcode} before reporting")
                    return results, True
            else:
                continue
        results[rank] = (status, payload)
        retire = retire or retired
        if status == "error":
            return results, True
    return results, retire


def _unpack(results, world_size):
    errors = [f"rank {rank} failed:\n{payload}" for rank, (status, payload) in sorted(results.items())
              if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [pickle.loads(results[r][1]) for r in range(world_size)]


def _stop(procs, timeout):
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def run_in_fresh_processes(fn, world_size=2, *args):
    """`fn` on `world_size` new processes: [result of rank 0, result of rank 1, ...]; raises with the failing rank's
    traceback."""
    ctx = _context()
    outbox = ctx.Queue()
    port, caller = free_port(), _caller_state()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, caller, fn, args, outbox))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, _ = _collect(procs, outbox, world_size)
    failed = any(status == "error" for status, _ in results.values())
    _stop(procs, 5 if failed else 60)
    return _unpack(results, world_size)


class _WarmRanks:
    """`world_size` processes in one gloo group that run bodies one after another (see the module doc)."""

    def __init__(self, world_size):
        ctx = _context()
        port, caller = free_port(), _caller_state()
        self.world_size = world_size
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_warm_entry, args=(r, world_size, port, caller, self.inboxes[r],
                                                            self.outbox))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args):
        message = pickle.dumps((fn, args, list(sys.path)))  # a body's sys.path is the caller's at the call
        for inbox in self.inboxes:
            inbox.put(message)
        results, retire = _collect(self.procs, self.outbox, self.world_size)
        if retire:
            self.close(timeout=5)
        return retire, results

    def close(self, timeout=30):
        for p, inbox in zip(self.procs, self.inboxes):
            if p.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        _stop(self.procs, timeout)


_pool = None  # world size -> _WarmRanks of the module that asked for warm ranks (the most recently used last)


@contextlib.contextmanager
def warm_ranks():
    """For the block (a test module: the `warm_ranks` fixture), `run_distributed` keeps its processes between bodies,
    one set per world size (at most WARM_WORLD_SIZES at once); they are closed at the end of the block."""
    global _pool
    if _pool is not None:
        raise RuntimeError("warm_ranks() is already active (one module at a time)")
    _pool = {}
    try:
        yield
    finally:
        pool, _pool = _pool, None
        while pool:
            pool.pop(next(iter(pool))).close()


def run_distributed(fn, world_size=2, *args):
    """Returns [result of rank 0, result of rank 1, ...] of `fn` on `world_size` gloo processes: new ones, or the
    module's warm ones under `warm_ranks()` (see the module doc); raises with the failing rank's traceback."""
    if _pool is None or os.environ.get("MINDSPEED_TEST_FRESH_RANKS") == "1":
        return run_in_fresh_processes(fn, world_size, *args)
    ranks = _pool.pop(world_size, None)
    if ranks is None:
        while len(_pool) >= WARM_WORLD_SIZES:  # the least recently used world size goes
            _pool.pop(next(iter(_pool))).close()
        ranks = _WarmRanks(world_size)
    retired, results = ranks.run(fn, args)
    if not retired:
        _pool[world_size] = ranks
    return _unpack(results, world_size)


def _posttrain_main_cases(rank, world_size, cases):
    """posttrain_gpt.main on each argv in this process: [(exit code, stdout, stderr)]."""
    import contextlib
    import io

    import posttrain_gpt

    results = []
    for case in cases:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = posttrain_gpt.main(case)
        results.append((code, out.getvalue(), err.getvalue()))
    return results


def posttrain_in_process(cases):
    """posttrain_gpt.main on each argv (a list of argvs), one after another in one spawned process (world size
    1): [(exit code, stdout, stderr)] per case."""
    return run_distributed(_posttrain_main_cases, 1, cases)[0]


def single_rank_env():
    return dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                WORLD_SIZE="1", LOCAL_RANK="0", PYTHONWARNINGS="ignore")
