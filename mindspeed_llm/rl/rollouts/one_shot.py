"""The `one_shot` schedule (`base.Schedule`), the default: an iteration's samples are one call of the run's generator
over the sampler's batch of the iteration (`--n-samples-per-prompt` samples a prompt), the CP ranks' rollouts gathered
(`plain.gather_context_parallel`). Nothing carries over between iterations."""

from __future__ import annotations

import time
from typing import Dict, Tuple

from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.rollouts.base import CarriesNothing, expand
from mindspeed_llm.rl.rollouts.plain import gather_context_parallel


class OneShot(CarriesNothing):
    name = "one_shot"
    flag = None  # the default

    def __init__(self, generator):
        self.generator = generator

    @classmethod
    def from_settings(cls, settings, generator) -> "OneShot":
        return cls(generator)

    def collect(self, iteration: int, prompts) -> Tuple[Experience, Dict[str, float]]:
        generator = self.generator
        samples, sample_ids = expand(prompts.first_batch, generator.samples_per_prompt)
        start = time.perf_counter()
        result = generator.generate(iteration, samples, sample_ids)
        seconds = time.perf_counter() - start
        exp = generator.experience(result, samples)
        metrics = generator.metrics(exp, [result.stats], seconds)
        return gather_context_parallel(exp), metrics  # the CP ranks' rollouts: this DP rank's share, on each of them


__all__ = ["OneShot"]
