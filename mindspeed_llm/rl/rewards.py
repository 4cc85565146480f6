"""Rule-based reward verifiers and reward mixing for the RL stages (GRPO / PPO).

A *verifier* is a plain function ``fn(response_text: str, label: str | None) -> float``, registered by
name with :func:`register_verifier` and looked up with :func:`get_verifier`. The stages select them with
``--verifier-function NAME [NAME ...]`` and weigh them with ``--verifier-weight W [W ...]``;
:func:`score_batch` scores a batch of responses and mixes the verifier scores (and optionally reward
model scores) into one scalar reward per response.

Built-in verifiers
------------------
``math_acc`` (needs a label)
    1.0 when the final answer of the response is mathematically equal to the label, else 0.0.
    The final answer is the content of the *last* ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces),
    else the content of the last ``<answer>...</answer>`` tag, else the last ``Answer: ...`` line (the
    format DAPO-Math-17k's prompts ask for; ``MathAccConfig(answer_line=False)`` turns it off), else
    nothing (score 0). Scoring the whole response when none is present can be switched on with
    ``MathAccConfig(allow_unanchored=True)``; it is off by default because it rewards rambling that
    happens to mention the right number.
    Equality: a cheap normalised string comparison first, then the ``math_verify`` package
    (``parse`` + ``verify``), which handles ``\\frac{9}{10}`` == ``0.9``, ``80\\%`` == ``80``, units,
    ``x=3`` vs ``3``, intervals, sets, tuples, symbolic expressions, and so on. Before parsing,
    ``\\dfrac``/``\\tfrac`` become ``\\frac``, ``\\frac12``/``\\sqrt5`` get braces, and a multiple-choice
    marker (``\\textbf{(B)}\\ 7``, ``(D) \\frac{5}{3}``, ``40\\textbf{ (B)}``) is dropped, except that a
    bare letter label (``B``) is compared with the chosen letter.
``format``
    1.0 when the response is exactly ``<think>...</think>`` followed by ``<answer>...</answer>``
    (the R1 template; surrounding whitespace allowed, exactly one of each tag, non-empty answer).
``boxed_format``
    1.0 when the response contains exactly one ``\\boxed{}`` / ``\\fbox{}`` and its content is non-empty.

Timeouts
--------
``math_verify`` bounds its sympy work with ``signal.alarm``, which only works in the main thread of
the main interpreter (elsewhere it raises ``ValueError``). :func:`math_acc` therefore picks a mode
(``MathAccConfig.timeout_mode``, default ``"auto"``):

* main thread on POSIX: ``math_verify``'s own signal timeouts (``parsing_timeout`` / ``timeout_seconds``;
  note that they replace the SIGALRM handler during a call and cancel any alarm the caller had set);
* any other thread: the comparison runs in a helper interpreter (a ``python -c`` subprocess started on
  first use, one request at a time) where it is the main thread and the signal timeouts work; the
  caller waits at most a fixed budget and a worker that overruns it is killed and replaced, so a call
  is always bounded. (Calling ``math_verify`` in-thread with ``parsing_timeout=None`` /
  ``timeout_seconds=None``, ``timeout_mode="none"``, is unbounded and meant for callers that bound
  the call themselves.)

A comparison that hits a timeout raises :class:`VerifierTimeout`; :func:`score_batch` turns it (and any
other exception raised by a verifier) into a score of 0 and counts it in ``failures``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

__all__ = [
    "MissingLabelError",
    "VerifierTimeout",
    "MathAccConfig",
    "register_verifier",
    "get_verifier",
    "first_line_answer",
    "parse_first_line_answer",
    "verifier_requires_label",
    "available_verifiers",
    "get_math_acc_config",
    "set_math_acc_config",
    "last_boxed_content",
    "extract_answer",
    "math_equal",
    "math_acc",
    "format_reward",
    "boxed_format_reward",
    "score_batch",
    "reward_metrics",
]


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

Verifier = Callable[[str, Optional[str]], float]


@dataclass(frozen=True)
class _VerifierSpec:
    fn: Verifier
    requires_label: bool


_REGISTRY: "OrderedDict[str, _VerifierSpec]" = OrderedDict()


def register_verifier(name: str, *, requires_label: bool = False, override: bool = False):
    """Decorator registering ``fn(response_text, label) -> float`` under ``name``.

    ``requires_label=True`` makes :func:`score_batch` reject rows whose label is missing (with
    :class:`MissingLabelError` naming the row) before anything is scored. Registering a name twice
    is an error unless ``override=True``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError("verifier name must be a non-empty string")

    def decorator(fn: Verifier) -> Verifier:
        if name in _REGISTRY and not override:
            raise ValueError(f"verifier '{name}' is already registered (pass override=True to replace it)")
        _REGISTRY[name] = _VerifierSpec(fn=fn, requires_label=bool(requires_label))
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


# ----------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------

_BOX_CMD_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# "Answer: 34" on a line of its own (DAPO-Math's prompt asks for it); "**Answer:** 34" too
_ANSWER_LINE_RE = re.compile(r"^[ \t]*(?:\*\*)?Answer[ \t]*:[ \t]*(?:\*\*)?[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)


def _balanced_group(text: str, open_idx: int) -> Optional[str]:
    """Content of the brace group opening at ``text[open_idx] == '{'``; None if never closed.

    Escaped braces (``\\{``, ``\\}``) do not count.
    """
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1:i]
        i += 1
    return None


def _box_content_at(text: str, cmd_end: int) -> Optional[str]:
    """Argument of a ``\\boxed`` / ``\\fbox`` command ending at ``cmd_end``: ``{...}`` or one bare token."""
    j = cmd_end
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        return _balanced_group(text, j)
    if j > cmd_end:  # "\boxed 5": the single token after the space
        m = re.match(r"[^\s$\\{}]+", text[j:])
        if m:
            return m.group(0)
    return None


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (balanced braces).

    Returns None when there is none, or when the last one is never closed (a truncated response):
    an earlier, complete box is then *not* used, since it is usually an intermediate result.
    """
    matches = list(_BOX_CMD_RE.finditer(text))
    if not matches:
        return None
    return _box_content_at(text, matches[-1].end())


@dataclass(frozen=True)
class ExtractedAnswer:
    text: str
    source: str  # "boxed" | "answer_tag" | "answer_line" | "unanchored"


def extract_answer(response: str, allow_unanchored: bool = False,
                   answer_line: bool = True) -> Optional[ExtractedAnswer]:
    """The final answer of a response, by the first rule that applies:

    1. the content of the last ``\\boxed{}`` / ``\\fbox{}`` (see :func:`last_boxed_content`);
    2. the content of the last ``<answer>...</answer>`` tag;
    3. with ``answer_line``: the rest of the last line starting with ``Answer:`` (DAPO's format);
    4. with ``allow_unanchored``: the whole response (off by default).
    """
    if not isinstance(response, str):
        return None
    boxed = last_boxed_content(response)
    if boxed is not None:
        return ExtractedAnswer(boxed.strip(), "boxed")
    tags = _ANSWER_TAG_RE.findall(response)
    if tags:
        return ExtractedAnswer(tags[-1].strip(), "answer_tag")
    if answer_line:
        lines = _ANSWER_LINE_RE.findall(response)
        if lines:
            return ExtractedAnswer(lines[-1].strip(), "answer_line")
    if allow_unanchored and response.strip():
        return ExtractedAnswer(response.strip(), "unanchored")
    return None


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------

_TOKEN = r"[0-9A-Za-z]"
_FRAC_CMD_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_FRAC_TT_RE = re.compile(r"\\frac\s*(" + _TOKEN + r")\s*(" + _TOKEN + r")")  # \frac12
_FRAC_TG_RE = re.compile(r"\\frac\s*(" + _TOKEN + r")\s*\{")  # \frac1{2}
_FRAC_GT_RE = re.compile(r"\\frac\s*(\{[^{}]*\})\s*(" + _TOKEN + r")")  # \frac{1}2
_SQRT_T_RE = re.compile(r"\\sqrt\s*(" + _TOKEN + r")")  # \sqrt5
_CHOICE_RE = re.compile(
    r"^\s*(?:\\(?:textbf|text|mathrm|mathbf|textrm)\s*\{\s*\(?\s*([A-E])\s*\)?\s*\}|\(\s*([A-E])\s*\))"
    r"(?:\s|\\ |~|\\quad|\\qquad|\\,|\\;|\\:|\\!)*(.*)$",
    re.DOTALL,
)
_CHOICE_SUFFIX_RE = re.compile(
    r"^(.*?)(?:\s|\\ |~|\\quad|\\qquad|\\,|\\;|\\:|\\!)*"
    r"\\(?:textbf|text|mathrm|mathbf|textrm)\s*\{\s*\(\s*([A-E])\s*\)\s*\}\s*$",
    re.DOTALL,
)
_LETTER_RE = re.compile(r"^\(?\s*([A-E])\s*\)?$")


def _normalize_latex(s: str) -> str:
    """Meaning-preserving rewrites that ``math_verify``'s LaTeX parser does not do itself."""
    s = s.strip()
    s = _FRAC_CMD_RE.sub(r"\\frac", s)
    s = _FRAC_TT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_TG_RE.sub(r"\\frac{\1}{", s)
    s = _FRAC_GT_RE.sub(r"\\frac\1{\2}", s)
    s = _SQRT_T_RE.sub(r"\\sqrt{\1}", s)
    return s


def _split_choice(s: str) -> Tuple[Optional[str], str]:
    """``\\textbf{(B)}\\ 7`` -> ("B", "7"); ``40\\textbf{ (B)}`` -> ("B", "40"); ``(C)`` -> ("C", "");
    ``7`` -> (None, "7")."""
    m = _CHOICE_RE.match(s)
    if m:
        return (m.group(1) or m.group(2)), m.group(3).strip()
    m = _CHOICE_SUFFIX_RE.match(s)  # "40\textbf{ (B)}", "\frac{25}{32} \ \mathbf{(B)}"
    if m and m.group(1).strip():
        return m.group(2), m.group(1).strip()
    return None, s


def _strip_math_delims(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            inner = s[len(left):len(s) - len(right)]
            if "$" not in inner:
                return inner.strip()
    return s


_CHEAP_DROP_RE = re.compile(
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;:]|\\ |\\displaystyle|\^\{?\\circ\}?|\\%|%|\s+|\$"
)


def _cheap_key(s: str) -> str:
    s = _CHEAP_DROP_RE.sub("", _normalize_latex(s))
    return s.rstrip(".")


# ----------------------------------------------------------------------------------------------
# math_acc
# ----------------------------------------------------------------------------------------------


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


def _mv():
    import math_verify  # local: keeps `import rewards` cheap and the format verifiers usable without it

    return math_verify


_EXTRACTION_CONFIG = None


def _boxed_extraction_config():
    global _EXTRACTION_CONFIG
    if _EXTRACTION_CONFIG is None:
        mv = _mv()
        _EXTRACTION_CONFIG = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    return _EXTRACTION_CONFIG


def _parse(text: str, extraction_config, timeout: Optional[int]) -> list:
    """``math_verify.parse`` that reports a timeout (which it otherwise swallows) as VerifierTimeout."""
    mv = _mv()
    start = time.perf_counter()
    out = mv.parse(text, extraction_config=extraction_config, parsing_timeout=timeout)
    if not out and timeout and time.perf_counter() - start >= timeout - 0.05:
        raise VerifierTimeout(f"math_verify.parse exceeded {timeout}s")
    return out


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


def _math_equal_direct(
    pred_text: str, pred_is_unanchored: bool, gold_text: str, timeout: Optional[int], float_rounding: int
) -> bool:
    """parse + verify with the given math_verify timeout (None = no signal use)."""
    mv = _mv()
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


class _WorkerProcess:
    """A helper interpreter that runs comparisons requested off the main thread.

    It is a plain ``python -c`` subprocess (not ``multiprocessing``, whose ``spawn`` start method
    re-imports the caller's ``__main__``), speaking one JSON object per line over stdin/stdout. In its
    own main thread ``math_verify``'s signal timeouts work; on top of that the parent waits at most
    ``budget`` seconds for an answer and kills and replaces a worker that overruns it.
    """

    _BOOT = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        "from mindspeed_llm.rl.rewards import _worker_main; _worker_main()"
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._replies = None

    def _start_locked(self, startup_timeout: float) -> None:
        import json
        import queue
        import subprocess
        import sys

        paths = [p for p in sys.path if p] + [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(
            [sys.executable, "-c", self._BOOT, json.dumps(paths)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )
        replies: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump(stream=proc.stdout, out=replies):
            for line in stream:
                out.put(line)
            out.put(None)  # EOF: the worker died

        threading.Thread(target=pump, name="math-acc-worker-reader", daemon=True).start()
        self._proc, self._replies = proc, replies
        if self._get_locked(startup_timeout) != {"ready": True}:
            self._kill_locked()
            raise RuntimeError("math_acc worker process failed to start")

    def _get_locked(self, timeout: float):
        import json
        import queue

        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            raise RuntimeError("math_acc worker process exited unexpectedly")
        return json.loads(line)

    def run(self, args: tuple, budget: float) -> bool:
        import json

        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill_locked()
                self._start_locked(startup_timeout=120.0)
            try:
                self._proc.stdin.write(json.dumps(list(args)) + "\n")
                self._proc.stdin.flush()
                reply = self._get_locked(budget)
            except (OSError, RuntimeError):
                self._kill_locked()
                raise
            if reply is None:
                self._kill_locked()
                raise VerifierTimeout(f"math_acc worker exceeded {budget:.0f}s and was restarted")
        if "timeout" in reply:
            raise VerifierTimeout(reply["timeout"])
        if "error" in reply:
            raise RuntimeError(f"math_acc worker: {reply['error']}")
        return bool(reply["ok"])

    def _kill_locked(self) -> None:
        proc, self._proc, self._replies = self._proc, None, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        with self._lock:
            self._kill_locked()


def _worker_main() -> None:
    """Entry point of the worker interpreter (see :class:`_WorkerProcess`)."""
    import json
    import sys

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    _mv()
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            pred_text, unanchored, gold_text, timeout, rounding = json.loads(line)
            reply = {"ok": _math_equal_direct(pred_text, unanchored, gold_text, timeout, rounding)}
        except VerifierTimeout as exc:
            reply = {"timeout": str(exc)}
        except Exception as exc:  # noqa: BLE001
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        proto.write(json.dumps(reply) + "\n")


_WORKER = _WorkerProcess()
atexit.register(_WORKER.close)


def _forget_worker_in_child() -> None:
    # a forked child (e.g. a DataLoader worker) must not share the parent's pipes or a held lock
    _WORKER._lock = threading.Lock()
    _WORKER._proc = None
    _WORKER._replies = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_in_child)


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
        return _math_equal_direct(pred_text, source == "unanchored", gold_text, timeout, cfg.float_rounding)
    if mode == "none":
        return _math_equal_direct(pred_text, source == "unanchored", gold_text, None, cfg.float_rounding)
    # process: parse and verify (a handful of operations, each bounded by `timeout` in the worker)
    budget = 6.0 * timeout + 5.0
    return _WORKER.run((pred_text, source == "unanchored", gold_text, timeout, cfg.float_rounding), budget)


def _label_missing(label) -> bool:
    if label is None:
        return True
    if isinstance(label, float) and math.isnan(label):
        return True
    return isinstance(label, str) and not label.strip()


@register_verifier("math_acc", requires_label=True)
def math_acc(response_text: str, label: Optional[str], config: Optional[MathAccConfig] = None) -> float:
    """1.0 when the response's final answer equals ``label`` (see the module docstring), else 0.0."""
    if _label_missing(label):
        raise MissingLabelError("math_acc")
    cfg = config or _MATH_ACC_CONFIG
    answer = extract_answer(response_text, allow_unanchored=cfg.allow_unanchored, answer_line=cfg.answer_line)
    if answer is None or not answer.text:
        return 0.0
    return 1.0 if math_equal(answer.text, str(label), cfg, source=answer.source) else 0.0


# ----------------------------------------------------------------------------------------------
# Format verifiers
# ----------------------------------------------------------------------------------------------

_R1_FORMAT_RE = re.compile(r"^\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL)


@register_verifier("format")
def format_reward(response_text: str, label: Optional[str] = None) -> float:
    """1.0 for ``<think>...</think><answer>...</answer>`` (whitespace around/between tags allowed,
    exactly one of each tag, non-empty answer), else 0.0. The label is ignored."""
    if not isinstance(response_text, str):
        return 0.0
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if response_text.count(tag) != 1:
            return 0.0
    m = _R1_FORMAT_RE.match(response_text)
    return 1.0 if m is not None and m.group(2).strip() else 0.0


@register_verifier("boxed_format")
def boxed_format_reward(response_text: str, label: Optional[str] = None) -> float:
    """1.0 when the response holds exactly one ``\\boxed``/``\\fbox`` with non-empty content, else 0.0."""
    if not isinstance(response_text, str):
        return 0.0
    matches = list(_BOX_CMD_RE.finditer(response_text))
    if len(matches) != 1:
        return 0.0
    content = _box_content_at(response_text, matches[0].end())
    return 1.0 if content is not None and content.strip() else 0.0



# ----------------------------------------------------------------------------------------------
# first_line_answer: short numeric answers ("Answer with just the number.")
# ----------------------------------------------------------------------------------------------
# The reply's first non-empty line must be the number, or end with "= N", "is N" or ": N" (optional final
# period and ** bold markers); anything after the first line is ignored. So the answer has to come first:
# restating the operands, listing candidates or explaining before answering scores 0. Small instruct
# models answer short arithmetic in these shapes ("7", "5 + 2 = 7", "The answer is 5."), which gives GRPO
# a strict, cheap reward without rewarding rambling.

_FIRST_LINE_NUMBER = r"[-\u2212]?\d+(?:\.\d+)?"
# the whole (stripped) first line: optional "<anything> (=|is|:)" then the number, optional period
_FIRST_LINE_RE = re.compile(
    r"^(?:(?P<lead>.*?)(?:=|\bis\b|:)\s*)?\**\s*(?P<num>" + _FIRST_LINE_NUMBER + r")\s*\**\s*\.?\s*\**$",
    re.IGNORECASE,
)


def parse_first_line_answer(response: str) -> Optional[str]:
    """The number that answers on the first non-empty line of ``response`` (see the module docstring),
    as written (``"-3"``, ``"14"``); None when the first line has no answer of that shape."""
    if not isinstance(response, str):
        return None
    for line in response.splitlines():
        line = line.strip()
        if line:
            break
    else:
        return None
    m = _FIRST_LINE_RE.match(line)
    if m is None:
        return None
    return m.group("num").replace("\u2212", "-")


def _as_plain_number(text: str) -> Optional[float]:
    try:
        return float(str(text).strip().replace("\u2212", "-").replace(",", ""))
    except ValueError:
        return None


@register_verifier("first_line_answer", requires_label=True)
def first_line_answer(response_text: str, label: Optional[str]) -> float:
    """1.0 when the first line answers with a number equal to ``label`` (see the module docstring)."""
    if label is None or (isinstance(label, str) and not label.strip()):
        raise MissingLabelError("first_line_answer")
    got = parse_first_line_answer(response_text)
    if got is None:
        return 0.0
    want = _as_plain_number(label)
    value = _as_plain_number(got)
    if want is None or value is None:
        return 0.0
    return 1.0 if value == want else 0.0

# ----------------------------------------------------------------------------------------------
# Batch scoring and mixing
# ----------------------------------------------------------------------------------------------

_WARN_LIMIT = 5
_warned: Dict[str, int] = {}


def _warn_failure(name: str, row: int, exc: BaseException) -> None:
    count = _warned.get(name, 0)
    if count < _WARN_LIMIT:
        _warned[name] = count + 1
        suffix = " (further failures of this verifier are not logged)" if count + 1 == _WARN_LIMIT else ""
        logger.warning("verifier '%s' failed on row %d (scored 0): %s: %s%s",
                       name, row, type(exc).__name__, str(exc)[:200], suffix)


def _as_float_list(values, what: str) -> List[float]:
    if hasattr(values, "detach"):  # torch tensor
        values = values.detach().float().cpu().reshape(-1).tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy
        values = values.reshape(-1).tolist()
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be numbers: {exc}") from None


def score_batch(
    responses: Sequence[str],
    labels: Optional[Sequence[Optional[str]]],
    verifier_names: Sequence[str],
    verifier_weights: Sequence[float],
    reward_model_scores=None,
    reward_model_weight: float = 1.0,
    *,
    as_tensor: bool = False,
):
    """Score responses with the named verifiers and mix them into one reward per response.

    ``total[i] = sum_j verifier_weights[j] * verifier_j(responses[i], labels[i])
    (+ reward_model_weight * reward_model_scores[i] when reward model scores are given)``.

    Returns ``(total_scores, per_verifier, failures)``: ``total_scores`` a list of floats (a float32
    tensor with ``as_tensor=True``), ``per_verifier`` maps each verifier name to its unweighted scores,
    ``failures`` maps each verifier name to how many rows it crashed or timed out on (scored 0 there).

    Raises ``ValueError`` for mismatched lengths or an unknown verifier name, and
    :class:`MissingLabelError` (with ``row_index``) when a verifier that needs a label meets a row
    without one; both are checked before any scoring.
    """
    names = list(verifier_names or [])
    weights = list(verifier_weights or [])
    if len(names) != len(weights):
        raise ValueError(
            f"--verifier-function has {len(names)} entr{'y' if len(names) == 1 else 'ies'} ({', '.join(map(str, names)) or 'none'}) "
            f"but --verifier-weight has {len(weights)} ({', '.join(map(str, weights)) or 'none'}); "
            "give exactly one weight per verifier function"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--verifier-function lists a verifier more than once: {names}")
    weights = _as_float_list(weights, "--verifier-weight values")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"--verifier-weight values must be finite numbers, got {weights}")
    specs = [_spec(name) for name in names]  # unknown names fail here, listing the valid ones

    responses = list(responses)
    n = len(responses)
    if labels is None:
        labels = [None] * n
    labels = list(labels)
    if len(labels) != n:
        raise ValueError(f"got {n} responses but {len(labels)} labels")
    rm_scores = None
    if reward_model_scores is not None:
        rm_scores = _as_float_list(reward_model_scores, "reward model scores")
        if len(rm_scores) != n:
            raise ValueError(f"got {n} responses but {len(rm_scores)} reward model scores")
        reward_model_weight = float(reward_model_weight)
    if not names and rm_scores is None:
        raise ValueError("nothing to score: no --verifier-function given and no reward model scores")

    label_strs: List[Optional[str]] = [None if _label_missing(lb) else str(lb) for lb in labels]
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

    totals = []
    for i in range(n):
        total = 0.0
        for name, w in zip(names, weights):
            total += w * per_verifier[name][i]
        if rm_scores is not None:
            total += reward_model_weight * rm_scores[i]
        totals.append(total)
    if as_tensor:
        import torch

        totals = torch.tensor(totals, dtype=torch.float32)
    return totals, per_verifier, failures


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
