"""Model-state bytes per parameter of a real `TrainableModel` by part, with what each --offload-train-* flag leaves on
the device (`measure_model_state`), and the cases at TP2 plus the DP2 model state on two gloo processes (`run_tp2`)."""

from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict
from types import SimpleNamespace
from typing import List, Sequence

from benchmarks.step_memory.measure import build, free_port, init_process, measure, micro_batch_of, synthetic_experience
from benchmarks.step_memory.shapes import KL_COEF, LOSS_ARGS, Case, Shape


# What each --offload-train-* flag moves off the device between updates (`rl/update/roles.offload_parts`), by role
OFFLOAD_FLAGS = {"optimizer": "offload_train_optimizer", "grad": "offload_train_grad", "param": "offload_train_param"}


def _offload_args(flags: Sequence[str]) -> SimpleNamespace:
    return SimpleNamespace(**{OFFLOAD_FLAGS[f]: f in flags for f in OFFLOAD_FLAGS})


def measure_model_state(shape: Shape, distributed_optimizer: bool = False, offload: bool = True) -> dict:
    """Bytes per parameter of each part of a trainable bf16 model's state (`rl/update/model_state.bytes_per_parameter`:
    weights, DDP grad buffer, fp32 main weights, Adam moments, each storage once) after one optimizer step, at this
    process's data-parallel size, with or without the distributed optimizer; and (`offload`) what is left on the
    device after `TrainableModel.offload()` (what the stages call before the rollout) for each --offload-train-*
    flag alone and all three, for the actor and the critic (`roles.offload_parts`: the critic's weights go too),
    and after `onload()`; and the bytes per parameter of a frozen bf16 model."""
    from mindspeed_llm import distributed  # noqa: F401  (parallel state is set by the caller)
    from megatron.core import parallel_state

    from mindspeed_llm.rl.update import model_state, roles
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel
    from mindspeed_llm.rl.update.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings

    gc.collect()
    case = Case(shape, 64, "sdpa")
    exp = synthetic_experience(1, 32, 32, shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = LossSettings(**LOSS_ARGS, max_new_tokens=32)

    def trained(parts=()):
        tm = TrainableModel(build(case, trainable=False), OptimizerSettings(
            lr=1e-6, params_dtype="bf16", adam_beta2=0.95, use_distributed_optimizer=distributed_optimizer),
            name="actor", offload=parts)
        tm.train_step([mb], lambda out, m: clipped_policy_loss(args, out, m, KL_COEF))
        return tm

    tm = trained()
    result = dict(shape=asdict(shape), distributed_optimizer=distributed_optimizer,
                  data_parallel=parallel_state.get_data_parallel_world_size(),
                  params=model_state.device_bytes(tm)["parameters"],
                  bytes_per_param=model_state.bytes_per_parameter(tm))
    del tm
    gc.collect()
    if offload:
        result["offloaded"] = {}
        for name in ("actor", "critic"):
            for flags in (("optimizer",), ("grad",), ("param",), tuple(OFFLOAD_FLAGS)):
                parts = roles.offload_parts(_offload_args(flags), name)
                tm = trained(parts)
                tm.offload()
                left = model_state.bytes_per_parameter(tm)
                tm.onload()
                back = model_state.bytes_per_parameter(tm)
                result["offloaded"][f"{name}: " + " ".join(f"--offload-train-{f}" for f in flags)] = dict(
                    role=name, flags=list(flags), parts=list(parts), on_device_during_rollout=left,
                    after_onload=back)
                del tm
                gc.collect()
    frozen = roles.frozen(build(case, trainable=False))
    result["frozen_bytes_per_param"] = sum(s.nbytes() for s in model_state.unique_storages(frozen.parameters())) / sum(
        p.numel() for p in frozen.parameters())
    del frozen
    gc.collect()
    return result


def _tp_worker(rank: int, world: int, port: int, cases: List[Case], state_shape: Shape, queue) -> None:
    """One of the two gloo processes: the cases at TP2, then at TP1 DP2 the model state of `state_shape` with
    megatron's optimizer and with the distributed optimizer (with its offloads)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MINDSPEED_DEVICE="cpu")
    try:
        import torch

        torch.set_num_threads(1)
        init_process(2, port)
        results = [measure(case, "cpu", timing=False) for case in cases]
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        states = {}
        for key, distributed_optimizer in (("dp2", False), ("distributed_optimizer_dp2", True)):
            try:
                states[key] = measure_model_state(state_shape, distributed_optimizer, offload=distributed_optimizer)
            except Exception as exc:  # a result, not the end of the benchmark: say why
                states[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        queue.put((rank, "ok", json.dumps(dict(cases=results, model_state=states))))
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc()))


def run_tp2(cases: List[Case], state_shape: Shape) -> dict:
    """`cases` on two gloo processes at TP2, then the DP2 model state (rank 0's figures; both ranks hold the
    same shapes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, cases, state_shape, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(2):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = json.loads(payload)
        else:
            errors.append(f"rank {rank}: {payload}")
            break
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    if errors:
        return {"error": "\n".join(errors)[-3000:]}
    return results[0]
