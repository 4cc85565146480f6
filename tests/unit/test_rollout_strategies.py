"""`rl/rollouts/base.py`, the rollout seam: the prompt source the trainer hands a stage, the strategy registry, the
strategies' state in the checkpoint's loop state, and a third strategy registered here that both stages take through
the same call (`self.rollouts.collect(iteration, prompts)`) without a model. (The strategies on a real model:
tests/dist/test_stages*.py; --partial-rollout's buffers: test_partial_rollout.py.)"""

from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.data import PromptSampler
from mindspeed_llm.rl.rollouts import base as rollout_strategies
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.rollouts.base import (
    ROLLOUT_STRATEGIES,
    PromptSource,
    UnresumableStateError,
    build_rollouts,
    load_state,
    save_state,
)
from mindspeed_llm.rl.settings import AlgorithmSettings, BatchSettings


# ---------------------------------------------------------------------------------------------- the prompt source
def test_prompt_source_draws_the_first_batch_at_once_and_further_ones_in_order():
    drawn = []

    def draw(j):
        drawn.append(j)
        return [{"input_ids": [j], "position": 10 * j}]

    prompts = PromptSource(draw(0), draw)
    assert drawn == [0] and prompts.first_batch == [{"input_ids": [0], "position": 0}]
    assert prompts.more(1) == [{"input_ids": [1], "position": 10}] and drawn == [0, 1]
    with pytest.raises(ValueError, match="generation batch 3 asked for after 2 were drawn"):
        prompts.more(3)
    alone = prompts.batch(2)  # --dynamic-sampling's refill: batch 2 as a source of its own
    assert alone.first_batch == [{"input_ids": [2], "position": 20}] and drawn == [0, 1, 2]
    with pytest.raises(ValueError, match="ask its parent"):
        alone.more(1)
    assert prompts.more(3)[0]["position"] == 30  # the parent goes on counting


def test_prompt_source_from_sampler_numbers_positions_over_the_global_batches():
    dataset = [{"input_ids": [i], "labels": str(i)} for i in range(16)]
    sampler = PromptSampler(16, 4, dp_rank=1, dp_size=2, seed=3)
    reference = PromptSampler(16, 4, dp_rank=1, dp_size=2, seed=3)
    prompts = PromptSource.from_sampler(dataset, sampler, global_batch_size=4, rollout_rank=1)
    first, second = reference.next_batch_indices(), reference.next_batch_indices()
    assert prompts.first_batch == [dict(dataset[i], index=i, position=2 + k) for k, i in enumerate(first)]
    assert prompts.more(1) == [dict(dataset[i], index=i, position=6 + k) for k, i in enumerate(second)]
    assert sampler.state_dict() == reference.state_dict()  # every batch drawn moves the saved position


# ---------------------------------------------------------------------------------------------- the registry
def test_the_registry_names_each_strategy_by_its_own_name_and_the_flag_picks_it():
    from mindspeed_llm.rl.settings import Settings, ToolSettings

    for name in ("single_turn", "partial_rollout", "multi_turn"):
        assert ROLLOUT_STRATEGIES[name].name == name  # also the key of its state in the loop state
    assert rollout_strategies.strategy_name(Settings(algorithm=AlgorithmSettings(partial_rollout=False))) == \
        "single_turn"
    assert rollout_strategies.strategy_name(Settings(algorithm=AlgorithmSettings(partial_rollout=True))) == \
        "partial_rollout"
    assert rollout_strategies.strategy_name(Settings(tools=ToolSettings(tool_config="tools.yaml"))) == "multi_turn"
    assert rollout_strategies.strategy_name(Settings(tools=ToolSettings(tool_config="tools.yaml"), algorithm=
                                                     AlgorithmSettings(partial_rollout=True))) == "partial_rollout"
    assert ROLLOUT_STRATEGIES["partial_rollout"].flag == "--partial-rollout"
    assert ROLLOUT_STRATEGIES["multi_turn"].flag == "--tool-config"


def test_a_registry_takes_entries_by_decorator_by_key_and_lazily(monkeypatch, tmp_path):
    """`mindspeed_llm.registry.Registry`, the one registry idiom: `@register(name)` (default: the entry's own name),
    `REGISTRY[name] = value` (a tool module adding its call parser), and "module:attribute" entries imported when
    first read."""
    import sys

    from mindspeed_llm.registry import Registry
    from mindspeed_llm.rl.tools import TOOL_PARSERS, HermesParser, get_parser

    (tmp_path / "registry_lazy_entry.py").write_text("VALUE = 'imported'\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry({"lazy": "registry_lazy_entry:VALUE"})

    @registry.register()
    class Plain:
        pass

    @registry.register("named")
    def fn():
        pass

    assert list(registry) == ["lazy", "Plain", "named"] and registry["named"] is fn and registry["Plain"] is Plain
    try:
        assert "registry_lazy_entry" not in sys.modules  # naming the choices imports nothing
        assert registry["lazy"] == "imported" and "registry_lazy_entry" in sys.modules
    finally:
        sys.modules.pop("registry_lazy_entry", None)

    class MyParser(HermesParser):
        pass

    monkeypatch.setitem(TOOL_PARSERS, "my_format", MyParser)  # what a user's tool module does
    assert isinstance(get_parser("my_format"), MyParser)


def test_single_turn_generates_the_first_batch_and_carries_nothing(monkeypatch):
    from mindspeed_llm.rl.rollouts import plain as rollout

    seen = []

    def fake_rollout(actor, rows, sampling, iteration, tokenizer, samples_per_prompt=1):
        seen.append((actor, [r["position"] for r in rows], iteration, samples_per_prompt))
        return _experience(len(rows) * samples_per_prompt)

    monkeypatch.setattr(rollout, "rollout", fake_rollout)
    gathered = []
    monkeypatch.setattr(rollout.distributed, "gather_over_context_parallel", lambda obj: gathered.append(obj) or [obj])
    strategy = build_rollouts(_settings(partial_rollout=False, n_samples_per_prompt=2), "actor", None, None)
    assert isinstance(strategy, rollout.SingleTurnRollouts)
    prompts = PromptSource([{"position": 4}, {"position": 5}], _no_draw)
    exp, metrics = strategy.collect(3, prompts)  # one CP rank: the gather gives back its own rows
    assert seen == [("actor", [4, 5], 3, 2)] and exp.batch_size == 4 and metrics == {}
    assert [g.batch_size for g in gathered] == [4]
    loop_state = {"sampler": {}}
    save_state(strategy, loop_state)
    assert loop_state == {"sampler": {}}  # the checkpoint's format without --partial-rollout, as before
    assert load_state(strategy, loop_state) is None


def _settings(**algorithm):
    """The run's typed settings with these AlgorithmSettings fields (what build_rollouts reads)."""
    from mindspeed_llm.rl.settings import LoopSettings, ToolSettings

    return SimpleNamespace(algorithm=AlgorithmSettings(**algorithm), batch=BatchSettings(global_batch_size=2),
                           tools=ToolSettings(), loop=LoopSettings())


def _no_draw(j):
    raise AssertionError("single_turn draws no further batch")


def _experience(B, R=2):
    mask = torch.ones(B, R)
    exp = Experience(tokens=torch.ones(B, 1 + R, dtype=torch.long), position_ids=torch.arange(1 + R).expand(B, 1 + R),
                     prompt_lengths=torch.ones(B, dtype=torch.long), responses=torch.ones(B, R, dtype=torch.long),
                     response_mask=mask, ended_with_eos=torch.ones(B, dtype=torch.bool))
    exp.sample_data = SampleData(finish_reasons=["eos"] * B, texts=[""] * B, labels=[None] * B, indices=list(range(B)))
    return exp


# ---------------------------------------------------------------------------------------------- a third strategy
class TurnsRollouts:
    """A stand-in for a multi-turn strategy: the first batch's prompts, one more batch pulled from the source, and a
    count that carries over between iterations (its checkpoint state)."""

    name = "test_turns"
    flag = "--test-turns"

    def __init__(self, samples_per_prompt):
        self.samples_per_prompt, self.turns, self.calls = samples_per_prompt, 0, []

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling):
        return cls(settings.algorithm.n_samples_per_prompt)

    def collect(self, iteration, prompts):
        rows = prompts.first_batch + prompts.more(1)
        self.turns += len(rows)
        self.calls.append((iteration, [r["position"] for r in rows]))
        return _experience(len(prompts.first_batch) * self.samples_per_prompt), {"turns/total": float(self.turns)}

    def state_dict(self):
        return {"turns": self.turns}

    def load_state_dict(self, state):
        self.turns = state["turns"]
        return f"--test-turns: {self.turns} turns so far"

    @classmethod
    def saved_work(cls, state):
        return f"{state['turns']} turns of --test-turns" if state["turns"] else None


class _Reached(Exception):
    """Raised by the stub micro-batch plan: the stage got as far as planning the strategy's experience."""


@pytest.fixture
def turns(monkeypatch):
    monkeypatch.setitem(ROLLOUT_STRATEGIES, "test_turns", TurnsRollouts)
    monkeypatch.setattr(rollout_strategies, "strategy_name", lambda algorithm: "test_turns")
    return build_rollouts(_settings(n_samples_per_prompt=2), None, None, None)


@pytest.mark.parametrize("stage_name", ["grpo", "trl_ppo"])
def test_a_registered_strategy_is_what_both_stages_collect_from(stage_name, turns, monkeypatch):
    from mindspeed_llm.rl.stages import STAGES

    module = __import__(f"mindspeed_llm.rl.stages.{stage_name}", fromlist=["MicroBatchPlan"])
    planned = []

    def for_run(exp, batch, group_size):
        planned.append((exp.batch_size, group_size))
        raise _Reached

    monkeypatch.setattr(module, "MicroBatchPlan", SimpleNamespace(for_run=for_run))
    assert isinstance(turns, TurnsRollouts)
    stage = STAGES[stage_name].__new__(STAGES[stage_name])  # no models: the rollout comes first
    idle = SimpleNamespace(offload=lambda timers: None)
    stage.algorithm = AlgorithmSettings(n_samples_per_prompt=2, dynamic_sampling=False)
    stage.settings = SimpleNamespace(algorithm=stage.algorithm, batch=BatchSettings(global_batch_size=2))
    stage.actor, stage.critic, stage.rollouts = idle, idle, turns
    prompts = PromptSource([{"position": 0}, {"position": 1}], lambda j: [{"position": 2 * j}, {"position": 2 * j + 1}])
    with pytest.raises(_Reached):
        stage.iteration(7, prompts)
    assert turns.calls == [(7, [0, 1, 2, 3])] and planned == [(4, 2)]


def test_a_strategy_state_is_saved_under_its_name_and_refused_by_a_run_of_another(turns):
    from mindspeed_llm.rl.rollouts.plain import SingleTurnRollouts

    turns.collect(1, PromptSource([{"position": 0}], lambda j: [{"position": 1}]))
    loop_state = {"sampler": {}}
    save_state(turns, loop_state)
    assert loop_state == {"sampler": {}, "test_turns": {"turns": 2}}
    resumed = TurnsRollouts(2)
    assert load_state(resumed, loop_state) == "--test-turns: 2 turns so far" and resumed.turns == 2
    with pytest.raises(UnresumableStateError, match=r"^2 turns of --test-turns, which this run would drop; resume with "
                                                    r"--test-turns$"):
        load_state(SingleTurnRollouts(None, None, None), loop_state)
    assert load_state(SingleTurnRollouts(None, None, None), {"sampler": {}, "test_turns": {"turns": 0}}) is None
