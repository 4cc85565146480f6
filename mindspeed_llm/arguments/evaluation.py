"""The held-out evaluation's flags: --split's weights, the held-out sets (--eval-data-path [NAME=]PREFIX ..., or
--split's valid part), when they are evaluated (--eval-interval, --eval-before-train) and how (--eval-n-samples,
--eval-temperature, --eval-top-p, --eval-pass-threshold), resolved into the run's settings and refused by name
where they do not combine. Called from `validation.validate_args` with its resolving view of the Namespace."""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

from mindspeed_llm.errors import ArgumentError

# names a set may not take: the metric names of the unnamed set's keys (`eval/score/mean`, `eval/pass@4`, ...)
RESERVED_SET_NAMES = frozenset({"score", "response_length", "kl", "num_turns", "tool"})
_SET_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def split_weights(text: str) -> Tuple[float, float, float]:
    """Megatron-LM's --split: up to three train,valid,test weights ("98,2,0", "98 2 0", "969/30/1"), missing
    ones 0, normalised by their sum."""
    try:
        weights = [float(x) for x in text.replace("/", ",").replace(",", " ").split()]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ArgumentError(f"--split {text!r}: expected up to three weights >= 0 for train,valid,test with a "
                            "positive sum, e.g. --split 98,2,0")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)


def eval_sets(paths) -> Tuple[Tuple[Optional[str], str], ...]:
    """--eval-data-path's sets as (name, prefix) pairs: `NAME=PREFIX` names a set, a plain PREFIX is the one unnamed
    set (name None: its metrics keep the names `eval/score/mean`, ...), which cannot be mixed with named ones.
    Names are letters, digits, `_ . -`, unique, and not a metric's name."""
    sets = []
    for text in paths or ():
        name, sep, prefix = text.partition("=")
        if not sep:
            sets.append((None, text))
            continue
        if not _SET_NAME.match(name) or name in RESERVED_SET_NAMES or not prefix:
            raise ArgumentError(
                f"--eval-data-path {text!r}: expected NAME=PREFIX with a NAME of letters, digits, '_', '.', '-' (not "
                f"{', '.join(sorted(RESERVED_SET_NAMES))}: metric names) and a preprocessed prefix after '='")
        sets.append((name, prefix))
    names = [n for n, _ in sets]
    if len(sets) > 1 and None in names:
        raise ArgumentError(f"--eval-data-path {' '.join(paths)}: with several held-out sets, name each one "
                            "(NAME=PREFIX), e.g. --eval-data-path gsm8k=data/gsm8k math=data/math")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ArgumentError(f"--eval-data-path names {', '.join(repeated)} more than once; give each set its own name")
    return tuple(sets)


def _check_sampling(run) -> None:
    """--eval-n-samples / --eval-temperature / --eval-top-p: sampled evaluation needs samples drawn at a temperature;
    --eval-top-p without sampling is refused, as it would change nothing."""
    sampled = run.eval_n_samples > 1 or run.eval_temperature is not None
    if run.eval_top_p != 1.0 and not sampled:
        raise ArgumentError(f"--eval-top-p {run.eval_top_p} has no effect on greedy evaluation (--eval-n-samples 1 "
                            "without --eval-temperature); add --eval-n-samples N or --eval-temperature T")


def check_evaluation(run) -> None:
    """--split's weights (`split_weights`), the held-out sets (`eval_sets`), whether there are held-out prompts to
    evaluate (`eval_interval`, None when not), how many an evaluation takes (`eval_prompts`, 0 = all), and the
    evaluation's sampling."""
    run.split_weights = split_weights(run.split) if run.split is not None else None
    if run.split_weights is not None and run.split_weights[0] == 0:
        raise ArgumentError(f"--split {run.split} leaves nothing to train on; give the train part a weight")
    valid = run.split_weights is not None and run.split_weights[1] > 0
    run.eval_sets = eval_sets(run.eval_data_path)
    if run.eval_data_path and valid:
        raise ArgumentError(f"--eval-data-path and --split {run.split} both give held-out prompts; pick one "
                            "(drop --eval-data-path, or give --split a valid weight of 0)")
    _check_sampling(run)
    eval_source = "eval-data-path" if run.eval_data_path else ("split" if valid else None)
    run.eval_prompts = run.eval_samples or (run.eval_iters or 0) * run.global_batch_size
    if not run.eval_interval:
        if run.eval_before_train:
            raise ArgumentError("--eval-before-train evaluates at iteration 0 what --eval-interval evaluates during "
                                "training; give --eval-interval N (and held-out prompts) or drop it")
        if eval_source == "eval-data-path":  # held-out prompts given, never evaluated: said (0 is Megatron's "off")
            given = "--eval-interval 0" if run.eval_interval == 0 else "no --eval-interval"
            run.startup_notes.append(f"evaluation is off ({given}): the held-out prompts of --eval-data-path "
                                     f"{' '.join(run.eval_data_path)} are never evaluated; give --eval-interval N "
                                     "(N >= 1) to evaluate them every N iterations")
        if valid:
            run.startup_notes.append(f"--split {run.split} holds out a valid part, but no --eval-interval is "
                                     "given: it is never evaluated")
        return
    if eval_source is None:
        if run.split_weights is None:
            raise ArgumentError("--eval-interval needs held-out prompts: --eval-data-path (a preprocessed prompt "
                                "set) or --split with a valid part (e.g. --split 98,2,0)")
        run.startup_notes.append(f"evaluation is off: --split {run.split} has no valid part (--eval-interval "
                                 f"{run.eval_interval} is ignored; e.g. --split 98,2,0 evaluates)")
        run.eval_interval = None
    elif run.eval_iters == 0 and not run.eval_samples:
        run.startup_notes.append("evaluation is off: --eval-iters 0 (Megatron-LM's way to skip it)")
        run.eval_interval = None
