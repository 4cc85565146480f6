"""``math_acc``: 1.0 when the final answer of a response is mathematically equal to the label, else 0.0.

The final answer is the content of the *last* ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), else the
content of the last ``<answer>...</answer>`` tag, else the last ``Answer: ...`` line (the format
DAPO-Math-17k's prompts ask for; ``MathAccConfig(answer_line=False)`` turns it off), else nothing (score 0).
Scoring the whole response when none is present can be switched on with ``MathAccConfig(allow_unanchored=True)``;
it is off by default because it rewards rambling that happens to mention the right number.

Equality: a cheap normalised string comparison first, then the ``math_verify`` package (``parse`` + ``verify``,
`verifiers/equality.py`), which handles ``\\frac{9}{10}`` == ``0.9``, ``80\\%`` == ``80``, units, ``x=3`` vs ``3``,
intervals, sets, tuples, symbolic expressions, and so on. Before parsing, ``\\dfrac``/``\\tfrac`` become ``\\frac``,
``\\frac12``/``\\sqrt5`` get braces, and a multiple-choice marker (``\\textbf{(B)}\\ 7``,
``(D) \\frac{5}{3}``, ``40\\textbf{ (B)}``) is dropped, except that a bare letter label (``B``) is compared
with the chosen letter.

Timeouts: ``math_verify`` bounds its sympy work with ``signal.alarm``, which only works in the main thread of
the main interpreter. ``MathAccConfig.timeout_mode`` (default ``"auto"``): in the main thread on POSIX,
``math_verify``'s own signal timeouts (they replace the SIGALRM handler during a call and cancel any alarm the
caller had set); in any other thread, the comparison runs in a helper interpreter (`verifiers/worker.py`),
where it is the main thread; the caller waits at most a fixed budget, and a worker that overruns it is killed
and replaced. ``"none"`` calls ``math_verify`` without timeouts (unbounded; for callers that bound the call
themselves). A comparison that hits a timeout raises :class:`VerifierTimeout`, which batch scoring counts as a
failure scored 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from dataclasses import dataclass
from typing import Optional

from mindspeed_llm.rl.verifiers.answers import (
    _ANSWER_LINE_RE, _BOX_CMD_RE, _LETTER_RE, ExtractedAnswer, _cheap_key, _normalize_latex, _split_choice, _strip_math_delims,
    extract_answer, last_boxed_content,
)
from mindspeed_llm.rl.verifiers.equality import math_verify_equal
from mindspeed_llm.rl.verifiers.registry import (
    MissingLabelError, label_missing, register_verifier,
)
from mindspeed_llm.rl.verifiers.worker import WORKER

@dataclass(frozen=True)
class MathAccConfig:
    """Settings of the ``math_acc`` verifier.

    allow_unanchored: score the whole response (its tail) when it has no box, no ``<answer>`` tag
        and no ``Answer:`` line. Off by default.
    answer_line: accept a line ``Answer: <answer>`` (the format DAPO-Math-17k's prompts ask for)
        when there is no box and no ``<answer>`` tag. On by default.
    timeout_seconds: per-operation budget given to ``math_verify`` (``parsing_timeout`` and
        ``timeout_seconds``), whole seconds >= 1 since it uses ``signal.alarm``.
    timeout_mode: "auto" (signal in the main thread, worker process elsewhere), "signal",
        "process", or "none" (no timeouts: only for callers that bound the call themselves).
    max_answer_chars: longer extracted answers score 0 without being parsed.
    unanchored_tail_chars: with ``allow_unanchored``, only this many trailing characters are parsed.
    float_rounding: decimals used by ``math_verify`` for numeric comparison.
    """

    allow_unanchored: bool = False
    answer_line: bool = True
    timeout_seconds: int = 2
    timeout_mode: str = "auto"
    max_answer_chars: int = 1000
    unanchored_tail_chars: int = 600
    float_rounding: int = 6

    def __post_init__(self):
        if self.timeout_mode not in ("auto", "signal", "process", "none"):
            raise ValueError(f"timeout_mode must be auto|signal|process|none, got {self.timeout_mode!r}")
        if int(self.timeout_seconds) < 1:
            raise ValueError("timeout_seconds must be >= 1 (math_verify uses signal.alarm)")


_MATH_ACC_CONFIG = MathAccConfig()


def get_math_acc_config() -> MathAccConfig:
    return _MATH_ACC_CONFIG


def set_math_acc_config(config: Optional[MathAccConfig] = None, **changes) -> MathAccConfig:
    """Replace the process-wide ``math_acc`` settings (``config`` and/or field overrides)."""
    global _MATH_ACC_CONFIG
    base = config if config is not None else _MATH_ACC_CONFIG
    _MATH_ACC_CONFIG = dataclasses.replace(base, **changes)
    return _MATH_ACC_CONFIG


def _gold_text(label: str) -> str:
    label = _normalize_latex(label)
    if _BOX_CMD_RE.search(label):
        return label
    inner = _strip_math_delims(label)
    if "$" in inner or "\\(" in inner:
        return label  # several inline formulas: let math_verify find them
    return "\\boxed{" + inner + "}"


def _pred_text(answer: ExtractedAnswer) -> str:
    text = _normalize_latex(answer.text)
    if answer.source == "unanchored" or "$" in text or "\\(" in text:
        return text
    return "\\boxed{" + text + "}"


def _resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    if os.name == "posix" and threading.current_thread() is threading.main_thread():
        return "signal"
    return "process"


def math_equal(answer: str, label: str, config: Optional[MathAccConfig] = None, *, source: str = "boxed") -> bool:
    """True when the answer text (already extracted) equals the label. See the module docstring."""
    cfg = config or _MATH_ACC_CONFIG
    pred = ExtractedAnswer(answer.strip(), source)
    label = str(label).strip()
    if not pred.text or not label:
        return False
    if source != "unanchored" and len(pred.text) > cfg.max_answer_chars:
        return False

    # multiple choice: a bare letter label compares letters; otherwise the "(B)" prefix is dropped
    pred_letter, pred_value = _split_choice(pred.text)
    gold_letter, gold_value = _split_choice(_strip_math_delims(label))
    if gold_letter is None:
        m = _LETTER_RE.match(_strip_math_delims(label))
        gold_letter, gold_value = (m.group(1), "") if m else (None, gold_value)
    if gold_letter is not None and not gold_value and source != "unanchored":
        if pred_letter is None:
            m = _LETTER_RE.match(_strip_math_delims(pred.text).upper())
            pred_letter = m.group(1) if m else None
        return pred_letter == gold_letter
    if pred_letter is not None and pred_value:
        pred = ExtractedAnswer(pred_value, source)
    if gold_letter is not None and gold_value:
        label = gold_value

    if source != "unanchored" and _cheap_key(pred.text) == _cheap_key(_strip_math_delims(label)):
        return True

    pred_text = _pred_text(pred)
    if source == "unanchored":
        pred_text = pred_text[-cfg.unanchored_tail_chars:]
    gold_text = _gold_text(label)
    timeout = max(1, int(cfg.timeout_seconds))
    mode = _resolve_mode(cfg.timeout_mode)
    if mode == "signal":
        return math_verify_equal(pred_text, source == "unanchored", gold_text, timeout, cfg.float_rounding)
    if mode == "none":
        return math_verify_equal(pred_text, source == "unanchored", gold_text, None, cfg.float_rounding)
    # process: parse and verify (a handful of operations, each bounded by `timeout` in the worker)
    budget = 6.0 * timeout + 5.0
    return WORKER.run((pred_text, source == "unanchored", gold_text, timeout, cfg.float_rounding), budget)


def _score_answer(answer: Optional[ExtractedAnswer], label, cfg: MathAccConfig) -> float:
    if answer is None or not answer.text:
        return 0.0
    return 1.0 if math_equal(answer.text, str(label), cfg, source=answer.source) else 0.0


@register_verifier("math_acc", requires_label=True)
def math_acc(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """1.0 when the response's final answer equals ``label`` (see the module docstring), else 0.0."""
    if label_missing(label):
        raise MissingLabelError("math_acc")
    cfg = config or _MATH_ACC_CONFIG
    return _score_answer(
        extract_answer(response_text, allow_unanchored=cfg.allow_unanchored, answer_line=cfg.answer_line), label, cfg
    )


# MindSpeed-RL's name for the same check (boxed answers of DeepScaleR-style data).
register_verifier("base_acc", requires_label=True)(math_acc)


@register_verifier("math_17k_acc", requires_label=True)
def math_17k_acc(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """DAPO-Math-17k's answer format (MindSpeed-RL's ``math_17k_acc``): its prompts ask for a last line
    ``Answer: <answer>``, so that line decides, before any box or tag earlier in the response; without one,
    the final answer by ``math_acc``'s rules. Equality as ``math_acc``'s."""
    if label_missing(label):
        raise MissingLabelError("math_17k_acc")
    cfg = config or _MATH_ACC_CONFIG
    lines = _ANSWER_LINE_RE.findall(response_text) if isinstance(response_text, str) else []
    answer = (ExtractedAnswer(lines[-1].strip(), "answer_line") if lines else
              extract_answer(response_text, allow_unanchored=cfg.allow_unanchored, answer_line=False))
    return _score_answer(answer, label, cfg)


@register_verifier("acc_for_ppo", requires_label=True)
def acc_for_ppo(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """MindSpeed-RL's PPO accuracy (``acc_for_ppo``, its `ppo_accuracy_reward`): 1.0 when the content of the last
    ``\\boxed{}`` equals ``label``, else 0.0 (no box: 0.0, neither an ``<answer>`` tag nor an ``Answer:`` line
    counts). Equality as ``math_acc``'s."""
    if label_missing(label):
        raise MissingLabelError("acc_for_ppo")
    boxed = last_boxed_content(response_text) if isinstance(response_text, str) else None
    return _score_answer(None if boxed is None else ExtractedAnswer(boxed.strip(), "boxed"), label,
                         config or _MATH_ACC_CONFIG)


@register_verifier("acc_for_dapo", requires_label=True)
def acc_for_dapo(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """MindSpeed-RL's DAPO accuracy (``acc_for_dapo``, DAPO's `compute_score`): +1.0 for a right final answer,
    -1.0 otherwise (a missing answer included). DAPO-Math-17k's prompts ask for a last line ``Answer: ...``, which
    decides as in ``math_17k_acc``."""
    if label_missing(label):
        raise MissingLabelError("acc_for_dapo")
    return 2.0 * math_17k_acc(response_text, label, config) - 1.0


@register_verifier("retool_reward", requires_label=True)
def retool_reward(response_text: str, label: Optional[str], trajectory=None,
                  config: Optional[MathAccConfig] = None) -> float:
    """MindSpeed-RL's ReTool reward (``retool_reward``, its multi-turn DAPO config's): +1.0 when the content of the
    last ``\\boxed{}`` equals ``label`` (``acc_for_ppo``'s check), else -1.0 raised by 0.1 per tool call the
    trajectory made, up to 0 (a wrong answer that used the code tool scores better than one that did not)."""
    if label_missing(label):
        raise MissingLabelError("retool_reward")
    score = 2.0 * acc_for_ppo(response_text, label, config) - 1.0
    calls = trajectory["tool_calls"] if trajectory else 0
    return min(0.0, score + 0.1 * calls) if score < 0 else score


_R1_BOXED_FORMAT = re.compile(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", re.DOTALL)


@register_verifier("math_verify_reward", requires_label=True)
def math_verify_reward(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """MindSpeed-RL's ``math_verify_reward``: 1.0 when the response is the whole R1 template with a boxed answer
    (``<think>...</think> ... <answer> ... \\boxed{...} ... </answer>``) and that answer equals ``label`` (by
    math-verify, ``math_acc``'s equality), else 0.0."""
    if label_missing(label):
        raise MissingLabelError("math_verify_reward")
    if not isinstance(response_text, str) or _R1_BOXED_FORMAT.fullmatch(response_text) is None:
        return 0.0
    return acc_for_ppo(response_text, label, config)
