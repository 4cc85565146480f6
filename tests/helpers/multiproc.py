"""Run a test body on N gloo processes, collecting each rank's return value.

The body must be a module-level function `fn(rank, world_size, *args)`; it runs after the process group
exists (MASTER_ADDR/PORT set to a free loopback port). Megatron parallel state is the body's business
(call `mindspeed_llm.distributed.initialize(tp, pp)`).

Process start is slow (~5 s per rank with megatron on a quiet 2-core machine, more under load), so `run_distributed`
keeps the processes of each world size warm for the session (`_WarmRanks`) and runs one body after another on them
(the project's trainer and stages imported before the first). Between bodies each rank puts back what a fresh
process would have: no megatron parallel state or process groups but the default one, empty functools caches in the
project's modules, the environment and working directory it started with, float32 as the default dtype, its thread
count, and torch's default generator re-seeded with its start-up seed (so a body drawing from it unseeded draws what
it drew in a fresh process). A body that fails, or leaves the default process group destroyed, retires its
processes: the next body of that world size gets fresh ones. `run_in_fresh_processes` spawns new processes for one
body (for a body that needs a fresh interpreter, e.g. to see a warning its process has not shown yet);
`MINDSPEED_TEST_FRESH_RANKS=1` in the environment makes `run_distributed` do that for every body (to tell a leak
between bodies from a real failure).
A body that leaves an attribute of the project's modules (mindspeed_llm, posttrain_gpt), a method of a class they
define or a stage of the registry replaced by another object (a recording wrapper, a planted bug) retires its ranks
too, and says so on stderr (seen with `pytest -s`): a body that records through a replacement puts it back
(`pytest.MonkeyPatch.context()`) to keep its ranks warm. A body that replaces something of megatron's or torch's
must put it back itself (as the patch-removal bodies do). tests/dist/test_warm_ranks.py checks the reset and the
retirement.
"""

import atexit
import gc
import os
import pickle
import queue as queue_module
import sys
import traceback

import torch.multiprocessing as mp

from tests.helpers.ports import free_port

WARM_WORLD_SIZES = 2  # world sizes kept warm at once (each rank holds a few hundred MB)


def _rank_env(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")


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


def _entry(rank, world_size, port, fn, args, queue):
    _rank_env(rank, world_size, port)
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


def _own_attributes():
    """{(module, name): id} of every function and class of the project's loaded modules (mindspeed_llm,
    posttrain_gpt), of the methods of the classes they define, and of the stage registry's entries: what a test body
    replaces to record or plant something (the modules' other globals are their state: flags, caches)."""
    ids = {}
    for module_name, module in list(sys.modules.items()):
        if module is not None and (module_name == "posttrain_gpt" or module_name.split(".")[0] == "mindspeed_llm"):
            for name, value in list(vars(module).items()):
                if callable(value):
                    ids[(module_name, name)] = id(value)
                if isinstance(value, type) and value.__module__ == module_name:  # its methods, replaced in place
                    for attr, member in list(vars(value).items()):
                        if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                            ids[(module_name, f"{name}.{attr}")] = id(member)
    stages = sys.modules.get("mindspeed_llm.rl.stages")
    if stages is not None:
        for name, value in list(stages.STAGES.items()):  # the registry imports a stage's class on first read
            ids[("STAGES", name)] = id(value)
    return ids


def _replaced_own_attributes(before):
    """The attributes of `before` (`_own_attributes`) that now hold another object."""
    after = _own_attributes()
    return sorted(key for key, value in before.items() if key in after and after[key] != value)


def _preload_project():
    """Import the project's entry point, trainer and stages before the first body, so that what that body replaces
    in them is seen too (`_own_attributes` only knows modules loaded before a body)."""
    try:
        import posttrain_gpt  # noqa: F401
        import mindspeed_llm.rl.trainer  # noqa: F401
        from mindspeed_llm.rl.stages import STAGES

        for name in list(STAGES):
            STAGES[name]
    except Exception:  # the body that needs them reports the error
        pass


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


def _warm_entry(rank, world_size, port, inbox, outbox):
    """A warm rank: runs each (fn, args) sent to it until it gets None, a body fails or the group is gone."""
    _rank_env(rank, world_size, port)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    env, cwd, threads, seed = dict(os.environ), os.getcwd(), torch.get_num_threads(), torch.initial_seed()
    _preload_project()
    os.environ.clear()
    os.environ.update(env)
    try:
        while True:
            message = inbox.get()
            if message is None:
                return
            torch.manual_seed(seed)
            replaced = []
            try:
                fn, args = pickle.loads(message)
                own = _own_attributes()
                result = pickle.dumps(fn(rank, world_size, *args))  # bytes: see _entry
                status = "ok"
                # A body that left one of the project's functions or classes replaced (a recording wrapper, a
                # planted bug) would hand it to the next body: its ranks retire instead.
                replaced = _replaced_own_attributes(own)
                if replaced and rank == 0:  # why the next body pays a spawn (seen with pytest -s)
                    print(f"[warm ranks] {fn.__module__}.{fn.__qualname__} left {replaced} replaced: its ranks "
                          "retire", file=sys.stderr, flush=True)
            except BaseException:
                result, status = traceback.format_exc(), "error"
            finally:
                _destroy_model_parallel()
                _destroy_subgroups()
                _clear_project_caches()
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                torch.set_default_dtype(torch.float32)
                torch.set_num_threads(threads)
            retire = status == "error" or bool(replaced) or not dist.is_initialized()
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
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, outbox)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, _ = _collect(procs, outbox, world_size)
    failed = any(status == "error" for status, _ in results.values())
    _stop(procs, 5 if failed else 60)
    return _unpack(results, world_size)


class _WarmRanks:
    """`world_size` processes in one gloo group that run bodies one after another (see the module doc)."""

    def __init__(self, world_size):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size = world_size
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_warm_entry, args=(r, world_size, port, self.inboxes[r], self.outbox))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args):
        message = pickle.dumps((fn, args))
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


_warm = {}  # world size -> _WarmRanks, the most recently used last


def _close_warm():
    while _warm:
        _warm.pop(next(iter(_warm))).close()


atexit.register(_close_warm)


def run_distributed(fn, world_size=2, *args):
    """Returns [result of rank 0, result of rank 1, ...] of `fn` on the warm ranks of `world_size` (see the module
    doc); raises with the failing rank's traceback."""
    if os.environ.get("MINDSPEED_TEST_FRESH_RANKS") == "1":
        return run_in_fresh_processes(fn, world_size, *args)
    ranks = _warm.pop(world_size, None)
    if ranks is None:
        while len(_warm) >= WARM_WORLD_SIZES:  # the least recently used world size goes
            _warm.pop(next(iter(_warm))).close()
        ranks = _WarmRanks(world_size)
    retired, results = ranks.run(fn, args)
    if not retired:
        _warm[world_size] = ranks
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
