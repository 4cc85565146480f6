"""A trained role (the actor or the critic): its Megatron model with the DDP wrapper, optimizer and LR schedule.

`TrainableModel.train_step` is one optimizer step over a mini-batch's micro-batches on megatron's schedule
(`engine.run_schedule`), guarded (NaN / inf, divergence, the LR schedule on resume). It also owns what its
checkpoints need from the optimizer (with `--use-distributed-optimizer`, the sharded fp32 main weights and moments
that megatron's `state_dict()` leaves out: `parameter_state` / `load_state_dict(parameter_state=...)`, checked after
loading, by `rl/update/optimizer_state.py`) and where its training state lives between updates (`offload` / `onload` /
`on_device`, `rl/update/model_state.py`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mindspeed_llm import device
from mindspeed_llm.checkpoint.errors import DivergenceError
from mindspeed_llm.checkpoint.training import CheckpointError, NonFiniteError
from mindspeed_llm.distributed import any_rank, gather_messages, sum_over_data_parallel
from mindspeed_llm.rl.model_settings import OptimizerSettings
from mindspeed_llm.rl.update import engine, optimizer_state
from mindspeed_llm.rl.update.engine import LossFn, MicroBatch
from mindspeed_llm.rl.update.model_state import Offloader

# OptimizerParamScheduler state key -> what it is, for messages
_SCHEDULE_KEYS = {
    "max_lr": "learning rate", "min_lr": "minimum learning rate", "lr_warmup_steps": "warmup iterations",
    "lr_decay_steps": "decay iterations", "lr_decay_style": "decay style", "start_wd": "weight decay",
}


def use_fused_torch_adam(optimizer) -> None:
    """Run Megatron's fallback torch Adam/AdamW with torch's fused kernel where the device has one.

    Without Transformer Engine or Apex (the CPU case) megatron-core builds `torch.optim.AdamW` with its
    default multi-tensor (foreach) path; the fused kernel computes the same update, about 10x faster on CPU
    (135M fp32 parameters, 2 cores: 0.08 s against 0.81 s a step). The flag is read at every step.
    """
    if not device.accelerator().has_fused_torch_adam:
        return
    inners = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for inner in inners:
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
            for group in inner.param_groups:
                if all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in group["params"]):
                    group["foreach"], group["fused"] = False, True


class TrainableModel:
    """A Megatron model with its DDP wrapper, Megatron optimizer and LR schedule (the actor or the critic).

    `name` names the role in messages; with `check_finite` (--check-for-nan-in-loss-and-grad) a step whose loss
    or gradients hold NaN / inf on any rank raises `NonFiniteError` on every rank before the optimizer steps; with
    `check_divergence` (--check-for-divergence) a step that changes the norm of the weights by more than
    `WEIGHT_JUMP` of it on any rank raises `DivergenceError` on every rank (before anything of it is saved).
    `offload` names the parts of its state (`rl/update/model_state.PARTS`) that `offload()` moves to host memory.
    """

    # A relative change of the weights' norm in one optimizer step beyond which the step is divergence, not
    # learning: RL fine-tuning moves a pretrained model by ~1e-5..1e-3 of its norm per step (Adam moves each weight
    # by about lr), so half of the norm is orders of magnitude past any working setting (--lr 1e6 multiplies it
    # by ~1e5 in the first step).
    WEIGHT_JUMP = 0.5

    def __init__(self, model: torch.nn.Module, settings: OptimizerSettings, name: str = "model",
                 check_finite: bool = True, offload: Sequence[str] = (), check_divergence: bool = True):
        self.module = model
        self.name = name
        self.check_finite = check_finite
        self.check_divergence = check_divergence
        self._weight_norm: Optional[float] = None  # this rank's shard's, after the last step
        self.settings = settings
        self.offload_parts = tuple(offload)
        self._offloader = Offloader(self)
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.chunks: List[torch.nn.Module] = [self.ddp]
        optimizer_config = OptimizerConfig(
            optimizer=settings.optimizer,
            sgd_momentum=settings.sgd_momentum,
            lr=settings.lr,
            min_lr=settings.min_lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad,
            bf16=settings.params_dtype == "bf16",
            fp16=settings.params_dtype == "fp16",
            params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            loss_scale=settings.loss_scale,
            initial_loss_scale=settings.initial_loss_scale,
            min_loss_scale=settings.min_loss_scale,
            loss_scale_window=settings.loss_scale_window,
            hysteresis=settings.hysteresis,
        )
        self.optimizer = get_megatron_optimizer(optimizer_config, self.chunks)
        decay_steps = max(settings.lr_decay_iters, settings.lr_warmup_iters + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if settings.lr_warmup_iters else settings.lr,
            max_lr=settings.lr,
            min_lr=settings.min_lr,
            lr_warmup_steps=settings.lr_warmup_iters,
            lr_decay_steps=decay_steps,
            lr_decay_style=settings.lr_decay_style,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
            # "check": `reconcile_schedule` has refused every difference that matters before a load, so the
            # command line's values apply (they equal the checkpoint's, or have no effect).
            override_opt_param_scheduler=settings.schedule_on_resume != "checkpoint",
            use_checkpoint_opt_param_scheduler=settings.schedule_on_resume == "checkpoint",
        )
        use_fused_torch_adam(self.optimizer)
        # What megatron's schedule calls around the backward passes (as Megatron-LM's training loop sets them).
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.ddp.no_sync
        config.grad_scale_func = self.optimizer.scale_loss

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> Dict[str, float]:
        """One optimizer step over `micro_batches` (this DP rank's part of a mini-batch).

        `loss_fn` returns each micro-batch's SHARE of the step's loss and metrics: normalised by the step's
        global token / sequence counts (`core_algos.aggregation_weights`), so that the shares of all
        micro-batches on all DP ranks add up to the step's value. The gradient is that of the sum of the
        shares (`schedule_loss_scale` undoes Megatron's per-micro-batch and per-DP-rank averaging), so the
        step is the same for any micro-batch size and DP size. Returns each metric summed over micro-batches
        and DP ranks (on the last PP stage; other stages return only lr and grad_norm), `grad_norm` and `lr`.
        """
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        scale = engine.schedule_loss_scale(len(micro_batches), parallel_state.get_data_parallel_world_size())

        losses = []

        def scaled_loss_fn(output, micro_batch):
            loss, metrics = loss_fn(output, micro_batch)
            losses.append(loss.detach())
            return loss * scale, metrics

        results = engine.run_schedule(self.chunks, micro_batches, scaled_loss_fn, forward_only=False)
        # every rank of a DP group sits at the same pipeline stage: all have results (the last stage), or none
        keys = list(results[0]) if results else []  # the loss closure's order, the same on every rank
        local = {k: sum(torch.as_tensor(r[k]).double() for r in results) for k in keys}  # this rank's shares
        if self.check_finite:
            self._stop_if_not_finite(losses, local)
        if self.check_divergence and self._weight_norm is None:
            self._weight_norm = self.weight_norm()
        update_successful, grad_norm, _ = self.optimizer.step()
        if self.check_divergence:
            self._stop_if_diverged()
        if update_successful:
            self.scheduler.step(increment=1)
        metrics: Dict[str, float] = {}
        if keys:
            metrics = dict(zip(keys, sum_over_data_parallel(torch.stack([local[k] for k in keys])).tolist()))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        return metrics

    def weight_norm(self) -> float:
        """The L2 norm of this rank's shard of the weights: one fused norm per chunk of 4M values, in fp32 (no fp32
        copy of a half-precision weight), the chunks' squares summed in fp64. Within ~3e-5 of the exact norm (the
        check's threshold is 0.5) and 8x faster than squaring and summing chunk by chunk (98M fp32 values, 1 thread:
        0.021 s vs 0.179 s)."""
        with torch.no_grad():  # on the device: called within a step
            chunks = [c for param in self.module.parameters() for c in param.detach().reshape(-1).split(1 << 22)]
            if not chunks:
                return 0.0
            norms = torch._foreach_norm(chunks, 2, dtype=torch.float32)
            return float(torch.stack(norms).double().pow(2).sum().sqrt())

    def _stop_if_diverged(self) -> None:
        """The step's weights against the last step's (`WEIGHT_JUMP`), on every rank's shard: any rank's jump stops
        all of them (MoE expert shards differ from rank to rank)."""
        before, after = self._weight_norm, self.weight_norm()
        self._weight_norm = after
        # non-finite weights are the NaN guard's (the next step's loss, the save's check) and name themselves there
        jump = abs(after - before) / before if before > 0 and math.isfinite(after) else 0.0
        found = (f"one optimizer step changed the weights' norm from {before:.4g} to {after:.4g} (this rank's shard), "
                 f"{jump:.3g} of it" if jump > self.WEIGHT_JUMP else None)
        if any_rank(found is not None):
            problems = gather_messages(found)
            raise DivergenceError(f"{self.name}: {'; '.join(problems)}: the update diverged (more than "
                                  f"{self.WEIGHT_JUMP:g} of the norm in one step)")

    def _stop_if_not_finite(self, losses, metrics) -> None:
        """Megatron-LM's --check-for-nan-in-loss-and-grad: NaN / inf in this step's loss, its metric shares (last
        stage) or gradients (every stage) on any rank stops every rank before the optimizer step."""
        found = []
        if losses:
            loss = torch.stack(losses).sum()
            if not bool(torch.isfinite(loss)):
                found.append(f"the loss is {float(loss)}")
        for key, value in metrics.items():
            if not math.isfinite(float(value)):
                found.append(f"{key} is {float(value)}")
        # fp16 gradients carry the loss scale: an overflow there is megatron's grad scaler's to skip, not a stop
        buffers = [] if self.settings.params_dtype == "fp16" else self.ddp.buffers + self.ddp.expert_parallel_buffers
        # one fused reduction per buffer (NaN / inf propagate into the norm); the elementwise count only when it is
        # not finite, for the message (a bool mask of every gradient was most of an optimizer step's time on CPU)
        bad = sum(int((~torch.isfinite(buffer.grad_data)).sum()) for buffer in buffers
                  if not bool(torch.isfinite(torch.linalg.vector_norm(buffer.grad_data))))
        if bad:
            found.append(f"{bad} gradient values are NaN or inf")
        if any_rank(bool(found)):
            problems = gather_messages(", ".join(found) or None)
            raise NonFiniteError(f"{self.name}: {'; '.join(problems)}")

    def reconcile_schedule(self, checkpoint_schedule: dict) -> List[str]:
        """Compare a checkpoint's LR schedule with this run's before it is loaded (Megatron-LM's rules):
        differences are an error unless --override-opt_param-scheduler (the command line's apply) or
        --use-checkpoint-opt_param-scheduler (the checkpoint's apply) is given. Returns the messages to print."""
        ours = self.scheduler.state_dict()
        constant = ours["lr_decay_style"] == checkpoint_schedule.get("lr_decay_style") == "constant"
        differences = []
        for key, what in _SCHEDULE_KEYS.items():
            if key == "lr_decay_steps" and constant:
                continue  # no effect on a constant schedule
            if key in checkpoint_schedule and checkpoint_schedule[key] != ours[key]:
                differences.append(f"{what} {ours[key]} (checkpoint: {checkpoint_schedule[key]})")
        if not differences:
            return []
        listed = ", ".join(differences)
        mode = self.settings.schedule_on_resume
        if mode == "override":
            return [f"{self.name}: resuming with the command line's LR schedule (--override-opt_param-scheduler): "
                    f"{listed}"]
        if mode == "checkpoint":
            return [f"{self.name}: resuming with the checkpoint's LR schedule (--use-checkpoint-opt_param-scheduler), "
                    f"not the command line's {listed}"]
        raise CheckpointError(
            f"{self.name}: the command line's LR schedule differs from the checkpoint's: {listed}; pass "
            f"--override-opt_param-scheduler to use the command line's ({self.settings.lr_flag}, --min-lr, "
            "--lr-warmup-iters, --lr-decay-iters, --lr-decay-style, --weight-decay), or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )

    # ------------------------------------------------------------------ where the training state lives
    def offload(self, timers=None) -> None:
        """The parts of `offload_parts` that are on the device go to host memory (`timing/offload_train`)."""
        todo = [part for part in self.offload_parts if part not in self._offloader.offloaded]
        if todo:
            with _timed(timers, "offload_train"):
                self._offloader.offload(todo)

    def onload(self, timers=None, parts: Optional[Sequence[str]] = None) -> None:
        """The offloaded parts (of `parts`: all by default) come back to the device (`timing/onload_train`)."""
        todo = [part for part in self._offloader.offloaded if parts is None or part in parts]
        if todo:
            with _timed(timers, "onload_train"):
                self._offloader.onload(todo)

    @contextlib.contextmanager
    def on_device(self, timers=None):
        """The whole state on the device for the block (an update, a checkpoint), offloaded again after it."""
        self.onload(timers)
        try:
            yield self
        finally:
            self.offload(timers)

    # ------------------------------------------------------------------ checkpoint state
    @property
    def distributed_optimizers(self) -> list:
        """Megatron's DistributedOptimizer(s) of this model (dense and expert parameters have one each); [] without
        --use-distributed-optimizer."""
        return optimizer_state.distributed_optimizers(self.optimizer)

    def state_dict(self) -> dict:
        """Weights, the optimizer's state dict and the LR schedule. With the distributed optimizer the optimizer's
        entry holds its param groups, step and grad scaler only: the sharded main weights and moments are
        `parameter_state()`."""
        return {
            "model": self._module_state(),
            "optimizer": self.optimizer.state_dict(),
            "opt_param_scheduler": self.scheduler.state_dict(),
        }

    def _module_state(self) -> dict:
        """What a checkpoint holds of the model (all of it; a LoRA model's adapters only, `rl/update/lora.py`)."""
        return self.module.state_dict()

    def _load_module_state(self, model_state: dict) -> None:
        self.module.load_state_dict(model_state, strict=True)

    def parameter_state(self):
        """The distributed optimizer's fp32 main weights and Adam moments, gathered to DP rank 0 (a collective;
        `optimizer_state.parameter_state`); None on the other ranks and without the distributed optimizer."""
        return optimizer_state.parameter_state(self.distributed_optimizers)

    def reads_parameter_state(self) -> bool:
        """Whether this rank reads `distrib_optim.pt` on load (DP rank 0 of some distributed optimizer)."""
        return optimizer_state.reads_parameter_state(self.distributed_optimizers)

    def parameter_state_problem(self, parameter_state) -> Optional[str]:
        """Why `parameter_state` (read by this rank) cannot be loaded into this model, or None
        (`optimizer_state.parameter_state_problem`)."""
        return optimizer_state.parameter_state_problem(self.distributed_optimizers, parameter_state, self.name)

    def load_state_dict(self, state: dict, load_optim: bool = True, parameter_state=None, source: str = "") -> None:
        """Weights, and with `load_optim` the optimizer and LR schedule; with the distributed optimizer
        `parameter_state` (see `parameter_state()`; None on the ranks that do not read it) is scattered to the DP
        ranks (a collective). Afterwards the restored state is checked (`optimizer_state.check_restored`): a resume
        never runs on stale fp32 main weights or uninitialised moments. `source` names the file in messages."""
        self._load_module_state(state["model"])
        if load_optim:
            self.optimizer.load_state_dict(state["optimizer"])
            subs = self.distributed_optimizers
            if subs:
                optimizer_state.load_parameter_state(subs, parameter_state, self.name, source)
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
            # Megatron's param groups carry their own max / min lr, which the scheduler reads before its own:
            # the loaded groups hold the saver's, so they follow the schedule the load settled on.
            for group in self.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = self.scheduler.max_lr, self.scheduler.min_lr
            self.scheduler.step(increment=0)
            use_fused_torch_adam(self.optimizer)  # the loaded param groups carry the saver's settings
        else:
            # Weights changed under the optimizer: refresh its fp32 main copies (mixed precision).
            reload = getattr(self.optimizer, "reload_model_params", None)
            if reload is not None:
                reload()


def _timed(timers, name: str):
    return timers(name) if timers is not None else contextlib.nullcontext()
