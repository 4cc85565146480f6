"""Run a test body on N gloo processes (torch.multiprocessing spawn), collecting each rank's return value.

The body must be a module-level function `fn(rank, world_size, *args)`; it runs after the process group
exists (MASTER_ADDR/PORT set to a free loopback port). Megatron parallel state is the body's business
(call `mindspeed_llm.distributed.initialize(tp, pp)`). Process start is slow (~10 s with megatron), so
put all cases of one layout into one body.
"""

import os
import pickle
import traceback

import torch.multiprocessing as mp

from tests.helpers.ports import free_port


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Pickled to bytes here: tensors sent as such share memory by file descriptor, which races with
        # this process exiting.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report the failure to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size=2, *args):
    """Returns [result of rank 0, result of rank 1, ...]; raises with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break
    for p in procs:
        p.join(timeout=60 if not errors else 5)
        if p.is_alive():
            p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


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
