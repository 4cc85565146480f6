"""Rollout dump and replay: --rollout-dump-dir writes each iteration's scored rollouts; --rollout-replay-dir trains on
them instead of generating and scoring (the `replay` rollout strategy), the same updates bit for bit, so a bad update
can be reproduced without the sampler, the verifiers or the reward model, and a regression bisected.

The format (docs/monitoring.md, "Rollout dump and replay"), version `VERSION`:

    DIR/manifest.json                     the dumping run: stage, rollout strategy, samples per prompt, global batch,
                                          data-parallel size, seed, data path (a replay is checked against them)
    DIR/iteration_0000003/                one folder per iteration, complete once `done.json` is in it:
        batch_0_dp_rank_00.pt             generation batch 0 of DP rank 0: a dict of tensors (torch.save; loads with
                                          weights_only=True): tokens [B, T] (prompt + response, right padded),
                                          prompt_lengths [B], responses [B, R], response_mask [B, R], ended_with_eos
                                          [B], scores [B], and where the rollout had them rollout_logp [B, R] (the
                                          sampler's log-probs), tool_mask [B, R] (multi-turn tool tokens), routing
                                          [B, layers, T, topk] (a mixture of experts' recorded routing)
        batch_0_dp_rank_00.json           its per-sample data (`SampleData`'s fields: labels, indices, texts,
                                          finish_reasons, sample_ids, trajectories, score_parts, columns), the
                                          strategy's and the scorer's metrics, routing_recorded
        done.json                         generation batches and prompt batches the iteration drew

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
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics.samples import json_ready
from mindspeed_llm.rl.rollout_strategies import CarriesNothing

VERSION = 1
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


def dump_manifest(settings, strategy: str) -> dict:
    """The manifest of a dump made by the run of `settings` with rollout strategy `strategy`."""
    _, dp_size = distributed.data_parallel_info()
    return {"format": "mindspeed_llm rollout dump", "version": VERSION, "stage": settings.checkpoint.stage,
            "strategy": strategy, "n_samples_per_prompt": settings.algorithm.n_samples_per_prompt,
            "global_batch_size": settings.loop.global_batch_size, "data_parallel_size": dp_size,
            "seed": settings.data.seed, "data_path": settings.data.data_path,
            "temperature": settings.loss.temperature}


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"--rollout-replay-dir {root}: cannot read {path} ({exc}); pass the --rollout-dump-dir "
                            "of the run to replay") from None
    if manifest.get("version") != VERSION:
        raise ArgumentError(f"--rollout-replay-dir {root}: dump format version {manifest.get('version')!r}; this "
                            f"version reads {VERSION}")
    return manifest


class RolloutDumper:
    """--rollout-dump-dir: `add` each scored generation batch of an iteration, `finish` writes them (the first rank of
    each DP rank) and marks the iteration complete (rank 0, after every rank wrote)."""

    def __init__(self, root: str, manifest: dict):
        self.root = root
        dp_rank, _ = distributed.data_parallel_info()
        self.dp_rank = dp_rank
        self.writes = distributed.first_rank_of_data_parallel_rank()
        self.batches: List[Tuple[Experience, Dict[str, float]]] = []
        if distributed.is_rank_0():
            os.makedirs(root, exist_ok=True)
            _write_json(os.path.join(root, MANIFEST), manifest)

    def add(self, exp: Experience, metrics: Dict[str, float]) -> None:
        self.batches.append((exp, dict(metrics)))

    def finish(self, iteration: int, prompts_drawn: int) -> None:
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
                _write_json(base + ".json", {"sample_data": data, "metrics": metrics,
                                             "routing_recorded": bool(exp.routing_recorded)})
        distributed.barrier()
        if distributed.is_rank_0():
            _write_json(os.path.join(folder, DONE), {"generation_batches": len(self.batches),
                                                     "prompts_drawn": int(prompts_drawn)})
        self.batches = []


def load_batch(root: str, iteration: int, generation_batch: int, dp_rank: int) -> Tuple[Experience, Dict[str, float]]:
    """Generation batch `generation_batch` of DP rank `dp_rank` at `iteration`, as the dumping run scored it, on the
    model's device: (the experience, its strategy's and scorer's metrics)."""
    base = os.path.join(iteration_dir(root, iteration), _batch_name(generation_batch, dp_rank))
    tensors = torch.load(base + ".pt", map_location="cpu", weights_only=True)
    with open(base + ".json", encoding="utf-8") as f:
        record = json.load(f)
    on = device.current_device()
    tensors = {name: t.to(on) for name, t in tensors.items()}
    tokens = tensors["tokens"]
    positions = torch.arange(tokens.shape[1], device=on).expand_as(tokens).contiguous()
    exp = Experience(position_ids=positions, **tensors, sample_data=SampleData(**record["sample_data"]),
                     routing_recorded=record["routing_recorded"])
    return exp, record["metrics"]


def iteration_record(root: str, iteration: int) -> Optional[dict]:
    """The iteration's `done.json` (None: not dumped, or its dump was cut short)."""
    path = os.path.join(iteration_dir(root, iteration), DONE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def dumped_iterations(root: str) -> List[int]:
    """The complete iterations of a dump."""
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("iteration_") and name[10:].isdigit() and iteration_record(root, int(name[10:])):
            out.append(int(name[10:]))
    return out


class ReplayRollouts(CarriesNothing):
    """The `replay` rollout strategy (`rollout_strategies`, --rollout-replay-dir): each `collect` of an iteration
    returns the dumping run's next generation batch of this DP rank, scored (`scoring.Scorer` keeps the scores),
    with the dumping run's strategy and score metrics. The sampler still draws the prompts (`PromptSource`), so a
    checkpoint of the replay has the dumping run's data position, and a single-batch dump's prompts are checked
    against them: a replay with another --seed / --data-path is refused by name."""

    name = "replay"
    flag = "--rollout-replay-dir"

    def __init__(self, root: str, settings, dumped: dict):
        self.root, self.dumped = root, dumped
        self.samples_per_prompt = settings.algorithm.n_samples_per_prompt
        self.dp_rank, _ = distributed.data_parallel_info()
        self.iteration: Optional[int] = None
        self.collected = 0  # generation batches of `iteration` returned so far

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling) -> "ReplayRollouts":
        root = settings.loop.rollout_replay_dir
        dumped = read_manifest(root)
        mine = dump_manifest(settings, dumped.get("strategy"))
        differ = [f"{key} {dumped.get(key)!r} there, {mine[key]!r} here" for key in MUST_MATCH
                  if dumped.get(key) != mine[key]]
        if differ:
            raise ArgumentError(f"--rollout-replay-dir {root} was dumped by another kind of run ({'; '.join(differ)}); "
                                "replay it with the dumping run's --stage, --n-samples-per-prompt, "
                                "--global-batch-size and data-parallel size")
        if distributed.is_rank_0():
            print(f"posttrain_gpt.py: --rollout-replay-dir {root}: training on the {dumped['stage']} rollouts dumped "
                  f"there (strategy {dumped['strategy']}, iterations {_ranges(dumped_iterations(root)) or 'none'}), "
                  "with their scores: nothing is generated or scored, so the sampling flags (but --temperature, "
                  "at which the losses take the log-probs) and the reward flags do not apply", flush=True)
            if dumped.get("temperature") != mine["temperature"]:
                print(f"posttrain_gpt.py: --temperature {mine['temperature']} differs from the dumping run's "
                      f"{dumped.get('temperature')}: the losses' log-probs, and so the updates, differ from its",
                      flush=True)
        return cls(root, settings, dumped)

    def collect(self, iteration: int, prompts) -> Tuple[Experience, Dict[str, float]]:
        if iteration != self.iteration:
            self.iteration, self.collected = iteration, 0
        record = iteration_record(self.root, iteration)
        if record is None or self.collected >= record["generation_batches"]:
            have = dumped_iterations(self.root)
            raise ArgumentError(
                f"--rollout-replay-dir {self.root} holds no rollout for iteration {iteration}"
                f"{f' (generation batch {self.collected})' if record else ''}: it has iterations "
                f"{_ranges(have) or 'none'}; replay them with --train-iters up to the last one (and --load the "
                "checkpoint the dumping run started from)")
        exp, metrics = load_batch(self.root, iteration, self.collected, self.dp_rank)
        self.collected += 1
        if self.dumped.get("strategy") in ("single_turn", "multi_turn"):  # its rows are the prompts drawn now
            drawn = [row["index"] for row in prompts.first_batch for _ in range(self.samples_per_prompt)]
            if exp.sample_data.indices is not None and list(exp.sample_data.indices) != drawn:
                raise ArgumentError(
                    f"--rollout-replay-dir {self.root} iteration {iteration}: the dump's prompts "
                    f"({_head(exp.sample_data.indices)}) are not the ones the sampler drew ({_head(drawn)}); replay "
                    f"with the dumping run's --seed {self.dumped.get('seed')} and --data-path "
                    f"{self.dumped.get('data_path')}, from the checkpoint it started from")
        return exp, metrics

    def prompts_drawn(self, iteration: int) -> int:
        """How many prompt batches the dumping run drew at `iteration` (--partial-rollout draws ahead)."""
        record = iteration_record(self.root, iteration)
        return record["prompts_drawn"] if record else 1


def _head(values, count: int = 6) -> str:
    values = list(values)
    return ", ".join(map(str, values[:count])) + (" ..." if len(values) > count else "")


def _ranges(values: List[int]) -> str:
    if not values:
        return ""
    return f"{values[0]} .. {values[-1]}" if values == list(range(values[0], values[-1] + 1)) else _head(values, 10)
