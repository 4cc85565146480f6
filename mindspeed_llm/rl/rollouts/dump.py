"""Rollout dump: --rollout-dump-dir writes each iteration's scored rollouts; --rollout-replay-dir trains on them
instead of generating and scoring (the `replay` schedule, `replay.py`), the same updates bit for bit, so a bad update
can be reproduced without the sampler, the verifiers or the reward model, and a regression bisected.

The format (docs/monitoring.md, "Rollout dump and replay"), version `VERSION`:

    DIR/manifest.json                     the dumping run: stage, schedule, generator, samples per prompt, global batch,
                                          data-parallel size, seed, data path and size, the model (--load,
                                          --ref-model, layout), the tokenizer (vocabulary size and hash); a replay
                                          is checked against them (`rollout_dump_checks.py`)
    DIR/iteration_0000003/                one folder per iteration, complete once `done.json` is in it:
        batch_0_dp_rank_00.pt             generation batch 0 of DP rank 0: a dict of tensors (torch.save; loads with
                                          weights_only=True): tokens [B, T] (prompt + response, right padded),
                                          prompt_lengths [B], responses [B, R], response_mask [B, R], ended_with_eos
                                          [B], scores [B], and where the rollout had them rollout_logp [B, R] (the
                                          sampler's log-probs), tool_mask [B, R] (multi-turn tool tokens), routing
                                          [B, layers, T, topk] (a mixture of experts' recorded routing)
        batch_0_dp_rank_00.json           its per-sample data (`SampleData`'s fields: labels, indices, texts,
                                          finish_reasons, sample_ids, trajectories, score_parts, columns), the
                                          strategy's and the scorer's metrics, routing_recorded, and in batch 0's
                                          the hash of the prompts the DP rank drew first (`prompts_sha256`)
        done.json                         generation batches and prompt batches the iteration drew, the actor's
                                          weights' fingerprint when its rollouts were made (`actor_weights`)

B is the DP rank's samples (a prompt's samples consecutive, in the sampler's order). A generation batch is one
`collect` of the strategy: one per iteration, more with --dynamic-sampling's refills. Every rank of a DP rank (its
TP, PP and CP ranks) holds the same rollout; the first of them writes it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from typing import Dict, List, Optional, Tuple

import torch

from mindspeed_llm import device, distributed
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.files import write_atomically, write_text_atomically
from mindspeed_llm.rl.rollouts import dump_checks as checks
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics.samples import json_ready

VERSION = 2  # 2: the model, tokenizer and dataset recorded (a version 1 dump replays without those checks)
READS = (1, 2)
MANIFEST = "manifest.json"
DONE = "done.json"
# the tensors a dump holds, as the rollout made them (the loss mask and everything after scoring are derived again)
TENSORS = ("tokens", "prompt_lengths", "responses", "response_mask", "ended_with_eos", "scores", "rollout_logp",
           "tool_mask", "routing")
# what a replay must share with the dumping run for the same updates (the manifest's keys, the settings' values)
MUST_MATCH = ("stage", "n_samples_per_prompt", "global_batch_size", "data_parallel_size")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iteration_{iteration:07d}")


def _batch_name(generation_batch: int, dp_rank: int) -> str:
    return f"batch_{generation_batch}_dp_rank_{dp_rank:02d}"


def _write_json(path: str, obj) -> None:
    write_text_atomically(path, json.dumps(obj))


def dump_manifest(settings, strategy: str, tokenizer=None, generator: Optional[str] = None) -> dict:
    """The manifest of a dump made by the run of `settings` with schedule `strategy` (the key keeps its first
    name), sample generator `generator` and `tokenizer`."""
    _, dp_size = distributed.data_parallel_info()
    data = settings.data
    return {"format": "mindspeed_llm rollout dump", "version": VERSION, "stage": settings.checkpoint.stage,
            "strategy": strategy, "generator": generator, "n_samples_per_prompt": settings.algorithm.n_samples_per_prompt,
            "global_batch_size": settings.loop.global_batch_size, "data_parallel_size": dp_size,
            "seed": data.seed, "data_path": data.data_path, "data_size": checks.dataset_size(data.data_path),
            "temperature": settings.loss.temperature,
            "model": {"load": _real(settings.checkpoint.load), "ref_model": _real(data.ref_model),
                      "layout": checks.layout()},
            "tokenizer": checks.tokenizer_identity(tokenizer), "machine": device.machine_identity()}


def _real(path: Optional[str]) -> Optional[str]:
    return os.path.realpath(path) if path else None


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"--rollout-replay-dir {root}: cannot read {path} ({exc}); pass the --rollout-dump-dir "
                            "of the run to replay") from None
    if not isinstance(manifest, dict) or manifest.get("version") not in READS:
        version = manifest.get("version") if isinstance(manifest, dict) else None
        raise ArgumentError(f"--rollout-replay-dir {root}: dump format version {version!r}; this version reads "
                            f"{', '.join(map(str, READS))}")
    return manifest


class RolloutDumper:
    """--rollout-dump-dir: `add` each scored generation batch of an iteration, `finish` writes them (the first rank of
    each DP rank) and marks the iteration complete (rank 0, after every rank wrote)."""

    def __init__(self, root: str, manifest: dict, actor_module=None):
        self.root, self.actor_module = root, actor_module
        self.weights: Optional[list] = None  # the actor's fingerprint when the iteration's rollouts were made
        dp_rank, _ = distributed.data_parallel_info()
        self.dp_rank = dp_rank
        self.writes = distributed.first_rank_of_data_parallel_rank()
        self.batches: List[Tuple[Experience, Dict[str, float]]] = []
        if distributed.is_rank_0():
            os.makedirs(root, exist_ok=True)
            _write_json(os.path.join(root, MANIFEST), manifest)

    def add(self, exp: Experience, metrics: Dict[str, float]) -> None:
        if not self.batches:  # the weights that made the iteration's rollouts (a collective: every rank adds)
            self.weights = checks.weights_fingerprint(self.actor_module)
        self.batches.append((exp, dict(metrics)))

    def finish(self, iteration: int, prompts_drawn: int, first_prompts: Optional[str] = None) -> None:
        """Writes the iteration; `first_prompts`: `rollout_dump_checks.prompts_digest` of the prompts this rank drew
        first."""
        folder = iteration_dir(self.root, iteration)
        if distributed.is_rank_0():
            if os.path.isdir(folder):  # a resumed run writes the iteration again
                shutil.rmtree(folder)
            os.makedirs(folder)
        distributed.barrier()
        if self.writes:
            for k, (exp, metrics) in enumerate(self.batches):
                base = os.path.join(folder, _batch_name(k, self.dp_rank))
                tensors = {name: getattr(exp, name).detach().cpu() for name in TENSORS
                           if getattr(exp, name) is not None}
                write_atomically(base + ".pt", lambda tmp: torch.save(tensors, tmp))  # a failure: named, nothing left
                data = {f.name: json_ready(getattr(exp.sample_data, f.name)) for f in fields(SampleData)}
                record = {"sample_data": data, "metrics": metrics, "routing_recorded": bool(exp.routing_recorded)}
                if k == 0 and first_prompts is not None:
                    record["prompts_sha256"] = first_prompts
                _write_json(base + ".json", record)
        distributed.barrier()
        if distributed.is_rank_0():
            _write_json(os.path.join(folder, DONE), {"generation_batches": len(self.batches),
                                                     "prompts_drawn": int(prompts_drawn),
                                                     "actor_weights": self.weights})
        self.batches = []


def load_batch(root: str, iteration: int, generation_batch: int, dp_rank: int,
               vocab_size: Optional[int] = None) -> Tuple[Experience, Dict[str, float]]:
    """Generation batch `generation_batch` of DP rank `dp_rank` at `iteration`, as the dumping run scored it, on the
    model's device: (the experience, its strategy's and scorer's metrics). A file that cannot be read, or tensors
    that disagree with each other or with `vocab_size` (the model's), are a `DumpError` naming the file."""
    exp, metrics, _ = read_batch(root, iteration, generation_batch, dp_rank, vocab_size)
    return exp, metrics


def read_batch(root: str, iteration: int, generation_batch: int, dp_rank: int, vocab_size: Optional[int]):
    """(`load_batch`'s experience and metrics, the batch's JSON record)."""
    base = os.path.join(iteration_dir(root, iteration), _batch_name(generation_batch, dp_rank))
    tensors = checks.read_tensors(base + ".pt")
    record = checks.read_json(base + ".json")
    checks.check_batch(base + ".pt", tensors, record, vocab_size)
    try:
        sample_data = SampleData(**record["sample_data"])
        routing_recorded, metrics = bool(record["routing_recorded"]), dict(record["metrics"])
    except (KeyError, TypeError, ValueError) as exc:
        raise checks.DumpError(f"--rollout-replay-dir: {base}.json lacks or garbles {exc}: the dump is damaged; dump "
                               "that iteration again") from None
    on = device.current_device()
    tensors = {name: t.to(on) for name, t in tensors.items()}
    tokens = tensors["tokens"]
    positions = torch.arange(tokens.shape[1], device=on).expand_as(tokens).contiguous()
    exp = Experience(position_ids=positions, **tensors, sample_data=sample_data, routing_recorded=routing_recorded)
    return exp, metrics, record


def iteration_record(root: str, iteration: int) -> Optional[dict]:
    """The iteration's `done.json` (None: not dumped, or its dump was cut short)."""
    path = os.path.join(iteration_dir(root, iteration), DONE)
    if not os.path.isfile(path):
        return None
    record = checks.read_json(path)
    if not isinstance(record.get("generation_batches"), int) or not isinstance(record.get("prompts_drawn"), int):
        raise checks.DumpError(f"--rollout-replay-dir: {path} lacks its generation_batches / prompts_drawn counts: "
                               "the dump is damaged; dump that iteration again")
    return record


def dumped_iterations(root: str) -> List[int]:
    """The complete iterations of a dump."""
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("iteration_") and name[10:].isdigit() and iteration_record(root, int(name[10:])):
            out.append(int(name[10:]))
    return out
