"""The multi-turn trajectory of one sample, as the rollout records it (`SampleData.trajectories`, one per row; None
for a single-turn response) and the verifiers and reward functions read it (a parameter named ``trajectory``,
`verifiers/calling.py`).

It is plain Python data -- dicts, lists, strings, numbers, booleans -- so it pickles, goes through JSON (a partial
rollout's state, a worker process) and compares with ``==``::

    {
        "turns": [                                   # in order, the prompt not included
            {"role": "assistant", "text": "...",     # the model's turn, decoded
             "tool_calls": [{"name": "calculator", "arguments": {"expression": "12*7"}}]},
            {"role": "tool", "text": "84",           # a tool's message, as the model was shown it (truncated)
             "name": "calculator", "reward": 0.0, "error": False},
            {"role": "assistant", "text": "The answer is 84.", "tool_calls": []},
        ],
        "num_turns": 2,       # assistant turns
        "tool_calls": 1,      # tool calls made (parsed and run or refused)
        "tool_reward": 0.0,   # the sum of the tools' own rewards; the scorer adds it to the score, weight 1
    }

A tool turn's ``name``, ``reward`` and ``error`` are optional; the rollout may add further keys (the readers ignore
what they do not know). :func:`check_trajectory` checks the shape (tests/unit/test_multi_turn_trajectories.py holds
`rl/rollouts/tool_turns.trajectories`, which makes them, to it).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List

try:  # Python >= 3.11
    from typing import NotRequired, TypedDict
except ImportError:  # pragma: no cover - older Pythons
    from typing_extensions import NotRequired, TypedDict


class ToolCall(TypedDict):
    name: str
    arguments: Dict[str, Any]  # the parsed JSON arguments


class Turn(TypedDict):
    role: str  # "assistant" | "tool"
    text: str
    tool_calls: NotRequired[List[ToolCall]]  # assistant turns: the calls parsed from it ([] or absent: none)
    name: NotRequired[str]  # tool turns: the tool that answered
    reward: NotRequired[float]  # tool turns: the tool's own reward (0 when it gives none)
    error: NotRequired[bool]  # tool turns: the call failed or timed out (its text is the error message)


class Trajectory(TypedDict):
    turns: List[Turn]
    num_turns: int  # assistant turns
    tool_calls: int
    tool_reward: float  # the sum of the tools' rewards


ROLES = ("assistant", "tool")


def check_trajectory(trajectory) -> None:
    """``ValueError`` naming what is wrong when `trajectory` is not of the shape above (or not JSON-able)."""
    if not isinstance(trajectory, dict):
        raise ValueError(f"a trajectory is a dict, not {type(trajectory).__name__}")
    missing = [k for k in Trajectory.__annotations__ if k not in trajectory]
    if missing:
        raise ValueError(f"trajectory lacks {', '.join(missing)}")
    if not isinstance(trajectory["turns"], list):
        raise ValueError("trajectory['turns'] must be a list")
    for i, turn in enumerate(trajectory["turns"]):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("text"), str):
            raise ValueError(f"turn {i} must be a dict with role in {ROLES} and a text string, got {turn!r:.200}")
        for call in turn.get("tool_calls") or []:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                    or not isinstance(call.get("arguments"), dict):
                raise ValueError(f"turn {i}: a tool call is {{'name': str, 'arguments': dict}}, got {call!r:.200}")
    for key in ("num_turns", "tool_calls"):
        if not isinstance(trajectory[key], int) or isinstance(trajectory[key], bool) or trajectory[key] < 0:
            raise ValueError(f"trajectory[{key!r}] must be an integer >= 0, got {trajectory[key]!r}")
    reward = trajectory["tool_reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"trajectory['tool_reward'] must be a finite number, got {reward!r}")
    try:
        json.dumps(trajectory, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a trajectory must be plain JSON-able data: {exc}") from None
