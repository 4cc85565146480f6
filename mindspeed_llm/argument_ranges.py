"""The numeric flags' ranges, as one table next to the parser (`arguments/parser.py`), each with where its bound
comes from.

`check_ranges(args, parser)` runs first in `validate_args`: every float flag the command line sets must be finite
(NaN and inf pass argparse's `float`), and every flag of `RANGES` that is set must lie in its range. A violation is
an `ArgumentError` naming the flag, its value, the range and the bound's source, before anything is built.

Checks that relate flags to each other (--min-lr <= --lr, --max-new-tokens < --max-length, batch arithmetic,
group estimators' samples per prompt, stop ids inside the vocabulary) stay where those flags are resolved
(`arguments.validate_args`, `rl/rollouts/plain.py`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Dict, Optional

from mindspeed_llm.errors import ArgumentError


@dataclass(frozen=True)
class Bound:
    """low <= value <= high (strict where `*_open`); None: no bound on that side."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    source: str = ""

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"{'<' if self.high_open else '<='} {self.high:g}"


def _positive(source: str) -> Bound:
    return Bound(low=0, low_open=True, source=source)


def _at_least(low: float, source: str) -> Bound:
    return Bound(low=low, source=source)


def _unit(source: str, high_open: bool = False) -> Bound:
    return Bound(low=0, high=1, high_open=high_open, source=source)


_MEGATRON = "Megatron-LM"
_TORCH_ADAM = "torch.optim.Adam refuses betas outside [0, 1)"
RANGES: Dict[str, Bound] = {
    # optimizer and schedule
    "--lr": _positive(f"{_MEGATRON}: a learning rate; 0 trains nothing"),
    "--critic-lr": _positive("as --lr, for the critic"),
    "--min-lr": _at_least(0, f"{_MEGATRON}'s scheduler asserts 0 <= min_lr <= lr"),
    "--weight-decay": _at_least(0, "decoupled weight decay shrinks weights; a negative one grows them"),
    "--clip-grad": _at_least(0, f"{_MEGATRON}: a gradient-norm bound; 0 turns clipping off"),
    "--adam-beta1": _unit(_TORCH_ADAM, high_open=True),
    "--adam-beta2": _unit(_TORCH_ADAM, high_open=True),
    "--adam-eps": _positive("torch.optim.Adam takes eps >= 0; 0 divides by zero where a moment is 0"),
    "--sgd-momentum": _unit("torch.optim.SGD takes momentum >= 0; at 1 or more the velocity grows without bound",
                            high_open=True),
    "--lr-warmup-fraction": _unit(f"{_MEGATRON}: the share of --train-iters spent warming up"),
    "--lr-warmup-iters": _at_least(0, f"{_MEGATRON}: iterations"),
    "--lr-decay-iters": _at_least(1, f"{_MEGATRON}: iterations"),
    # RL algorithm
    "--gamma": _unit("the discount factor of GAE (Schulman et al. 2016) and REINFORCE++"),
    "--lam": _unit("GAE's lambda (Schulman et al. 2016)"),
    "--clip-ratio": _positive("PPO's clip range epsilon (Schulman et al. 2017); 0 freezes the policy"),
    "--clip-ratio-high": _positive("DAPO's clip-higher epsilon (Yu et al. 2025)"),
    "--gspo-clip-ratio": _positive("GSPO's sequence-ratio clip range (Zheng et al. 2025)"),
    "--gspo-clip-ratio-high": _positive("GSPO's upper clip range (Zheng et al. 2025)"),
    "--cliprange-value": _positive("TRL's cliprange_value: the critic's clip range around the old values"),
    "--dual-clip": Bound(low=1, low_open=True, source="dual-clip PPO's c > 1 (Ye et al. 2020)"),
    "--kl-coef": _at_least(0, "a penalty weight: a negative one rewards drifting from the reference"),
    "--distill-coef": _positive("the distillation term's weight; 0 would load a teacher for nothing"),
    "--distill-topk": _at_least(1, "the teacher's tokens per position"),
    "--vf-coef": _at_least(0, "TRL's vf_coef: the value loss's weight"),
    "--rollout-is-threshold": _at_least(1, "truncated importance sampling's cap C >= 1 (a cap below 1 shrinks "
                                           "every on-policy weight)"),
    "--overlong-penalty-factor": _at_least(0, "DAPO's overlong penalty weight"),
    "--moe-aux-loss-coeff": _at_least(0, "Megatron-LM: the load-balancing loss weight"),
    "--attention-dropout": _unit("a dropout probability", high_open=True),
    "--hidden-dropout": _unit("a dropout probability", high_open=True),
    # sampling
    "--temperature": _positive("logits are divided by it (sampling and the training log-probs)"),
    "--top-p": Bound(low=0, high=1, low_open=True, source="nucleus sampling's mass (Holtzman et al. 2020)"),
    "--top-k": _at_least(0, "tokens kept; 0 turns it off"),
    "--rollout-max-num-seqs": _at_least(1, "rows in flight; leave it out for no limit"),
    "--rollout-max-num-batched-tokens": _at_least(1, "tokens of one forward; leave it out for no limit"),
    # sizes and counts
    "--micro-batch-size": _at_least(1, "samples"),
    "--global-batch-size": _at_least(1, "prompts"),
    "--ppo-mini-batch-size": _at_least(1, "sequences"),
    "--ppo-epochs": _at_least(1, "passes"),
    "--n-samples-per-prompt": _at_least(1, "samples"),
    "--train-iters": _at_least(1, "iterations"),
    "--max-new-tokens": _at_least(1, "tokens"),
    "--judge-max-new-tokens": _at_least(1, "tokens"),
    "--max-length": _at_least(2, "tokens: a prompt token and a response token"),
    "--max-prompt-length": _at_least(1, "tokens"),
    "--max-num-gen-batches": _at_least(0, "generation batches; 0, no limit, only with --dynamic-sampling"),
    "--partial-rollout-max-split": _at_least(2, "MindSpeed-RL's partial_rollout_max_split: 1 cuts no sample (leave "
                                                "--partial-rollout out)"),
    "--max-assistant-turns": _at_least(1, "model turns"),
    "--max-tool-calls": _at_least(0, "tool calls per trajectory; 0 offers the tools but runs none"),
    "--max-parallel-calls": _at_least(1, "tool calls of one turn"),
    "--max-tool-response-length": _at_least(1, "tokens"),
    "--max-total-response-length": _at_least(1, "tokens"),
    "--tool-timeout": _positive("seconds"),
    "--tool-workers": _at_least(1, "threads"),
    "--save-interval": _at_least(1, "iterations"),
    "--log-interval": _at_least(1, "iterations"),
    "--eval-interval": _at_least(0, "iterations; 0 turns evaluation off"),
    "--eval-iters": _at_least(0, f"{_MEGATRON}: 0 skips evaluation"),
    "--eval-samples": _at_least(0, "prompts; 0 takes all"),
    "--eval-n-samples": _at_least(1, "responses per held-out prompt"),
    "--log-samples": _at_least(0, "rows per sample table (0: off)"),
    "--log-samples-interval": _at_least(1, "iterations"),
    "--eval-temperature": _positive("logits are divided by it; greedy evaluation is --eval-n-samples 1 without it"),
    "--eval-top-p": Bound(low=0, high=1, low_open=True, source="nucleus sampling's mass (Holtzman et al. 2020)"),
    "--tensor-model-parallel-size": _at_least(1, "ranks"),
    "--pipeline-model-parallel-size": _at_least(1, "ranks"),
    "--context-parallel-size": _at_least(1, "ranks"),
    "--expert-model-parallel-size": _at_least(1, "ranks"),
    "--profile-step-start": _at_least(0, f"{_MEGATRON}: the iterations done before the window opens (0: it opens "
                                         "at the first)"),
    "--profile-step-end": _at_least(1, f"{_MEGATRON}: the iterations done when the window closes"),
    "--rope-scaling-factor": _positive("RoPE frequency scaling divides frequencies by it"),
    # megatron's fp16 grad scaler
    "--loss-scale": _positive("Megatron-LM: a loss scale"),
    "--initial-loss-scale": _positive("Megatron-LM: a loss scale"),
    "--min-loss-scale": _positive("Megatron-LM: a loss scale"),
    "--loss-scale-window": _positive("Megatron-LM: steps"),
    "--hysteresis": _positive("Megatron-LM: overflows"),
}


def _float_typed(action: argparse.Action) -> bool:
    return action.type is float


def check_ranges(args, parser: argparse.ArgumentParser) -> None:
    """Refuse non-finite floats and out-of-range values (module doc). Flags not set (None) are skipped."""
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for flag, action in actions.items():
        if not _float_typed(action):
            continue
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ArgumentError(f"{flag} {v} must be a finite number")
    for flag, bound in RANGES.items():
        action = actions.get(flag)
        if action is None:
            raise RuntimeError(f"argument_ranges: {flag} is not a flag of the parser")
        value = getattr(args, action.dest, None)
        if value is None or isinstance(value, bool):
            continue
        if not bound.holds(float(value)):
            raise ArgumentError(f"{flag} {value} must be {bound.describe()} ({bound.source})")
