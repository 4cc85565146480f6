"""The outer loop every stage shares: set up, resume, iterate, evaluate, log, save.

A stage object (`TrlPPOStage`, `GRPOStage`) owns its models and implements `iteration(iteration, prompts)`;
this loop owns everything around it, so the two stages have no copies of it. It knows a stage through its contract
(`rl/stages/contract.py`: the `Stage` protocol and the `IterationResult` of an iteration) and checks its inputs and
outputs before any model is built (`rl/preflight.py`).

Checkpoints follow Megatron-LM (README, "Checkpoints"): `--save` writes every `--save-interval` and always at
the end of training (and on SIGTERM with `--exit-signal-handler`), with the loop state (the sampler's position,
--partial-rollout's carried and finished groups); `--load` resumes from the last complete checkpoint (or
`--ckpt-step`), and when it equals `--save` and holds none yet, the run starts fresh; any other
`--load` without a checkpoint is an error. A step with a NaN / inf loss or gradient stops the run before the
optimizer steps (`--check-for-nan-in-loss-and-grad`, on by default), and nothing non-finite is ever saved.
"""

from __future__ import annotations

import math
import os
import signal
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state

from mindspeed_llm import device, distributed
from mindspeed_llm.checkpoint import run_record
from mindspeed_llm.checkpoint import training as training_ckpt
from mindspeed_llm.checkpoint.errors import DivergenceError
from mindspeed_llm.rl import profiling
from mindspeed_llm.rl.rollouts import base as rollouts
from mindspeed_llm.rl.evaluation import Evaluator
from mindspeed_llm.rl.metrics import MetricsLogger, Progress, reduce_metrics, throughput_metrics, timers
from mindspeed_llm.rl.metrics.wandb_writer import wandb_options
from mindspeed_llm.rl.preflight import (acquire_save_lock, check_labels, check_output_paths, check_prompt_lengths,
                                        finetune_on_own_save, load_tokenizer, prompt_sampler, prompt_sets,
                                        resumes_from_load)
from mindspeed_llm.rl.settings import CheckpointSettings, Settings, with_values
from mindspeed_llm.rl.stages import STAGES, IterationResult, Stage
from mindspeed_llm.rl.startup import startup_lines
from mindspeed_llm.rl.tools.prompts import offer_run_tools
from mindspeed_llm.rl.update import roles


def samples_path(loop) -> Optional[str]:
    """Where --log-samples' rows go (`MetricsLogger.log_samples`): samples.jsonl and eval_samples.jsonl beside
    --metrics-jsonl; None without either."""
    if not (loop.log_samples and loop.metrics_jsonl):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(loop.metrics_jsonl)), "samples.jsonl (and eval_samples.jsonl)")


def _gather_to_logger(metrics: Dict[str, float]) -> Dict[str, float]:
    """Mean over DP ranks, then the last pipeline stage's view (it alone has the losses) to every rank."""
    metrics = reduce_metrics(metrics, group=parallel_state.get_data_parallel_group(), device=device.current_device())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        metrics = distributed.broadcast_object(
            metrics, src_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return metrics


class _ExitSignal:
    """--exit-signal-handler: SIGTERM is noted, and the loop saves and exits after the current iteration."""

    def __init__(self, enabled: bool):
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._note) if enabled else None

    def _note(self, signum, frame):
        self.received = True

    def any_rank(self) -> bool:
        return self._previous is not None and distributed.any_rank(self.received)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def run_description(stage_name: str, stage: Stage) -> dict:
    """What this run's checkpoints record (`checkpoint/run_record.py`): the stage, its roles, each role's base (the
    checkpoint it started from and a fingerprint of its weights, taken before any resume loads over them), the
    reference model, the reward model, the teacher and the judge. A collective (every rank's fingerprints)."""
    from mindspeed_llm.rl.update.lora import base_fingerprint

    def base_of(trainable):
        if getattr(trainable, "is_lora", False):
            return {"path": trainable.base, "fingerprint": run_record.combined_fingerprint(trainable.fingerprint),
                    "lora": {**trainable.config.to_dict(), "initial_adapter": trainable.initial_adapter}}
        module = trainable.module
        return {"path": getattr(module, "loaded_from", None), "lora": None,
                "fingerprint": run_record.combined_fingerprint(base_fingerprint(module, frozen_only=False))}

    roles = stage.roles()
    bases = {name: base_of(trainable) for name, trainable in roles.items()}

    def frozen(model, trained_role: str, frozen_only: bool):
        if model is None:
            return None
        if getattr(model, "trainable", None) is not None:  # a LoRA run's: the trained role's base (lora.SharedBase)
            return {key: bases[trained_role][key] for key in ("path", "fingerprint")}
        return {"path": getattr(model, "loaded_from", None),
                "fingerprint": run_record.combined_fingerprint(base_fingerprint(model, frozen_only=frozen_only))}

    reference = frozen(stage.reference, "actor", frozen_only=True)
    reward_model = frozen(stage.reward_model, "critic", frozen_only=False)
    teacher = frozen(stage.teacher, "actor", frozen_only=False)
    judge = frozen(stage.judge, "actor", frozen_only=False)
    sizes = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size())
    return run_record.make_record(stage_name, list(roles), sizes, bases, reference, reward_model, teacher, judge)


def _resume(checkpoint: CheckpointSettings, stage: Stage, sampler, record: dict) -> int:
    """Load what --load / --finetune / --ckpt-step say; returns the iteration the run continues from. Every check
    against the checkpoint's record (`run_record`) comes before anything is loaded or written."""
    if not resumes_from_load(checkpoint):
        return 0
    roles = stage.roles()
    finetune = checkpoint.finetune
    iteration = training_ckpt.resume_iteration(checkpoint.load, roles, checkpoint.stage, save=checkpoint.save,
                                               ckpt_step=checkpoint.ckpt_step, finetune=finetune)
    if iteration is None:
        if distributed.is_rank_0():
            print(f"--load {checkpoint.load} holds no checkpoint yet; starting from scratch (it is also --save: the "
                  "next run with this command line resumes from what this one saves)", flush=True)
        return 0
    notes = [] if finetune else run_record.resume_lines(checkpoint.load, iteration, record,
                                                        checkpoint.allow_reference_change, list(roles))
    messages = []

    def reconcile(name, trainable, state):
        messages.extend(trainable.reconcile_schedule(state["opt_param_scheduler"]))

    loop_state = training_ckpt.load(checkpoint.load, roles, iteration,
                                    load_optim=not (finetune or checkpoint.no_load_optim),
                                    load_rng=not (finetune or checkpoint.no_load_rng), on_schedule=reconcile)
    if distributed.is_rank_0():
        for message in messages:
            print(message, flush=True)
    if finetune:
        if distributed.is_rank_0():
            print(f"--finetune: weights from {checkpoint.load} iteration {iteration}; iteration, optimizer, RNG and "
                  "data position start fresh", flush=True)
        return 0
    sampler.load_state_dict(loop_state["sampler"])
    _resume_rollouts(checkpoint, stage, loop_state, iteration)
    if distributed.is_rank_0():
        print(f"resumed from {checkpoint.load} at iteration {iteration}", flush=True)
        for line in notes + fresh_on_resume(checkpoint):
            print(line, flush=True)
    return iteration


def fresh_on_resume(checkpoint: CheckpointSettings) -> List[str]:
    """What a resume does not take from the checkpoint (--no-load-optim, --no-load-rng), one line each."""
    lines = []
    if checkpoint.no_load_optim:
        lines.append("--no-load-optim: the optimizer starts over (Adam moments from zero) and so does the LR schedule "
                     "(from its first step, warmup included); the weights, iteration and data position are the "
                     "checkpoint's")
    if checkpoint.no_load_rng:
        lines.append("--no-load-rng: the torch, numpy and Python random states start from --seed, not the "
                     "checkpoint's (the rollouts' per-sample streams do not depend on them; dropout does)")
    return lines


def _resume_rollouts(checkpoint: CheckpointSettings, stage: Stage, loop_state: dict, iteration: int) -> None:
    """The schedule's state (--partial-rollout's carried and finished groups) continues from the checkpoint;
    a checkpoint that holds another strategy's work is refused, as the run would drop it."""
    try:
        note = rollouts.load_state(stage.rollouts, loop_state)
    except rollouts.UnresumableStateError as exc:
        raise training_ckpt.CheckpointError(f"--load {checkpoint.load} iteration {iteration} holds {exc} (or "
                                            "--finetune, which starts the data afresh)") from None
    if note and distributed.is_rank_0():
        print(note, flush=True)


def run(args) -> None:
    """A run of the validated command line `args`: its typed parts (`args.settings`) drive everything here, the stage
    included; the Namespace itself goes nowhere else (tests/unit/test_namespace_boundary.py)."""
    settings: Settings = args.settings
    parallel, checkpoint, data = settings.parallel, settings.checkpoint, settings.data
    distributed.initialize(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, data.seed,
                           expert_model_parallel_size=parallel.expert_parallel_size,
                           expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
                           context_parallel_size=parallel.context_parallel_size)
    # the prompts are dealt over DP x CP: the CP ranks of a DP rank generate their own (rollout_parallel_info)
    rollout_rank, rollout_size = distributed.rollout_parallel_info()
    if distributed.is_rank_0():
        for line in startup_lines(settings, device.accelerator().backend):
            print(f"posttrain_gpt.py: {line}", flush=True)
    tokenizer = load_tokenizer(data)
    # with --tool-config the prompts offer the run's tools, rendered here: a new tool config needs no new preprocessing
    dataset, eval_dataset = offer_run_tools(settings.tools.tool_config, tokenizer, *prompt_sets(data),
                                            ranks=distributed.world_share())  # each rank renders a share
    sampler = prompt_sampler(data, len(dataset), rollout_rank, rollout_size)
    check_labels(dataset, settings.reward, data.data_path)
    check_prompt_lengths(dataset, data.max_prompt_length, "--data-path")
    for _, held_out in eval_dataset or ():
        check_prompt_lengths(held_out, data.max_prompt_length,
                             "--eval-data-path" if data.eval_data_path else "--split (valid)")

    override = distributed.broadcast_object(finetune_on_own_save(checkpoint) if distributed.is_rank_0() else None)
    if override:
        settings = with_values(settings, finetune=False)
        checkpoint = settings.checkpoint
        if distributed.is_rank_0():
            print(f"posttrain_gpt.py: {override}", flush=True)
    check_output_paths(settings)
    lock = acquire_save_lock(checkpoint.save) if checkpoint.save else None
    exit_signal = _ExitSignal(checkpoint.exit_signal_handler)
    logger = evaluator = profiler = None
    loop = settings.loop
    failed = True  # until the loop returns: the wandb run then finishes with exit code 1
    try:
        stage = STAGES[checkpoint.stage](settings, tokenizer, roles.RoleFactory(settings))
        if checkpoint.save:
            training_ckpt.check_save_dir(checkpoint.save, stage.roles())
        record = run_description(checkpoint.stage, stage)
        start = _resume(checkpoint, stage, sampler, record)
        progress = Progress(loop.train_iters, start)  # the stdout line's elapsed / time left, the end summary
        logger = MetricsLogger(
            loop.log_interval, jsonl_path=loop.metrics_jsonl, tensorboard_dir=loop.tensorboard_dir,
            rank=torch.distributed.get_rank(), total_iterations=loop.train_iters, lines=stage.log_lines,
            resumed_at=start if resumes_from_load(checkpoint) else None,  # rows of re-run iterations are replaced
            wandb=wandb_options(settings),
            progress=progress, on_stdout=timers.on_stdout(settings.profile.timing_log_level),
        )
        evaluator = Evaluator(stage, eval_dataset or (), loop, start, rank=torch.distributed.get_rank())
        profiler = profiling.Profiler(settings.profile, torch.distributed.get_rank(), parallel.world_size)
        passed = profiler.resumed(start)  # a resumed run past its window: said, instead of traces never written
        if passed and distributed.is_rank_0():
            print(f"posttrain_gpt.py: {passed}", flush=True)
        saved = _loop(settings, stage, dataset, evaluator, sampler, logger, start, exit_signal, profiler, record)
        profiler.close()  # the traces of a window the run cut short are written before the summary names them
        if distributed.is_rank_0():
            outputs = [("checkpoints", f"{checkpoint.save} (last: iteration {saved})" if saved else None),
                       ("metrics", loop.metrics_jsonl), ("TensorBoard", loop.tensorboard_dir),
                       ("samples", samples_path(loop)), ("rollout dump", loop.rollout_dump_dir)]
            for line in progress.summary_lines(outputs) + [f"  {x}" for x in profiler.summary_lines()]:
                print(f"posttrain_gpt.py: {line}", flush=True)
        failed = False
    finally:
        exit_signal.restore()
        if evaluator is not None:
            evaluator.close()
        if profiler is not None:
            profiler.close()
        if logger is not None:
            logger.close(failed=failed)
        if lock is not None:
            lock.release()


class EntropyGuard:
    """--check-for-divergence, the policy's side: the actor's mean token entropy rising to the uniform maximum
    (log V over the vocabulary the log-probs normalise over) from clearly below it at the run's first iteration
    means the policy forgot everything it knew. A random-weight model that starts uniform is not flagged."""

    UNIFORM = 0.99  # of log V: reached
    BELOW = 0.9  # of log V: where the first iteration must have been

    def __init__(self, vocab_size: int):
        self.maximum = math.log(vocab_size)
        self.first: Optional[float] = None

    def check(self, entropy: Optional[float]) -> None:
        """`entropy`: the iteration's (None on a rank without the losses: not the last pipeline stage)."""
        found = None
        if entropy is not None:
            if self.first is None:
                self.first = entropy
            elif self.first < self.BELOW * self.maximum and entropy >= self.UNIFORM * self.maximum:
                found = (f"the actor's entropy rose from {self.first:.3f} to {entropy:.3f}, the uniform maximum "
                         f"log {round(math.exp(self.maximum))} = {self.maximum:.3f}: the policy went uniform")
        if distributed.any_rank(found is not None):
            raise DivergenceError(distributed.gather_messages(found)[0])  # the same on every rank that has it


def _loop(settings: Settings, stage: Stage, dataset, evaluator: Evaluator, sampler, logger, start: int, exit_signal,
          profiler: profiling.Profiler, record: Optional[dict] = None) -> Optional[int]:
    """The iterations after `start`; returns the last saved iteration (None: none)."""
    loop, checkpoint = settings.loop, settings.checkpoint
    world_size = settings.parallel.world_size
    _, dp_size = distributed.data_parallel_info()
    rollout_rank, _ = distributed.rollout_parallel_info()
    saved: Optional[int] = start or None
    save_hf = training_ckpt.save_hf.SaveHF(
        tokenizers=tuple(p for p in (settings.data.tokenizer_name_or_path, settings.data.ref_model,
                                     settings.data.load) if p),
        merge_lora=checkpoint.save_hf_merge_lora) if checkpoint.save_hf else None

    def save(iteration: int) -> None:
        nonlocal saved
        loop_state = {"sampler": sampler.state_dict()}
        rollouts.save_state(stage.rollouts, loop_state)  # --partial-rollout's buffers (a collective over DP)
        training_ckpt.save(checkpoint.save, iteration, stage.roles(), loop_state,
                           save_optim=not checkpoint.no_save_optim, record=record, hf=save_hf)
        saved = iteration

    entropy_guard = EntropyGuard(stage.vocab_size)
    iteration = start
    if evaluator.before_train():  # --eval-before-train: the baseline, at iteration 0
        metrics = _gather_to_logger(evaluator.evaluate())
        logger.log(0, metrics)
        evaluator.record(0, metrics)
        logger.log_samples(0, evaluator.pop_samples(), "eval_samples")
    if start >= loop.train_iters and distributed.is_rank_0():
        print(f"posttrain_gpt.py: the checkpoint is at iteration {start}, --train-iters is {loop.train_iters}: nothing "
              f"left to train; raise --train-iters to continue", flush=True)
    for iteration in range(start + 1, loop.train_iters + 1):
        last = f"the last checkpoint is iteration {saved}" if saved else "no checkpoint was written"
        profiler.begin(iteration)
        try:
            prompts = rollouts.PromptSource.from_sampler(dataset, sampler, loop.global_batch_size,
                                                                   rollout_rank)
            result: IterationResult = stage.iteration(iteration, prompts)
            if loop.check_for_divergence:
                entropy_guard.check(result.entropy)
        except DivergenceError as exc:
            raise DivergenceError(
                f"iteration {iteration}: {exc}; stopped, nothing of this iteration was saved ({last}); lower --lr "
                f"(--no-check-for-divergence trains on)") from None
        except training_ckpt.NonFiniteError as exc:
            raise training_ckpt.NonFiniteError(
                f"iteration {iteration}: {exc}; stopped before the optimizer step, nothing of this iteration was "
                f"saved ({last}); lower --lr or check the data (--no-check-for-nan-in-loss-and-grad trains on)"
            ) from None
        metrics = result.metrics
        metrics.update(throughput_metrics(result.prompt_tokens, result.response_tokens, world_size // dp_size, metrics))
        if evaluator.due(iteration):  # every --eval-interval, and the last iteration
            metrics.update(evaluator.evaluate())
        metrics = _gather_to_logger(metrics)
        metrics.update(global_batch_size=loop.global_batch_size, world_size=world_size)
        logger.log(iteration, metrics)
        logger.log_samples(iteration, result.samples, "samples")
        evaluator.record(iteration, metrics)
        logger.log_samples(iteration, evaluator.pop_samples(), "eval_samples")
        profiler.end(iteration)
        if checkpoint.save and checkpoint.save_interval and iteration % checkpoint.save_interval == 0:
            save(iteration)
        if exit_signal.any_rank():
            if checkpoint.save and saved != iteration:
                save(iteration)
            if distributed.is_rank_0():
                where = f"saved iteration {iteration} to {checkpoint.save}" if checkpoint.save else \
                    "no --save: nothing saved"
                print(f"SIGTERM received: {where}; exiting (--exit-signal-handler)", flush=True)
            return saved
    if checkpoint.save and saved != iteration:  # Megatron-LM saves at the end of training
        save(iteration)
    return saved
