"""The one place a response's score is made: rule verifiers, the reward model, and penalties (TRL's missing-EOS
penalty, DAPO's overlong penalty), mixed by their weights, with their metrics."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl import core_algos, verifiers
from mindspeed_llm.rl.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.passes import reward_scores
from mindspeed_llm.rl.roles import on_device
from mindspeed_llm.rl.settings import RewardMixing


class Scorer:
    """Sequence scores: rule verifiers and/or a reward model (weighted sum), less TRL's `missing_eos_penalty`
    for responses that did not end in EOS, plus DAPO's overlong penalty (`core_algos.overlong_penalty`, with
    `--overlong-buffer-len`); with their metrics."""

    @classmethod
    def from_settings(cls, reward: RewardMixing, reward_model=None, offload: bool = False) -> "Scorer":
        """The run's scorer: `reward`'s mixing, with `reward_model` (None: verifiers only) in host memory between
        uses when `offload` (--offload-ref-reward)."""
        return cls(reward.verifier_function, reward.verifier_weight, reward_model, reward.reward_model_weight,
                   offload, reward.missing_eos_penalty, overlong_buffer_len=reward.overlong_buffer_len,
                   overlong_penalty_factor=reward.overlong_penalty_factor, max_new_tokens=reward.max_new_tokens)

    def __init__(self, verifier_names: Sequence[str], verifier_weights: Sequence[float],
                 reward_model=None, reward_model_weight: float = 1.0, offload: bool = False,
                 missing_eos_penalty: Optional[float] = None, *, overlong_buffer_len: Optional[int] = None,
                 overlong_penalty_factor: float = 1.0, max_new_tokens: Optional[int] = None):
        try:
            verifiers.check_verifiers(verifier_names, verifier_weights)
        except ValueError as exc:  # the message lists the valid names
            raise ArgumentError(f"--verifier-function: {exc}") from exc
        self.verifier_names = list(verifier_names)
        self.verifier_weights = list(verifier_weights)
        self.reward_model = reward_model
        self.reward_model_weight = reward_model_weight
        self.offload = offload
        self.missing_eos_penalty = missing_eos_penalty
        if overlong_buffer_len is not None and max_new_tokens is None:
            raise ValueError("the overlong penalty needs max_new_tokens (its response length limit)")
        self.overlong = (overlong_buffer_len, overlong_penalty_factor, max_new_tokens)

    def __call__(self, exp: Experience, plan: MicroBatchPlan, timers) -> tuple:
        on = exp.tokens.device
        total = torch.zeros(exp.batch_size, device=on)
        metrics: Dict[str, float] = {}
        if self.reward_model is not None:
            with timers("reward_model"), on_device(self.reward_model, self.offload, timers) as reward_model:
                rm = reward_scores([reward_model], exp, plan)
            total += self.reward_model_weight * rm
            metrics["reward_model/mean"] = float(rm.mean())
        if self.verifier_names:
            with timers("rule_reward"):
                try:
                    per_verifier, failures = verifiers.score_batch(exp.sample_data.texts, exp.sample_data.labels,
                                                                   self.verifier_names)
                except verifiers.MissingLabelError as exc:
                    index = exp.sample_data.indices[exc.row_index]
                    raise ArgumentError(
                        f"prompt {index} of the dataset has no label, but --verifier-function {exc.verifier} needs "
                        "one; preprocess with a labels column (--map-keys '{\"labels\": \"answer\"}', "
                        "R1AlpacaStyleInstructionHandler)"
                    ) from exc
            for name, weight in zip(self.verifier_names, self.verifier_weights):
                total += weight * torch.as_tensor(per_verifier[name], dtype=torch.float32, device=on)
            metrics.update(verifiers.reward_metrics(per_verifier, failures))
        if self.missing_eos_penalty is not None:
            total = total - self.missing_eos_penalty * (~exp.ended_with_eos).float()
        buffer_len, factor, max_new_tokens = self.overlong
        if buffer_len is not None:
            penalty = core_algos.overlong_penalty(exp.response_lengths, max_new_tokens, buffer_len, factor)
            total = total + penalty.to(total.device)
            metrics["overlong/penalty_mean"] = float(penalty.mean())
            metrics["overlong/penalised_fraction"] = float(
                (exp.response_lengths > max_new_tokens - buffer_len).float().mean())
        return total, metrics
