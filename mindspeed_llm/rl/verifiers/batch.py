"""Scoring a batch of responses with the selected verifiers: each verifier's scores and failure count (a
verifier that raises or times out scores 0 there, logged a few times), and their logging metrics. Mixing the
scores with their weights and a reward model is `rl/scoring.py`'s job."""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

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


def score_batch(responses: Sequence[str], labels: Optional[Sequence[Optional[str]]],
                verifier_names: Sequence[str]) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Score every response with each named verifier: ``(per_verifier, failures)``, each verifier's unweighted
    scores and how many rows it crashed or timed out on (scored 0 there).

    Raises ``ValueError`` for mismatched lengths or an unknown verifier name, and :class:`MissingLabelError`
    (with ``row_index``) when a verifier that needs a label meets a row without one; both before any scoring.
    """
    names = list(verifier_names)
    check_verifiers(names, [1.0] * len(names))
    specs = [_spec(name) for name in names]
    responses = list(responses)
    labels = [None] * len(responses) if labels is None else list(labels)
    if len(labels) != len(responses):
        raise ValueError(f"got {len(responses)} responses but {len(labels)} labels")
    label_strs: List[Optional[str]] = [None if label_missing(lb) else str(lb) for lb in labels]
    for name, spec in zip(names, specs):
        if spec.requires_label:
            for i, lb in enumerate(label_strs):
                if lb is None:
                    raise MissingLabelError(name, i)

    per_verifier: Dict[str, List[float]] = {}
    failures: Dict[str, int] = {}
    for name, spec in zip(names, specs):
        scores: List[float] = []
        failed = 0
        for i, (resp, lb) in enumerate(zip(responses, label_strs)):
            try:
                value = float(spec.fn(resp, lb))
                if not math.isfinite(value):
                    raise ValueError(f"verifier returned a non-finite score {value}")
            except MissingLabelError as exc:
                raise MissingLabelError(name, i) from exc
            except Exception as exc:  # noqa: BLE001 - a weird string must never end the run
                _warn_failure(name, i, exc)
                value = 0.0
                failed += 1
            scores.append(value)
        per_verifier[name] = scores
        failures[name] = failed
    return per_verifier, failures


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
