"""The outer loop every stage shares: set up, resume, iterate, evaluate, log, save.

A stage object (`TrlPPOStage`, `GRPOStage`) owns its models and implements `iteration(iteration, rows)`;
this loop owns everything around it, so the two stages have no copies of it.
"""

from __future__ import annotations

import os
from typing import Dict

import torch
from megatron.core import parallel_state

from mindspeed_llm import distributed
from mindspeed_llm.arguments import ArgumentError
from mindspeed_llm.checkpoint import training as training_ckpt
from mindspeed_llm.data import PromptDataset, PromptSampler
from mindspeed_llm.rl.metrics import MetricsLogger, reduce_metrics, throughput_metrics
from mindspeed_llm.rl.stages import STAGES


def load_tokenizer(args):
    from transformers import AutoTokenizer

    path = args.tokenizer_name_or_path or args.ref_model or args.load
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers' own message does not name our flag
        raise ArgumentError(
            f"cannot load a tokenizer from {path!r} ({exc}); pass --tokenizer-name-or-path, or convert the model "
            "with convert_ckpt.py, which copies the tokenizer files next to the weights"
        ) from exc


def check_tokenizer(tokenizer, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise ArgumentError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size}: "
            "--tokenizer-name-or-path does not belong to this checkpoint"
        )


def check_labels(dataset, args) -> None:
    from mindspeed_llm.rl.rewards import get_verifier, verifier_requires_label

    for name in args.verifier_function:
        try:
            get_verifier(name)
        except ValueError as exc:  # the message lists the valid names
            raise ArgumentError(f"--verifier-function: {exc}") from exc
        if verifier_requires_label(name) and "labels" not in dataset.extra_keys:
            raise ArgumentError(
                f"--verifier-function {name} needs a reference answer per prompt, but {args.data_path} has no labels; "
                "preprocess with R1AlpacaStyleInstructionHandler and --map-keys '{\"prompt\": ..., \"labels\": ...}'"
            )


def is_stage_checkpoint(root: str, stage) -> bool:
    """True for a --save directory of a stage run (as opposed to a converted model)."""
    return all(os.path.isdir(os.path.join(root, role)) for role in stage.trained_roles())


def _gather_to_logger(metrics: Dict[str, float]) -> Dict[str, float]:
    """Mean over DP ranks, then the last pipeline stage's view (it alone has the losses) to every rank."""
    metrics = reduce_metrics(metrics, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        metrics = distributed.broadcast_object(
            metrics, src_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return metrics


def _evaluate(stage, dataset, args) -> Dict[str, float]:
    """Greedy rollouts on the held-out prompts of this DP rank: mean score, KL to the reference, length."""
    from mindspeed_llm.rl.passes import policy_logprobs
    from mindspeed_llm.rl.metrics import Timers
    from mindspeed_llm.rl.stages import common

    dp_rank, dp_size = distributed.data_parallel_info()
    count = len(dataset) if not args.eval_samples else min(args.eval_samples, len(dataset))
    indices = list(range(dp_rank, count, dp_size))
    if not indices:
        return {}
    rows = [dataset[i] for i in indices]
    sampling = common.sampling_config(args, stage.tokenizer, greedy=True)
    exp = common.rollout(stage.actor.module, rows, sampling, 0, args.max_prompt_length, stage.tokenizer)
    scores, _ = stage.scorer(exp, 1, Timers())
    out = {"eval/score/mean": float(scores.mean()), "eval/response_length/mean": float(exp.response_lengths.float().mean())}
    if stage.reference is not None:
        logp = policy_logprobs(stage.actor.chunks, exp, 1)
        ref = policy_logprobs([stage.reference], exp, 1)
        out["eval/kl/mean"] = float(((logp - ref) * exp.response_mask).sum(-1).mean())
    return out


def run(args) -> None:
    distributed.initialize(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed)
    dp_rank, dp_size = distributed.data_parallel_info()
    tokenizer = load_tokenizer(args)
    dataset = PromptDataset(args.data_path)
    eval_dataset = PromptDataset(args.eval_data_path) if args.eval_data_path else None
    sampler = PromptSampler(len(dataset), args.global_batch_size, dp_rank, dp_size, args.seed)

    check_labels(dataset, args)
    stage = STAGES[args.stage](args, tokenizer)
    check_tokenizer(tokenizer, stage.actor.module.model_spec.vocab_size)
    start = 0
    if args.load and not args.finetune and is_stage_checkpoint(args.load, stage):
        start, loop_state = training_ckpt.load(
            args.load, stage.trained_roles(), load_optim=not args.no_load_optim, load_rng=not args.no_load_rng
        )
        sampler.load_state_dict(loop_state["sampler"])
        if distributed.is_rank_0():
            print(f"resumed from {args.load} at iteration {start}", flush=True)

    logger = MetricsLogger(
        args.log_interval, jsonl_path=args.metrics_jsonl, tensorboard_dir=args.tensorboard_dir,
        rank=torch.distributed.get_rank(), total_iterations=args.train_iters, lines=stage.log_lines,
    )
    try:
        for iteration in range(start + 1, args.train_iters + 1):
            # `position`: the prompt's place in the global batch, which keys its samples' random streams
            first = dp_rank * sampler.local_batch_size
            rows = [dict(dataset[i], index=i, position=first + k) for k, i in enumerate(sampler.next_batch_indices())]
            metrics = stage.iteration(iteration, rows)
            metrics.update(throughput_metrics(
                metrics["prompt_length/mean"] * len(rows) * args.n_samples_per_prompt,
                metrics["response_length/mean"] * len(rows) * args.n_samples_per_prompt,
                args.world_size // dp_size, metrics,
            ))
            if eval_dataset is not None and args.eval_interval and iteration % args.eval_interval == 0:
                metrics.update(_evaluate(stage, eval_dataset, args))
            metrics = _gather_to_logger(metrics)
            metrics.update(global_batch_size=args.global_batch_size, world_size=args.world_size)
            logger.log(iteration, metrics)
            if args.save and args.save_interval and (
                iteration % args.save_interval == 0 or iteration == args.train_iters
            ):
                training_ckpt.save(args.save, iteration, stage.trained_roles(), {"sampler": sampler.state_dict()})
    finally:
        logger.close()
