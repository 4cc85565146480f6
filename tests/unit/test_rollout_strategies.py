"""`rl/rollouts/base.py`, the rollout seam: the prompt source the trainer hands a stage, the two registries (sample
generators, schedules) and how a run's flags choose from them, a pair refused by name, the schedules' state in the
checkpoint's loop state, and a third schedule registered here that both stages take through the same call
(`self.rollouts.collect(iteration, prompts)`) without a model. (On a real model, a toy generator and schedule through
both stages: tests/dist/test_rollout_extensions.py; the pairs: tests/dist/test_stages*.py; --partial-rollout's
buffers: test_partial_rollout.py.)"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.data import PromptSampler
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.rollouts.base import (
    SAMPLE_GENERATORS,
    SCHEDULES,
    PromptSource,
    UnresumableStateError,
    build_rollouts,
    chosen_pair,
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
def _run(tools=None, partial=False, replay=None):
    from mindspeed_llm.rl.settings import LoopSettings, Settings, ToolSettings

    return Settings(algorithm=AlgorithmSettings(partial_rollout=partial), tools=ToolSettings(tool_config=tools),
                    loop=LoopSettings(rollout_replay_dir=replay))


def test_each_axis_names_each_class_by_its_own_name_and_its_own_flag_picks_it():
    for registry in (SAMPLE_GENERATORS, SCHEDULES):
        assert all(registry[name].name == name for name in registry)
    assert [(SAMPLE_GENERATORS[n].flag, SCHEDULES[m].flag) for n, m in (("tools", "partial"), ("plain", "replay"))] \
        == [("--tool-config", "--partial-rollout"), (None, "--rollout-replay-dir")]
    names = lambda settings: tuple(cls.name for cls in chosen_pair(settings))  # noqa: E731
    assert names(_run()) == ("plain", "one_shot")
    assert names(_run(partial=True)) == ("plain", "partial")
    assert names(_run(tools="tools.yaml")) == ("tools", "one_shot")
    assert names(_run(tools="tools.yaml", partial=True)) == ("tools", "partial")
    # a replay generates nothing: the dumping run's --partial-rollout does not apply (its tools serve evaluation)
    assert names(_run(tools="tools.yaml", partial=True, replay="dump")) == ("tools", "replay")
    assert SCHEDULES["partial"].state_key == "partial_rollout"  # the key of the checkpoints' loop state


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


def test_one_shot_generates_the_first_batch_once_and_carries_nothing(monkeypatch):
    from mindspeed_llm.inference import SamplingConfig
    from mindspeed_llm.rl.rollouts import plain
    from mindspeed_llm.rl.rollouts.one_shot import OneShot

    seen = []

    def fake_generate(actor, prompts, sampling, iteration, sample_ids, **kwargs):
        seen.append((actor, prompts, iteration, sample_ids, kwargs["response_budgets"], kwargs["continuations"]))
        return _rollout(len(prompts))

    monkeypatch.setattr(plain, "generate", fake_generate)
    gathered = []
    monkeypatch.setattr(plain.distributed, "gather_over_context_parallel", lambda obj: gathered.append(obj) or [obj])
    monkeypatch.setattr(plain, "_is_moe", lambda model: False)
    strategy = build_rollouts(_settings(partial_rollout=False, n_samples_per_prompt=2), "actor", _Vocab(),
                              SamplingConfig(max_new_tokens=2))
    assert isinstance(strategy, OneShot) and isinstance(strategy.generator, plain.PlainGenerator)
    prompts = PromptSource([{"position": 4, "input_ids": [5]}, {"position": 5, "input_ids": [6, 7]}], _no_draw)
    exp, metrics = strategy.collect(3, prompts)  # one CP rank: the gather gives back its own rows
    # sample k of the prompt at position p draws from stream p * n + k
    assert seen == [("actor", [[5], [5], [6, 7], [6, 7]], 3, [8, 9, 10, 11], None, None)]
    assert exp.batch_size == 4 and metrics == {} and not strategy.scored
    assert [g.batch_size for g in gathered] == [4]
    loop_state = {"sampler": {}}
    save_state(strategy, loop_state)
    assert loop_state == {"sampler": {}}  # the checkpoint's format without --partial-rollout, as before
    assert load_state(strategy, loop_state) is None


class _Vocab:
    def __len__(self):
        return 16

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _rollout(B, R=2):
    from mindspeed_llm.inference import Rollout

    return Rollout(prompts=torch.ones(B, 1, dtype=torch.long), prompt_lengths=torch.ones(B, dtype=torch.long),
                   responses=torch.ones(B, R, dtype=torch.long), response_mask=torch.ones(B, R, dtype=torch.long),
                   response_lengths=torch.full((B,), R), ended_with_eos=torch.ones(B, dtype=torch.bool),
                   finish_reasons=["eos"] * B, log_probs=None, pad_token_id=0)


def _settings(**algorithm):
    """The run's typed settings with these AlgorithmSettings fields (what build_rollouts reads)."""
    from mindspeed_llm.rl.settings import LoopSettings, ToolSettings

    return SimpleNamespace(algorithm=AlgorithmSettings(**algorithm), batch=BatchSettings(global_batch_size=2),
                           tools=ToolSettings(), loop=LoopSettings())


def _no_draw(j):
    raise AssertionError("one_shot draws no further batch")


def _experience(B, R=2):
    mask = torch.ones(B, R)
    exp = Experience(tokens=torch.ones(B, 1 + R, dtype=torch.long), position_ids=torch.arange(1 + R).expand(B, 1 + R),
                     prompt_lengths=torch.ones(B, dtype=torch.long), responses=torch.ones(B, R, dtype=torch.long),
                     response_mask=mask, ended_with_eos=torch.ones(B, dtype=torch.bool))
    exp.sample_data = SampleData(finish_reasons=["eos"] * B, texts=[""] * B, labels=[None] * B, indices=list(range(B)))
    return exp


# ---------------------------------------------------------------------------------------------- a third schedule
class TurnsRollouts:
    """A stand-in schedule: the first batch's prompts, one more batch pulled from the source, and a count that carries
    over between iterations (its checkpoint state); registered from here, selected by its own flag."""

    name = "test_turns"
    flag = "--test-turns"
    state_key = None  # its name
    replaces_generation = False
    scored = False

    def __init__(self, generator):
        self.generator, self.turns, self.calls = generator, 0, []

    @classmethod
    def selected(cls, settings):
        return getattr(settings, "test_turns", False)

    @classmethod
    def refuses(cls, generator):
        return None

    @classmethod
    def from_settings(cls, settings, generator):
        return cls(generator)

    def collect(self, iteration, prompts):
        rows = prompts.first_batch + prompts.more(1)
        self.turns += len(rows)
        self.calls.append((iteration, [r["position"] for r in rows]))
        n = self.generator.samples_per_prompt
        return _experience(len(prompts.first_batch) * n), {"turns/total": float(self.turns)}

    def state_dict(self):
        return {"turns": self.turns}

    def load_state_dict(self, state):
        self.turns = state["turns"]
        return f"--test-turns: {self.turns} turns so far"

    @classmethod
    def saved_work(cls, state):
        return f"{state['turns']} turns of --test-turns" if state["turns"] else None

    def prompts_drawn(self, iteration):
        return None


class _Reached(Exception):
    """Raised by the stub micro-batch plan: the stage got as far as planning the schedule's experience."""


@pytest.fixture
def turns(monkeypatch):
    monkeypatch.setitem(SCHEDULES, "test_turns", TurnsRollouts)
    settings = _settings(n_samples_per_prompt=2)
    settings.test_turns = True
    return build_rollouts(settings, None, None, None)


def _stage(stage_name, turns, monkeypatch):
    from mindspeed_llm.rl.stages import STAGES

    module = __import__(f"mindspeed_llm.rl.stages.{stage_name}", fromlist=["MicroBatchPlan"])
    planned = []

    def for_run(exp, batch, group_size):
        planned.append((exp.batch_size, group_size))
        return "plan"

    monkeypatch.setattr(module, "MicroBatchPlan", SimpleNamespace(for_run=for_run))
    stage = STAGES[stage_name].__new__(STAGES[stage_name])  # no models: the rollout comes first
    idle = SimpleNamespace(offload=lambda timers: None)
    stage.algorithm = AlgorithmSettings(n_samples_per_prompt=2, dynamic_sampling=False)
    stage.settings = SimpleNamespace(algorithm=stage.algorithm, batch=BatchSettings(global_batch_size=2))
    stage.actor, stage.critic, stage.rollouts = idle, idle, turns
    return stage, planned


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("stage_name", ["grpo", "trl_ppo"])
def test_a_registered_schedule_is_what_both_stages_collect_from(stage_name, scored, turns, monkeypatch):
    """Both stages collect from the schedule, score its batch unless it arrives scored (`Schedule.scored`: a replay),
    and hand it with the schedule's metrics to the records."""
    assert isinstance(turns, TurnsRollouts) and turns.generator.name == "plain"
    turns.scored = scored
    stage, planned = _stage(stage_name, turns, monkeypatch)
    scored_batches = []

    def scorer(exp, plan, timers):
        scored_batches.append(exp.batch_size)
        return torch.zeros(exp.batch_size), {"score/x": 1.0}

    def records_add(exp, metrics):
        raise _Reached(metrics)

    stage.scorer = scorer
    stage.records = SimpleNamespace(add=records_add)
    stage.critic = SimpleNamespace(offload=lambda timers: None, onload=lambda timers, parts: None, chunks=None)
    stage.reference = None
    if stage_name == "trl_ppo":  # its passes come before scoring: stand-ins here
        module = __import__("mindspeed_llm.rl.stages.trl_ppo", fromlist=["x"])
        monkeypatch.setattr(module, "policy_logprobs", lambda *args, **kwargs: (None, None))
        monkeypatch.setattr(module, "critic_values", lambda chunks, exp, plan: None)
        monkeypatch.setattr(module, "old_logp_is_current", lambda update, exp: False)
        monkeypatch.setattr(module.roles, "on_device", lambda model, offload, timers: contextlib.nullcontext(model))
        stage.actor = SimpleNamespace(offload=lambda timers: None, chunks=None)
        stage.settings.update, stage.settings.loss = None, SimpleNamespace(temperature=1.0)
        stage.settings.offload = SimpleNamespace(offload_ref_reward=False)
    prompts = PromptSource([{"position": 0}, {"position": 1}], lambda j: [{"position": 2 * j}, {"position": 2 * j + 1}])
    with pytest.raises(_Reached) as reached:
        stage.iteration(7, prompts)
    assert turns.calls == [(7, [0, 1, 2, 3])] and planned == [(4, 2)]
    assert scored_batches == ([] if scored else [4])
    assert reached.value.args[0] == {"turns/total": 4.0, **({} if scored else {"score/x": 1.0})}


def test_a_schedule_state_is_saved_under_its_name_and_refused_by_a_run_of_another(turns):
    from mindspeed_llm.rl.rollouts.one_shot import OneShot

    turns.collect(1, PromptSource([{"position": 0}], lambda j: [{"position": 1}]))
    loop_state = {"sampler": {}}
    save_state(turns, loop_state)
    assert loop_state == {"sampler": {}, "test_turns": {"turns": 2}}
    resumed = TurnsRollouts(turns.generator)
    assert load_state(resumed, loop_state) == "--test-turns: 2 turns so far" and resumed.turns == 2
    with pytest.raises(UnresumableStateError, match=r"^2 turns of --test-turns, which this run would drop; resume with "
                                                    r"--test-turns$"):
        load_state(OneShot(None), loop_state)
    assert load_state(OneShot(None), {"sampler": {}, "test_turns": {"turns": 0}}) is None


class _OneTurnOnly:
    """A generator that cannot continue a carried sample (`continues = False`)."""

    name = "one_turn_only"
    flag = "--one-turn-only"
    continues = False

    @classmethod
    def selected(cls, settings):
        return True


def test_a_pair_that_cannot_work_together_is_refused_naming_both_flags(monkeypatch):
    from mindspeed_llm.arguments import parse_args

    monkeypatch.setitem(SAMPLE_GENERATORS, "one_turn_only", _OneTurnOnly)
    assert chosen_pair(_run())[0] is _OneTurnOnly  # with the one-shot schedule it runs
    argv = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "4",
            "--global-batch-size", "4", "--ref-model", "r", "--partial-rollout"]
    with pytest.raises(ArgumentError, match=r"^--partial-rollout with --one-turn-only"):
        parse_args(argv, world_size=1)  # at argument validation, before any model is built
    with pytest.raises(ArgumentError, match=r"^--partial-rollout with --one-turn-only: the one_turn_only generator "
                                            r"cannot continue a sample carried from an earlier round; drop one of "
                                            r"them$"):
        chosen_pair(_run(partial=True))
    with pytest.raises(ArgumentError, match=r"^--tool-config and --one-turn-only each choose the run's sample "
                                            r"generator \(tools, one_turn_only\); give one of them$"):
        chosen_pair(_run(tools="tools.yaml"))
