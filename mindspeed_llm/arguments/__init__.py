"""The command line: one parser of Megatron-LM's flag names for what we support plus the RL flags of the stages
(`parser.py`, one `_add_<group>_args` per argument group), and its validation into the run's typed settings
(`validation.py`: every inconsistent combination refused with a message that names the flags, the stage defaults
and derived values resolved into `rl/settings.Settings`)."""

from __future__ import annotations

from typing import Optional, Sequence

from mindspeed_llm.arguments.parser import (  # noqa: F401  (the parser's constants, imported from here)
    ATTENTION_BACKENDS,
    LLAMA3_FIXED,
    LOCAL_ATTENTION_BACKENDS,
    RECOMPUTE_MODULES,
    REFUSED_RECOMPUTE_MODULES,
    build_parser,
)
from mindspeed_llm.arguments.validation import validate_args
from mindspeed_llm.errors import ArgumentError  # noqa: F401  (re-exported: users import the parser's error from here)


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1):
    """Parse and check a command line; the Namespace carries its typed settings as `args.settings`. A
    `--config FILE.yaml` is resolved before, by the caller (`run_config.config_argv`: the file's flags in front of
    the command line's)."""
    args = build_parser().parse_args(argv)
    validate_args(args, world_size)
    return args


__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]
