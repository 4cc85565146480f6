"""The RL stages, by their `--stage` name, and the contract the trainer drives them through (`contract.py`: the
`Stage` protocol, the `IterationResult` of an iteration; `base.py`: what both stages share).

`STAGES` names each stage's class by module and attribute and imports it on first use: the parser takes its
`--stage` choices from these keys, and `--help` or a refused flag should not wait for megatron-core's import (tens of
seconds on a loaded 2-core machine), which the stage modules bring in."""

from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.stages.contract import IterationResult, Stage

STAGES = Registry({
    "trl_ppo": "mindspeed_llm.rl.stages.trl_ppo:TrlPPOStage",
    "grpo": "mindspeed_llm.rl.stages.grpo:GRPOStage",
})
_EXPORTED_CLASSES = {"TrlPPOStage": "trl_ppo", "GRPOStage": "grpo"}


def __getattr__(name: str):  # `from mindspeed_llm.rl.stages import GRPOStage` without importing both stages eagerly
    if name in _EXPORTED_CLASSES:
        return STAGES[_EXPORTED_CLASSES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STAGES", "IterationResult", "Stage", "GRPOStage", "TrlPPOStage"]
