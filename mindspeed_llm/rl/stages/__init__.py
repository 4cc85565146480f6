"""The RL stages, by their `--stage` name."""

from mindspeed_llm.rl.stages.grpo import GRPOStage
from mindspeed_llm.rl.stages.trl_ppo import TrlPPOStage

STAGES = {"trl_ppo": TrlPPOStage, "grpo": GRPOStage}

__all__ = ["STAGES", "GRPOStage", "TrlPPOStage"]
