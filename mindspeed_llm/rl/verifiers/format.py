"""Format verifiers: the R1 template (``format``) and one non-empty box (``boxed_format``); the label is ignored."""

from __future__ import annotations

import re
from typing import Optional

from mindspeed_llm.rl.verifiers.answers import _BOX_CMD_RE, _box_content_at
from mindspeed_llm.rl.verifiers.registry import register_verifier

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
