"""What a run keeps of each iteration's scored rollouts besides training on them: the sample table (--log-samples,
`metrics/samples.py`) and the dump (--rollout-dump-dir, `dump.py`). A stage hands each scored generation
batch to `add` as soon as it is scored and calls `finish` at the end of its iteration (`rl/stages/base.py`).

`finish` also draws the prompt batches the schedule says the iteration drew beyond those it asked for
(`Schedule.prompts_drawn`: under --rollout-replay-dir those the dumping run drew, --partial-rollout drawing ahead), so
the sampler's position, and every later iteration's prompts, are the dumping run's."""

from __future__ import annotations

from typing import Dict, List, Optional

from mindspeed_llm import distributed
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.metrics.samples import first_rows, rollout_rows
from mindspeed_llm.rl.rollouts.dump import RolloutDumper, dump_manifest
from mindspeed_llm.rl.rollouts.dump_checks import prompts_digest


class RolloutRecords:
    def __init__(self, tokenizer, log_samples: int = 0, log_samples_interval: int = 1,
                 dumper: Optional[RolloutDumper] = None, schedule=None):
        self.tokenizer = tokenizer
        self.log_samples, self.log_samples_interval = log_samples, log_samples_interval
        self.dumper, self.schedule = dumper, schedule  # the schedule: how many prompt batches an iteration draws
        self.batches: List[Experience] = []

    @classmethod
    def from_settings(cls, settings, tokenizer, rollouts) -> "RolloutRecords":
        """The run's records (`settings.loop`'s --log-samples, --rollout-dump-dir) of the stage's schedule `rollouts`
        (`base.Schedule`) and its generator."""
        loop = settings.loop
        generator = getattr(rollouts, "generator", None)
        dumper = None
        if loop.rollout_dump_dir:
            manifest = dump_manifest(settings, rollouts.name, tokenizer, getattr(generator, "name", None))
            dumper = RolloutDumper(loop.rollout_dump_dir, manifest, getattr(generator, "actor_module", None))
        return cls(tokenizer, loop.log_samples, loop.log_samples_interval or 1, dumper, rollouts)

    def add(self, exp: Experience, metrics: Dict[str, float]) -> None:
        """A scored generation batch of the iteration (the schedule's and the scorer's metrics)."""
        if self.log_samples:
            self.batches.append(exp)
        if self.dumper is not None:
            self.dumper.add(exp, metrics)

    def samples_due(self, iteration: int) -> bool:
        return bool(self.log_samples) and iteration % self.log_samples_interval == 0

    def finish(self, iteration: int, prompts) -> List[dict]:
        """Ends the iteration: its dump written, the schedule's prompt draws completed, and, when a sample table is
        due, its rows (the first --log-samples of the global batch, on rank 0; [] elsewhere and when not due).
        Called on every rank (it gathers over the data-parallel ranks)."""
        drawn = self.schedule.prompts_drawn(iteration) if self.schedule is not None else None
        while drawn is not None and prompts.drawn < drawn:  # a replay draws what the dumping run drew
            prompts.more(prompts.drawn)
        if self.dumper is not None:
            self.dumper.finish(iteration, prompts.drawn, prompts_digest(prompts.first_batch))
        rows: List[dict] = []
        if self.samples_due(iteration):
            dp_rank, _ = distributed.data_parallel_info()
            local: List[dict] = []
            first = dp_rank * self.batches[0].batch_size if self.batches else 0
            for exp in self.batches:  # the generation batches in order (--dynamic-sampling's refills after the first)
                if len(local) >= self.log_samples:
                    break
                local += rollout_rows(exp, self.tokenizer, self.log_samples - len(local), first + len(local))
            parts = distributed.gather_over_data_parallel(local)
            rows = first_rows(parts, self.log_samples) if distributed.is_rank_0() else []
        self.batches = []
        return rows
