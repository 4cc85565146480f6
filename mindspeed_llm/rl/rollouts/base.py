"""The rollout seam: how an iteration's experience is generated, one strategy per run, chosen by name.

A stage asks its strategy for the iteration's batch the same way whatever the strategy (`exp, metrics =
self.rollouts.collect(iteration, prompts)`), and the trainer saves and restores the strategy's state through one
interface, so a new way of generating (multi-turn tool use, ...) is one module with a class of the `RolloutStrategy`
shape and one entry in `ROLLOUT_STRATEGIES`, and neither the stages nor the trainer change.

Strategies: `single_turn` (`rollout.SingleTurnRollouts`: one generation per prompt batch, the CP ranks' rollouts
gathered), `partial_rollout` (`partial_rollout.PartialRollouts`, `--partial-rollout`: long responses generated over
several iterations, its carried and finished groups saved with the checkpoint), `multi_turn`
(`multi_turn.MultiTurnRollouts`, `--tool-config`: the model calls tools between its turns) and `replay`
(`rollout_dump.ReplayRollouts`, `--rollout-replay-dir`: the scored rollouts a `--rollout-dump-dir` run wrote).

Prompts: the trainer hands a stage a `PromptSource` per iteration, this rank's prompts of the sampler's next global
batch (`first_batch`) and, on request, of further ones (`more(j)`: --dynamic-sampling's refills, --partial-rollout's
rounds). The sampler's position, saved with every checkpoint, counts every batch drawn, so a resumed run draws the
same prompts.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.experience import Experience


class PromptSource:
    """This rank's prompts of one iteration: `first_batch`, the sampler's next global batch (drawn when the source is
    made), and `more(j)`, generation batch j >= 1 after it (drawn on request, in order)."""

    def __init__(self, first_batch: Sequence[dict], draw: Callable[[int], Sequence[dict]]):
        self.first_batch = list(first_batch)
        self._draw = draw
        self.drawn = 1  # generation batches drawn so far, the first included

    @classmethod
    def from_sampler(cls, dataset, sampler, global_batch_size: int, rollout_rank: int) -> "PromptSource":
        """The prompts of `sampler`'s next global batches over `dataset`, as rollout rank `rollout_rank` holds them."""

        def draw(generation_batch: int) -> List[dict]:
            # `position` (the prompt's place in the global batch; generation batches after the first of an
            # iteration continue the count) keys its samples' random streams
            first = generation_batch * global_batch_size + rollout_rank * sampler.local_batch_size
            return [dict(dataset[i], index=i, position=first + k) for k, i in enumerate(sampler.next_batch_indices())]

        return cls(draw(0), draw)

    def more(self, generation_batch: int) -> List[dict]:
        """This rank's prompts of generation batch `generation_batch` (1, 2, ...: the sampler draws them in order)."""
        if generation_batch != self.drawn:
            raise ValueError(f"generation batch {generation_batch} asked for after {self.drawn} were drawn: the "
                             "sampler gives them in order")
        self.drawn += 1
        return list(self._draw(generation_batch))

    def batch(self, generation_batch: int) -> "PromptSource":
        """Generation batch `generation_batch` as a source of its own (its `first_batch`), for a stage that has it
        collected separately (--dynamic-sampling); the batches after it stay with this source."""
        return PromptSource(self.more(generation_batch), _no_more)


def _no_more(generation_batch: int):
    raise ValueError("this prompt source is one generation batch (PromptSource.batch): ask its parent for more")


class RolloutStrategy(Protocol):
    """What a stage and the trainer know of a rollout strategy. Built as `Strategy.from_settings(settings,
    actor_module, tokenizer, sampling)` (the run's typed `Settings`, the actor's model, the tokenizer, the engine's
    `SamplingConfig`)."""

    name: str  # its key in `ROLLOUT_STRATEGIES`, and that of its state in the checkpoint's loop state
    flag: Optional[str]  # the command-line flag that selects it (named when a resume would drop its state)

    def collect(self, iteration: int, prompts: PromptSource) -> Tuple[Experience, Dict[str, float]]:
        """This DP rank's experience of iteration `iteration` (a prompt's samples consecutive rows, every CP rank of
        the DP rank holding all of them), and its metrics."""

    def state_dict(self) -> Optional[dict]:
        """What a resume needs, or None when nothing carries over between iterations. Called on every rank (it may
        be a collective)."""

    def load_state_dict(self, state: dict) -> Optional[str]:
        """Restores `state_dict()`'s state; returns a line for the log when the resume changed something, else None."""

    @classmethod
    def saved_work(cls, state: dict) -> Optional[str]:
        """What a saved state holds that a run with another strategy would drop ("... of --flag"), or None."""


class CarriesNothing:
    """The checkpoint side of a strategy that keeps nothing between iterations (`single_turn`, `multi_turn`)."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> Optional[str]:
        return None

    @classmethod
    def saved_work(cls, state: dict) -> Optional[str]:
        return None


ROLLOUT_STRATEGIES = Registry({
    "single_turn": "mindspeed_llm.rl.rollouts.plain:SingleTurnRollouts",
    "partial_rollout": "mindspeed_llm.rl.rollouts.partial:PartialRollouts",
    "multi_turn": "mindspeed_llm.rl.rollouts.tool_turns:MultiTurnRollouts",
    "replay": "mindspeed_llm.rl.rollouts.dump:ReplayRollouts",
})


def strategy_name(settings) -> str:
    """The run's strategy (`Settings`): `replay` with --rollout-replay-dir (a dump of any strategy's rollouts),
    `partial_rollout` with --partial-rollout (with or without tools), `multi_turn` with --tool-config, else
    `single_turn`."""
    if settings.loop.rollout_replay_dir:
        return "replay"
    if settings.algorithm.partial_rollout:  # with --tool-config too: its trajectories are generated in rounds
        return "partial_rollout"
    return "multi_turn" if settings.tools.tool_config else "single_turn"


def build_rollouts(settings, actor_module, tokenizer, sampling) -> RolloutStrategy:
    """The run's rollout strategy (`strategy_name`) on the actor's model, from the run's typed `Settings`."""
    return ROLLOUT_STRATEGIES[strategy_name(settings)].from_settings(settings, actor_module, tokenizer, sampling)


class UnresumableStateError(ValueError):
    """A checkpoint holds another strategy's state that this run would drop."""


def save_state(strategy: RolloutStrategy, loop_state: dict) -> None:
    """Puts the strategy's state (if any) into the checkpoint's `loop_state`, under its name. Call on every rank."""
    state = strategy.state_dict()
    if state is not None:
        loop_state[strategy.name] = state


def load_state(strategy: RolloutStrategy, loop_state: dict) -> Optional[str]:
    """Restores the strategy's state from a checkpoint's `loop_state` (nothing when it holds none). Raises
    `UnresumableStateError` (saying what would be dropped and the flag to resume with) when the checkpoint holds work
    of another strategy. Returns the strategy's note, if any."""
    for name in ROLLOUT_STRATEGIES:
        saved = loop_state.get(name)
        if name == strategy.name or saved is None:
            continue
        other = ROLLOUT_STRATEGIES[name]
        work = other.saved_work(saved)
        if work:
            raise UnresumableStateError(f"{work}, which this run would drop; resume with {other.flag}")
    saved = loop_state.get(strategy.name)
    return strategy.load_state_dict(saved) if saved is not None else None


__all__ = ["CarriesNothing", "PromptSource", "RolloutStrategy", "ROLLOUT_STRATEGIES", "UnresumableStateError", "build_rollouts",
           "load_state", "save_state", "strategy_name"]
