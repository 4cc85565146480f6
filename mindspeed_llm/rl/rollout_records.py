"""What a run keeps of each iteration's scored rollouts besides training on them: the sample table (--log-samples,
`metrics/samples.py`) and the dump (--rollout-dump-dir, `rollout_dump.py`). A stage hands each scored generation
batch to `add` as soon as it is scored and calls `finish` at the end of its iteration (`rl/stages/base.py`).

Under --rollout-replay-dir `finish` also draws the prompt batches the dumping run drew beyond those the replay asked
for (--partial-rollout draws ahead), so the sampler's position, and every later iteration's prompts, are the dumping
run's."""

from __future__ import annotations

from typing import Dict, List, Optional

from mindspeed_llm import distributed
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.metrics.samples import first_rows, rollout_rows
from mindspeed_llm.rl.rollout_dump import ReplayRollouts, RolloutDumper, dump_manifest
from mindspeed_llm.rl.rollout_dump_checks import prompts_digest


class RolloutRecords:
    def __init__(self, tokenizer, log_samples: int = 0, log_samples_interval: int = 1,
                 dumper: Optional[RolloutDumper] = None, replay: Optional[ReplayRollouts] = None):
        self.tokenizer = tokenizer
        self.log_samples, self.log_samples_interval = log_samples, log_samples_interval
        self.dumper, self.replay = dumper, replay
        self.batches: List[Experience] = []

    @classmethod
    def from_settings(cls, settings, tokenizer, rollouts) -> "RolloutRecords":
        """The run's records (`settings.loop`'s --log-samples, --rollout-dump-dir) of the stage's rollout strategy
        `rollouts`."""
        loop = settings.loop
        dumper = RolloutDumper(loop.rollout_dump_dir, dump_manifest(settings, rollouts.name, tokenizer),
                               getattr(rollouts, "actor_module", None)) if loop.rollout_dump_dir else None
        return cls(tokenizer, loop.log_samples, loop.log_samples_interval or 1, dumper,
                   rollouts if isinstance(rollouts, ReplayRollouts) else None)

    def add(self, exp: Experience, metrics: Dict[str, float]) -> None:
        """A scored generation batch of the iteration (the rollout strategy's and the scorer's metrics)."""
        if self.log_samples:
            self.batches.append(exp)
        if self.dumper is not None:
            self.dumper.add(exp, metrics)

    def samples_due(self, iteration: int) -> bool:
        return bool(self.log_samples) and iteration % self.log_samples_interval == 0

    def finish(self, iteration: int, prompts) -> List[dict]:
        """Ends the iteration: its dump written, the replay's prompt draws completed, and, when a sample table is
        due, its rows (the first --log-samples of the global batch, on rank 0; [] elsewhere and when not due).
        Called on every rank (it gathers over the data-parallel ranks)."""
        if self.replay is not None:
            while prompts.drawn < self.replay.prompts_drawn(iteration):
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
