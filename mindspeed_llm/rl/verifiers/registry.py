"""The verifier registry: a verifier is a plain function ``fn(response_text: str, label: str | None) -> float``
registered by name; the stages select them with ``--verifier-function NAME ...`` and weigh them with
``--verifier-weight W ...``. Names and weights are validated here (`check_verifiers`), once. A verifier that
declares ``row`` / ``trajectory`` (or verl's parameter names) gets them: its signature is read once, when it is
registered (`verifiers/calling.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.verifiers.calling import CallPlan, call_plan

class MissingLabelError(ValueError):
    """A verifier that needs a reference answer got a row without one.

    ``row_index`` is the position of the row in the batch given to :func:`score_batch` (``None`` when a
    verifier is called directly); the caller maps it back to its dataset index for the message.
    """

    def __init__(self, verifier: str, row_index: Optional[int] = None):
        self.verifier = verifier
        self.row_index = row_index
        where = f"row {row_index}" if row_index is not None else "a row"
        super().__init__(
            f"verifier '{verifier}' needs a label (reference answer) but {where} has none; "
            "check the dataset's label column (e.g. DeepScaleR 'answer', DAPO 'reward_model.ground_truth')"
        )

    def __reduce__(self):  # keep it picklable across processes
        return (type(self), (self.verifier, self.row_index))


class VerifierTimeout(RuntimeError):
    """A verifier exceeded its time budget (counted as a failure by :func:`score_batch`)."""


Verifier = Callable[[str, Optional[str]], float]


@dataclass(frozen=True)
class _VerifierSpec:
    fn: Verifier
    requires_label: bool
    plan: CallPlan = CallPlan("verifier")


_REGISTRY = Registry()  # name -> _VerifierSpec


def register_verifier(name: str, *, requires_label: bool = False, override: bool = False):
    """Decorator registering ``fn(response_text, label) -> float`` under ``name`` (or a function that takes
    ``row`` / ``trajectory`` as well, `verifiers/calling.py`).

    ``requires_label=True`` makes :func:`score_batch` reject rows whose label is missing (with
    :class:`MissingLabelError` naming the row) before anything is scored. Registering a name twice
    is an error unless ``override=True``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError("verifier name must be a non-empty string")

    def decorator(fn: Verifier) -> Verifier:
        if name in _REGISTRY and not override:
            raise ValueError(f"verifier '{name}' is already registered (pass override=True to replace it)")
        plan = call_plan(fn, f"verifier '{name}'")  # a signature nothing can fill fails here, naming the parameter
        _REGISTRY[name] = _VerifierSpec(fn=fn, requires_label=bool(requires_label), plan=plan)
        return fn

    return decorator


def available_verifiers() -> List[str]:
    """Names of all registered verifiers, sorted."""
    return sorted(_REGISTRY)


def _spec(name: str) -> _VerifierSpec:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown verifier function {name!r}; valid names: {', '.join(available_verifiers())}"
        ) from None


def get_verifier(name: str) -> Verifier:
    """The verifier registered under ``name``; ``ValueError`` listing the valid names otherwise."""
    return _spec(name).fn


def verifier_requires_label(name: str) -> bool:
    return _spec(name).requires_label


def check_verifiers(names: Sequence[str], weights: Sequence[float]) -> None:
    """The one validation of a verifier selection: known names (the message lists the valid ones), each once,
    one finite weight per name. Raises ``ValueError``."""
    names, weights = list(names or []), list(weights or [])
    if len(names) != len(weights):
        raise ValueError(
            f"--verifier-function has {len(names)} entr{'y' if len(names) == 1 else 'ies'} "
            f"({', '.join(map(str, names)) or 'none'}) but --verifier-weight has {len(weights)} "
            f"({', '.join(map(str, weights)) or 'none'}); give exactly one weight per verifier function"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--verifier-function lists a verifier more than once: {names}")
    try:
        finite = all(math.isfinite(float(w)) for w in weights)
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise ValueError(f"--verifier-weight values must be finite numbers, got {weights}")
    for name in names:
        _spec(name)  # unknown names fail here, listing the valid ones


def label_missing(label) -> bool:
    """No reference answer: None, NaN (a pandas gap) or a blank string."""
    if label is None:
        return True
    if isinstance(label, float) and math.isnan(label):
        return True
    return isinstance(label, str) and not label.strip()
