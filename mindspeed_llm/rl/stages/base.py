"""What both stages do alike, written once: the typed settings they are built from, the parts built after the models
(scorer, sampling config, the schedule over its sample generator, rollout records), held-out evaluation, and the iteration's frame. A
stage writes its models' building and `_train`, one iteration's training from generation to update; `iteration`
around it finishes the records and returns the typed `IterationResult` (`contract.py`).

The rollout records have one owner, the stage: each scored generation batch goes to `records.add` (`_score`), and
the iteration ends with `records.finish`, whose sample-table rows come back in the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from mindspeed_llm import distributed
from mindspeed_llm.rl.evaluation import evaluate_policy
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.judge import Judge
from mindspeed_llm.rl.metrics.pass_at_k import PromptResult
from mindspeed_llm.rl.rollouts.base import PromptSource, build_rollouts
from mindspeed_llm.rl.rollouts.plain import sampling_config
from mindspeed_llm.rl.rollouts.records import RolloutRecords
from mindspeed_llm.rl.scoring import Scorer
from mindspeed_llm.rl.settings import Settings
from mindspeed_llm.rl.stages.contract import IterationResult


@dataclass
class Trained:
    """What a stage's `_train` hands its frame: the iteration's metrics, the experience trained on (its lengths are
    the throughputs' tokens) and the actor's losses (`core_algos`' names; its entropy guards against divergence)."""

    metrics: Dict[str, float]
    exp: Experience
    actor_metrics: Dict[str, float]


class StageBase:
    name: str
    log_lines: Dict[str, List[str]]
    reference = None  # the frozen reference policy (a stage without one leaves it None)
    distill = None  # the teacher and its use (`rl/distillation.py`), with --teacher-load

    def __init__(self, settings: Settings, tokenizer):
        if not isinstance(settings, Settings):  # the Namespace stops in arguments/ (its `.settings` is this)
            raise TypeError(f"a stage is built from the run's typed settings (rl/settings.Settings), not a "
                            f"{type(settings).__name__}")
        self.settings = settings
        self.algorithm = settings.algorithm
        self.tokenizer = tokenizer

    def _build_rollout_side(self, reward_model) -> None:
        """The parts built once the models are: the scorer (with `reward_model`, None: verifiers only, and the
        --judge-load judge), the sampling config, the schedule over its sample generator on the actor, the records of
        its scored rollouts."""
        settings, tokenizer = self.settings, self.tokenizer
        self.scorer = Scorer.from_settings(settings.reward, reward_model, settings.offload.offload_ref_reward,
                                           judge=Judge.from_settings(settings, tokenizer))
        self.sampling = sampling_config(settings.sampling, tokenizer)
        self.rollouts = build_rollouts(settings, self.actor.module, tokenizer, self.sampling)
        self.records = RolloutRecords.from_settings(settings, tokenizer, self.rollouts)

    @property
    def reward_model(self):
        return self.scorer.reward_model

    @property
    def vocab_size(self) -> int:
        return self.actor.module.model_spec.vocab_size

    def evaluate(self, rows: Sequence[dict]) -> List[PromptResult]:
        return evaluate_policy(self.actor, self.reference, self.scorer, self.tokenizer, rows, self.settings.sampling,
                               self.rollouts.generator, self.settings.offload.offload_ref_reward, self.settings.loop)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, iteration: int, prompts: PromptSource) -> IterationResult:
        trained = self._train(iteration, prompts)
        samples = self.records.finish(iteration, prompts)  # --log-samples' rows, --rollout-dump-dir's files
        prompt_tokens, response_tokens = self._tokens(trained.exp)
        return IterationResult(trained.metrics, prompt_tokens, response_tokens, trained.actor_metrics.get("entropy"),
                               samples)

    def _train(self, iteration: int, prompts: PromptSource) -> Trained:
        raise NotImplementedError

    def _score(self, exp: Experience, plan, timers, schedule_metrics: Dict[str, float]) -> Dict[str, float]:
        """`exp.scores` from the scorer (unless the schedule's batches arrive scored: a replay's carry the dumping
        run's scores, and their metrics ride in the schedule's), and the scored batch to the records (with the
        schedule's and the scorer's metrics: --rollout-dump-dir keeps them); returns the scorer's metrics."""
        score_metrics = {}
        if not self.rollouts.scored:
            exp.scores, score_metrics = self.scorer(exp, plan, timers)
        self.records.add(exp, {**schedule_metrics, **score_metrics})  # --log-samples, --rollout-dump-dir
        return score_metrics

    def _tokens(self, exp: Experience):
        """(prompt, response) tokens of this DP rank's share of the global batch: the mean lengths of `exp`'s samples
        (`prompt_length/mean`, `response_length/mean`) times the DP rank's samples, as MindSpeed-RL counts them."""
        _, dp_size = distributed.data_parallel_info()
        prompts, n = self.settings.loop.global_batch_size // dp_size, self.algorithm.n_samples_per_prompt
        return _mean(exp.prompt_lengths) * prompts * n, _mean(exp.action_lengths) * prompts * n


def _mean(lengths) -> float:
    values = [float(v) for v in lengths.detach().double().reshape(-1).tolist()]
    return sum(values) / len(values) if values else 0.0
