"""Chat templates for ``--prompt-type``, read from ``configs/model/templates.json``.

A template is a JSON object selected by its ``name``. Fields (all strings unless noted):

``prefix``             text put once at the start (for example Llama 3's ``<|begin_of_text|>``)
``system``             format of a system turn, ``{{content}}`` marks the message text
``user``               format of a user turn
``assistant``          format of a finished assistant turn
``tool``               format of a tool-response turn (``null``: the template has none; a few-shot
                       prompt that shows a tool call needs it)
``generation_prompt``  text that opens the assistant turn the model is asked to write
``default_system``     system text used when a sample has no system message (``null``: none)
``user_instruction``   text put before the first user message (the R1 "think, then answer
                       in \\boxed{}" instruction of ``qwen_r1``)
``strip_content``      (bool) strip surrounding whitespace of every message, as Llama 3 does
``stop_words``         (list) strings that end a generation, for the rollout side
``description``        free text

Rendering is plain string concatenation, so the same messages always give the same text; the
test-suite checks each template against the model's own Jinja chat template.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from mindspeed_llm.data.errors import DataError, InputFormatError, UnknownNameError

CONTENT = "{{content}}"
ROLES = ("system", "user", "assistant", "tool")
_FIELDS = {
    "name", "tool", "description", "prefix", "system", "user", "assistant", "generation_prompt",
    "default_system", "user_instruction", "strip_content", "stop_words",
}
TEMPLATES_ENV = "MINDSPEED_LLM_TEMPLATES"


def default_templates_path() -> Path:
    """``$MINDSPEED_LLM_TEMPLATES`` if set, else ``configs/model/templates.json`` of the repo."""
    env = os.environ.get(TEMPLATES_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs" / "model" / "templates.json"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    user: str = CONTENT
    assistant: str = CONTENT
    system: Optional[str] = None
    tool: Optional[str] = None
    generation_prompt: str = ""
    prefix: str = ""
    default_system: Optional[str] = None
    user_instruction: str = ""
    strip_content: bool = False
    stop_words: Sequence[str] = field(default_factory=tuple)
    description: str = ""

    def _fill(self, fmt: str, content: str) -> str:
        return fmt.replace(CONTENT, content)

    def render(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages (``{"role", "content"}`` dicts) to the model's prompt text."""
        msgs = [(str(m["role"]), "" if m.get("content") is None else str(m["content"]))
                for m in messages]
        parts = [self.prefix]
        if (not msgs or msgs[0][0] != "system") and self.default_system is not None:
            parts.append(self._turn("system", self.default_system))
        instructed = False
        for role, content in msgs:
            if role == "user" and self.user_instruction and not instructed:
                content = self.user_instruction + content
                instructed = True
            parts.append(self._turn(role, content))
        if add_generation_prompt:
            parts.append(self.generation_prompt)
        return "".join(parts)

    def _turn(self, role: str, content: str) -> str:
        if role not in ROLES:
            raise InputFormatError(
                f"chat role {role!r} is not supported by prompt type {self.name!r}; "
                f"supported roles: {', '.join(ROLES)}")
        fmt = getattr(self, role)
        if fmt is None:
            raise InputFormatError(f"prompt type {self.name!r} has no format for {role} messages")
        if self.strip_content:
            content = content.strip()
        return self._fill(fmt, content)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in sorted(_FIELDS) if k != "tool" or self.tool is not None}
        out["stop_words"] = list(self.stop_words)
        return out


def _parse(entry: Mapping, path: Path, index: int) -> ChatTemplate:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise InputFormatError(f"{path}: template #{index} is not an object with a string 'name'")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise InputFormatError(
            f"{path}: template {entry['name']!r} has unknown field(s) {sorted(unknown)}; "
            f"valid fields: {sorted(_FIELDS)}")
    kwargs = dict(entry)
    kwargs["stop_words"] = tuple(kwargs.get("stop_words") or ())
    for key in ("user", "assistant"):
        if key in kwargs and CONTENT not in kwargs[key]:
            raise InputFormatError(f"{path}: template {entry['name']!r}: '{key}' lacks {CONTENT}")
    return ChatTemplate(**kwargs)


@lru_cache(maxsize=8)
def _load(path_str: str, mtime: float) -> dict:
    path = Path(path_str)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputFormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, list):
        raise InputFormatError(f"{path}: expected a JSON array of templates")
    templates = {}
    for i, entry in enumerate(raw):
        t = _parse(entry, path, i)
        if t.name in templates:
            raise InputFormatError(f"{path}: template name {t.name!r} appears twice")
        templates[t.name] = t
    return templates


def load_templates(path: Optional[os.PathLike] = None) -> dict:
    """All templates of ``path`` (default: :func:`default_templates_path`) by name."""
    p = Path(path) if path is not None else default_templates_path()
    if not p.is_file():
        raise DataError(f"chat template file not found: {p} (pass --prompt-type-path or set ${TEMPLATES_ENV})")
    return dict(_load(str(p.resolve()), p.stat().st_mtime))


def get_template(name: str, path: Optional[os.PathLike] = None) -> ChatTemplate:
    """The template called ``name``; an :class:`UnknownNameError` lists the valid names."""
    templates = load_templates(path)
    if name not in templates:
        raise UnknownNameError(
            f"unknown prompt type {name!r}; valid prompt types: {', '.join(sorted(templates))}")
    return templates[name]
