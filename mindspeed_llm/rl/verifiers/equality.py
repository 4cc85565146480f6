"""Whether two math texts are equal by ``math_verify`` (``parse`` + ``verify``), in the interpreter that calls it:
the one comparison that ``math_acc`` runs in its own main thread (`math.py`) and in the helper interpreter off it
(`worker.py`). A timeout that ``math_verify`` would swallow is raised as :class:`VerifierTimeout`; the parsed
labels are cached (4096, least recently used first out)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional, Tuple

from mindspeed_llm.rl.verifiers.registry import VerifierTimeout


def load_math_verify():
    import math_verify  # local: keeps importing the verifiers cheap, and the format verifiers usable without it

    return math_verify


_EXTRACTION_CONFIG = None


def _boxed_extraction_config():
    global _EXTRACTION_CONFIG
    if _EXTRACTION_CONFIG is None:
        mv = load_math_verify()
        _EXTRACTION_CONFIG = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    return _EXTRACTION_CONFIG


def _parse(text: str, extraction_config, timeout: Optional[int]) -> list:
    """``math_verify.parse`` that reports a timeout (which it otherwise swallows) as VerifierTimeout."""
    mv = load_math_verify()
    start = time.perf_counter()
    out = mv.parse(text, extraction_config=extraction_config, parsing_timeout=timeout)
    if not out and timeout and time.perf_counter() - start >= timeout - 0.05:
        raise VerifierTimeout(f"math_verify.parse exceeded {timeout}s")
    return out


def _gold_cache_get(key):
    with _GOLD_CACHE_LOCK:
        if key in _GOLD_CACHE:
            _GOLD_CACHE.move_to_end(key)
            return _GOLD_CACHE[key]
    return None


def _gold_cache_put(key, value):
    with _GOLD_CACHE_LOCK:
        _GOLD_CACHE[key] = value
        while len(_GOLD_CACHE) > 4096:
            _GOLD_CACHE.popitem(last=False)


_GOLD_CACHE: "OrderedDict[Tuple[str, Optional[int]], list]" = OrderedDict()
_GOLD_CACHE_LOCK = threading.Lock()


def math_verify_equal(
    pred_text: str, pred_is_unanchored: bool, gold_text: str, timeout: Optional[int], float_rounding: int
) -> bool:
    """parse + verify with the given math_verify timeout (None = no signal use)."""
    mv = load_math_verify()
    boxed_cfg = _boxed_extraction_config()
    gold = _gold_cache_get((gold_text, timeout))
    if gold is None:
        gold = _parse(gold_text, boxed_cfg, timeout)
        _gold_cache_put((gold_text, timeout), gold)
    if not gold:
        return False
    if pred_is_unanchored:
        pred_cfg = (mv.LatexExtractionConfig(), mv.ExprExtractionConfig())  # math_verify's own anchors
    else:
        pred_cfg = boxed_cfg
    pred = _parse(pred_text, pred_cfg, timeout)
    if not pred:
        return False
    start = time.perf_counter()
    ok = mv.verify(gold, pred, float_rounding=float_rounding, timeout_seconds=timeout)
    if not ok and timeout and time.perf_counter() - start >= timeout - 0.05:
        raise VerifierTimeout(f"math_verify.verify exceeded {timeout}s")
    return bool(ok)
