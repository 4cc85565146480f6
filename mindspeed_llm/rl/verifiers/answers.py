"""Finding the final answer in a response (the last box, an ``<answer>`` tag, an ``Answer:`` line) and the
LaTeX normalisation that prepares it for comparison."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

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
