"""`rl/rollouts/tool_turns.trajectories`: a rollout's responses and tool masks as the trajectories the rewards read, of the
shape `verifiers.trajectory` documents (its `check_trajectory`), on a hand-built batch (characters as token ids)."""

import pytest
import torch

from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.rollouts.tool_turns import trajectories
from mindspeed_llm.rl.tools import get_parser
from mindspeed_llm.rl.verifiers import check_trajectory


class _Chars:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def _batch(parts):
    """One row per list of (text, is_tool) parts, right-padded."""
    rows = [[(ord(c), int(tool)) for text, tool in row for c in text] for row in parts]
    width = max(len(r) for r in rows)
    responses = torch.zeros(len(rows), width, dtype=torch.long)
    tool = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        responses[b, :len(row)] = torch.tensor([t for t, _ in row])
        tool[b, :len(row)] = torch.tensor([float(m) for _, m in row])
        mask[b, :len(row)] = 1
    tokens = torch.cat([torch.ones(len(rows), 2, dtype=torch.long), responses], 1)
    return Experience(tokens=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                      prompt_lengths=torch.full((len(rows),), 2), responses=responses, response_mask=mask,
                      ended_with_eos=torch.ones(len(rows), dtype=torch.bool), tool_mask=tool)


def test_turns_calls_and_rewards_of_each_trajectory():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    exp = _batch([[(call, False), (" 6 ", True), ("It is 6.", False)],
                  [("7", False)]])
    got = trajectories(exp, _Chars(), get_parser("hermes"), [0.5, 0.0])
    for trajectory in got:
        check_trajectory(trajectory)
    assert [t["role"] for t in got[0]["turns"]] == ["assistant", "tool", "assistant"]
    assert got[0]["turns"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2*3"}}]
    assert got[0]["turns"][1]["text"] == " 6 " and got[0]["turns"][2]["text"] == "It is 6."
    assert (got[0]["num_turns"], got[0]["tool_calls"], got[0]["tool_reward"]) == (2, 1, 0.5)
    assert got[1] == {"turns": [{"role": "assistant", "text": "7", "tool_calls": []}], "num_turns": 1,
                      "tool_calls": 0, "tool_reward": 0.0}


def test_verls_reward_functions_read_num_turns_in_verls_count():
    """verl's tool agent loop sets num_turns = user turns (tool answers) + assistant turns + 1 (2 for a single turn);
    verl's ReTool reward adds (num_turns - 2) / 2 * 0.1 for a trajectory that used the tool. The same trajectories
    give the same rewards here, through a verl-style compute_score."""
    from mindspeed_llm.rl.verifiers.calling import call_plan

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    exp = _batch([[(call, False), (" 6 ", True), (call, False), (" 6 ", True), ("It is 6.", False)],
                  [("7", False)]])
    got = trajectories(exp, _Chars(), get_parser("hermes"), [0.0, 0.0])

    def retool_like(data_source, solution_str, ground_truth, extra_info=None):
        return (extra_info["num_turns"] - 2) / 2 * 0.1, extra_info["assistant_turns"]

    plan = call_plan(retool_like)
    # 3 assistant turns + 2 tool answers + 1 = 6 -> 0.2; one assistant turn: 2 (verl's single turn) -> 0.0
    assert plan.call(retool_like, "t", "l", {}, got[0]) == (pytest.approx(0.2), 3)
    assert plan.call(retool_like, "t", "l", {}, got[1]) == (0.0, 1)


def test_a_tools_own_metrics_are_summed_per_tool_and_logged_under_its_name():
    """`ToolResult.metrics` of each call (the executor sums a turn's by tool) reach the rollout's metrics as
    `tool/<name>/<metric>`, summed over the calls of every turn, beside the call counts."""
    import concurrent.futures
    from types import SimpleNamespace

    from mindspeed_llm.inference.turns import TurnExchange
    from mindspeed_llm.rl.rollouts.tool_turns import ToolTurns, tool_metrics
    from mindspeed_llm.rl.settings import ToolSettings
    from mindspeed_llm.rl.tools import TurnResult

    class Executor:
        def start(self, sample, row):
            pass

        def submit(self, sample, calls):
            done = concurrent.futures.Future()
            done.set_result(TurnResult(messages=["ok"] * len(calls), metrics={"echo": {"words": 2.0 + sample}},
                                       seconds=0.5))
            return done

    parser = get_parser("hermes")
    call = '<tool_call>{"name": "echo", "arguments": {"words": ["a"]}}</tool_call>'
    turns = ToolTurns([{}, {}], _Chars(), ToolSettings(), Executor(), parser,
                      SimpleNamespace(delta_ids=lambda messages: [1] * len(messages)), budgets=[64, 64])
    for sample in (0, 1):
        known = [ord(c) for c in call]
        assert turns.wants_observation(sample, known, 0, 0)
        turns.begin(sample, known, 0, 0)
    assert sorted(TurnExchange(turns, None, None, torch.device("cpu")).exchange(wait=True)) == [(0, [1]), (1, [1])]
    assert turns.counts == {"calls": 2, "failures": 0, "timeouts": 0, "seconds": 1.0, "echo/words": 5.0}
    exp = SimpleNamespace(sample_data=SimpleNamespace(trajectories=[{"num_turns": 2}] * 2),
                          tool_mask=torch.ones(2, 3))
    metrics = tool_metrics(exp, turns.counts, 0.0, 1.0)
    assert metrics["tool/echo/words"] == 5.0 and metrics["tool/calls"] == 2.0


def test_each_model_turn_is_parsed_once():
    """A turn the tool loop parsed when it ended (`ToolTurns.wants_observation`) keeps those calls in the sample's
    record (`ToolTurns.record`, `Rollout.trajectories`); the trajectory reads them instead of parsing the turn again:
    only the last turn, which no observation followed, is parsed then. The trajectory is the one parsed from the
    tokens alone."""
    from types import SimpleNamespace

    from mindspeed_llm.rl.rollouts.tool_turns import ToolTurns
    from mindspeed_llm.rl.settings import ToolSettings

    hermes, texts = get_parser("hermes"), []

    class Counting:
        def parse(self, text):
            texts.append(text)
            return hermes.parse(text)

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    turns = ToolTurns([{}], _Chars(), ToolSettings(), None, Counting(), None, budgets=[256])
    prompt = [1, 1]  # `_batch`'s two prompt tokens
    assert turns.wants_observation(0, prompt + [ord(c) for c in call], len(prompt), 0)
    exp = _batch([[(call, False), (" 6 ", True), ("It is 6.", False)]])
    turns.observed(0, {"reward": 0.5, "counts": {}, "metrics": {}})  # the tool's answer's note (`TurnExchange`)
    record = turns.record(0)
    got = trajectories(exp, _Chars(), Counting(), [0.5], [record["parsed"]])
    assert texts == [call, "It is 6."]  # the first turn at its end, the last one here
    assert got == trajectories(exp, _Chars(), hermes, [0.5])
    resumed = ToolTurns([{}], _Chars(), ToolSettings(), None, Counting(), None, budgets=[256], states=[record])
    assert resumed.record(0) == record  # a continued trajectory (a partial rollout's) keeps its turns' calls


def test_a_non_picking_rank_has_the_whole_record_when_generation_ends(monkeypatch):
    """The tools run on the token-picking rank; their answers' ids and notes (reward, call counts, the tools' own
    metrics) cross to the other ranks of the model-parallel group in the engine's exchange (`TurnExchange`), so a
    non-picking rank's `ToolTurnsGenerator.generate` returns the picking rank's records and `tool/*` stats with no
    collective after the engine. Two ranks played in one process: rank 0's broadcasts are replayed to rank 1."""
    import concurrent.futures
    from types import SimpleNamespace

    import torch.distributed as dist

    from mindspeed_llm.inference import engine_inputs
    from mindspeed_llm.inference.turns import TurnExchange
    from mindspeed_llm.rl import tools as tool_lib
    from mindspeed_llm.rl.rollouts.tool_turns import ToolBox, ToolTurnsGenerator
    from mindspeed_llm.rl.settings import ToolSettings
    from mindspeed_llm.rl.tools import TurnResult

    rank, wire, engine_done = [0], [], []

    def broadcast(tensor, src, group=None):
        assert not engine_done, "a collective after the engine returned"
        if rank[0] == src:
            wire.append(tensor.clone())
        else:
            tensor.copy_(wire.pop(0))

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective after the engine returned")

    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank[0])
    monkeypatch.setattr(dist, "broadcast", broadcast)
    for name in ("broadcast_object_list", "all_gather_object", "all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, no_collective)
    monkeypatch.setattr(engine_inputs, "source_rank", lambda: (object(), 0))  # a model-parallel group, rank 0 picks

    class Executor:
        def __init__(self, tools, **kwargs):
            pass

        def start(self, sample, row):
            pass

        def submit(self, sample, calls):
            assert rank[0] == 0, "the tools run on the token-picking rank only"
            done = concurrent.futures.Future()
            done.set_result(TurnResult(messages=["ok"] * len(calls), reward=0.25 + sample,
                                       metrics={"echo": {"words": 2.0 + sample}}, failures=sample, seconds=0.5))
            return done

        def finish(self, sample):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tool_lib, "ToolExecutor", Executor)
    call = [ord(c) for c in '<tool_call>{"name": "echo", "arguments": {"words": ["a"]}}</tool_call>']

    def engine(iteration, prompts, sample_ids, continuations, budgets, sampling, turns=None, options=None):
        """The continuous engine's part in the tool loop: each sample's first turn calls a tool, the exchange
        brings the answers (as many exchanges on every rank: rank 1 replays rank 0's)."""
        exchange = TurnExchange(turns, 0, None, torch.device("cpu"))
        for s, prompt in enumerate(prompts):
            assert turns.wants_observation(s, prompt + call, len(prompt), 0)
            if exchange.picks:
                turns.begin(s, prompt + call, len(prompt), 0)
        answered = 0
        while answered < len(prompts) if exchange.picks else wire:
            answered += len(exchange.exchange(wait=True))
        engine_done.append(True)
        return SimpleNamespace(stats={"parked_turns": len(prompts)}, trajectories=None)

    toolbox = ToolBox.__new__(ToolBox)
    toolbox.settings, toolbox.tokenizer, toolbox.max_length = ToolSettings(max_total_response_length=64), _Chars(), 256
    toolbox.tools, toolbox.parser = [], get_parser("hermes")
    toolbox.delta = SimpleNamespace(delta_ids=lambda messages: [1] * len(messages))
    generator = ToolTurnsGenerator.__new__(ToolTurnsGenerator)
    generator.toolbox, generator.sampling, generator.engine = toolbox, None, engine
    rows = [{"input_ids": [1, 1]}, {"input_ids": [1, 1, 1]}]
    got = {}
    for rank[0] in (0, 1):
        engine_done.clear()
        got[rank[0]] = generator.generate(3, rows, [0, 1])
    assert not wire
    for result in got.values():
        assert [t["tool_reward"] for t in result.trajectories] == [0.25, 1.25]
        assert [t["calls"] for t in result.trajectories] == [1, 1]
        assert [t["tool_metrics"] for t in result.trajectories] == [{"echo/words": 2.0}, {"echo/words": 3.0}]
        assert result.stats == {"parked_turns": 2, "tool/calls": 2, "tool/failures": 1, "tool/timeouts": 0,
                                "tool/seconds": 1.0, "tool/echo/words": 5.0}
    assert got[1].trajectories == got[0].trajectories


def test_a_trajectorys_call_count_is_made_from_its_parsed_turns():
    """One count of a trajectory's tool calls: `ToolTurns.calls`, made from the calls of the turns parsed when they
    ended (the record's `parsed`), within --max-tool-calls (hand-counted: 2 calls, then 2 of which 1 is allowed, then
    none parsed at the limit); it drives the limit, is the record's `calls`, and a record saved before it kept its
    turns' calls (an older partial-rollout checkpoint: counts only) goes on from its saved count."""
    from mindspeed_llm.rl.rollouts.tool_turns import ToolTurns
    from mindspeed_llm.rl.settings import ToolSettings

    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    settings = ToolSettings(max_tool_calls=3)
    turns = ToolTurns([{}], _Chars(), settings, None, get_parser("hermes"), None, budgets=[512])
    known, starts = [1, 1], []
    for k in range(3):
        starts.append(len(known) - 2)
        known = known + [ord(c) for c in one * 2]
        wants = turns.wants_observation(0, known, 2, starts[-1])
        assert wants == (k < 2) and turns.calls(0) == [2, 3, 3][k], k
        known = known + [ord("x")] * 3  # the tools' answer
    record = turns.record(0)
    assert record["calls"] == 3 and sorted(record["parsed"]) == starts[:2]
    assert turns.parsed[0][1] == 1  # the second turn: 1 of its 2 calls allowed
    older = ToolTurns([{}], _Chars(), settings, None, get_parser("hermes"), None, budgets=[512],
                      states=[{"turns": 1, "calls": 2, "tool_reward": 0.5}])
    assert older.calls(0) == 2
    assert older.wants_observation(0, [1, 1] + [ord(c) for c in one * 2], 2, 0)
    assert older.record(0)["calls"] == 3 and not older.wants_observation(0, [1, 1] + [ord(c) for c in one * 3], 2, 0)
