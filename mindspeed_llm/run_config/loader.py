"""Loading a run config: the YAML file and its model files (`load_run_config` -> `RunConfig`), and the hook
`posttrain_gpt.py` calls (`config_argv`: `--config FILE.yaml` replaced by the file's flags)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mindspeed_llm.arguments import build_parser
from mindspeed_llm.run_config.mapping import resolve
from mindspeed_llm.run_config.reader import ConfigReader, RoleKeys
from mindspeed_llm.run_config.tables import (
    CUSTOM_REWARD, DOCUMENTED_NULLS, EXCLUSIVE, GENERATE, MEGATRON, RL, ROLE_SECTIONS, SECTIONS, ConfigError, Slot,
)


@dataclass
class RunConfig:
    """The mapping of one file: `argv` goes in front of the command line's (see `config_argv`)."""
    path: str
    argv: List[str]
    ignored: List[Tuple[str, str]]
    notes: List[str]

    def report(self) -> str:
        lines = []
        if self.ignored:
            lines.append(f"--config {self.path}: {len(self.ignored)} keys have no meaning here and are ignored:")
            lines += [f"  {key}: {reason}" for key, reason in self.ignored]
        lines += [f"--config {self.path}: {note}" for note in dict.fromkeys(self.notes)]
        return "\n".join(lines)


def _null_means_something(keys) -> bool:
    """A section left empty (an empty section), or a key whose null is documented (`tables.DOCUMENTED_NULLS`)."""
    return len(keys) == 1 or any(tuple(keys[-len(k):]) == k for k in DOCUMENTED_NULLS)


def _load_yaml(path: str):
    """The file's mapping, read strictly (`files.read_yaml`: not UTF-8, not YAML, a key given twice, a key without
    a value are refused with the line); a section left empty is an empty section."""
    from mindspeed_llm.files import YamlFileError, read_yaml

    try:
        data = read_yaml(path, f"--config {path}", allow_null=_null_means_something)
    except FileNotFoundError:
        raise ConfigError(f"--config {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a directory; pass a YAML file") from None
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    return {} if data is None else data


def _default_models(reader: ConfigReader, defaults) -> List[str]:
    """The model names of hydra's `defaults: [{model: [NAME, ...]}]` (`_self_` entries are fine)."""
    names = []
    for item in defaults if isinstance(defaults, list) else [defaults]:
        if item == "_self_":
            continue
        if not isinstance(item, dict) or set(item) - {"model"}:
            raise reader.error("defaults", f"{item!r}: only '- model: [NAME]' entries (and _self_) are understood")
        listed = item.get("model")
        listed = listed if isinstance(listed, list) else [listed]
        if not all(isinstance(n, str) for n in listed):
            raise reader.error("defaults", f"{item!r}: model names must be strings")
        names += listed
    return names


def _model_entries(reader: ConfigReader, models: Dict[str, Any], name: Optional[str]):
    """The keys of model `name`: the file's `model` section, else `model/NAME.yaml` next to the file."""
    if name is None:
        return []
    if name in models:
        return reader.entries(f"model.{name}", models[name], MEGATRON, "megatron")
    here = os.path.dirname(os.path.abspath(reader.path))
    for candidate in (os.path.join(here, "model", f"{name}.yaml"), os.path.join(here, "..", "model", f"{name}.yaml")):
        if os.path.isfile(candidate):
            data = _load_yaml(candidate)
            if not isinstance(data, dict) or name not in data:
                raise ConfigError(f"--config {reader.path}: model '{name}': {candidate} has no top-level '{name}' key")
            return ConfigReader(candidate, reader.parser, reader.given).entries(f"model.{name}", data[name], MEGATRON,
                                                                                "megatron")
    reader.notes.append(f"model '{name}' is not defined in the file (nor model/{name}.yaml): its architecture is "
                        "read from the checkpoints")
    return []


def load_run_config(path: str, cli_argv: Sequence[str] = (), parser: Optional[argparse.ArgumentParser] = None
                    ) -> RunConfig:
    """Map the MindSpeed-RL run config at `path`; `cli_argv` (the command line without --config) decides what
    the file may not set (what it gives wins) and completes what the file leaves out (e.g. --ref-model)."""
    parser = parser or build_parser()
    given = given_dests(parser, cli_argv)
    reader = ConfigReader(path, parser, given)
    data = _load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of sections (megatron_training, actor_config, "
                          f"rl_config, ...), not {type(data).__name__}")
    for section in data:
        if section not in SECTIONS:
            near = difflib.get_close_matches(str(section), SECTIONS, n=1, cutoff=0.7)
            hint = f" (did you mean '{near[0]}'?)" if near else f"; the sections are: {', '.join(SECTIONS)}"
            raise ConfigError(f"--config {path}: unknown section '{section}'{hint}")
    sections = {name: (data.get(name) or {}) for name in SECTIONS if name != "defaults"}
    models = sections["model"]
    if not isinstance(models, dict):
        raise reader.error("model", "must map model names to their keys")
    for name in _default_models(reader, data.get("defaults") or []):
        if name not in models:
            _model_entries(reader, models, name)  # a note when it is nowhere
    for name, keys in models.items():
        reader.entries(f"model.{name}", keys, MEGATRON, "megatron")  # every entry is checked, used or not

    run = RoleKeys()
    base = reader.entries("megatron_training", sections["megatron_training"], MEGATRON, "megatron")
    actor = reader.entries("actor_config", sections["actor_config"], MEGATRON, "megatron")
    actor_model = _model_name(reader, base + actor)
    reader.read(run, _model_entries(reader, models, actor_model))
    reader.read(run, base)
    reader.read(run, actor)
    reader.read(run, reader.entries("rl_config", sections["rl_config"], RL, "rl"))
    reader.read(run, reader.entries("generate_config", sections["generate_config"], GENERATE))
    if sections["custom_reward_function"]:  # verl's place for it
        if isinstance(sections["rl_config"], dict) and sections["rl_config"].get("custom_reward_function"):
            raise reader.error("custom_reward_function", "is given twice, as a section and in rl_config; keep one")
        reader.read(run, reader.entries("custom_reward_function", sections["custom_reward_function"], CUSTOM_REWARD))

    roles: Dict[str, Tuple[RoleKeys, List]] = {}
    for section in ROLE_SECTIONS:
        if section not in data:
            continue
        entries = reader.entries(section, sections[section], MEGATRON, "megatron")
        name = _model_name(reader, entries)
        own = _model_entries(reader, models, name) if name not in (None, actor_model) else []
        role = RoleKeys()
        frozen = section != "critic_config"
        reader.read(role, own, frozen)
        reader.read(role, entries, frozen)
        roles[section] = (role, name)

    flags = resolve(reader, run, roles, cli_argv)
    for group in EXCLUSIVE:
        if given & set(group):
            given = given | set(group)
    argv = [token for dest, v in flags.items() if dest not in given for token in v.tokens]
    return RunConfig(path, argv, reader.ignored, reader.notes)


def _model_name(reader: ConfigReader, entries) -> Optional[str]:
    """The last `model:` of these entries (a role section's overrides the base's)."""
    name = None
    for where, entry, value in entries:
        if isinstance(entry, Slot) and entry.name == "model":
            name = reader.slot_value(entry, value, where)
    return name


# ------------------------------------------------------------------------------------------ the hook
def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set:
    """The dests of the options on a command line (values are never taken for options: this parser's values
    do not start with '--')."""
    given = set()
    for token in argv:
        if token.startswith("--"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                given.add(action.dest)
    return given


def split_config(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """(the --config path or None, the command line without it)."""
    path, rest, it = None, [], iter(range(len(argv)))
    for i in it:
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if path is not None:
                raise ConfigError("--config is given twice; pass one run config")
            if token == "--config":
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError("--config needs a YAML file")
                path = argv[i + 1]
                next(it, None)
            else:
                path = token.split("=", 1)[1]
        else:
            rest.append(token)
    return path, rest


def config_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The command line with `--config FILE.yaml` replaced by the file's flags (put first: what the command line
    gives wins). Without --config, the command line unchanged. Rank 0 lists the ignored keys once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = split_config(argv)
    if path is None:
        return argv
    config = load_run_config(path, rest)
    report = config.report()
    if report and os.environ.get("RANK", "0") == "0":
        print(report, flush=True)
    return config.argv + rest
