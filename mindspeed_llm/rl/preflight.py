"""What a run checks and opens before any model is built (`trainer.run`): the tokenizer, the training and held-out
prompts (with --split's parts), their labels for the verifiers and their lengths, the sampler's order, the output
paths, and the --save folder every node must share. Each problem is an error that names its flag and the fix."""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

from mindspeed_llm import distributed
from mindspeed_llm.checkpoint import training as training_ckpt
from mindspeed_llm.checkpoint.megatron_layout import checkpoint_traces
from mindspeed_llm.data import PromptDataset, PromptSampler
from mindspeed_llm.data.errors import DataError
from mindspeed_llm.data.prompt_dataset import PromptSubset, split_indices
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.settings import CheckpointSettings, DataSettings, RewardMixing, Settings


def load_tokenizer(data: DataSettings):
    from transformers import AutoTokenizer

    path = data.tokenizer_name_or_path or data.ref_model or data.load
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=not data.tokenizer_not_use_fast)
    except Exception as exc:  # transformers' own message does not name our flag
        raise ArgumentError(
            f"cannot load a tokenizer from {path!r} ({exc}); pass --tokenizer-name-or-path, or convert the model "
            "with convert_ckpt.py, which copies the tokenizer files next to the weights"
        ) from exc


def check_labels(dataset, reward: RewardMixing, data_path: str) -> None:
    from mindspeed_llm.rl.verifiers import check_verifiers, verifier_requires_label

    try:
        check_verifiers(list(reward.verifier_function), list(reward.verifier_weight))
    except ValueError as exc:  # the message lists the valid names
        raise ArgumentError(f"--verifier-function: {exc}") from exc
    for name in reward.verifier_function:
        if verifier_requires_label(name) and "labels" not in dataset.extra_keys:
            raise ArgumentError(
                f"--verifier-function {name} needs a reference answer per prompt, but {data_path} has no labels; "
                "preprocess with R1AlpacaStyleInstructionHandler and --map-keys '{\"prompt\": ..., \"labels\": ...}'"
            )


def check_prompt_lengths(dataset, max_prompt_length: int, flag: str) -> None:
    """Prompts are never cut at training time: one longer than --max-prompt-length is an error here."""
    lengths = dataset.prompt_lengths
    over = int((lengths > max_prompt_length).sum()) if len(lengths) else 0
    if over:
        raise ArgumentError(
            f"{flag} {dataset.prefix}: {over} of {len(lengths)} prompts are longer than --max-prompt-length "
            f"{max_prompt_length} (the longest has {int(lengths.max())} tokens); preprocess with "
            f"--max-prompt-length {max_prompt_length} --overlong-prompts drop (or truncate), or raise "
            "--max-prompt-length / --max-length"
        )


def resumes_from_load(checkpoint: CheckpointSettings) -> bool:
    """--load is a --save directory to resume from, except for grpo without --ref-model, where it is the
    initial actor (a converted model)."""
    return bool(checkpoint.load) and not (checkpoint.stage == "grpo" and not checkpoint.ref_model)


def eval_sets(data: DataSettings):
    """--eval-data-path's held-out sets as (name, dataset) pairs (name None: the unnamed set); None without
    --eval-interval."""
    if not data.eval_interval:
        return None
    sets = [(name, _open_eval_set(name, prefix)) for name, prefix in data.eval_sets]
    for _, dataset in sets:
        dataset.check_prompts("--eval-data-path")
    return sets


def _open_eval_set(name, prefix: str) -> PromptDataset:
    """The held-out set at `prefix`; a missing or damaged one is a `DataError` that names --eval-data-path."""
    try:
        return PromptDataset(prefix)
    except DataError as exc:
        given = prefix if name is None else f"{name}={prefix}"
        raise type(exc)(f"--eval-data-path {given}: {exc}") from None


def prompt_sets(data: DataSettings):
    """The training prompts and the held-out sets, (name, dataset) pairs (None: no evaluation): --eval-data-path's,
    or --split's valid part of --data-path, unnamed (the training sampler then sees only the train part)."""
    dataset = PromptDataset(data.data_path)
    dataset.check_prompts("--data-path")
    weights = data.split_weights
    if weights is None:
        return dataset, (eval_sets(data) if data.eval_data_path else None)
    parts = split_indices(len(dataset), weights, data.seed)
    sizes = f"--split {data.split} of --data-path {data.data_path} ({len(dataset)} prompts: " \
            f"{len(parts[0])} train, {len(parts[1])} valid, {len(parts[2])} test)"
    if weights[1] > 0 and not len(parts[1]):
        raise ArgumentError(f"{sizes} leaves the valid part empty; give it a larger weight or use more prompts")
    if len(parts[0]) < data.global_batch_size:
        raise ArgumentError(f"{sizes} leaves fewer training prompts than one --global-batch-size "
                            f"{data.global_batch_size}; give --split's train part more weight or use more prompts")
    if distributed.is_rank_0():
        print(sizes + (" (the test part is not used)" if len(parts[2]) else ""), flush=True)
    train = PromptSubset(dataset, parts[0], "train")
    if data.eval_data_path:
        return train, eval_sets(data)
    return train, ([(None, PromptSubset(dataset, parts[1], "valid"))] if data.eval_interval and len(parts[1]) else None)


def prompt_sampler(data: DataSettings, dataset_len: int, rank: int, size: int) -> PromptSampler:
    """The training prompts' order over `size` rollout ranks: a --seed permutation per epoch, or dataset order with
    --no-shuffle (the checkpoint records which, and a resume with the other is refused)."""
    return PromptSampler(dataset_len, data.global_batch_size, rank, size, data.seed, shuffle=not data.no_shuffle)


def output_path_problem(settings: Settings) -> Optional[str]:
    """Why an output of the run cannot be written where asked, found before any model is built: a --metrics-jsonl,
    --tensorboard-dir or --wandb-save-dir under a file (or a directory given as the JSONL file), a --save that is a
    file, or a --save holding checkpoints this run would write over (it starts at iteration 1 there: without --load
    of that directory, or with a --finetune that finetune_on_own_save did not turn into a resume)."""
    loop, checkpoint = settings.loop, settings.checkpoint
    for flag, path, is_dir in (("--metrics-jsonl", loop.metrics_jsonl, False),
                               ("--tensorboard-dir", loop.tensorboard_dir, True), ("--save", checkpoint.save, True),
                               ("--wandb-save-dir", settings.wandb.wandb_save_dir, True)):
        if not path:
            continue
        if os.path.exists(path) and os.path.isdir(path) != is_dir:
            return f"{flag} {path} is a {'file' if is_dir else 'directory'}; pass a {'directory' if is_dir else 'file'}"
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            return f"{flag} {path} lies under {parent}, which is a file; pass a path in a directory"
    if checkpoint.save and os.path.isdir(checkpoint.save):
        traces = checkpoint_traces(checkpoint.save)
        resumes_there = resumes_from_load(checkpoint) and \
            os.path.abspath(checkpoint.load) == os.path.abspath(checkpoint.save)
        if traces and not resumes_there:  # (a --finetune of it resumes it: finetune_on_own_save)
            return (f"--save {checkpoint.save} already holds checkpoints ({', '.join(traces[:4])}"
                    f"{' ...' if len(traces) > 4 else ''}) and this run does not resume from it (--load): its saves "
                    f"would replace them; pass --load {checkpoint.save} to resume them, or another --save")
    return None


def finetune_on_own_save(checkpoint: CheckpointSettings) -> Optional[str]:
    """The startup line when --finetune is overridden, else None. MindSpeed-LLM's scripts carry --finetune (their
    first run loads the SFT model with it); a user resumes one by adding --load <its --save>, and --finetune would
    then restart the iteration count over the run's own checkpoints. With --load equal to --save and checkpoints
    there, the run resumes them instead."""
    if not (checkpoint.finetune and checkpoint.save and resumes_from_load(checkpoint)):
        return None
    if os.path.abspath(checkpoint.load) != os.path.abspath(checkpoint.save) or not checkpoint_traces(checkpoint.save):
        return None
    return (f"--finetune is overridden: --load {checkpoint.load} is this run's own --save and holds its checkpoints, "
            "so the run resumes them (--finetune would restart the iteration count and write over them)")


def check_output_paths(settings: Settings) -> None:
    """`output_path_problem`, judged on rank 0 (one filesystem view) and raised on every rank."""
    problem = output_path_problem(settings) if distributed.is_rank_0() else None
    problem = distributed.broadcast_object(problem)
    if problem:
        raise training_ckpt.CheckpointError(problem)


def check_shared_save(save: str, lock_file: str, wait_s: float = 10.0) -> None:
    """Every rank must see the writer lock rank 0 has just written into --save: rank 0 publishes every rank's
    checkpoint shards there, so a --save that is a local folder on each node would give checkpoints that lack
    the other nodes' shards. A rank looks for `wait_s` seconds (a network filesystem may show a new file late)."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(lock_file) and time.monotonic() < deadline:
        time.sleep(0.2)
    missing = None if os.path.exists(lock_file) else f"host {socket.gethostname()} does not see {lock_file}"
    messages = distributed.gather_messages(missing)
    if messages:
        raise training_ckpt.CheckpointError(
            f"--save {save} is not one folder shared by every node: rank 0 wrote its writer lock there, but "
            f"{'; '.join(messages)}. Put --save (and --load) on a filesystem every node mounts at the same path"
        )


def acquire_save_lock(save: str) -> training_ckpt.WriterLock:
    """--save's writer lock, taken by rank 0 (the folder made first), then seen by every rank (`check_shared_save`);
    a --save this job cannot write, or one another run holds, is an error on every rank."""
    lock = training_ckpt.WriterLock(save)
    problem = None
    if distributed.is_rank_0():
        try:
            os.makedirs(save, exist_ok=True)
            lock.acquire()
        except (OSError, training_ckpt.CheckpointError) as exc:
            problem = str(exc) if isinstance(exc, training_ckpt.CheckpointError) else \
                f"--save {save} cannot be written ({exc.strerror or exc}); pass a --save this job can write"
    problem = distributed.broadcast_object(problem)
    if problem:
        raise training_ckpt.CheckpointError(problem)
    check_shared_save(save, lock.path)
    return lock
