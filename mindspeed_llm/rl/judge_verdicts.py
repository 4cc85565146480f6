"""What an LLM judge reads and writes, without its model (`rl/judge.py` runs the model): the prompt template of
--judge-template, the verdict parsers (the default one and a user's --judge-parser PATH[:NAME]) and how a verdict
becomes a score.

The template is a UTF-8 text file in Python's `str.format` syntax with the placeholders of `PLACEHOLDERS`:
``{prompt}`` (the actor's prompt), ``{response}`` (its response, as the verifiers read it) and, optionally,
``{label}`` (the dataset's reference answer; empty where a row has none). A literal brace is written ``{{`` or
``}}``. Another name, an attribute or index (``{prompt.x}``, ``{label[0]}``), a conversion or format spec, an
unmatched brace, or a template without ``{prompt}`` and ``{response}`` is refused when the run starts
(`read_template`), naming the file and the placeholder.

The default parser (`parse_score`) reads the number written right after the verdict's last ``Score:`` (any case;
markdown emphasis or a bracket between them is skipped: ``**Score:** 7``, ``score: [0.5]``) that is followed by one:
``Score: 8/10`` reads 8, so the template should ask for the scale it wants. A user's parser is a function
``verdict_text -> float or None`` in a .py file, loaded as --custom-reward-function loads (`reward_functions`).
A verdict that gives no finite number (None, not a number, NaN / inf, the parser raising) is *unparsed*: it scores
--judge-unparsed-score and is counted (`judge/unparsed`), never a crash (`score_verdicts`).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import string
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl import reward_functions

logger = logging.getLogger(__name__)

PLACEHOLDERS = ("prompt", "response", "label")
REQUIRED = ("prompt", "response")
MARKER = "Score:"  # the default parser's verdict marker
TEMPLATE_FLAG, PARSER_FLAG = "--judge-template", "--judge-parser"
DEFAULT_PARSER_NAME = "parse_verdict"  # NAME of --judge-parser PATH when not given

# the marker, then emphasis / brackets / spaces, then a decimal number (sign, fraction, exponent)
_SCORE = re.compile(r"score\s*:[\s*_\[(]*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)

Parser = Callable[[str], Optional[float]]


@dataclass(frozen=True)
class JudgeTemplate:
    """A checked --judge-template: its file and text, and the placeholders it uses."""

    path: str
    text: str
    uses: Tuple[str, ...]

    def render(self, prompt: str, response: str, label=None) -> str:
        """The judge's prompt for one sample (`label` None: empty)."""
        return self.text.format(prompt=prompt, response=response, label="" if label is None else str(label))


def read_template(path: str) -> JudgeTemplate:
    """The template of `path`; `ArgumentError` naming --judge-template, the file and the fix (module doc)."""
    where = f"{TEMPLATE_FLAG} {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ArgumentError(f"{where}: there is no such file; give the judge's prompt template, a text file with "
                            "{prompt} and {response}") from None
    except IsADirectoryError:
        raise ArgumentError(f"{where} is a directory; give the template file in it") from None
    except OSError as exc:
        raise ArgumentError(f"{where}: cannot be read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArgumentError(f"{where}: not UTF-8 text (byte {exc.start}); save the template as UTF-8") from None
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(text)
                  if name is not None]
    except ValueError as exc:  # an unmatched brace
        raise ArgumentError(f"{where}: {exc}; write a literal brace as {{{{ or }}}}") from None
    uses = []
    for name, spec, conversion in fields:
        if name not in PLACEHOLDERS:
            shown = "{}" if name == "" else "{" + name + "}"
            raise ArgumentError(f"{where}: unknown placeholder {shown}; the placeholders are "
                                f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (write a literal brace as {{{{ "
                                "or }}}})")
        if spec or conversion:
            raise ArgumentError(f"{where}: the placeholder {{{name}}} has a format spec or conversion "
                                f"({'!' + conversion if conversion else ':' + spec}); write it bare, {{{name}}}")
        uses.append(name)
    missing = [name for name in REQUIRED if name not in uses]
    if missing:
        raise ArgumentError(f"{where}: the template has no {' and no '.join('{' + m + '}' for m in missing)}; the "
                            "judge must see the prompt and the response: put {prompt} and {response} where they go")
    return JudgeTemplate(path, text, tuple(dict.fromkeys(uses)))


def parse_score(verdict: str) -> Optional[float]:
    """The default parser: the number after the last ``Score:`` followed by one (module doc); None without one."""
    matches = _SCORE.findall(verdict or "")
    return float(matches[-1]) if matches else None


def load_parser(spec: Optional[str]) -> Parser:
    """--judge-parser's function (None: `parse_score`), loaded by `reward_functions.load_user_function`; refused
    by name when it cannot take one positional argument, the verdict text."""
    if spec is None:
        return parse_score
    fn, path, name = reward_functions.load_user_function(spec, PARSER_FLAG, DEFAULT_PARSER_NAME)
    try:
        inspect.signature(fn).bind("verdict")
    except TypeError as exc:
        raise ArgumentError(f"{PARSER_FLAG} {spec}: '{name}' in {path} cannot be called with the verdict text alone "
                            f"({exc}); define it as {name}(verdict_text) returning a number or None") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


def parsed(parser: Parser, verdict: str) -> Tuple[Optional[float], Optional[str]]:
    """(the finite score `parser` reads from `verdict`, or None; why not, or None)."""
    try:
        value = parser(verdict)
    except Exception as exc:  # noqa: BLE001 - a user's parser failing on one verdict is that verdict unparsed
        return None, f"the parser raised {type(exc).__name__}: {exc}"
    if value is None:
        return None, None
    if isinstance(value, bool):
        return None, f"the parser returned a bool ({value}), not a number"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, f"the parser returned {type(value).__name__} {value!r}, not a number"
    if not math.isfinite(value):
        return None, f"the parser returned {value}"
    return value, None


def score_verdicts(parser: Parser, verdicts: Sequence[str], unparsed_score: float) -> Tuple[List[float], List[bool]]:
    """(each verdict's score: what `parser` reads, else `unparsed_score`; whether it parsed). The first reason a
    batch's verdict did not parse beyond giving no number is logged once."""
    scores, ok, reason = [], [], None
    for verdict in verdicts:
        value, why = parsed(parser, verdict)
        reason = reason or why
        ok.append(value is not None)
        scores.append(unparsed_score if value is None else value)
    if reason is not None:
        logger.warning("%s: %s; such verdicts score --judge-unparsed-score %g", PARSER_FLAG, reason, unparsed_score)
    return scores, ok
