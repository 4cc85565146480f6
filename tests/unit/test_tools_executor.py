"""rl/tools/executor.py: a turn's calls run concurrently, failures / timeouts / unknown tools answer as error text
and are counted, calls beyond max_parallel_calls are refused, create / release once per trajectory, and a hung
call does not hold a worker slot."""

import sys
import threading
import time

import pytest

from mindspeed_llm.rl.tools import ToolCall, ToolDelta, ToolExecutor, ToolResult, ToolTimeout, function_tool
from tests.helpers.fixtures_data import qwen_tok, qwen_tok_dir  # noqa: F401 - pytest fixtures


class SleepTool:
    """Sleeps ``parameters["s"]`` seconds and records (start, end) of each call."""

    name = "sleep"
    tool_schema = {"type": "function", "function": {"name": "sleep", "description": "Sleep.", "parameters": {}}}

    def __init__(self):
        self.spans = []
        self.lock = threading.Lock()

    def execute(self, parameters, row):
        start = time.monotonic()
        time.sleep(parameters.get("s", 0.3))
        with self.lock:
            self.spans.append((start, time.monotonic()))
        return ToolResult(f"slept {parameters.get('s', 0.3)}", reward=0.25, metrics={"naps": 1})


class CountingTool:
    """create / release counted per trajectory; state kept on the (per-trajectory) copy."""

    name = "counting"
    tool_schema = {"type": "function", "function": {"name": "counting", "description": "Count.", "parameters": {}}}

    def __init__(self):
        self.events = []  # shared by the copies: a shallow copy shares the list
        self.label = None

    def create(self, row):
        self.label = row["label"]
        self.events.append(("create", row["label"]))

    def execute(self, parameters, row):
        return f"label={self.label}"

    def release(self):
        self.events.append(("release", self.label))


def broken(x: int) -> str:
    """Always fails."""
    raise RuntimeError(f"disk on fire ({x})")


def overlap(spans):
    """True when every span overlaps every other (they all ran at once)."""
    return max(s for s, _ in spans) < min(e for _, e in spans)


def test_calls_of_a_turn_run_concurrently():
    sleep = SleepTool()
    executor = ToolExecutor([sleep], max_workers=4, timeout=5)
    executor.start(0, {})
    started = time.monotonic()
    turn = executor.run(0, [ToolCall("sleep", {"s": 0.3}), ToolCall("sleep", {"s": 0.3})])
    elapsed = time.monotonic() - started
    assert turn.messages == ["slept 0.3", "slept 0.3"]
    assert overlap(sleep.spans), sleep.spans
    assert elapsed < 0.55  # one sleep, not two, plus thread start-up
    assert turn.reward == 0.5 and turn.metrics == {"sleep": {"naps": 2.0}} and turn.failures == turn.timeouts == 0
    assert 0.55 < turn.seconds < 1.0  # the sum of the calls' wall times


def test_max_workers_bounds_concurrency_across_trajectories():
    sleep = SleepTool()
    executor = ToolExecutor([sleep], max_workers=1, timeout=5)
    for t in (0, 1):
        executor.start(t, {})
    futures = [executor.submit(t, [ToolCall("sleep", {"s": 0.1})]) for t in (0, 1)]
    assert [f.result().messages for f in futures] == [["slept 0.1"], ["slept 0.1"]]
    (a_start, a_end), (b_start, b_end) = sorted(sleep.spans)
    assert b_start >= a_end  # one slot: one after the other


def test_failures_unknown_tools_and_timeouts_are_messages_and_counted():
    executor = ToolExecutor([SleepTool(), function_tool(broken)], max_workers=4, timeout=0.2)
    executor.start("t", {})
    turn = executor.run("t", [
        ToolCall("broken", {"x": 1}), ToolCall("nope", {}), ToolCall("sleep", {"s": 1.0}),
        ToolCall("sleep", {"s": 0.01}), ToolCall("broken", {}),
    ])
    failed, unknown, timed_out, ok, bad_arguments = turn.messages
    assert failed == "error: tool 'broken' failed: RuntimeError: disk on fire (1)"
    assert unknown == "error: unknown tool 'nope'; the tools are: broken, sleep"
    assert timed_out == "error: tool 'sleep' timed out after 0.2 s"
    assert ok == "slept 0.01"
    assert bad_arguments.startswith("error: tool 'broken' failed: ValueError: missing argument(s) x")
    assert (turn.failures, turn.timeouts, turn.refused) == (3, 1, 0)
    assert 0.2 <= turn.seconds < 1.0  # the timed-out call counts its timeout


def test_a_tools_own_timeout_is_counted_as_a_timeout():
    def slow_code(code: str) -> str:
        """Pretends its subprocess ran over."""
        raise ToolTimeout("partial output\nerror: the code ran longer than 1 s and was stopped")

    executor = ToolExecutor([function_tool(slow_code)])
    executor.start(1, {})
    turn = executor.run(1, [ToolCall("slow_code", {"code": ""})])
    assert turn.messages == ["partial output\nerror: the code ran longer than 1 s and was stopped"]
    assert (turn.failures, turn.timeouts) == (0, 1)


def test_a_hung_call_gives_its_worker_slot_back():
    release = threading.Event()

    def hang(x: int) -> str:
        """Blocks until the test lets it go."""
        release.wait(10)
        return "late"

    def quick(x: int) -> str:
        """Answers at once."""
        return "quick"

    executor = ToolExecutor([function_tool(hang), function_tool(quick)], max_workers=1, timeout=0.2)
    executor.start(0, {})
    try:
        assert executor.run(0, [ToolCall("hang", {"x": 1})]).timeouts == 1
        started = time.monotonic()
        quick_turn = executor.submit(0, [ToolCall("quick", {"x": 1})]).result(timeout=5)  # not forever if it hangs
        assert quick_turn.messages == ["quick"]  # the one slot is free again
        assert time.monotonic() - started < 0.15
    finally:
        release.set()


def test_calls_beyond_max_parallel_calls_are_refused():
    sleep = SleepTool()
    executor = ToolExecutor([sleep], max_parallel_calls=2)
    executor.start(0, {})
    turn = executor.run(0, [ToolCall("sleep", {"s": 0.01})] * 3)
    assert turn.messages[:2] == ["slept 0.01"] * 2
    assert turn.messages[2] == "error: at most 2 tool calls are run per turn; this call was not run"
    assert turn.refused == 1 and len(sleep.spans) == 2


def test_create_and_release_once_per_trajectory_on_its_own_copy():
    counting = CountingTool()
    executor = ToolExecutor([counting, SleepTool()])
    executor.start("a", {"label": "A"})
    executor.start("b", {"label": "B"})
    for _ in range(2):
        assert executor.run("a", [ToolCall("counting", {})]).messages == ["label=A"]
        assert executor.run("b", [ToolCall("counting", {})]).messages == ["label=B"]
    executor.finish("a")
    executor.finish("b")
    executor.finish("b")  # a second finish is a no-op
    assert counting.events == [("create", "A"), ("create", "B"), ("release", "A"), ("release", "B")]
    assert counting.label is None  # the shared instance was never touched


def test_a_failing_create_answers_that_tools_calls_with_its_error():
    class Fragile(CountingTool):
        name = "fragile"
        tool_schema = {"type": "function", "function": {"name": "fragile", "parameters": {}}}

        def create(self, row):
            raise OSError("no sandbox left")

    executor = ToolExecutor([Fragile()])
    executor.start(0, {"label": "x"})
    turn = executor.run(0, [ToolCall("fragile", {})])
    assert turn.messages == ["error: tool 'fragile' could not start: OSError: no sandbox left"]
    assert turn.failures == 1
    executor.finish(0)


def test_misuse_is_refused_by_name():
    executor = ToolExecutor([SleepTool()])
    with pytest.raises(KeyError, match="trajectory 7 was not started"):
        executor.submit(7, [])
    executor.start(7, {})
    with pytest.raises(ValueError, match="started twice"):
        executor.start(7, {})
    with pytest.raises(ValueError, match="two tools are named 'sleep'"):
        ToolExecutor([SleepTool(), SleepTool()])
    assert executor.run(7, []).messages == []
    assert [s["function"]["name"] for s in executor.schemas] == ["sleep"]


def test_an_async_tool_is_awaited_in_its_worker_thread():
    async def add(a: int, b: int) -> int:
        """Add two integers, asynchronously."""
        return a + b

    executor = ToolExecutor([function_tool(add)])
    executor.start(0, {})
    assert executor.run(0, [ToolCall("add", {"a": 2, "b": 3})]).messages == ["5"]


# ------------------------------------------------------------------ any answer becomes text, or a counted failure
class AnswerTool:
    """Returns whatever the call's `kind` names: the answers and rewards the sweep found crashing or passing."""

    name = "answer"
    tool_schema = {"type": "function", "function": {"name": "answer", "description": "Answer.", "parameters": {}}}
    ANSWERS = {
        "int_text": lambda: ToolResult(text=12345),
        "surrogate": lambda: "half a pair: \ud800 here",
        "bytes": lambda: b"caf\xc3\xa9 \xff",
        "none_text": lambda: ToolResult(text=None),
        "huge_reward": lambda: ("ok", 1e30),
        "inf_reward": lambda: ToolResult("ok", reward=float("inf")),
        "nan_reward": lambda: ("ok", float("nan")),
        "fine_reward": lambda: ("ok", 0.5),
        "text_reward": lambda: ("ok", "high"),
        "exit": lambda: sys.exit(3),
        "interrupt": lambda: (_ for _ in ()).throw(KeyboardInterrupt("stop")),
    }

    def execute(self, parameters, row):
        return self.ANSWERS[parameters["kind"]]()


def _answer(*kinds, timeout=10.0):
    executor = ToolExecutor([AnswerTool()], timeout=timeout, max_parallel_calls=len(kinds))
    executor.start("t", {})
    turn = executor.run("t", [ToolCall("answer", {"kind": k}) for k in kinds])
    executor.finish("t")
    return turn


def test_an_answer_of_any_type_or_encoding_becomes_text_the_tokenizer_takes(qwen_tok):
    turn = _answer("int_text", "surrogate", "bytes", "none_text")
    assert turn.messages[0] == "12345" and turn.messages[3] == ""
    assert turn.messages[1] == "half a pair: \ufffd\ufffd\ufffd here" and turn.messages[2] == "café \ufffd"
    assert turn.failures == 0 and turn.timeouts == 0
    delta = ToolDelta(qwen_tok, max_tool_response_length=16)  # the path that raised (truncate_text, the tokenizer)
    ids = delta.delta_ids(turn.messages)
    assert "12345" in qwen_tok.decode(ids) and "café" in qwen_tok.decode(ids)


def test_a_reward_that_is_not_finite_or_beyond_the_limit_is_dropped_and_counted(caplog):
    turn = _answer("huge_reward", "inf_reward", "nan_reward", "fine_reward")
    assert turn.messages == ["ok"] * 4  # the answers still reach the model
    assert turn.reward == 0.5 and turn.failures == 3
    named = [r.getMessage() for r in caplog.records if "tool 'answer' returned the reward" in r.getMessage()]
    assert len(named) == 1 and "1e+30" in named[0] and "within +-1e+06" in named[0]
    turn = _answer("text_reward")
    assert turn.failures == 1 and "a tool's reward must be a number or None, got str" in turn.messages[0]


@pytest.mark.parametrize("kind, name", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")])
def test_a_tool_that_exits_is_a_failure_at_once_not_a_timeout(kind, name):
    start = time.monotonic()
    turn = _answer(kind, timeout=5.0)
    assert time.monotonic() - start < 2.0  # not the whole --tool-timeout
    assert turn.failures == 1 and turn.timeouts == 0
    assert turn.messages[0].startswith(f"error: tool 'answer' failed: {name}")
