"""The stage runs `test_distributed_optimizer.py` and `test_offload.py` share: one 2-process spawn (DP2) on the tiny
word task (`word_task.py`), built once per session by the `model_state_runs` fixture (conftest.py).

Each run is `trainer.run` on a command line, as posttrain_gpt.py runs it; the spawn records, per run, what a test
needs beyond the files the run writes (checkpoints, metrics): the bytes of every role's model state allocated when
each rollout starts and when each optimizer step starts (measured by `allocated_bytes`, a traversal of megatron's own
attributes, independent of `rl/update/model_state.py`), the model state by part at the end (`model_state.device_bytes`),
and the error a run stopped with.

Runs (all DP2, 3 iterations with a save after each unless said):

    {stage}_{dtype}            --use-distributed-optimizer, for trl_ppo / grpo in fp32 / bf16
    {stage}_{dtype}_resumed    the same command line resumed from the first one's iteration 1 into another --save
    trl_ppo_bf16_stale         a resume whose distributed optimizer state is never loaded (megatron's
                               load_parameter_state_from_dp_zero made a no-op): it must stop, not train
    trl_ppo_bf16_offload       trl_ppo_bf16 with all three --offload-train-* flags
    grpo_bf16_plain            grpo bf16 without the distributed optimizer; grpo_bf16_plain_offload with the flags
    trl_ppo_bf16_{flag}        trl_ppo_bf16 with one of the three flags, 2 iterations, no save
"""

from __future__ import annotations

import time
from pathlib import Path

ITERS = 3
OFFLOAD = ("--offload-train-optimizer", "--offload-train-grad", "--offload-train-param")


def stage_argv(task, stage, out: Path, *extra, iters=ITERS, save=True):
    argv = ["--stage", stage, "--ref-model", task["mg_actor_tp1pp1"], "--reward-model", task["mg_reward_tp1pp1"],
            "--tokenizer-name-or-path", task["tokenizer"], "--data-path", task["data"], "--global-batch-size", "4",
            "--micro-batch-size", "2", "--train-iters", str(iters), "--max-length", "24", "--max-new-tokens", "4",
            "--do-sample", "--seed", "5", "--lr", "1e-3", "--metrics-jsonl", str(out / "metrics.jsonl")]
    if save:
        argv += ["--save", str(out), "--save-interval", "1"]
    if stage == "grpo":  # the reward model scores, so groups have reward spread and the loss is not 0
        argv += ["--n-samples-per-prompt", "2", "--kl-coef", "0.01", "--ppo-mini-batch-size", "4"]
    return argv + list(extra)


def run_table(task, root: Path) -> dict:
    """{name: argv} of the runs above (the names say what they are)."""
    runs = {}
    dist = ("--use-distributed-optimizer",)
    for stage in ("trl_ppo", "grpo"):
        for dtype in ("fp32", "bf16"):
            name = f"{stage}_{dtype}"
            flags = dist + (("--bf16",) if dtype == "bf16" else ())
            runs[name] = stage_argv(task, stage, root / name, *flags)
            runs[f"{name}_resumed"] = stage_argv(task, stage, root / f"{name}_resumed", *flags, "--load",
                                                 str(root / name), "--ckpt-step", "1")
    runs["trl_ppo_bf16_stale"] = stage_argv(task, "trl_ppo", root / "stale", *dist, "--bf16", "--load",
                                            str(root / "trl_ppo_bf16"), "--ckpt-step", "1")
    runs["trl_ppo_bf16_offload"] = stage_argv(task, "trl_ppo", root / "trl_ppo_bf16_offload", *dist, "--bf16",
                                              *OFFLOAD)
    runs["grpo_bf16_plain"] = stage_argv(task, "grpo", root / "grpo_bf16_plain", "--bf16")
    runs["grpo_bf16_plain_offload"] = stage_argv(task, "grpo", root / "grpo_bf16_plain_offload", "--bf16", *OFFLOAD)
    for flag in OFFLOAD:
        name = "trl_ppo_bf16_" + flag[len("--offload-train-"):]
        runs[name] = stage_argv(task, "trl_ppo", root / name, *dist, "--bf16", flag, iters=2, save=False)
    return runs


def allocated_bytes(trainable) -> int:
    """Bytes of device storage a TrainableModel's training state holds now: its parameters, megatron DDP's param
    and grad buffers, the optimizer's parameters (fp32 main copies), megatron's main-param groups and the optimizer
    state tensors (Adam's 0-dim `step` left out), each storage once."""
    import torch

    tensors = list(trainable.module.parameters())
    for buffer in trainable.ddp.buffers + trainable.ddp.expert_parallel_buffers:
        tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    for sub in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer]):
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            tensors += [t for group in getattr(sub, name, []) for t in group if t is not None]
        inner = sub.optimizer
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for k, v in state.items()
                    if k != "step" and isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def weights_bytes(trainable) -> int:
    seen, total = set(), 0
    for param in trainable.module.parameters():
        storage = param.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def _runs_body(rank, world_size, runs):
    """trainer.run on each (name, argv); returns {name: record} (see the module doc)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.checkpoint.training import CheckpointError
    from mindspeed_llm.rl import rollout, trainer
    from mindspeed_llm.rl.update import model_state, trainable

    current = {}
    loop, generate, train_step = trainer._loop, rollout.generate, trainable.TrainableModel.train_step

    def recording_loop(args, stage, *rest):
        current["stage"] = stage
        return loop(args, stage, *rest)

    def snapshot():
        return {name: {"allocated": allocated_bytes(t), "weights": weights_bytes(t)}
                for name, t in current["stage"].roles().items()}

    def measuring_generate(*args, **kwargs):
        current["rollout"].append(snapshot())
        return generate(*args, **kwargs)

    def measuring_train_step(self, *args, **kwargs):
        current["update"].append({self.name: allocated_bytes(self)})
        return train_step(self, *args, **kwargs)

    trainer._loop, rollout.generate, trainable.TrainableModel.train_step = \
        recording_loop, measuring_generate, measuring_train_step
    records = {}
    try:
        for name, argv in runs:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            current.update(stage=None, rollout=[], update=[])
            error, started = None, time.perf_counter()
            original_load = DistributedOptimizer.load_parameter_state_from_dp_zero
            if name.endswith("_stale"):
                DistributedOptimizer.load_parameter_state_from_dp_zero = lambda self, state, **kw: None
            try:
                trainer.run(parse_args(argv, world_size))
            except Exception as exc:  # recorded: each test says which runs must succeed and how the others stop
                error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            finally:
                DistributedOptimizer.load_parameter_state_from_dp_zero = original_load
            stage = current["stage"]
            records[name] = dict(
                error=error, seconds=time.perf_counter() - started, rollout=current["rollout"],
                update=current["update"],
                parts={n: model_state.device_bytes(t) for n, t in stage.roles().items()} if stage else {},
            )
    finally:
        trainer._loop, rollout.generate, trainable.TrainableModel.train_step = loop, generate, train_step
    return records


def build(tmp_path_factory) -> dict:
    """Run the table on 2 processes: {"task", "root", "records" (rank 0's), "argv"}."""
    from tests.helpers import word_task
    from tests.helpers.multiproc import run_distributed

    root = tmp_path_factory.mktemp("model_state")
    task = word_task.build(root / "task", reward=True)
    table = run_table(task, root / "runs")
    records = run_distributed(_runs_body, 2, list(table.items()))[0]
    return {"task": task, "root": root / "runs", "records": records, "argv": table}


def nested_tensors(obj, prefix=""):
    """{path: tensor} of every tensor in a nested checkpoint object (dicts, lists, tuples)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(nested_tensors(value, f"{prefix}/{key}"))
    return out
