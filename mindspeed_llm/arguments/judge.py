"""Checking the LLM judge's flags (`--judge-*`, `rl/judge.py`) before any model is built: the template read and its
placeholders checked, the parser loaded (`rl/judge_verdicts.py`), the checkpoint and tokenizer folders present, and
no judge flag given without --judge-load."""

from __future__ import annotations

import os

from mindspeed_llm.errors import ArgumentError

# the judge's flags that mean nothing without --judge-load, with their parser defaults
_DEPENDENT = {"judge_tokenizer_name_or_path": None, "judge_template": None, "judge_parser": None,
              "judge_weight": 1.0, "judge_max_new_tokens": 256, "judge_unparsed_score": 0.0}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_judge(run) -> None:
    """`ArgumentError` naming the flag and the fix for a judge flag without --judge-load, --judge-load without
    --judge-template, a checkpoint or tokenizer folder that is not there, a bad template or parser; with the default
    parser a startup note says what it reads."""
    if run.judge_load is None:
        given = [_flag(dest) for dest, default in _DEPENDENT.items() if getattr(run, dest) != default]
        if given:
            raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                "--judge-load PATH (the judge's checkpoint); add it or drop them")
        return
    from mindspeed_llm.rl import judge_verdicts  # loads the user's parser: its errors before any model

    if not os.path.isdir(run.judge_load):
        raise ArgumentError(f"--judge-load {run.judge_load}: there is no such folder; give the judge's Megatron "
                            "checkpoint (convert_ckpt.py converts a Hugging Face model)")
    path = run.judge_tokenizer_name_or_path
    if path is not None and not os.path.isdir(path):
        raise ArgumentError(f"--judge-tokenizer-name-or-path {path}: there is no such folder; give the judge's "
                            "local tokenizer folder (nothing is downloaded), or drop the flag to use the run's "
                            "tokenizer")
    if run.judge_template is None:
        raise ArgumentError("--judge-load needs --judge-template FILE: the judge's prompt, a text file with "
                            "{prompt} and {response} (optionally {label}); see docs/algorithms.md, "
                            "\"LLM-as-judge rewards\"")
    judge_verdicts.read_template(run.judge_template)
    judge_verdicts.load_parser(run.judge_parser)
    if run.judge_parser is None:
        run.startup_notes.append(f"--judge-load: each verdict scores the number after its last "
                                 f"'{judge_verdicts.MARKER}' (the default parser; --judge-parser PATH:NAME for your "
                                 f"own), else --judge-unparsed-score {run.judge_unparsed_score:g}")
