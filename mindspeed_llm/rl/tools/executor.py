"""Runs the tool calls of many trajectories at once, off the generation loop: a turn's calls are submitted together
and their messages come back in a `Future`, so the engine keeps decoding other samples while tools run.

Per trajectory: `ToolExecutor.start` (each tool's ``create(row)`` on its own copy), `ToolExecutor.submit` for each
turn that calls tools, `ToolExecutor.finish` (``release()``). A failing call (any exception, ``SystemExit`` and
``KeyboardInterrupt`` raised by the tool's code included: counted at once, not after the timeout), an unknown tool
name and a call that runs over the timeout each answer with an error text as that call's message and are counted;
nothing raises into the caller. A tool's answer of any type becomes text (`base.as_tool_result`). A tool's reward
must be a finite number of magnitude at most `MAX_TOOL_REWARD`: another is dropped (the call's reward counts 0), the
call is counted as failed and the first such reward of each tool is logged by name; the call's text still answers.

Threads: each call runs on its own daemon thread once one of ``max_workers`` slots is free, and a per-turn thread
waits for the turn's calls. A Python thread cannot be killed, so a call that runs over ``timeout`` is answered as
timed out and its slot is given back at once; its thread finishes (or hangs) in the background without holding a
slot, and its late result is dropped. The built-in python tool kills its own subprocess at its own time limit
(``config.timeout``, keep it below the executor's), so its threads do end.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence

from mindspeed_llm.rl.tools.adapters import adapt_tool
from mindspeed_llm.rl.tools.base import (
    ToolResult, ToolTimeout, as_text, as_tool_result, resolve, schema_dict, tool_name,
)

MAX_ERROR_CHARS = 500
MAX_TOOL_REWARD = 1e6  # the largest magnitude of one call's reward (a score of 1e30 would swamp every advantage)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnResult:
    """One turn's answers: ``messages[i]`` answers call ``i`` (in call order, refused calls included)."""

    messages: List[str]
    reward: float = 0.0  # the sum of the calls' own rewards
    # the calls' own metrics (`ToolResult.metrics`), summed by tool and key: {tool name: {metric: sum}}
    metrics: Dict[str, Dict[str, float]] = field(default_factory=dict)
    failures: int = 0
    timeouts: int = 0
    seconds: float = 0.0  # the sum of the calls' wall times
    refused: int = 0  # calls beyond max_parallel_calls, not run


@dataclass
class _Outcome:
    result: ToolResult
    failed: bool = False
    timed_out: bool = False
    seconds: float = 0.0


class _CallSlot:
    """One call's state, shared by its thread and the turn's waiting thread; ``lock`` makes exactly one of them
    settle the outcome and give the worker slot back."""

    def __init__(self, name: Any):
        self.name = name
        self.lock = threading.Lock()
        self.started = threading.Event()
        self.done = threading.Event()
        self.start_time = 0.0
        self.outcome: Optional[_Outcome] = None


def _error_text(text: str) -> str:
    text = as_text(text)  # an exception's message may hold what a tokenizer refuses (a lone surrogate)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


class _Session:
    def __init__(self, row: Mapping[str, Any], tools: Dict[str, Any], broken: Dict[str, str]):
        self.row = row
        self.tools = tools  # name -> this trajectory's tool (a copy when the tool has create / release)
        self.broken = broken  # name -> why its create() failed


class ToolExecutor:
    """Tool calls of many trajectories in a bounded set of worker threads, each call with a timeout."""

    def __init__(self, tools: Iterable[Any], max_workers: int = 8, timeout: float = 30.0,
                 max_parallel_calls: int = 8):
        if max_workers < 1 or max_parallel_calls < 1 or not timeout > 0:
            raise ValueError("ToolExecutor needs max_workers >= 1, max_parallel_calls >= 1 and timeout > 0")
        self.tools: Dict[str, Any] = {}
        for tool in tools:
            tool = adapt_tool(tool)
            name = tool_name(tool)
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}; each tool needs its own function name")
            self.tools[name] = tool
        self.timeout = float(timeout)
        self.max_parallel_calls = int(max_parallel_calls)
        self._slots = threading.BoundedSemaphore(max_workers)
        self._sessions: Dict[Hashable, _Session] = {}
        self._lock = threading.Lock()
        self._bad_reward_tools: set = set()

    @property
    def schemas(self) -> List[Dict[str, Any]]:
        """The tools' OpenAI schemas, for the prompt (`chat_delta.tools_prompt`)."""
        return [schema_dict(tool.tool_schema) for tool in self.tools.values()]

    # ---- trajectories ---------------------------------------------------------------------------------------
    def start(self, trajectory_id: Hashable, row: Mapping[str, Any]) -> None:
        """Begin a trajectory: each tool with ``create`` / ``release`` gets its own copy and ``create(row)``."""
        tools, broken = {}, {}
        for name, tool in self.tools.items():
            if not (callable(getattr(tool, "create", None)) or callable(getattr(tool, "release", None))):
                tools[name] = tool
                continue
            own = copy.copy(tool)
            try:
                if callable(getattr(own, "create", None)):
                    resolve(own.create(row))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the trajectory's calls to this tool say why
                # (the caller's thread: a real Ctrl-C still stops the run)
                broken[name] = _error_text(f"error: tool {name!r} could not start: {type(exc).__name__}: {exc}")
            tools[name] = own
        with self._lock:
            if trajectory_id in self._sessions:
                raise ValueError(f"trajectory {trajectory_id!r} was started twice without finish()")
            self._sessions[trajectory_id] = _Session(row, tools, broken)

    def finish(self, trajectory_id: Hashable) -> None:
        """End a trajectory: ``release()`` on its copies (errors are swallowed: the trajectory is over anyway)."""
        with self._lock:
            session = self._sessions.pop(trajectory_id, None)
        if session is None:
            return
        for name, tool in session.tools.items():
            if tool is not self.tools[name] and name not in session.broken and callable(getattr(tool, "release", None)):
                try:
                    resolve(tool.release())
                except (Exception, SystemExit):  # noqa: BLE001 - the trajectory is over; a tool's exit ends nothing
                    pass

    # ---- calls ----------------------------------------------------------------------------------------------
    def submit(self, trajectory_id: Hashable, calls: Sequence[Any]) -> "Future[TurnResult]":
        """Run one turn's calls (objects with ``name`` and ``arguments``, e.g. `parsers.ToolCall`); the future's
        `TurnResult` has one message per call, in call order."""
        with self._lock:
            session = self._sessions.get(trajectory_id)
        if session is None:
            raise KeyError(f"trajectory {trajectory_id!r} was not started (call start(trajectory_id, row) first)")
        future: "Future[TurnResult]" = Future()
        future.set_running_or_notify_cancel()
        allowed = list(calls[: self.max_parallel_calls])
        slots = [self._launch(session, call) for call in allowed]
        threading.Thread(target=self._finish_turn, args=(future, slots, len(calls) - len(allowed)),
                         name="tool-turn", daemon=True).start()
        return future

    def run(self, trajectory_id: Hashable, calls: Sequence[Any]) -> TurnResult:
        """`submit` and wait."""
        return self.submit(trajectory_id, calls).result()

    def _launch(self, session: _Session, call: Any) -> _CallSlot:
        slot = _CallSlot(getattr(call, "name", None))
        threading.Thread(target=self._run_call, args=(session, call, slot), name="tool-call", daemon=True).start()
        return slot

    def _run_call(self, session: _Session, call: Any, slot: _CallSlot) -> None:
        self._slots.acquire()
        slot.start_time = time.monotonic()
        slot.started.set()
        outcome = self._call_tool(session, call)
        with slot.lock:
            if slot.outcome is not None:  # answered as timed out already; that side gave the worker slot back
                return
            outcome.seconds = time.monotonic() - slot.start_time
            slot.outcome = outcome
            self._slots.release()
        slot.done.set()

    def _call_tool(self, session: _Session, call: Any) -> _Outcome:
        name, arguments = getattr(call, "name", None), getattr(call, "arguments", None)
        tool = session.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return _Outcome(ToolResult(f"error: unknown tool {name!r}; the tools are: {known}"), failed=True)
        if name in session.broken:
            return _Outcome(ToolResult(session.broken[name]), failed=True)
        if not isinstance(arguments, Mapping):
            return _Outcome(ToolResult(f"error: the arguments of {name!r} must be an object"), failed=True)
        try:
            return self._checked_reward(name, as_tool_result(resolve(tool.execute(dict(arguments), session.row))))
        except ToolTimeout as exc:
            return _Outcome(ToolResult(_error_text(str(exc))), timed_out=True)
        except BaseException as exc:  # noqa: BLE001 - any failure of a tool (SystemExit, KeyboardInterrupt raised by
            # its code: this is a worker thread, which a real Ctrl-C never reaches) is the model's message
            return _Outcome(ToolResult(_error_text(f"error: tool {name!r} failed: {type(exc).__name__}: {exc}")),
                            failed=True)

    def _checked_reward(self, name: Any, result: ToolResult) -> _Outcome:
        """The call's outcome; a reward that is not finite or exceeds `MAX_TOOL_REWARD` is dropped and counted."""
        reward = result.reward
        if reward is None or (math.isfinite(reward) and abs(reward) <= MAX_TOOL_REWARD):
            return _Outcome(result)
        with self._lock:
            first = name not in self._bad_reward_tools
            self._bad_reward_tools.add(name)
        if first:
            logger.warning("tool %r returned the reward %r: a tool's reward must be a finite number within +-%g; "
                           "this call's reward is dropped and the call counted in tool/failures (further ones of "
                           "this tool are counted without this message)", name, reward, MAX_TOOL_REWARD)
        return _Outcome(ToolResult(result.text, None, result.metrics), failed=True)

    def _wait(self, slot: _CallSlot) -> _Outcome:
        slot.started.wait()  # waiting for a free worker slot does not count against the call's timeout
        remaining = self.timeout - (time.monotonic() - slot.start_time)
        if slot.done.wait(max(remaining, 0.0)):
            return slot.outcome
        with slot.lock:
            if slot.outcome is None:
                slot.outcome = _Outcome(ToolResult(f"error: tool {slot.name!r} timed out after {self.timeout:g} s"),
                                        timed_out=True, seconds=self.timeout)
                self._slots.release()  # the hung thread keeps running without a slot
        return slot.outcome

    def _finish_turn(self, future: "Future[TurnResult]", slots: List[_CallSlot], refused: int) -> None:
        try:
            outcomes = [self._wait(slot) for slot in slots]
            result = self._turn_result(outcomes, refused, [str(slot.name) for slot in slots])
        except BaseException as exc:  # noqa: BLE001 - never leave the caller waiting forever
            future.set_exception(exc)
            return
        future.set_result(result)

    def _turn_result(self, outcomes: List[_Outcome], refused: int, names: List[str]) -> TurnResult:
        messages = [outcome.result.text for outcome in outcomes]
        messages += [f"error: at most {self.max_parallel_calls} tool calls are run per turn; this call was not run"
                     ] * refused
        metrics: Dict[str, Dict[str, float]] = {}
        for name, outcome in zip(names, outcomes):
            for key, value in outcome.result.metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    own = metrics.setdefault(name, {})
                    own[str(key)] = own.get(str(key), 0.0) + float(value)
        result = TurnResult(
            messages=messages,
            reward=sum(o.result.reward for o in outcomes if o.result.reward is not None),
            metrics=metrics,
            failures=sum(o.failed for o in outcomes),
            timeouts=sum(o.timed_out for o in outcomes),
            seconds=sum(o.seconds for o in outcomes),
            refused=refused,
        )
        return result

    def close(self) -> None:
        """Release every trajectory still open."""
        for trajectory_id in list(self._sessions):
            self.finish(trajectory_id)
