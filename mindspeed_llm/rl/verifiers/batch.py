"""Scoring a batch of responses with the selected verifiers (and a user's reward function): each one's scores and
failure count (a verifier that raises, times out or returns no finite number scores 0 there, logged a few times),
and their logging metrics. Each is given what its signature asks for: text and label, the dataset row, the
trajectory (`verifiers/calling.py`). Mixing the scores with their weights and a reward model is
`rl/scoring.py`'s job."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from mindspeed_llm.errors import UserError
from mindspeed_llm.rl.verifiers.calling import CallPlan, as_score, call_plan
from mindspeed_llm.rl.verifiers.registry import MissingLabelError, _spec, check_verifiers, label_missing

logger = logging.getLogger(__name__)

_WARN_LIMIT = 5
_warned: Dict[str, int] = {}


def _warn_failure(name: str, row: int, exc: BaseException) -> None:
    count = _warned.get(name, 0)
    if count < _WARN_LIMIT:
        _warned[name] = count + 1
        suffix = " (further failures of this verifier are not logged)" if count + 1 == _WARN_LIMIT else ""
        logger.warning("verifier '%s' failed on row %d (scored 0): %s: %s%s",
                       name, row, type(exc).__name__, str(exc)[:200], suffix)


class RewardFunctionExit(UserError):
    """A verifier or reward function tried to end the process (``sys.exit()``, ``exit()``, a ``KeyboardInterrupt``
    it raised, or a real Ctrl-C while it ran): the run stops naming it, the row and what it did, instead of ending
    silently with the function's exit code."""


def describe_function(name: str, fn: Callable) -> str:
    """``'compute_score' in /path/file.py`` (or the scorer's name alone when the source is unknown)."""
    target = getattr(fn, "__wrapped__", fn)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    try:
        where = inspect.getsourcefile(target)
    except TypeError:
        where = None
    return f"'{name}' ('{qualname}'{f' in {where}' if where else ''})"


def _exit_error(name: str, fn: Callable, row: int, index, exc: BaseException) -> RewardFunctionExit:
    if isinstance(exc, SystemExit):
        did = f"called sys.exit({exc.code!r})"
    else:
        did = f"raised {type(exc).__name__} (itself, or the run was interrupted while it ran)"
    at = f"row {row} of the batch" + ("" if index is None else f" (prompt {index} of the dataset)")
    return RewardFunctionExit(
        f"the reward function {describe_function(name, fn)} {did} on {at}: a reward function must return a score "
        "(an exception it raises scores 0 there and is counted in "
        f"{name}_rewards/failures); remove the exit from it")


@dataclass(frozen=True)
class RewardFunction:
    """A function scored like a verifier but not in the registry (`--custom-reward-function`): its call plan is
    read once (`calling.call_plan`)."""
    fn: Callable
    plan: CallPlan
    requires_label: bool = False

    @classmethod
    def of(cls, fn: Callable, what: str = "the reward function") -> "RewardFunction":
        return cls(fn, call_plan(fn, what))


@dataclass
class BatchScores:
    """Each scorer's unweighted scores (`per_verifier`, by name), how many rows it crashed or timed out on
    (`failures`, scored 0 there), and the numeric entries of mapping returns by key (`extra`, over the rows that
    gave them)."""
    per_verifier: Dict[str, List[float]] = field(default_factory=dict)
    failures: Dict[str, int] = field(default_factory=dict)
    extra: Dict[str, List[float]] = field(default_factory=dict)
    first_failure: Dict[str, str] = field(default_factory=dict)  # the first error of each scorer that failed

    def metrics(self) -> Dict[str, float]:
        """`reward_metrics` plus ``reward/<key>/mean`` of each extra entry."""
        out = reward_metrics(self.per_verifier, self.failures)
        out.update({f"reward/{key}/mean": sum(v) / len(v) for key, v in self.extra.items() if v})
        return out


def score_batch(responses: Sequence[str], labels: Optional[Sequence[Optional[str]]],
                verifier_names: Sequence[str]) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Score every response with each named verifier: ``(per_verifier, failures)``, each verifier's unweighted
    scores and how many rows it crashed or timed out on (scored 0 there). `score_rows` with no rows, trajectories
    or further functions (a verifier that declares ``row`` gets ``{"labels": label}``)."""
    scores = score_rows(responses, labels, verifier_names)
    return scores.per_verifier, scores.failures


def score_rows(responses: Sequence[str], labels: Optional[Sequence[Optional[str]]],
               verifier_names: Sequence[str] = (), *, rows: Optional[Sequence[Mapping]] = None,
               trajectories: Optional[Sequence[Optional[Mapping]]] = None,
               functions: Optional[Mapping[str, RewardFunction]] = None) -> BatchScores:
    """Score every response with each named verifier and each of `functions` (by their names), giving each what
    its signature asks for (`verifiers/calling.py`): the text and label, the row (`rows`: a dict per response,
    every column of its dataset row; default ``{"labels": label}``) and the trajectory (`trajectories`: one per
    response, None for single-turn ones; default None).

    Raises ``ValueError`` for mismatched lengths, an unknown verifier name or a function named like a verifier,
    and :class:`MissingLabelError` (with ``row_index``) when a verifier that needs a label meets a row without
    one; all before any scoring.
    """
    names = list(verifier_names)
    check_verifiers(names, [1.0] * len(names))
    functions = dict(functions or {})
    clash = set(names) & set(functions)
    if clash:
        raise ValueError(f"{', '.join(sorted(clash))} is both a --verifier-function and a reward function's name")
    specs = [(name, _spec(name)) for name in names] + list(functions.items())
    responses = list(responses)
    labels = [None] * len(responses) if labels is None else list(labels)
    rows = [{"labels": lb} for lb in labels] if rows is None else list(rows)
    trajectories = [None] * len(responses) if trajectories is None else list(trajectories)
    for what, values in (("labels", labels), ("rows", rows), ("trajectories", trajectories)):
        if len(values) != len(responses):
            raise ValueError(f"got {len(responses)} responses but {len(values)} {what}")
    label_strs: List[Optional[str]] = [None if label_missing(lb) else str(lb) for lb in labels]
    for name, spec in specs:
        if spec.requires_label:
            for i, lb in enumerate(label_strs):
                if lb is None:
                    raise MissingLabelError(name, i)

    out = BatchScores()
    for name, spec in specs:
        scores: List[float] = []
        failed = 0
        for i, (resp, lb) in enumerate(zip(responses, label_strs)):
            try:
                value, extra = as_score(spec.plan.call(spec.fn, resp, lb, rows[i], trajectories[i]))
            except MissingLabelError as exc:
                raise MissingLabelError(name, i) from exc
            except Exception as exc:  # noqa: BLE001 - a weird string must never end the run
                _warn_failure(name, i, exc)
                value, extra = 0.0, {}
                failed += 1
                out.first_failure.setdefault(name, f"row {i}: {type(exc).__name__}: {str(exc)[:200]}")
            except (SystemExit, KeyboardInterrupt) as exc:  # the user's code tried to end the process: say so
                raise _exit_error(name, spec.fn, i, rows[i].get("index"), exc) from None
            scores.append(value)
            for key, item in extra.items():
                out.extra.setdefault(key, []).append(item)
        out.per_verifier[name] = scores
        out.failures[name] = failed
    return out


def reward_metrics(per_verifier: Dict[str, Sequence[float]], failures: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """Logging helpers: ``{name}_rewards/mean`` per verifier (MindSpeed-RL's metric name) and
    ``{name}_rewards/failures`` when ``failures`` is given."""
    out: Dict[str, float] = {}
    for name, scores in per_verifier.items():
        scores = list(scores)
        if scores:
            out[f"{name}_rewards/mean"] = sum(scores) / len(scores)
    for name, count in (failures or {}).items():
        out[f"{name}_rewards/failures"] = float(count)
    return out
