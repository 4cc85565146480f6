"""Reading a run config's keys into typed flag values: `ConfigReader` looks each key up in its section's table
(`tables.py`), types a flag's value as the parser would (`FlagValue`, with the command-line tokens that give it)
and collects what a role's sections say (`RoleKeys`); `cli_value` reads a flag's value off a command line."""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mindspeed_llm.run_config.tables import LORA, OPTIM, RECOMPUTE, Accept, ConfigError, Flag, Ignored, Nested, Slot


@dataclass
class FlagValue:
    """One typed flag value: its parser action, the value argparse would produce, its tokens, where from."""
    action: argparse.Action
    value: Any
    tokens: List[str]
    origin: str

    @property
    def dest(self) -> str:
        return self.action.dest


@dataclass
class RoleKeys:
    """What the file says for one role (or, for the actor, the run)."""
    flags: Dict[str, FlagValue] = field(default_factory=dict)
    slots: Dict[str, Tuple[Any, str]] = field(default_factory=dict)

    def slot(self, name, default=None):
        return self.slots[name][0] if name in self.slots else default

    def origin(self, name) -> str:
        return self.slots[name][1] if name in self.slots else name


class ConfigReader:
    def __init__(self, path: str, parser: argparse.ArgumentParser, given: set):
        self.path = path
        self.parser = parser
        self.given = given
        self.actions = parser._option_string_actions
        self.ignored: List[Tuple[str, str]] = []
        self.notes: List[str] = []
        groups = {g.title or "": g._group_actions for g in parser._action_groups}
        # the model flags (checked against every checkpoint) and this program's RL flags, by action
        self.arch = {id(a) for title, acts in groups.items() if title.startswith("model") for a in acts}
        self.rl_flags = {a.dest: a.option_strings[0] for title, acts in groups.items() if title.startswith("RL:")
                         for a in acts}

    def is_arch(self, v: "FlagValue") -> bool:
        return id(v.action) in self.arch

    def lookup(self, key: str, table: Dict[str, Any], fallback: Optional[str]):
        """The table's entry for `key`; else, for `fallback` "megatron", this program's flag of that name, for
        "rl" its RL flag of that name; Ignored entries only while the parser has no such flag."""
        entry = table.get(key)
        if isinstance(entry, (Ignored, type(None))) and fallback is not None:
            flag = "--" + key.replace("_", "-")
            if fallback == "megatron" and flag in self.actions:
                return Flag(flag)
            if fallback == "rl" and key in self.rl_flags:
                return Flag(self.rl_flags[key])
        return entry

    def known(self, table: Dict[str, Any], fallback: Optional[str]) -> List[str]:
        keys = set(table)
        if fallback == "megatron":
            keys |= {a.dest for a in self.parser._actions if a.option_strings and a.dest != "help"}
        elif fallback == "rl":
            keys |= set(self.rl_flags)
        return sorted(keys)

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"--config {self.path}: {where}: {message}")

    # -- keys
    def entries(self, section: str, mapping, table: Dict[str, Any], fallback: Optional[str] = None):
        """[(qualified key, entry, value)] of `mapping`; unknown keys and nested non-mappings refused."""
        if not isinstance(mapping, dict):
            raise self.error(section, f"must be a mapping of keys to values, not {type(mapping).__name__}")
        out = []
        for key, value in mapping.items():
            where = f"{section}.{key}"
            entry = self.lookup(key, table, fallback) if isinstance(key, str) else None
            if entry is None:
                known = self.known(table, fallback)
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.7)
                hint = f" (did you mean '{near[0]}'?)" if near else \
                    f"; the known keys of '{section}' are: {', '.join(known)}"
                raise ConfigError(f"--config {self.path}: unknown key '{key}' in section '{section}'{hint}")
            if value is None:  # a section left empty (a key without a value is refused as the file is read)
                continue
            if isinstance(entry, Nested):
                out += self.entries(where, value, entry.table)
            else:
                out.append((where, entry, value))
        return out

    # -- typing
    def typed(self, flag: str, value, where: str) -> FlagValue:
        """`value` for `flag` as argparse would produce it from the tokens returned with it."""
        action = self.actions[flag]
        opt = action.option_strings[0]

        def wrong(kind: str) -> ConfigError:
            return self.error(where, f"{value!r} is not {kind} (it sets {opt})")

        if action.nargs == 0:
            if not isinstance(value, bool):
                raise wrong("true or false")
            if isinstance(action, argparse.BooleanOptionalAction):
                return FlagValue(action, value, [opt if value else "--no-" + opt[2:]], where)
            if value and action.const is not True:  # store_const
                return FlagValue(action, action.const, [opt], where)
            return FlagValue(action, bool(value), [opt] if value else [], where)
        if isinstance(action, argparse._AppendAction):  # e.g. --seq-length, which a command line may repeat
            converted, text = self._scalar(action, value, wrong)
            return FlagValue(action, [converted], [f"{opt}={text}"], where)
        if action.nargs in ("+", "*"):
            items = value if isinstance(value, list) else [value]
            if not items and action.nargs == "+":
                raise wrong("a non-empty list")
            converted = [self._scalar(action, item, wrong) for item in items]
            return FlagValue(action, [c for c, _ in converted], [opt] + [t for _, t in converted], where)
        if isinstance(value, list) and action.type not in (None, str, int, float):  # e.g. --stop-token-ids
            value = ",".join(str(v) for v in value)
        converted, text = self._scalar(action, value, wrong)
        return FlagValue(action, converted, [f"{opt}={text}"], where)

    @staticmethod
    def _scalar(action, value, wrong):
        if isinstance(value, (list, dict)):
            raise wrong("a single value")
        kind = {int: "an integer", float: "a number"}.get(action.type, "a valid value")
        text = str(value)  # what a command line would give (a YAML bool reads "True": no number)
        try:
            converted = action.type(text) if action.type is not None else text
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise wrong(kind) from None
        if action.choices is not None and converted not in action.choices:
            raise wrong(f"one of {', '.join(map(str, action.choices))}")
        return converted, text

    def slot_value(self, slot: Slot, value, where: str):
        ok = {
            "path": isinstance(value, str) and bool(value.strip()),
            "bool": isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "name": isinstance(value, str),
            "names": isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
        }[slot.kind]
        if not ok:
            kind = {"path": "a path", "bool": "true or false", "number": "a number", "name": "a name",
                    "names": "a list of names"}[slot.kind]
            raise self.error(where, f"{value!r} is not {kind}")
        if slot.kind == "names" and isinstance(value, str):
            return [value]
        return value

    # -- a layer of keys into a role
    def read(self, role: RoleKeys, entries, frozen: bool = False) -> None:
        for where, entry, value in entries:
            if isinstance(entry, Ignored):
                self.ignored.append((where, entry.reason))
            elif isinstance(entry, Accept):
                if not entry.ok(value):
                    raise self.error(where, f"{value!r} cannot be honoured: {entry.reason}")
            elif isinstance(entry, Slot):
                role.slots[entry.name] = (self.slot_value(entry, value, where), where)
            elif frozen and where.rsplit(".", 1)[-1] in OPTIM:
                self.ignored.append((where, "a frozen model has no optimizer"))
            elif frozen and where.rsplit(".", 1)[-1] in RECOMPUTE:
                self.ignored.append((where, "a frozen model runs no backward: nothing to recompute"))
            elif frozen and where.rsplit(".", 1)[-1] in LORA:
                self.ignored.append((where, "a frozen model trains no adapters (with LoRA it is a trained model's "
                                            "base with its adapters off)"))
            else:
                if entry.convert is not None:
                    try:
                        value = entry.convert(value)
                    except ValueError as exc:
                        raise self.error(where, str(exc)) from None
                typed = self.typed(entry.flag, value, where)
                role.flags[typed.action.dest] = typed


def cli_value(argv: Sequence[str], flag: str) -> Optional[str]:
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value
