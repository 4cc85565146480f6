"""How a verifier or reward function is called: its signature, read once (`call_plan`), says what it takes.

Three styles, told apart by the parameters' names (never by trying a call):

* **verifier** (the built-in ones): ``fn(response_text, label) -> float``, the first two positional parameters
  whatever their names; the label is the string label or None.
* **keyword**: a verifier that also declares ``row`` and / or ``trajectory`` gets them by name:
  ``fn(text, label, *, row, trajectory)``, or only ``fn(row, trajectory)`` (a function that names no text / label
  parameter gets none). ``row`` is a dict of every dataset column of the sample (`--dataset-additional-keys`), its
  ``labels`` (as stored) and its ``index``; ``trajectory`` is the multi-turn trajectory
  (`verifiers/trajectory.py`), None for a single-turn response.
* **verl**: a function that declares ``solution_str`` or ``ground_truth`` is verl's
  ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``: ``data_source`` is the
  row's ``data_source`` column (None without one), ``solution_str`` the response text, ``ground_truth`` the
  label, ``extra_info`` a copy of the row's ``extra_info`` column (a mapping; without one, the row), with
  ``num_turns`` added for a multi-turn response in verl's agent loop's count (user + assistant turns + 1;
  ``assistant_turns`` beside it). It may declare ``row`` / ``trajectory`` as well. Only the parameters the function declares are passed (a ``**kwargs`` gets nothing more).

A parameter without a default that none of these fills is an error when the plan is made (at registration, or
when `--custom-reward-function` is loaded), naming it. A function returns a number, or a mapping with a
``score`` (verl's form): its other numeric entries are logged as ``reward/<key>/mean`` (`as_score`).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

CONTEXT = ("row", "trajectory")
VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class SignatureError(ValueError):
    """A function whose parameters the scorer cannot fill."""


@dataclass(frozen=True)
class CallPlan:
    """What a function takes, read off its signature once: `style` ("verifier", "keyword" or "verl"), the names
    of the text / label parameters passed by keyword (`text_label`; empty with `positional` set: the first two
    positional arguments), and the context it takes (`context`: "row", "trajectory"; verl's names for "verl")."""
    style: str
    positional: int = 2  # how many of (text, label) go positionally
    text_label: Tuple[str, ...] = ()
    context: Tuple[str, ...] = ()

    @property
    def needs_row(self) -> bool:
        return "row" in self.context or self.style == "verl"

    def call(self, fn: Callable, text: str, label: Optional[str], row: Optional[Mapping] = None,
             trajectory: Optional[Mapping] = None):
        """`fn`'s value for one response (`label`: the string label or None)."""
        row = {} if row is None else row
        kwargs: Dict[str, Any] = {}
        if "row" in self.context:
            kwargs["row"] = row
        if "trajectory" in self.context:
            kwargs["trajectory"] = trajectory
        if self.style == "verl":
            values = {"data_source": row.get("data_source"), "solution_str": text, "ground_truth": label}
            if "extra_info" in self.context:
                values["extra_info"] = extra_info(row, trajectory)
            kwargs.update({name: values[name] for name in VERL if name in self.context})
            return fn(**kwargs)
        args = (text, label)[:self.positional]
        kwargs.update(zip(self.text_label, (text, label)))
        return fn(*args, **kwargs)


def verl_num_turns(trajectory: Mapping) -> Optional[int]:
    """verl's ``num_turns`` of a multi-turn response: its user turns (here: the tool answers, one per turn of
    calls) + its assistant turns + 1 (verl's tool agent loop counts the prompt too; a single-turn response is 2).
    From the trajectory's ``turns``; without them each assistant turn but the last is taken as answered."""
    turns = trajectory.get("turns")
    if isinstance(turns, list):
        roles = [t.get("role") for t in turns if isinstance(t, Mapping)]
        return roles.count("assistant") + roles.count("tool") + 1
    assistant = trajectory.get("num_turns")
    return None if not isinstance(assistant, int) else assistant + max(assistant - 1, 0) + 1


def extra_info(row: Mapping, trajectory: Optional[Mapping]) -> dict:
    """verl's ``extra_info``: a copy of the row's ``extra_info`` column (a mapping, or a JSON object's text), else
    of the row; for a multi-turn response ``num_turns`` in verl's count (`verl_num_turns`, so that verl's reward
    functions, e.g. ReTool's ``(num_turns - 2) / 2``, read what they read there) and ``assistant_turns`` (the
    trajectory's own ``num_turns``: model turns)."""
    info = row.get("extra_info")
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            pass
    info = dict(info) if isinstance(info, Mapping) else dict(row)
    if trajectory is not None and "num_turns" not in info:
        info["num_turns"] = verl_num_turns(trajectory)
    if trajectory is not None and "assistant_turns" not in info:
        info["assistant_turns"] = trajectory.get("num_turns")
    return info


def call_plan(fn: Callable, what: str = "the verifier") -> CallPlan:
    """The call plan of `fn` (module doc); :class:`SignatureError` naming `what` and the parameter otherwise."""
    if not callable(fn):
        raise SignatureError(f"{what} is a {type(fn).__name__}, not a function")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the verifier convention
        return CallPlan("verifier")
    names = {p.name for p in params}
    star = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    context = tuple(p.name for p in params if p.name in CONTEXT and p.kind in _NAMED)
    if names & {"solution_str", "ground_truth"}:
        taken = set(VERL) | set(CONTEXT)
        _check_filled(params, taken, what, "verl's compute_score(data_source, solution_str, ground_truth, "
                                           "extra_info=None, **kwargs)")
        return CallPlan("verl", positional=0, context=tuple(n for n in VERL if n in names) + context)
    for p in params:
        if p.name in CONTEXT and p.kind not in _NAMED:
            raise SignatureError(f"{what}: parameter '{p.name}' must be passable by name (not positional-only)")
    if star and any(p.name in CONTEXT and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        raise SignatureError(f"{what} takes *args: declare {', '.join(context)} keyword-only (after *)")
    others = [p for p in params if p.kind in _POSITIONAL and p.name not in CONTEXT]
    slots = others[:2]
    if star or any(p.kind == inspect.Parameter.POSITIONAL_ONLY for p in slots) or not context:
        plan = CallPlan("keyword" if context else "verifier", positional=2 if star else len(slots), context=context)
    else:
        plan = CallPlan("keyword", positional=0, text_label=tuple(p.name for p in slots), context=context)
    filled = {p.name for p in slots} | set(CONTEXT)
    _check_filled(params, filled, what, "fn(text, label) or fn(text, label, *, row, trajectory)")
    return plan


def _check_filled(params, filled, what: str, form: str) -> None:
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.name not in filled and p.default is inspect.Parameter.empty:
            raise SignatureError(
                f"{what}: parameter '{p.name}' has no default and nothing fills it; a reward function is {form} "
                f"(the names it may declare: text, label, {', '.join(CONTEXT)}, or verl's {', '.join(VERL)})")


def as_score(value) -> Tuple[float, Dict[str, float]]:
    """A function's value as ``(score, metrics)``: a number, or a mapping with a ``score`` whose other numeric
    entries are metrics (verl's ``reward_extra_info``). ``ValueError`` for anything else or a non-finite score."""
    metrics: Dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a mapping without a 'score' key (keys: {', '.join(map(str, value))})")
        for key, item in value.items():
            if key != "score" and isinstance(item, (int, float)) and math.isfinite(float(item)):
                metrics[str(key)] = float(item)
        value = value["score"]
    if isinstance(value, str):
        raise ValueError(f"returned the string {value!r}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, metrics
