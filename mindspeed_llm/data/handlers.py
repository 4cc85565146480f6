"""Instruction handlers: turn raw rows into what a training stage reads.

A handler is picked by ``--handler-name`` from :data:`HANDLERS`. It maps the row's columns to
*roles* with ``--map-keys`` (JSON ``{"role": "column"}``):

``prompt``   the instruction; a string, or a list of ``{"role", "content"}`` chat messages
             (DAPO-Math-17k's ``prompt`` column)
``query``    optional extra input, appended to the prompt after a newline (Alpaca's ``input``)
``response`` the answer text (SFT / reward data)
``system``   a per-row system message; overrides the template's default system prompt
``labels``   the reference answer kept as a string label (GRPO on math)
``history``  accepted for MindSpeed compatibility and ignored

Columns may be nested: ``reward_model.ground_truth`` reads ``row["reward_model"]["ground_truth"]``.
Without ``--map-keys`` a handler uses its :attr:`~BaseHandler.default_map_keys` (Alpaca column
names) and tolerates missing optional columns. With ``--map-keys`` the roles not given are empty,
and a given column that a row lacks is an error naming the key and the columns that exist.

Each kept row yields *packed* token-id sequences (``input_ids``, and ``labels`` for
:class:`AlpacaStyleInstructionHandler`) and *extras*: JSON values kept per sample (the string
``labels`` of :class:`R1AlpacaStyleInstructionHandler` and every ``--dataset-additional-keys``
column). A row is dropped, and counted by reason, when its prompt is empty, its label or
response is missing, or it is longer than ``--max-prompt-length`` / ``--seq-length``; with
``--overlong-prompts truncate`` an over-long prompt keeps its last tokens instead (counted as
truncated), with ``--overlong-prompts error`` it stops the run naming the row.

The text roles (prompt, query, response, system, chat-message content) must hold strings: a
number or a struct there is an error naming the column and its type, never the text "1". Only
``labels`` may be a number (or a list / struct): verifiers compare answers as strings, so it is
kept as its string (lists and structs as JSON).
"""
from __future__ import annotations

import datetime
import json
import logging
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from mindspeed_llm.data.errors import DataError, InputFormatError, MissingColumnError, UnknownNameError
from mindspeed_llm.data.readers import flat_columns
from mindspeed_llm.data.templates import ChatTemplate
from mindspeed_llm.registry import Registry

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = ("prompt", "query", "response", "system", "labels", "history")

# drop reasons
EMPTY_PROMPT = "empty_prompt"
EMPTY_LABEL = "empty_label"
EMPTY_RESPONSE = "empty_response"
PROMPT_TOO_LONG = "prompt_too_long"
SEQUENCE_TOO_LONG = "sequence_too_long"

#: what --overlong-prompts does with a prompt longer than --max-prompt-length
OVERLONG_MODES = ("drop", "truncate", "error")

HANDLERS = Registry()

_MISSING = object()
_KEY_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def register_handler(cls):
    """Class decorator: make ``cls`` selectable by ``--handler-name <class name>``."""
    return HANDLERS.register()(cls)


def handler_names() -> List[str]:
    return sorted(HANDLERS)


def get_handler_class(name: str):
    if name not in HANDLERS:
        raise UnknownNameError(
            f"unknown --handler-name {name!r}; valid handlers: {', '.join(handler_names())}")
    return HANDLERS[name]


def parse_map_keys(value) -> Optional[Dict[str, Optional[str]]]:
    """``--map-keys`` (a JSON string or a dict) as ``{role: column or None}``; None if not given."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"--map-keys is not valid JSON ({e.msg} at column {e.colno}): {value!r}") from None
    if not isinstance(value, dict):
        raise DataError(f"--map-keys must be a JSON object like {{\"prompt\": \"problem\"}}, got {value!r}")
    out = {}
    for role, column in value.items():
        if role not in ROLES:
            raise UnknownNameError(f"unknown --map-keys role {role!r}; valid roles: {', '.join(ROLES)}")
        if column is not None and not isinstance(column, str):
            raise DataError(f"--map-keys {role!r} must name a column (a string), got {column!r}")
        out[role] = column or None
    return out


def lookup(row: dict, column: str):
    """``row[column]``, following dots into nested structs; ``_MISSING`` when absent."""
    if column in row:
        return row[column]
    if "." in column:
        cur = row
        for part in column.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                return _MISSING
        return cur
    return _MISSING


def _json_default(value):
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        raise InputFormatError("binary column values cannot be kept as dataset keys")
    raise InputFormatError(f"value of type {type(value).__name__} cannot be kept as a dataset key")


def encode_extra(value) -> bytes:
    """How an extra value is stored: UTF-8 JSON (``json.loads`` gives it back with its type)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=_json_default).encode("utf-8")


def _kind(value) -> str:
    """A value's type for error messages (JSON / Parquet terms where they differ from Python's)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, dict):
        return "struct"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _role_text(value, role: str, column: str, source: str, what: str = "") -> str:
    """The text of a prompt / query / response / system value; anything but a string (or nothing)
    is an error: an id or a number in a text role would silently become the prompt "1", "2"."""
    if value is None or value is _MISSING:
        return ""
    if isinstance(value, str):
        return value
    shown = " ".join(str(value).split())[:60]
    raise InputFormatError(
        f"{source}: column {column!r} (--map-keys {role!r}){what} holds {_kind(value)} {shown}, not "
        f"text; map a text column to {role!r} in --map-keys (only 'labels' may be numbers)")


def _as_text(value, what: str, source: str) -> str:
    if value is None or value is _MISSING:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    raise InputFormatError(f"{source}: {what} must be text, got {type(value).__name__}: {str(value)[:80]!r}")


class BaseHandler:
    """Common part of the instruction handlers (prompt building, filtering, extras)."""

    #: token-id datasets this handler writes, in order
    packed_keys: Tuple[str, ...] = ("input_ids",)
    #: role -> column used when --map-keys is not given
    default_map_keys: Dict[str, str] = {"prompt": "instruction", "query": "input", "system": "system"}
    #: roles this handler reads
    roles_used: Tuple[str, ...] = ("prompt", "query", "system")
    #: whether the handler wants a string label (role ``labels``, falling back to ``response``)
    label_required = False

    def __init__(self, tokenizer, template: ChatTemplate, map_keys: Optional[dict] = None,
                 additional_keys: Sequence[str] = (), max_prompt_length: Optional[int] = None,
                 seq_length: Optional[int] = None, append_eod: bool = False, overlong_prompts: str = "drop"):
        if overlong_prompts not in OVERLONG_MODES:
            raise DataError(f"--overlong-prompts {overlong_prompts!r}: use one of {', '.join(OVERLONG_MODES)}")
        self.tokenizer = tokenizer
        self.overlong_prompts = overlong_prompts
        self.template = template
        self.explicit_map_keys = map_keys is not None
        self.map_keys = dict(self.default_map_keys) if map_keys is None else dict(map_keys)
        self.max_prompt_length = max_prompt_length or None
        self.seq_length = seq_length or None
        self.append_eod = append_eod
        self.notes: List[str] = []
        self.label_column = self._label_column()
        self.produced_extras: Tuple[str, ...] = ("labels",) if self.label_column else ()
        self.additional_keys = self._check_additional(additional_keys)
        self.extra_keys: Tuple[str, ...] = tuple(dict.fromkeys(self.produced_extras + self.additional_keys))
        for role, column in self.map_keys.items():
            if column and role not in self.roles_used and role not in ("labels", "response"):
                self.notes.append(f"--map-keys {role!r} is not used by {type(self).__name__}; ignored")

    # ---- configuration -------------------------------------------------------------------
    def _label_column(self) -> Optional[str]:
        column = self.map_keys.get("labels") or (self.map_keys.get("response") if self.label_required else None)
        if self.label_required and not column:
            raise DataError(
                f"{type(self).__name__} keeps a reference answer per prompt: map its column with "
                f"--map-keys, e.g. '{{\"prompt\": \"problem\", \"labels\": \"answer\"}}'")
        return column

    def _check_additional(self, keys: Sequence[str]) -> Tuple[str, ...]:
        out = []
        for key in keys or ():
            if not key or not _KEY_NAME.match(key):
                raise DataError(
                    f"--dataset-additional-keys {key!r}: use letters, digits, '_', '-' and '.' only")
            if key in self.packed_keys:
                raise DataError(
                    f"--dataset-additional-keys {key!r} clashes with the token dataset {key!r} "
                    f"that {type(self).__name__} writes")
            out.append(key)
        return tuple(dict.fromkeys(out))

    def _get(self, row: dict, role: str, source: str):
        column = self.map_keys.get(role)
        if not column:
            return None
        value = lookup(row, column)
        if value is _MISSING:
            if not self.explicit_map_keys and role != "prompt" and role not in self.required_roles():
                return None
            raise MissingColumnError(
                f"{source}: column {column!r} (--map-keys {role!r}) not found; "
                f"columns in this row: {', '.join(flat_columns(row)) or '(none)'}")
        return value

    def required_roles(self) -> Tuple[str, ...]:
        return ("prompt",)

    def _text(self, row: dict, role: str, source: str) -> str:
        return _role_text(self._get(row, role, source), role, self.map_keys.get(role) or role, source)

    def _overlong(self, n_tokens: int, limit: int, flag: str, source: str) -> Optional[int]:
        """What to do with a prompt of ``n_tokens`` > ``limit``: None (drop it) or how many of its
        leading tokens to cut (truncate, keeping the end); raises with ``--overlong-prompts error``."""
        if self.overlong_prompts == "error":
            raise DataError(
                f"{source}: the templated prompt has {n_tokens} tokens, more than {flag} {limit} "
                f"(--overlong-prompts error); raise {flag}, or pass --overlong-prompts drop (skip such rows) or "
                f"truncate (keep each prompt's last {limit} tokens)")
        if self.overlong_prompts == "truncate":
            return n_tokens - limit
        return None

    # ---- row -> messages ---------------------------------------------------------------------
    def build_messages(self, row: dict, source: str) -> Optional[List[dict]]:
        """The chat messages of a row's prompt, or None when the prompt is empty."""
        prompt = self._get(row, "prompt", source)
        query = self._text(row, "query", source)
        system = self._text(row, "system", source)
        if isinstance(prompt, (list, tuple)):
            messages = []
            for m in prompt:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise InputFormatError(
                        f"{source}: a chat-message prompt must be a list of {{'role', 'content'}} "
                        f"objects, got {str(m)[:80]!r}")
                messages.append({"role": str(m["role"]),
                                 "content": _role_text(m["content"], "prompt", self.map_keys.get("prompt"), source,
                                                       " message content")})
            if query:
                users = [i for i, m in enumerate(messages) if m["role"] == "user"]
                if users:
                    messages[users[-1]]["content"] += "\n" + query
                else:
                    messages.append({"role": "user", "content": query})
        else:
            text = _role_text(prompt, "prompt", self.map_keys.get("prompt"), source)
            if query:
                text = f"{text}\n{query}" if text else query
            messages = [{"role": "user", "content": text}]
        if not any(m["content"].strip() for m in messages if m["role"] == "user"):
            return None
        if system.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def extras_of(self, row: dict, source: str) -> Tuple[Optional[Dict[str, bytes]], Optional[str]]:
        """The encoded extras of a row, or ``(None, reason)`` when the row must be dropped."""
        extras: Dict[str, bytes] = {}
        if self.label_column:
            value = lookup(row, self.label_column)
            if value is _MISSING:
                if self.explicit_map_keys or self.label_required:
                    raise MissingColumnError(
                        f"{source}: column {self.label_column!r} (--map-keys 'labels') not found; "
                        f"columns in this row: {', '.join(flat_columns(row)) or '(none)'}")
                value = None
            if isinstance(value, (list, dict)):
                label = json.dumps(value, ensure_ascii=False, default=_json_default)
            else:
                label = _as_text(value, "label", source)
            if self.label_required and not label.strip():
                return None, EMPTY_LABEL
            extras["labels"] = encode_extra(label)
        for key in self.additional_keys:
            if key in extras:
                continue
            value = lookup(row, key)
            if value is _MISSING:
                raise MissingColumnError(
                    f"{source}: column {key!r} (--dataset-additional-keys) not found; "
                    f"columns in this row: {', '.join(flat_columns(row)) or '(none)'}")
            extras[key] = encode_extra(value)
        return extras, None

    def encode(self, texts: List[str]) -> List[List[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    # ---- main entry --------------------------------------------------------------------------
    def process_batch(self, rows: Iterable[Tuple[str, dict]]) -> List[tuple]:
        """Process ``(source, row)`` pairs, in order, to ``("ok", packed, extras)`` or ``("drop", reason)``."""
        raise NotImplementedError


class _PromptOnlyHandler(BaseHandler):
    """Writes the templated prompt's token ids (``input_ids``) plus the extras."""

    def process_batch(self, rows):
        results: List[tuple] = []
        pending: List[Tuple[int, str, Dict[str, bytes]]] = []
        for source, row in rows:
            messages = self.build_messages(row, source)
            if messages is None:
                results.append(("drop", EMPTY_PROMPT))
                continue
            extras, reason = self.extras_of(row, source)
            if reason:
                results.append(("drop", reason))
                continue
            results.append(None)
            pending.append((len(results) - 1, source, self.template.render(messages, add_generation_prompt=True),
                            extras))
        limit = min(x for x in (self.max_prompt_length, self.seq_length, float("inf")) if x)
        flag = "--max-prompt-length" if limit == self.max_prompt_length else "--seq-length"
        for (slot, source, _, extras), ids in zip(pending, self.encode([p[2] for p in pending])):
            if len(ids) <= limit:
                results[slot] = ("ok", {"input_ids": ids}, extras)
                continue
            cut = self._overlong(len(ids), limit, flag, source)
            if cut is None:
                results[slot] = ("drop", PROMPT_TOO_LONG)
            else:  # the end holds the question and the opened assistant turn
                results[slot] = ("ok", {"input_ids": ids[cut:]}, extras, PROMPT_TOO_LONG)
        return results


@register_handler
class PPOAlpacaStyleInstructionHandler(_PromptOnlyHandler):
    """Prompts only, for ``trl_ppo``: ``input_ids`` = the templated prompt ending with the
    template's generation prompt (the opened assistant turn). A ``labels`` role, if mapped, is kept
    as a string extra."""


@register_handler
class R1AlpacaStyleInstructionHandler(_PromptOnlyHandler):
    """Prompts plus a reference answer, for GRPO with rule rewards: ``input_ids`` = the templated
    prompt, extra ``labels`` = the answer string (role ``labels``, else ``response``). Rows without
    an answer are dropped (reason ``empty_label``).

    DeepScaleR: ``{"prompt": "problem", "labels": "answer"}``;
    DAPO-Math-17k: ``{"prompt": "prompt", "labels": "reward_model.ground_truth"}``."""

    default_map_keys = {"prompt": "instruction", "query": "input", "system": "system", "labels": "output"}
    label_required = True


@register_handler
class AlpacaStyleInstructionHandler(BaseHandler):
    """Prompt + response, for SFT-style use and reward data: ``input_ids`` = the templated
    conversation including the finished assistant turn, ``labels`` = the same ids with the prompt
    part set to -100 (only the response is trained on). Rows with an empty response are dropped."""

    packed_keys = ("input_ids", "labels")
    default_map_keys = {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}
    roles_used = ("prompt", "query", "system", "response")

    def _label_column(self):
        if self.map_keys.get("labels"):
            raise DataError(
                "AlpacaStyleInstructionHandler stores token-level labels built from the response; "
                "map the answer column to 'response' instead of 'labels' in --map-keys")
        return None

    def required_roles(self):
        return ("prompt", "response")

    def process_batch(self, rows):
        results: List[tuple] = []
        pending = []
        for source, row in rows:
            messages = self.build_messages(row, source)
            if messages is None:
                results.append(("drop", EMPTY_PROMPT))
                continue
            response = self._text(row, "response", source)
            if not response.strip():
                results.append(("drop", EMPTY_RESPONSE))
                continue
            extras, reason = self.extras_of(row, source)
            if reason:
                results.append(("drop", reason))
                continue
            prompt_text = self.template.render(messages, add_generation_prompt=True)
            full_text = self.template.render(messages + [{"role": "assistant", "content": response}],
                                             add_generation_prompt=False)
            results.append(None)
            pending.append((len(results) - 1, prompt_text, full_text, extras, source))
        prompt_ids = self.encode([p[1] for p in pending])
        full_ids = self.encode([p[2] for p in pending])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for (slot, _, _, extras, source), p_ids, ids in zip(pending, prompt_ids, full_ids):
            # the prompt part is the longest common prefix of the two encodings; a token that
            # straddles the boundary belongs to the response
            n = 0
            limit = min(len(p_ids), len(ids))
            while n < limit and p_ids[n] == ids[n]:
                n += 1
            if self.append_eod and eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            labels = [IGNORE_INDEX] * n + ids[n:]
            note = ()
            if self.max_prompt_length and len(p_ids) > self.max_prompt_length:
                cut = self._overlong(len(p_ids), self.max_prompt_length, "--max-prompt-length", source)
                if cut is None:
                    results[slot] = ("drop", PROMPT_TOO_LONG)
                    continue
                cut = min(cut, n)  # only prompt tokens go: the prompt's end and the response stay
                ids, labels, note = ids[cut:], labels[cut:], (PROMPT_TOO_LONG,)
            if self.seq_length and len(ids) > self.seq_length:
                results[slot] = ("drop", SEQUENCE_TOO_LONG)
            else:
                results[slot] = ("ok", {"input_ids": ids, "labels": labels}, extras) + note
        return results
