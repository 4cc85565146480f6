"""The one place a response's score is made: rule verifiers, a user's reward function (`--custom-reward-function`),
the tools' own rewards of a multi-turn trajectory, the reward model, an LLM judge (`judge.py`, --judge-load), and
penalties (TRL's missing-EOS penalty, DAPO's overlong penalty), mixed by their weights, with their metrics. The
verifiers and the reward function get what their signatures ask for (`verifiers/calling.py`): the response text and
label, the sample's dataset row (`rows`) and its trajectory (`SampleData.trajectories`, `verifiers/trajectory.py`)."""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence

import torch

from mindspeed_llm.errors import ArgumentError, UserError
from mindspeed_llm.rl import core_algos, reward_functions, verifiers
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.update.passes import reward_scores
from mindspeed_llm.rl.update.roles import on_device
from mindspeed_llm.rl.settings import RewardMixing

logger = logging.getLogger(__name__)


def sample_rows(sample_data: SampleData) -> List[dict]:
    """Each sample's dataset row as the verifiers see it: every column (`SampleData.columns`), ``labels`` and
    ``index``."""
    n = len(sample_data.texts or [])
    labels = sample_data.labels or [None] * n
    indices = sample_data.indices or [None] * n
    out = []
    for i in range(n):
        row = {key: values[i] for key, values in sample_data.columns.items()}
        row.update(labels=labels[i], index=indices[i])
        out.append(row)
    return out


def tool_rewards(trajectories: Sequence[Optional[dict]]) -> List[float]:
    """Each trajectory's ``tool_reward`` (0 for a single-turn sample, or where it is missing or not a finite
    number: logged)."""
    out = []
    for i, trajectory in enumerate(trajectories):
        value = 0.0 if trajectory is None else trajectory.get("tool_reward", 0.0)
        try:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(value)
        except (TypeError, ValueError):
            logger.warning("row %d: the tools' reward %r is not a finite number; counted as 0", i, value)
            value = 0.0
        out.append(value)
    return out


class RewardFailureError(UserError):
    """A verifier or reward function failed on every row it scored at once: a run would otherwise train on zero
    rewards (and end well); partial failures score 0 and are counted (``<name>_rewards/failures``)."""


def check_not_all_failed(scores, rows: int, flags: Dict[str, str]) -> None:
    """`RewardFailureError` naming the scorer (`flags`: its flag by name), the first error and the fix when one of
    `scores` (`verifiers.BatchScores`) failed on every one of `rows` (> 0) rows."""
    for name, failed in scores.failures.items():
        if rows and failed == rows:
            raise RewardFailureError(
                f"{flags.get(name, f'--verifier-function {name}')} failed on every one of the {rows} rows it "
                f"scored (the first: {scores.first_failure.get(name, 'no error recorded')}); every reward would be 0 "
                "and the run would learn nothing: fix the function (it must return a number or a mapping with a "
                "'score' for a response), or the data it reads (labels, columns)")


class Scorer:
    """Sequence scores: rule verifiers, a user's reward function and/or a reward model (weighted sum), plus the
    tools' own rewards of multi-turn trajectories (weight 1; only recorded with --tool-rewards record), less TRL's
    `missing_eos_penalty` for responses that did not end in EOS, plus DAPO's overlong penalty
    (`core_algos.overlong_penalty`, with `--overlong-buffer-len`); with their metrics."""

    @classmethod
    def from_settings(cls, reward: RewardMixing, reward_model=None, offload: bool = False, judge=None) -> "Scorer":
        """The run's scorer: `reward`'s mixing, with `reward_model` (None: verifiers only) in host memory between
        uses when `offload` (--offload-ref-reward), and `judge` (`judge.Judge`, None: no judge)."""
        return cls(reward.verifier_function, reward.verifier_weight, reward_model, reward.reward_model_weight,
                   offload, reward.missing_eos_penalty, overlong_buffer_len=reward.overlong_buffer_len,
                   overlong_penalty_factor=reward.overlong_penalty_factor, max_new_tokens=reward.max_new_tokens,
                   custom_reward_function=reward.custom_reward_function,
                   custom_reward_weight=1.0 if reward.custom_reward_weight is None else reward.custom_reward_weight,
                   tool_rewards=reward.tool_rewards or "add", judge=judge)

    def __init__(self, verifier_names: Sequence[str], verifier_weights: Sequence[float],
                 reward_model=None, reward_model_weight: float = 1.0, offload: bool = False,
                 missing_eos_penalty: Optional[float] = None, *, overlong_buffer_len: Optional[int] = None,
                 overlong_penalty_factor: float = 1.0, max_new_tokens: Optional[int] = None,
                 custom_reward_function=None, custom_reward_weight: float = 1.0, tool_rewards: str = "add",
                 judge=None):
        """`custom_reward_function`: ``PATH[:NAME]`` (loaded with `reward_functions.load_reward_function`), a
        `verifiers.RewardFunction`, or None; scored as the verifier ``custom`` with `custom_reward_weight`.
        `tool_rewards` (--tool-rewards): ``add`` the tools' rewards of a trajectory to its score (score part
        ``tool``), or ``record`` them only (verl's way; score part ``tool_recorded``, not in the score). `judge`: a
        `judge.Judge` whose score enters with its own weight (score parts ``judge`` and ``judge_verdict``, the
        verdict's text), or None."""
        if tool_rewards not in ("add", "record"):
            raise ValueError(f"tool_rewards {tool_rewards!r}: use add or record (--tool-rewards)")
        self.tool_rewards = tool_rewards
        try:
            verifiers.check_verifiers(verifier_names, verifier_weights)
        except ValueError as exc:  # the message lists the valid names
            raise ArgumentError(f"--verifier-function: {exc}") from exc
        self.verifier_names = list(verifier_names)
        self.verifier_weights = list(verifier_weights)
        self.functions: Dict[str, verifiers.RewardFunction] = {}
        self.function_weights: Dict[str, float] = {}
        self.flags: Dict[str, str] = {}  # each function's flag, for the errors (a verifier's: --verifier-function)
        if custom_reward_function is not None:
            spec = custom_reward_function if isinstance(custom_reward_function, str) else None
            if isinstance(custom_reward_function, str):
                custom_reward_function = reward_functions.load_reward_function(custom_reward_function)
            if reward_functions.CUSTOM in self.verifier_names:
                raise ArgumentError(f"--verifier-function {reward_functions.CUSTOM} and --custom-reward-function "
                                    f"would both score under the name '{reward_functions.CUSTOM}'")
            self.functions[reward_functions.CUSTOM] = custom_reward_function
            self.flags[reward_functions.CUSTOM] = f"{reward_functions.FLAG} {spec}" if spec else reward_functions.FLAG
            self.function_weights[reward_functions.CUSTOM] = float(custom_reward_weight)
        self.judge = judge
        self.reward_model = reward_model
        self.reward_model_weight = reward_model_weight
        self.offload = offload
        self.missing_eos_penalty = missing_eos_penalty
        if overlong_buffer_len is not None and max_new_tokens is None:
            raise ValueError("the overlong penalty needs max_new_tokens (its response length limit)")
        self.overlong = (overlong_buffer_len, overlong_penalty_factor, max_new_tokens)

    def __call__(self, exp: Experience, plan: MicroBatchPlan, timers) -> tuple:
        """(the scores [B], their metrics); each row's parts go to `exp.sample_data.score_parts`. (A schedule whose
        batches arrive scored, a replay, says so: `Schedule.scored`, and the stage does not call the scorer.)"""
        on = exp.tokens.device
        total = torch.zeros(exp.batch_size, device=on)
        metrics: Dict[str, float] = {}
        parts: List[dict] = [{} for _ in range(exp.batch_size)]
        if self.reward_model is not None:
            with timers("reward_model"), on_device(self.reward_model, self.offload, timers) as reward_model:
                rm = reward_scores([reward_model], exp, plan)
            total += self.reward_model_weight * rm
            metrics["reward_model/mean"] = float(rm.mean())
            for part, value in zip(parts, rm.tolist()):
                part["reward_model"] = value
        data = exp.sample_data
        if self.judge is not None:
            with timers("judge"):
                verdicts = self.judge(exp, timers)
            total += self.judge.weight * torch.as_tensor(verdicts.scores, dtype=torch.float32, device=on)
            for part, score, text in zip(parts, verdicts.scores, verdicts.texts):
                part.update(judge=float(score), judge_verdict=text)
            metrics.update(verdicts.metrics)
        if self.verifier_names or self.functions:
            with timers("rule_reward"):
                try:
                    scores = verifiers.score_rows(data.texts, data.labels, self.verifier_names, rows=sample_rows(data),
                                                  trajectories=data.trajectories, functions=self.functions)
                except verifiers.MissingLabelError as exc:
                    index = data.indices[exc.row_index]
                    raise ArgumentError(
                        f"prompt {index} of the dataset has no label, but --verifier-function {exc.verifier} needs "
                        "one; preprocess with a labels column (--map-keys '{\"labels\": \"answer\"}', "
                        "R1AlpacaStyleInstructionHandler)"
                    ) from exc
            check_not_all_failed(scores, len(data.texts or []), self.flags)
            weights = {**dict(zip(self.verifier_names, self.verifier_weights)), **self.function_weights}
            for name, weight in weights.items():
                total += weight * torch.as_tensor(scores.per_verifier[name], dtype=torch.float32, device=on)
                for part, value in zip(parts, scores.per_verifier[name]):
                    part[name] = float(value)
            metrics.update(scores.metrics())
        if data.trajectories is not None:
            tool = torch.as_tensor(tool_rewards(data.trajectories), dtype=torch.float32, device=on)
            if self.tool_rewards == "add":
                total += tool
            for part, value in zip(parts, tool.tolist()):
                part["tool" if self.tool_rewards == "add" else "tool_recorded"] = value
            metrics["tool/reward/mean"] = float(tool.mean()) if len(tool) else 0.0
        if self.missing_eos_penalty is not None:
            penalty = -self.missing_eos_penalty * (~exp.ended_with_eos).float()
            total = total + penalty.to(total.device)
            for part, value in zip(parts, penalty.tolist()):
                part["missing_eos_penalty"] = value
        buffer_len, factor, max_new_tokens = self.overlong
        if buffer_len is not None:
            penalty = core_algos.overlong_penalty(exp.response_lengths, max_new_tokens, buffer_len, factor)
            total = total + penalty.to(total.device)
            for part, value in zip(parts, penalty.tolist()):
                part["overlong_penalty"] = value
            metrics["overlong/penalty_mean"] = float(penalty.mean())
            metrics["overlong/penalised_fraction"] = float(
                (exp.response_lengths > max_new_tokens - buffer_len).float().mean())
        data.score_parts = parts
        return total, metrics
