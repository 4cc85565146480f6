"""The RL stages, by their `--stage` name, and the protocol the trainer drives them through."""

from typing import Callable, Dict, List, Optional, Protocol, Sequence

from mindspeed_llm.rl.stages.grpo import GRPOStage
from mindspeed_llm.rl.stages.trl_ppo import TrlPPOStage


class Stage(Protocol):
    """What the outer loop (`rl/trainer.py`) knows of a stage. Built as `Stage(args, tokenizer)`, which loads its
    models and checks them against each other and the tokenizer."""

    name: str
    log_lines: Dict[str, List[str]]  # stdout line groups (`MetricsLogger`)
    # --partial-rollout's buffers (`rl/partial_rollout.PartialRollouts`, saved with the loop state), else None
    partial_rollout: Optional[object]

    def roles(self) -> Dict[str, object]:
        """The trained models by role name (`TrainableModel`s: "actor", "critic"): what checkpoints hold."""

    def iteration(self, iteration: int, rows: Sequence[dict],
                  more_rows: Callable[[int], Sequence[dict]]) -> Dict[str, float]:
        """One iteration on this DP rank's prompts; returns its metrics (this rank's view). `more_rows(j)` gives
        this rank's prompts of the next global batch (j: its generation batch in this iteration, from 1), for a
        stage that generates more than one batch (`--dynamic-sampling`, `--partial-rollout`)."""

    def evaluate(self, rows: Sequence[dict]) -> Dict[str, float]:
        """Held-out metrics (`eval/*`) of the current policy on this DP rank's prompts."""


STAGES = {"trl_ppo": TrlPPOStage, "grpo": GRPOStage}

__all__ = ["STAGES", "Stage", "GRPOStage", "TrlPPOStage"]
