"""Every flag the parser accepts is applied, listed as ignored (`compat_flags`), or refused: a flag that parses and is
never read anywhere is a silent no-op, the worst kind of bug a launcher script can hit. Likewise every key the YAML
run config maps to a slot (`run_config.Slot`) is read by the mapping code.

A flag counts as read when the package (or `posttrain_gpt.py`) reads its destination outside the parser's
construction (`arguments/parser.py`): `args.<dest>` / `self.args.<dest>` / `run.<dest>` (validation's view of the
Namespace), `getattr(args, "<dest>")`, or the destination's name as a string literal (the tables that loop over
names) anywhere but the two mapping tables (the `run_config` package, which maps YAML keys of the same names, and
`compat_flags.py`). Flags that `validate_args` resolves into others (e.g.
`--lr-warmup-fraction` -> `lr_warmup_iters`) are read there, which counts. A flag whose destination is a field of
a typed settings part (`rl/settings.py`, which fills every field from the destination of its name) counts as read
when a consumer reads that field: `<part>.<dest>` anywhere but `settings.py` itself.

Run on the sources of ea923d8 (before activation recompute was applied) this test lists `--swiglu`,
`--use-rotary-position-embeddings`, `--recompute-granularity` (read nowhere: its only trace was
`config.recompute_granularity`, megatron's field) and `--no-save-optim`; a planted flag is listed too
(`test_a_planted_unused_flag_is_found`).
"""

import argparse
import re
from pathlib import Path

from dataclasses import fields

from mindspeed_llm import compat_flags
from mindspeed_llm.arguments import build_parser
from mindspeed_llm.rl import settings
from mindspeed_llm.run_config import GENERATE, MEGATRON, RL, SAMPLING, Nested, Slot

ROOT = Path(__file__).resolve().parents[2]
TABLES = (ROOT / "mindspeed_llm" / "run_config", ROOT / "mindspeed_llm" / "compat_flags.py")
SETTING_FIELDS = frozenset(f.name for part in settings.PARTS for f in fields(part))


def _sources():
    files = sorted((ROOT / "mindspeed_llm").rglob("*.py")) + [ROOT / "posttrain_gpt.py"]
    texts = {}
    for path in files:
        text = path.read_text()
        if path.parent.name == "arguments" and path.name == "parser.py":  # the parser's own construction reads nothing
            continue
        texts[path] = text
    return texts


def _in_tables(path: Path) -> bool:
    return any(path == table or table in path.parents for table in TABLES)


def unread_flags(parser: argparse.ArgumentParser, sources, setting_fields=SETTING_FIELDS) -> list:
    ignored = {compat_flags._dest(f) for f in (*compat_flags.IGNORED_SWITCHES, *compat_flags.IGNORED_VALUES,
                                               *compat_flags.IGNORED_LISTS)}
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", *ignored):
            continue
        dest = re.escape(action.dest)
        # `run.<dest>`: validation's view of the Namespace (arguments/validation._Resolving)
        attribute = re.compile(rf"\b(?:args|run)\.{dest}\b|getattr\(\s*[\w.]*(?:args|run)\s*,\s*[\"']{dest}[\"']")
        literal = re.compile(rf"[\"']{dest}[\"']")
        field_read = re.compile(rf"\.{dest}\b") if action.dest in setting_fields else None
        if not any(attribute.search(text) or (not _in_tables(path) and literal.search(text))
                   or (field_read is not None and path.name != "settings.py" and field_read.search(text))
                   for path, text in sources.items()):
            missing.append(action.option_strings[0])
    return missing


def test_every_flag_is_read_or_listed_as_ignored():
    assert unread_flags(build_parser(), _sources()) == []


def test_a_planted_unused_flag_is_found():
    parser = build_parser()
    parser.add_argument("--planted-unused-flag", type=int)
    assert unread_flags(parser, _sources()) == ["--planted-unused-flag"]


def test_a_settings_field_no_consumer_reads_is_found():
    """`settings.from_args` fills a field from the flag of its name, so the field existing proves nothing: a
    consumer must read it."""
    parser = build_parser()
    parser.add_argument("--planted-setting", type=int)
    assert unread_flags(parser, _sources(), SETTING_FIELDS | {"planted_setting"}) == ["--planted-setting"]


def _slots(table):
    for key, entry in table.items():
        if isinstance(entry, Slot):
            yield key, entry.name
        elif isinstance(entry, Nested):
            yield from _slots(entry.table)


def test_every_yaml_slot_is_read_by_the_mapping():
    """A `Slot` is a key the mapping code resolves itself (checkpoints, stage-dependent keys): its name must be read
    there (`run_config/mapping.py`, `run_config/checkpoints.py`, `run_config/dapo.py`: `slot("name")`,
    `origin("name")`, `"name" in ...slots`, or a tuple of names the code loops over)."""
    package = ROOT / "mindspeed_llm" / "run_config"
    mapping, checkpoints = (package / "mapping.py").read_text(), (package / "checkpoints.py").read_text()
    dapo = (package / "dapo.py").read_text()
    code = (mapping[mapping.index("def resolve("):] + checkpoints[checkpoints.index("def resolve_checkpoints("):]
            + dapo[dapo.index("_LOSS_KEYS = "):])
    unread = [key for table in (MEGATRON, RL, GENERATE, SAMPLING) for key, name in _slots(table)
              if not re.search(rf"[\"']{re.escape(name)}[\"']", code)]
    assert unread == []
