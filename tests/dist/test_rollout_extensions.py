"""A new sample generator and a new schedule are one class and one registration each (`rl/rollouts/base.py`,
docs/extending.md): both registered from this file, in the process that runs the stages, and one iteration of each
stage (grpo, trl_ppo) on the tiny models trains on what they made.

* `CannedAnswers`, a generator: every sample's response is the same few tokens (`CANNED`) and EOS, made without
  the model (a `Rollout` built by hand), with a metric of its own.
* `Halves`, a schedule: the iteration's prompts in two generator calls, half each, joined; a metric of its own.

The runs check what only these two classes can have made: the trained responses' length, both classes' metrics in
the run's metrics row, and the sample table's responses (the canned text)."""

import json

import pytest
import torch

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_assets import posttrain_argv

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

CANNED = "7 7 7"  # the canned response (before its EOS)


def _classes():
    """The toy generator and schedule (defined inside: the ranks unpickle the body by reference to this module)."""
    from mindspeed_llm.inference import Rollout
    from mindspeed_llm.rl.experience import Experience
    from mindspeed_llm.rl.rollouts.base import CarriesNothing, expand
    from mindspeed_llm.rl.rollouts.plain import PlainGenerator, gather_context_parallel

    class CannedAnswers(PlainGenerator):
        name, flag = "canned_answers", "--canned-answers"

        @classmethod
        def selected(cls, settings):
            return True  # registered in this process only

        def generate(self, iteration, samples, sample_ids, continuations=None, budgets=None, sampling=None):
            answer = self.tokenizer.encode(CANNED, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            prompts = [list(row["input_ids"]) for row in samples]
            B, P, R = len(prompts), max(map(len, prompts)), len(answer)
            pad = self.sampling.pad_id
            tokens = torch.full((B, P), pad, dtype=torch.long)
            for b, prompt in enumerate(prompts):
                tokens[b, :len(prompt)] = torch.tensor(prompt)
            return Rollout(prompts=tokens, prompt_lengths=torch.tensor(list(map(len, prompts))),
                           responses=torch.tensor([answer] * B), response_mask=torch.ones(B, R, dtype=torch.long),
                           response_lengths=torch.full((B,), R), ended_with_eos=torch.ones(B, dtype=torch.bool),
                           finish_reasons=["eos"] * B, log_probs=None, pad_token_id=pad)

        def metrics(self, exp, stats, seconds):
            return {"canned/calls": float(len(stats))}

    class Halves(CarriesNothing):
        name, flag = "halves", "--halves"

        def __init__(self, generator):
            self.generator = generator

        @classmethod
        def selected(cls, settings):
            return True

        @classmethod
        def from_settings(cls, settings, generator):
            return cls(generator)

        def collect(self, iteration, prompts):
            rows, parts, stats = prompts.first_batch, [], []
            for half in (rows[:len(rows) // 2], rows[len(rows) // 2:]):
                samples, sample_ids = expand(half, self.generator.samples_per_prompt)
                result = self.generator.generate(iteration, samples, sample_ids)
                parts.append(self.generator.experience(result, samples))
                stats.append(result.stats)
            exp = Experience.concat(parts, parts[0].tokens.device)
            metrics = {"halves/parts": float(len(parts)), **self.generator.metrics(exp, stats, 0.0)}
            return gather_context_parallel(exp), metrics

    return CannedAnswers, Halves


def _run_with_toys(rank, world_size, argv):
    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.rollouts.base import SAMPLE_GENERATORS, SCHEDULES

    generator, schedule = _classes()
    SAMPLE_GENERATORS[generator.name] = generator  # the one registration of each
    SCHEDULES[schedule.name] = schedule
    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer.run(parse_args(argv, world_size))
    finally:
        del SAMPLE_GENERATORS[generator.name], SCHEDULES[schedule.name]


@pytest.mark.parametrize("stage", ["grpo", "trl_ppo"])
def test_a_toy_generator_under_a_toy_schedule_trains_in_both_stages(stage_paths, tmp_path, stage):
    from transformers import AutoTokenizer

    out = tmp_path / stage
    argv = posttrain_argv(stage_paths, stage, iters=1, extra=[
        "--metrics-jsonl", str(out / "metrics.jsonl"), "--log-samples", "2"])
    run_distributed(_run_with_toys, 1, argv)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    answer = AutoTokenizer.from_pretrained(stage_paths["tokenizer"]).encode(CANNED, add_special_tokens=False)
    assert row["halves/parts"] == 2.0 and row["canned/calls"] == 2.0
    assert row["response_length/mean"] == row["response_length/max"] == len(answer) + 1  # and its EOS
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["response"].strip().startswith(CANNED) for s in samples), samples
