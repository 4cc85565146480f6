"""``first_line_answer``: the strict verifier of the demo's arithmetic task.

The demo's prompts say "Answer with just the number." SmolLM2-135M-Instruct then answers in one of
a few short shapes on its first line (``7``, ``5 + 2 = 7``, ``7 + 7 is 14.``, ``The answer is 5.``), or
it starts an explanation (``To solve this problem, we need to find the sum of 8 and 6.``) that runs
past the token budget. The verifier scores the *first non-empty line* only:

    1.0  when that line is just a number, or ends with ``= N``, ``is N`` or ``: N`` (an optional
         final period, ``**`` bold markers and surrounding whitespace allowed), and N equals the label
    0.0  otherwise (another number, another shape, no line at all)

So an answer must come first: a reply that restates the operands ("the difference between 8 and 4")
does not score even when its last number happens to equal the result, listing candidates does not
help (only the number that ends the line counts), and anything after the first line is ignored
(the RL stage may still mask responses truncated at the length limit). Registered in
:mod:`mindspeed_llm.rl.rewards` on import of this module (``import mindspeed_llm.demo`` does it), as
``--verifier-function first_line_answer``; it needs a label.
"""

from __future__ import annotations

import re
from typing import Optional

from mindspeed_llm.rl.rewards import MissingLabelError, available_verifiers, register_verifier

__all__ = ["VERIFIER_NAME", "first_line_answer", "parse_first_line_answer"]

VERIFIER_NAME = "first_line_answer"

_NUMBER = r"[-\u2212]?\d+(?:\.\d+)?"
# the whole (stripped) first line: optional "<anything> (=|is|:)" then the number, optional period
_LINE_RE = re.compile(
    r"^(?:(?P<lead>.*?)(?:=|\bis\b|:)\s*)?\**\s*(?P<num>" + _NUMBER + r")\s*\**\s*\.?\s*\**$",
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
    m = _LINE_RE.match(line)
    if m is None:
        return None
    return m.group("num").replace("\u2212", "-")


def _as_number(text: str) -> Optional[float]:
    try:
        return float(str(text).strip().replace("\u2212", "-").replace(",", ""))
    except ValueError:
        return None


def first_line_answer(response_text: str, label: Optional[str]) -> float:
    """1.0 when the first line answers with a number equal to ``label`` (see the module docstring)."""
    if label is None or (isinstance(label, str) and not label.strip()):
        raise MissingLabelError(VERIFIER_NAME)
    got = parse_first_line_answer(response_text)
    if got is None:
        return 0.0
    want = _as_number(label)
    value = _as_number(got)
    if want is None or value is None:
        return 0.0
    return 1.0 if value == want else 0.0


if VERIFIER_NAME not in available_verifiers():  # importing twice (e.g. a reload) must not fail
    register_verifier(VERIFIER_NAME, requires_label=True)(first_line_answer)
