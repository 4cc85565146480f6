"""``first_line_answer``: short numeric answers ("Answer with just the number.").

The reply's first non-empty line must be the number, or end with "= N", "is N" or ": N" (optional final
period and ** bold markers); anything after the first line is ignored. So the answer has to come first:
restating the operands, listing candidates or explaining before answering scores 0. Small instruct models
answer short arithmetic in these shapes ("7", "5 + 2 = 7", "The answer is 5."), which gives GRPO a strict,
cheap reward without rewarding rambling.
"""

from __future__ import annotations

import re
from typing import Optional

from mindspeed_llm.rl.verifiers.registry import MissingLabelError, label_missing, register_verifier

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
    if label_missing(label):
        raise MissingLabelError("first_line_answer")
    got = parse_first_line_answer(response_text)
    if got is None:
        return 0.0
    want = _as_plain_number(label)
    value = _as_plain_number(got)
    if want is None or value is None:
        return 0.0
    return 1.0 if value == want else 0.0
