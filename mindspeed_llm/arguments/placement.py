"""Checking the placement flags (`--rollout-world-size`, `--infer-tensor-parallel-size`; issue 47's asynchronous RL)
before anything is built. The placement itself, its groups and the weight stream exist (`rl/async_rl/`), but no
schedule runs on it yet, so a run that asks for generator ranks is refused by name rather than trained synchronously
behind the user's back."""

from __future__ import annotations

from mindspeed_llm.errors import ArgumentError


def check_placement(run) -> None:
    """`ArgumentError` for --rollout-world-size R > 0 (not built yet) and for --infer-tensor-parallel-size without it
    (there are no generator ranks whose TP it could set)."""
    rollout, generator_tp = run.rollout_world_size, run.infer_tensor_parallel_size
    if rollout > 0:
        raise ArgumentError(
            f"--rollout-world-size {rollout}: asynchronous training (generator ranks beside trainer ranks, weights "
            "streamed between them) is not built yet (issue 47: the placement and the weight stream exist, no "
            "schedule runs on them); drop --rollout-world-size to train synchronously, every rank generating and "
            "training in turn")
    if generator_tp is not None:
        raise ArgumentError(
            f"--infer-tensor-parallel-size {generator_tp} sets the generator ranks' tensor-parallel size, and there "
            "are none without --rollout-world-size R > 0: generation runs on the training model at "
            "--tensor-model-parallel-size; drop the flag")
