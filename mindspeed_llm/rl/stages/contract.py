"""What the outer loop (`rl/trainer.py`) knows of a stage, typed: the `Stage` protocol and the `IterationResult` its
`iteration` returns. Imports nothing heavy: the stage registry (`rl/stages/__init__.py`) and the parser read it
without megatron-core."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from mindspeed_llm.rl.update.roles import RoleFactory
    from mindspeed_llm.rl.rollouts.base import PromptSource, Schedule
    from mindspeed_llm.rl.settings import Settings


@dataclass
class IterationResult:
    """One iteration of a stage on this rank."""

    # what is logged (this rank's view; the trainer adds throughputs and evaluation, then reduces over DP)
    metrics: Dict[str, float]
    # this DP rank's share of the global batch, in tokens: the samples' mean prompt / response (the model's own tokens)
    # length times the DP rank's samples (global batch / DP x --n-samples-per-prompt); with CP each CP rank's mean
    # stands for its DP rank's (the throughputs, `metrics.throughput_metrics`)
    prompt_tokens: float
    response_tokens: float
    # the actor's mean token entropy (--check-for-divergence); None on ranks without the losses (not the last pipeline
    # stage)
    entropy: Optional[float]
    # --log-samples' table rows of the iteration (rank 0, when due; [] elsewhere)
    samples: List[dict] = field(default_factory=list)


class Stage(Protocol):
    """A stage, as the trainer drives it. Built as `STAGES[name](settings, tokenizer, build)`: the run's typed settings
    (`rl/settings.Settings`, never the command line's Namespace: tests/unit/test_namespace_boundary.py), the tokenizer
    and the factory of its models (`rl/update/roles.RoleFactory`); it loads its models and checks them against each
    other and the tokenizer."""

    name: str
    log_lines: Dict[str, List[str]]  # stdout line groups (`MetricsLogger`)
    # how it generates its experience: a schedule over a sample generator (`rl/rollouts/base.Schedule`; its state is
    # saved with the loop state)
    rollouts: "Schedule"
    # the frozen models the run records (`checkpoint/run_record.py`; None: not loaded): the reference policy and the
    # reward model (with LoRA, views of the trained roles' bases, `rl/update/lora.py`), the teacher (--teacher-load)
    # and the judge (--judge-load)
    reference: Optional[object]
    reward_model: Optional[object]
    teacher: Optional[object]
    judge: Optional[object]
    # the size of the vocabulary the actor's log-probs normalise over (--check-for-divergence's uniform entropy)
    vocab_size: int

    def __init__(self, settings: "Settings", tokenizer, build: "RoleFactory"): ...

    def roles(self) -> Dict[str, object]:
        """The trained models by role name (`TrainableModel`s: "actor", "critic"): what checkpoints hold."""

    def iteration(self, iteration: int, prompts: "PromptSource") -> IterationResult:
        """One iteration on this DP rank's prompts (`rl/rollouts/base.PromptSource`: the sampler's batch of the
        iteration, and further ones for what generates more than one batch, `--dynamic-sampling`,
        `--partial-rollout`), its rollout records (--log-samples, --rollout-dump-dir) finished. A collective."""

    def evaluate(self, rows: Sequence[dict]) -> list:
        """One `metrics.pass_at_k.PromptResult` per held-out row of this DP rank (`evaluation.evaluate_policy`): the
        current policy's --eval-n-samples responses to it, scored."""
