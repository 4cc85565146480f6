"""The rollout seam: how an iteration's experience is generated, as two independent choices of the run.

* A *sample generator* (`SampleGenerator`, registry `SAMPLE_GENERATORS`) turns dataset rows, and samples carried from
  an earlier call (`inference.Continuation`) with their per-sample budgets, into generated samples (`Rollout`) and
  those into an `Experience`: `plain` (one model turn, `plain.py`, the default) or `tools` (model turns and tool
  answers, `--tool-config`, `tool_turns.py`).
* A *schedule* (`Schedule`, registry `SCHEDULES`) decides how an iteration asks its generator for samples: `one_shot`
  (one call over the iteration's prompts, `one_shot.py`, the default), `partial` (rounds of a per-sample token budget
  with carried samples, `--partial-rollout`, `partial.py`) or `replay` (a dump's scored batches instead of generating,
  `--rollout-replay-dir`, `replay.py`).

Any schedule takes any generator, asking it what differs (its budget and the flag that sets it, whether a stop was
a cut to continue, its observation tokens, its metrics); a pair that cannot work together is refused by name at
startup (`Schedule.refuses`). Each class is keyed by its own `name` and selected by its own `selected(settings)`;
the default of an axis is the class without a `flag`; two selected are refused by name, except a schedule that
`replaces_generation` (a replay: every other schedule's flag then does not apply, and the replay says so).

A stage asks `exp, metrics = self.rollouts.collect(iteration, prompts)` whatever the pair, scores the batch when
`self.rollouts.scored` is False, and the trainer saves and restores the schedule's state through one interface:
a new generator or schedule is one module with one class and one registration, and neither the stages nor the
trainer change.

Prompts: the trainer hands a stage a `PromptSource` per iteration, this rank's prompts of the sampler's next global
batch (`first_batch`) and, on request, of further ones (`more(j)`: --dynamic-sampling's refills, --partial-rollout's
rounds). The sampler's position, saved with every checkpoint, counts every batch drawn, so a resumed run draws the
same prompts.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.inference import Continuation, Rollout, SamplingConfig
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


class SampleGenerator(Protocol):
    """What a schedule knows of a sample generator. Built as `Generator.from_settings(settings, actor_module,
    tokenizer, sampling)` (the run's typed `Settings`, the actor's model, the tokenizer, the engine's
    `SamplingConfig`)."""

    name: str  # its key in `SAMPLE_GENERATORS`
    flag: Optional[str]  # the flag that selects it (None: the default)
    budget_flag: str  # the flag of a sample's whole response budget (named in the errors about it)
    observes: bool  # its responses hold fed observation tokens (`Rollout.tool_mask`): tool answers
    continues: bool  # it can continue a sample carried from an earlier call (`Continuation`)
    samples_per_prompt: int

    @classmethod
    def selected(cls, settings) -> bool:
        """Whether the run's `Settings` ask for this generator (by its flag)."""

    @property
    def whole_budget(self) -> int:
        """The value of `budget_flag`: a sample's most tokens after its prompt (a partial round's share of it)."""

    def response_budgets(self, prompt_lengths: Sequence[int]) -> List[int]:
        """Each sample's whole response budget (`whole_budget` within --max-length)."""

    def generate(self, iteration: int, samples: Sequence[dict], sample_ids: Sequence[int],
                 continuations: Optional[Sequence[Optional[Continuation]]] = None,
                 budgets: Optional[Sequence[int]] = None, sampling: Optional[SamplingConfig] = None) -> Rollout:
        """One generation over `samples` (a dataset row each), sample b drawing from stream (iteration,
        `sample_ids[b]`); `continuations`: what each continues (None: fresh); `budgets`: this call's response
        budget of each (default: the whole ones); `sampling`: another `SamplingConfig` (held-out evaluation).
        `Rollout.trajectories` holds what a continuation of each sample needs of the generator's own records."""

    def carried(self, reason: str, length: int, whole: int) -> bool:
        """Whether a sample that stopped for `reason` at `length` tokens (of its `whole` budget) was cut by a call's
        budget and continues in a later call."""

    def experience(self, result: Rollout, samples: Sequence[dict], **sample_data) -> Experience:
        """The generated `result` of `samples` as an Experience with its `SampleData` (`sample_data`: more fields)."""

    def metrics(self, exp: Experience, stats: Sequence[Dict[str, float]], seconds: float) -> Dict[str, float]:
        """The generator's metrics of the trained `exp`, from the `Rollout.stats` of the calls that made it and
        their wall time."""


class Schedule(Protocol):
    """What a stage and the trainer know of a schedule. Built as `Schedule.from_settings(settings, generator)`."""

    name: str  # its key in `SCHEDULES`
    flag: Optional[str]  # the command-line flag that selects it (named when a resume would drop its state)
    state_key: Optional[str]  # the key of its state in the checkpoint's loop state (None: its name)
    replaces_generation: bool  # it trains on rollouts made elsewhere (another schedule's flag then does not apply)
    generator: SampleGenerator  # the run's generator (held-out evaluation generates with it too)
    scored: bool  # its batches arrive scored (the stage does not score them again)

    @classmethod
    def selected(cls, settings) -> bool:
        """Whether the run's `Settings` ask for this schedule (by its flag)."""

    @classmethod
    def refuses(cls, generator: type) -> Optional[str]:
        """Why this schedule cannot run samples of the generator class `generator` (None: it can)."""

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
        """What a saved state holds that a run with another schedule would drop ("... of --flag"), or None."""

    def prompts_drawn(self, iteration: int) -> Optional[int]:
        """How many prompt batches iteration `iteration` draws in all (None: those the schedule asked for); the
        records draw the rest when the iteration ends (a replay draws what the dumping run drew)."""


class CarriesNothing:
    """The checkpoint side of a schedule that keeps nothing between iterations (`one_shot`, `replay`)."""

    replaces_generation = False
    scored = False

    @classmethod
    def refuses(cls, generator: type) -> Optional[str]:
        return None

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> Optional[str]:
        return None

    @classmethod
    def saved_work(cls, state: dict) -> Optional[str]:
        return None

    def prompts_drawn(self, iteration: int) -> Optional[int]:
        return None


def expand(rows: Sequence[dict], n: int) -> Tuple[List[dict], List[int]]:
    """The samples of `rows`, `n` a row and a row's consecutive, and their random streams' ids: sample k of the
    prompt at position p of the global batch (`row["position"]`, set by the trainer; its index in `rows` without one)
    draws from stream p * n + k, so a sampled rollout is the same at any data-parallel size."""
    samples = [row for row in rows for _ in range(n)]
    sample_ids = [row.get("position", i) * n + k for i, row in enumerate(rows) for k in range(n)]
    return samples, sample_ids


SAMPLE_GENERATORS = Registry({
    "plain": "mindspeed_llm.rl.rollouts.plain:PlainGenerator",
    "tools": "mindspeed_llm.rl.rollouts.tool_turns:ToolTurnsGenerator",
})

SCHEDULES = Registry({
    "one_shot": "mindspeed_llm.rl.rollouts.one_shot:OneShot",
    "partial": "mindspeed_llm.rl.rollouts.partial:PartialRollouts",
    "replay": "mindspeed_llm.rl.rollouts.replay:ReplayRollouts",
})


def _flag(cls) -> str:
    return cls.flag or f"the default {cls.name}"


def _chosen(registry: Registry, axis: str, settings):
    """The class of `registry` the run's `settings` select (module docstring); two selected are an ArgumentError
    naming both flags."""
    chosen = [registry[name] for name in registry if registry[name].flag and registry[name].selected(settings)]
    replacing = [cls for cls in chosen if getattr(cls, "replaces_generation", False)]
    chosen = replacing[:1] or chosen
    if len(chosen) > 1:
        raise ArgumentError(f"{' and '.join(cls.flag for cls in chosen)} each choose the run's {axis} "
                            f"({', '.join(cls.name for cls in chosen)}); give one of them")
    if chosen:
        return chosen[0]
    defaults = [registry[name] for name in registry if not registry[name].flag]
    return defaults[0]


def chosen_pair(settings) -> Tuple[type, type]:
    """(the generator class, the schedule class) of the run's `Settings`; a pair that cannot work together is an
    ArgumentError naming both flags and why."""
    generator = _chosen(SAMPLE_GENERATORS, "sample generator", settings)
    schedule = _chosen(SCHEDULES, "rollout schedule", settings)
    why = schedule.refuses(generator)
    if why:
        raise ArgumentError(f"{_flag(schedule)} with {_flag(generator)}: {why}; drop one of them")
    return generator, schedule


def build_rollouts(settings, actor_module, tokenizer, sampling) -> Schedule:
    """The run's schedule over its sample generator (`chosen_pair`) on the actor's model, from the run's `Settings`."""
    generator, schedule = chosen_pair(settings)
    return schedule.from_settings(settings, generator.from_settings(settings, actor_module, tokenizer, sampling))


class UnresumableStateError(ValueError):
    """A checkpoint holds another schedule's state that this run would drop."""


def save_state(schedule: Schedule, loop_state: dict) -> None:
    """Puts the schedule's state (if any) into the checkpoint's `loop_state`, under its `state_key`. Call on every
    rank."""
    state = schedule.state_dict()
    if state is not None:
        loop_state[_state_key(schedule)] = state


def _state_key(schedule) -> str:
    """A schedule's (class or instance) key in the loop state: its `state_key`, else its name."""
    return getattr(schedule, "state_key", None) or schedule.name


def load_state(schedule: Schedule, loop_state: dict) -> Optional[str]:
    """Restores the schedule's state from a checkpoint's `loop_state` (nothing when it holds none). Raises
    `UnresumableStateError` (saying what would be dropped and the flag to resume with) when the checkpoint holds work
    of another schedule. Returns the schedule's note, if any."""
    for name in SCHEDULES:
        other = SCHEDULES[name]
        key = _state_key(other)
        saved = loop_state.get(key)
        if key == _state_key(schedule) or saved is None:
            continue
        work = other.saved_work(saved)
        if work:
            raise UnresumableStateError(f"{work}, which this run would drop; resume with {other.flag}")
    saved = loop_state.get(_state_key(schedule))
    return schedule.load_state_dict(saved) if saved is not None else None


__all__ = ["CarriesNothing", "PromptSource", "SAMPLE_GENERATORS", "SCHEDULES", "SampleGenerator", "Schedule",
           "UnresumableStateError", "build_rollouts", "chosen_pair", "expand", "load_state", "save_state"]
