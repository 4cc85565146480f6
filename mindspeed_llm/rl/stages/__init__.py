"""The RL stages, by their `--stage` name, and the protocol the trainer drives them through.

`STAGES` names each stage's class by module and attribute and imports it on first use: the parser takes its
`--stage` choices from these keys, and `--help` or a refused flag should not wait for megatron-core's import (tens of
seconds on a loaded 2-core machine), which the stage modules bring in."""

from typing import TYPE_CHECKING, Dict, List, Protocol, Sequence

from mindspeed_llm.registry import Registry

if TYPE_CHECKING:
    from mindspeed_llm.rl.rollout_records import RolloutRecords
    from mindspeed_llm.rl.rollout_strategies import PromptSource, RolloutStrategy


class Stage(Protocol):
    """What the outer loop (`rl/trainer.py`) knows of a stage. Built as `Stage(model_args, tokenizer)`, which loads
    its models and checks them against each other and the tokenizer. `model_args` is the validated Namespace: the
    stage reads its typed parts only (`model_args.settings`, rl/settings.py), and builds its models from them
    (`rl/update/roles.RoleFactory`; tests/unit/test_namespace_boundary.py)."""

    name: str
    log_lines: Dict[str, List[str]]  # stdout line groups (`MetricsLogger`)
    # how it generates its experience (`rl/rollout_strategies.RolloutStrategy`; its state is saved with the loop state)
    rollouts: "RolloutStrategy"
    # what the run keeps of its scored rollouts (`rl/rollout_records.RolloutRecords`: --log-samples, --rollout-dump-dir)
    records: "RolloutRecords"

    def roles(self) -> Dict[str, object]:
        """The trained models by role name (`TrainableModel`s: "actor", "critic"): what checkpoints hold."""

    def iteration(self, iteration: int, prompts: "PromptSource") -> Dict[str, float]:
        """One iteration on this DP rank's prompts (`rl/rollout_strategies.PromptSource`: the sampler's batch of the
        iteration, and further ones for what generates more than one batch, `--dynamic-sampling`,
        `--partial-rollout`); returns its metrics (this rank's view)."""

    def evaluate(self, rows: Sequence[dict]) -> list:
        """One `metrics.pass_at_k.PromptResult` per held-out row of this DP rank (`evaluation.evaluate_policy`): the
        current policy's --eval-n-samples responses to it, scored."""


STAGES = Registry({
    "trl_ppo": "mindspeed_llm.rl.stages.trl_ppo:TrlPPOStage",
    "grpo": "mindspeed_llm.rl.stages.grpo:GRPOStage",
})
_EXPORTED_CLASSES = {"TrlPPOStage": "trl_ppo", "GRPOStage": "grpo"}


def __getattr__(name: str):  # `from mindspeed_llm.rl.stages import GRPOStage` without importing both stages eagerly
    if name in _EXPORTED_CLASSES:
        return STAGES[_EXPORTED_CLASSES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STAGES", "Stage", "GRPOStage", "TrlPPOStage"]
