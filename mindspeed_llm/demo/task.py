r"""The demo's task: short arithmetic questions, generated offline from a seed, in the DeepScaleR schema.

Every row is ``{"problem": str, "answer": str, "solution": "", "difficulty": float}`` (DeepScaleR's
columns: ``preprocess_data.py`` maps ``problem`` -> prompt and ``answer`` -> label). The train and
held-out splits are disjoint by expression: the held-out questions are never seen in training.
Answers are plain integers computed with Python ints, so they are correct by construction (the tests
recompute them from the text with a small parser of their own).

Variants (``VARIANTS``; the default is ``DEFAULT_VARIANT``) fix the operand range, the operators and
the question wording; the reward is :mod:`mindspeed_llm.demo.verifier`'s ``first_line_answer`` (the
first line of the reply must be the number, or end with ``= N`` / ``is N``).

Measurements (SmolLM2-135M-Instruct, fp32, ``transformers`` generate on 1 CPU thread, no system turn,
i.e. ``--prompt-type chatml``; the held-out split of each variant at seed 1234;
``mindspeed_llm.demo.evaluate.measure_variant``, about 2-4 min per row on a shared 2-core machine;
no system turn unless noted; mixed = share of groups of 4 samples with both a reward 0 and a
reward 1, the groups that give GRPO a gradient)

    variant                       prompt  greedy  greedy len   T=1.0        T=0.7        T=0.5
                                  tokens  acc     / truncated  acc / mixed  acc / mixed  acc / mixed
    ----------------------------  ------  ------  -----------  -----------  -----------  -----------
    add20 (chosen)                24.2    0.38    14.9 / 25%   0.07 / 0.23  0.23 / 0.52  -
    add20, stop at newline        24.2    0.38    11.5 /  1%   -            -            0.32 / 0.55
    add20 + SmolLM2 system turn   45.2    0.40    14.4 / 31%   0.11 / 0.34  0.24 / 0.47  -
    add20_compute                 24.2    0.45    16.6 / 36%   0.07 / 0.23  0.22 / 0.44  -
    addsub20                      24.0    0.22    14.9 / 33%   0.04 / 0.14  0.11 / 0.27  -
    chain3                        26.0    0.04    18.9 / 60%   0.02 / 0.08  0.05 / 0.14  -

    greedy/sampled: max_new_tokens 24; lengths in generated tokens incl. eos; sampled = 64 problems
    x 4 samples, pure temperature sampling (top_k 0, top_p 1); "stop at newline" adds SmolLM2's
    newline tokens 198 ("\n") and 1116 ("\n\n") as stop ids (the verifier only reads the first line,
    so scores are unchanged and replies end sooner). The base model knows most sums when it answers at
    once ("7 + 14 = 21"), but often starts "To solve this problem, we need to find the sum of ..." and
    runs out of tokens, or adds the last digits only ("19 + 4 = 6"); at T=1.0 pure sampling is mostly
    incoherent (few right answers, few mixed groups), at 0.5-0.7 about half of the groups are mixed.
    Two-digit questions with "-", or three terms, are too hard for it (little signal).

Recommended demo settings: variant ``add20`` (``What is 17 + 14? Answer with just the number.``), no
system turn (``--prompt-type chatml``), verifier ``first_line_answer``, ``--max-new-tokens 24`` with
``--stop-token-ids 198 1116`` (SmolLM2's newlines), ``--temperature 0.7`` (top_k/top_p off),
``--n-samples-per-prompt 4``, 8 prompts per iteration, lr 1e-5 (constant, Adam, grad clip 1.0).

Check of those settings with a bare on-policy GRPO loop in ``transformers`` (not the Megatron stage:
one Adam step per batch of 8 prompts x 4 samples, group-normalised advantages, token-mean loss, no KL,
1 CPU thread, about 17 s per iteration): training reward 0.31 -> 0.91 in 15 iterations, held-out greedy
accuracy 0.38 -> 0.83 (e.g. "17 + 14 = 31", "12 + 10 = 22" instead of "= 21", "= 120"); reply
length 14.8 -> 9.6 tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = [
    "TaskVariant",
    "VARIANTS",
    "DEFAULT_VARIANT",
    "expression_value",
    "all_expressions",
    "make_splits",
    "write_splits",
    "load_problems",
]


@dataclass(frozen=True)
class TaskVariant:
    """A family of questions ``template.format(expr=...)``, ``expr`` = ``a op b [op c ...]``.

    ``operands``: inclusive range of every operand; ``ops``: operators drawn per position;
    ``terms``: number of operands; ``non_negative``: skip expressions whose running value or result
    is below 0 (small models handle negatives poorly; this keeps the task about one skill).
    """

    name: str
    template: str
    operands: Tuple[int, int] = (1, 20)
    ops: Tuple[str, ...] = ("+",)
    terms: int = 2
    non_negative: bool = True
    description: str = ""

    def problem(self, expr: str) -> str:
        return self.template.format(expr=expr)


JUST_NUMBER = "What is {expr}? Answer with just the number."

VARIANTS: Dict[str, TaskVariant] = {
    v.name: v
    for v in (
        TaskVariant("add20", JUST_NUMBER, (1, 20), ("+",), 2,
                    description="a + b, operands 1..20"),
        TaskVariant("addsub20", JUST_NUMBER, (1, 20), ("+", "-"), 2,
                    description="a + b or a - b (result >= 0), operands 1..20"),
        TaskVariant("add20_compute", "Compute {expr}. Reply with only the result.", (1, 20), ("+",), 2,
                    description="a + b, operands 1..20, other wording"),
        TaskVariant("chain3", JUST_NUMBER, (1, 9), ("+", "-"), 3,
                    description="a +/- b +/- c, digits 1..9 (reference: too hard, no signal)"),
    )
}
DEFAULT_VARIANT = "add20"


# ----------------------------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([+\-]))")


def expression_value(expr: str) -> int:
    """Value of ``a op b op c ...`` with ``+``/``-`` evaluated left to right (an independent parser
    used by the tests to re-check the generated answers)."""
    tokens = []
    pos = 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot parse {expr!r} at {pos}")
        tokens.append(int(m.group(1)) if m.group(1) is not None else m.group(2))
        pos = m.end()
    if not tokens or not isinstance(tokens[0], int) or len(tokens) % 2 == 0:
        raise ValueError(f"not an expression: {expr!r}")
    value = tokens[0]
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if not isinstance(num, int) or op not in "+-":
            raise ValueError(f"not an expression: {expr!r}")
        value = value + num if op == "+" else value - num
    return value


def _eval(operands: Sequence[int], ops: Sequence[str]) -> Tuple[int, bool]:
    value, ok = operands[0], True
    for op, x in zip(ops, operands[1:]):
        value = value + x if op == "+" else value - x
        ok = ok and value >= 0
    return value, ok


def _format(operands: Sequence[int], ops: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:]):
        parts.append(f"{op} {x}")
    return " ".join(parts)


def all_expressions(variant: TaskVariant) -> List[Tuple[str, int]]:
    """Every expression of the variant with its value, in a fixed order (the space the splits come from)."""
    import itertools

    lo, hi = variant.operands
    out = []
    for operands in itertools.product(range(lo, hi + 1), repeat=variant.terms):
        for ops in itertools.product(variant.ops, repeat=variant.terms - 1):
            value, ok = _eval(operands, ops)
            if variant.non_negative and not ok:
                continue
            out.append((_format(operands, ops), value))
    return out


def _difficulty(expr: str, value: int) -> float:
    """A rough DeepScaleR-like difficulty: 1 + carries/borrows + 0.5 per extra term."""
    nums = [int(x) for x in re.findall(r"\d+", expr)]
    hard = 0
    if "-" in expr or value >= 10 or any(n >= 10 for n in nums):
        hard += 1
    return float(1 + hard + 0.5 * (len(nums) - 2))


def _row(variant: TaskVariant, expr: str, value: int) -> dict:
    return {"problem": variant.problem(expr), "answer": str(value), "solution": "",
            "difficulty": _difficulty(expr, value)}


def make_splits(variant: Union[str, TaskVariant] = DEFAULT_VARIANT, *, n_train: Optional[int] = None,
                n_test: int = 100, seed: int = 1234) -> Tuple[List[dict], List[dict]]:
    """``(train, test)`` rows of ``variant``, disjoint by expression, deterministic for ``seed``.

    The variant's whole expression space is shuffled with ``random.Random(seed)``; the first
    ``n_test`` expressions are the held-out split, the next ``n_train`` (default: all the rest) the
    training split.
    """
    v = VARIANTS[variant] if isinstance(variant, str) else variant
    space = all_expressions(v)
    if n_test < 0 or (n_train is not None and n_train < 0):
        raise ValueError("split sizes must be >= 0")
    if n_test >= len(space):
        raise ValueError(f"variant {v.name!r} has {len(space)} expressions; n_test={n_test} leaves none to train on")
    rng = random.Random(seed)
    order = list(range(len(space)))
    rng.shuffle(order)
    test_idx = order[:n_test]
    rest = order[n_test:]
    if n_train is not None:
        if n_train > len(rest):
            raise ValueError(f"variant {v.name!r} has {len(rest)} expressions left for training, asked {n_train}")
        rest = rest[:n_train]
    test = [_row(v, *space[i]) for i in test_idx]
    train = [_row(v, *space[i]) for i in rest]
    return train, test


def write_splits(out_dir: Union[str, Path], variant: Union[str, TaskVariant] = DEFAULT_VARIANT, *,
                 n_train: Optional[int] = None, n_test: int = 100, seed: int = 1234) -> Dict[str, Path]:
    """Write ``train.json`` and ``test.json`` (JSON lists of DeepScaleR rows) to ``out_dir``.

    Returns ``{"train": path, "test": path}``. The files are written to a temporary name and renamed,
    so a reader never sees half a file.
    """
    train, test = make_splits(variant, n_train=n_train, n_test=n_test, seed=seed)
    return write_json_splits(out_dir, train=train, test=test)


def write_json_splits(out_dir: Union[str, Path], **splits: List[dict]) -> Dict[str, Path]:
    """Each split's rows as ``<name>.json`` (a JSON list) in ``out_dir``, written to a temporary name and renamed so
    that a reader never sees half a file; ``{name: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        path = out / f"{name}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(path)
        paths[name] = path
    return paths


def load_problems(path: Union[str, Path]) -> List[dict]:
    """Rows of a ``write_splits`` file (a JSON list) or of a JSON-lines file."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Write the demo's arithmetic train/test splits (DeepScaleR schema).")
    parser.add_argument("out_dir")
    parser.add_argument("--variant", default=DEFAULT_VARIANT, choices=sorted(VARIANTS))
    parser.add_argument("--n-train", type=int, default=None)
    parser.add_argument("--n-test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    paths = write_splits(args.out_dir, args.variant, n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    for name, path in paths.items():
        print(f"{name}: {path} ({len(load_problems(path))} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
