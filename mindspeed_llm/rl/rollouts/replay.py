"""The `replay` schedule (`base.Schedule`, --rollout-replay-dir): trains on the scored rollouts a --rollout-dump-dir
run wrote (`dump.py`, the format) instead of generating and scoring them, the same updates bit for bit. Its batches
arrive scored (`scored`), so the stage does not score them; it `replaces_generation`, so a --partial-rollout of the
dumping run's command line does not apply; the run's generator serves held-out evaluation only."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mindspeed_llm import distributed
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.rollouts import dump_checks as checks
from mindspeed_llm.rl.rollouts.base import CarriesNothing
from mindspeed_llm.rl.rollouts.dump import (MUST_MATCH, dump_manifest, dumped_iterations, iteration_record,
                                            read_batch, read_manifest)

# the schedules whose rows are the prompts the sampler draws at the iteration (older dumps name them otherwise)
ONE_CALL = ("one_shot", "single_turn", "multi_turn")


class ReplayRollouts(CarriesNothing):
    """The `replay` schedule (module docstring): each `collect` of an iteration returns the dumping run's next
    generation batch of this DP rank, scored, with the dumping run's rollout and score metrics. The sampler still draws the prompts (`PromptSource`), so a
    checkpoint of the replay has the dumping run's data position, and a single-batch dump's prompts are checked
    against them: a replay with another --seed / --data-path is refused by name. So are another tokenizer, another
    dataset (its size, the drawn prompts' hash) and another model (its weights' fingerprint at the first replayed
    iteration), and a damaged batch (`rollout_dump_checks`)."""

    name = "replay"
    flag = "--rollout-replay-dir"
    replaces_generation = True  # a replay generates nothing: another schedule's flag does not apply
    scored = True  # its batches carry the dumping run's scores

    def __init__(self, root: str, settings, dumped: dict, actor_module=None, generator=None):
        self.root, self.dumped, self.actor_module, self.generator = root, dumped, actor_module, generator
        spec = getattr(actor_module, "model_spec", None)
        self.vocab_size: Optional[int] = getattr(spec, "vocab_size", None)  # token ids past it: a damaged dump
        self.weights_checked = actor_module is None  # the first iteration replayed checks the model
        self.samples_per_prompt = settings.algorithm.n_samples_per_prompt
        self.dp_rank, _ = distributed.data_parallel_info()
        self.iteration: Optional[int] = None
        self.collected = 0  # generation batches of `iteration` returned so far

    @classmethod
    def selected(cls, settings) -> bool:
        return bool(settings.loop.rollout_replay_dir)

    @classmethod
    def from_settings(cls, settings, generator) -> "ReplayRollouts":
        actor_module = getattr(generator, "actor_module", None)
        tokenizer = getattr(generator, "tokenizer", None)
        root = settings.loop.rollout_replay_dir
        dumped = read_manifest(root)
        mine = dump_manifest(settings, dumped.get("strategy"), tokenizer)
        differ = [f"{key} {dumped.get(key)!r} there, {mine[key]!r} here" for key in MUST_MATCH
                  if dumped.get(key) != mine[key]]
        if differ:
            raise ArgumentError(f"--rollout-replay-dir {root} was dumped by another kind of run ({'; '.join(differ)}); "
                                "replay it with the dumping run's --stage, --n-samples-per-prompt, "
                                "--global-batch-size and data-parallel size")
        _check_identity(root, dumped, mine)
        if distributed.is_rank_0():
            print(f"posttrain_gpt.py: --rollout-replay-dir {root}: training on the {dumped['stage']} rollouts dumped "
                  f"there (strategy {dumped['strategy']}, iterations {_ranges(dumped_iterations(root)) or 'none'}), "
                  "with their scores: nothing is generated or scored, so the sampling flags (but --temperature, "
                  "at which the losses take the log-probs) and the reward flags do not apply", flush=True)
            machine = [f"{key} {dumped['machine'].get(key)!r} there, {value!r} here"
                       for key, value in mine["machine"].items() if dumped.get("machine", {}).get(key) != value]
            if dumped.get("machine") and machine:
                print(f"posttrain_gpt.py: --rollout-replay-dir {root} was dumped on another machine or build "
                      f"({'; '.join(machine)}): the replay trains on the same rollouts, but its updates are bit for "
                      "bit the dumping run's only on the same torch build, device, processor kind and threads",
                      flush=True)
            if dumped.get("temperature") != mine["temperature"]:
                print(f"posttrain_gpt.py: --temperature {mine['temperature']} differs from the dumping run's "
                      f"{dumped.get('temperature')}: the losses' log-probs, and so the updates, differ from its",
                      flush=True)
        return cls(root, settings, dumped, actor_module, generator)

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
        exp, metrics, batch = read_batch(self.root, iteration, self.collected, self.dp_rank, self.vocab_size)
        if not self.weights_checked:
            self._check_weights(iteration, record)
        self.collected += 1
        if self.dumped.get("strategy") in ONE_CALL:  # its rows are the prompts drawn now
            drawn = [row["index"] for row in prompts.first_batch for _ in range(self.samples_per_prompt)]
            if exp.sample_data.indices is not None and list(exp.sample_data.indices) != drawn:
                raise ArgumentError(
                    f"--rollout-replay-dir {self.root} iteration {iteration}: the dump's prompts "
                    f"({_head(exp.sample_data.indices)}) are not the ones the sampler drew ({_head(drawn)}); replay "
                    f"with the dumping run's --seed {self.dumped.get('seed')} and --data-path "
                    f"{self.dumped.get('data_path')}, from the checkpoint it started from")
        dumped_prompts = batch.get("prompts_sha256")
        if self.collected == 1 and dumped_prompts is not None and \
                dumped_prompts != checks.prompts_digest(prompts.first_batch):
            raise ArgumentError(
                f"--rollout-replay-dir {self.root} iteration {iteration}: the prompts the sampler drew here (dataset "
                f"rows {_head(row['index'] for row in prompts.first_batch)}) hold other tokens than those the dump "
                f"was made from: --data-path is another dataset than the dumping run's "
                f"{self.dumped.get('data_path')}; replay on that dataset")
        return exp, metrics

    def _check_weights(self, iteration: int, record: dict) -> None:
        """The actor's weights are those that made the first replayed iteration's rollouts (where the dump recorded
        them at this run's layout): another model, or another starting checkpoint, is refused by name."""
        self.weights_checked = True
        dumped, model = record.get("actor_weights"), self.dumped.get("model") or {}
        if dumped is None or model.get("layout") != checks.layout():
            return
        mine = checks.weights_fingerprint(self.actor_module)  # a collective: every rank collects
        differ = distributed.broadcast_object(not checks.same_weights(dumped, mine))  # rank 0's verdict for all
        if differ:
            raise ArgumentError(
                f"--rollout-replay-dir {self.root} iteration {iteration}: the actor here is not the model whose "
                f"weights made the dumped rollouts (the dumping run had --ref-model {model.get('ref_model')}, --load "
                f"{model.get('load')}; weights' sums {dumped[1]:.9g} there, {mine[1]:.9g} here); replay from the "
                f"checkpoint the dumping run had at iteration {iteration - 1} (its --ref-model, or --load)")

    def prompts_drawn(self, iteration: int) -> Optional[int]:
        """How many prompt batches the dumping run drew at `iteration` (--partial-rollout draws ahead): the
        records draw the rest at the iteration's end, so the sampler's position is the dumping run's."""
        record = iteration_record(self.root, iteration)
        return record["prompts_drawn"] if record else 1


def _check_identity(root: str, dumped: dict, mine: dict) -> None:
    """The replay's tokenizer and dataset size are the dumping run's (a version 1 dump recorded neither: said)."""
    if dumped.get("version", 1) < 2:
        if distributed.is_rank_0():
            print(f"posttrain_gpt.py: --rollout-replay-dir {root} is a version 1 dump: it records neither the model, "
                  "the tokenizer nor the dataset it came from, so they are not checked", flush=True)
        return
    there, here = dumped.get("tokenizer"), mine.get("tokenizer")
    if there and here and there != here:
        raise ArgumentError(f"--rollout-replay-dir {root} was dumped with another tokenizer (vocabulary of "
                            f"{there['vocab_size']}, hash {there['sha256']} there; {here['vocab_size']}, hash "
                            f"{here['sha256']} here); replay with the dumping run's --tokenizer-name-or-path (its "
                            f"--ref-model {(dumped.get('model') or {}).get('ref_model')})")
    if dumped.get("data_size") is not None and mine.get("data_size") is not None and \
            dumped["data_size"] != mine["data_size"]:
        raise ArgumentError(f"--rollout-replay-dir {root} was dumped from {dumped['data_size']} prompts (--data-path "
                            f"{dumped.get('data_path')}); --data-path {mine.get('data_path')} holds "
                            f"{mine['data_size']}: replay on the dumping run's dataset")


def _head(values, count: int = 6) -> str:
    values = list(values)
    return ", ".join(map(str, values[:count])) + (" ..." if len(values) > count else "")


def _ranges(values: List[int]) -> str:
    if not values:
        return ""
    return f"{values[0]} .. {values[-1]}" if values == list(range(values[0], values[-1] + 1)) else _head(values, 10)
