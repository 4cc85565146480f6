r"""The demo's tool task (``python -m mindspeed_llm.demo.run --tools``): arithmetic too hard to do in the head, with a
calculator tool offered in the prompt.

Rows are DeepScaleR rows like :mod:`mindspeed_llm.demo.task`'s, ``{"problem", "answer", "solution", "difficulty"}``,
plus ``system`` (the task's instruction; the stage's ``--tool-config`` puts the tools' Hermes block after it in
the system message at rollout time) and ``messages``: the prompt as chat messages, the variant's worked examples (question,
call, tool answer, reply) and then the question (``--map-keys '{"prompt": "messages", ...}'``). Train and held-out splits are disjoint by expression, drawn from a seed.

The tool config the demo writes (:func:`write_tool_config`) is verl's / MindSpeed-RL's schema with the built-in
calculator; the reward is :func:`final_answer` (the first line of the *last* assistant turn is the number), passed
to the stage as ``--custom-reward-function mindspeed_llm/demo/tool_task.py:final_answer``.

Measurements (SmolLM2-135M-Instruct dequantized from Q4_1, fp32, transformers on 1 CPU thread, the first held-out
problems of ``mul3x2`` at seed 1234; the conversation loop of :mod:`mindspeed_llm.demo.tool_eval`: turns of at most
40 tokens, 3 model turns, the calculator executed and its answer appended as the template's tool delta; "calls" =
turns whose ``<tool_call>`` block parses (any tool name), "right" = the last turn's first line is the product)

    prompt (system = the Hermes tools block, then)      greedy (n)       T=0.7, 8 x 4      T=1.0, 8 x 4
                                                         right / calls    right / calls     right / calls
    ---------------------------------------------------  ---------------  ----------------  ----------------
    no tools offered (plain question, 24 tokens)         0/8              -                 -
    block only (mul3x2_0shot)                            0/8 / 0          -                 -
    block + "use the calculator" + a call in the system  0/8 / 0          0/32 / 0          0/32 / 0
    SmolLM2's function-calling system text + block       0/8 / 0          -                 -
    instruction in the user turn                         0/8 / 0          -                 -
    1 worked example as chat turns, 12 * 34              0/8 / 0          0/32 / 1 (bad)    0/32 / 0
    1 worked example, 506 * 93 (mul3x2, the default)     0/16 / 2 (bad)   -                 0/32 / 0
    2 worked examples (mul3x2_2shot)                     8/8 / 8          -                 3/32 / 10
    3 worked examples                                    8/8 / 8          -                 10/32 / 14

Without a worked example the model never writes a well-formed calculator call (it answers in the head, wrongly, or
rambles); with one it sometimes opens ``<tool_call>`` but names an invented tool ("addition", "calculate") with
invented arguments; with two or more it copies the format, greedy is then right every time (the calculator's
answer is copied into the reply) and sampled at T=1.0 about a third of the turns call. So the greedy accuracy
jumps from 0 to 100% between one and two examples: no prompt measured gives both a base below 20% and sampled groups
with mixed rewards (GRPO's signal). About 4-5 s per conversation on one thread (prompts of 310-470 tokens).

So the demo (``python -m mindspeed_llm.demo.run --tools``) trains and measures at temperature 1.0 with two worked
examples (``mul3x2_2shot``, the default variant), sampled (top-k 0, top-p 1) in the rollouts and in the evaluation
alike. What the demo measures: the first 16 held-out problems, each sampled 4 times (64 conversations, the same seed
before and after) in :mod:`mindspeed_llm.demo.tool_eval`'s loop with the stage's limits (48 tokens a model turn, 2
model turns, 1 call, 128 tokens of trajectory); "accuracy" = share of the 64 whose last turn's first line is the
product; "tool-call rate" = share whose first turn is a well-formed ``<tool_call>`` (any tool name); "clean call
rate" = such a call and no failed call in the conversation. Measured 2026-12-02 on 2 CPU cores shared with other
jobs (load average 3-11), seed 1234, GRPO 8 iterations of 4 prompts x 4 samples, lr 3e-5, no KL (the demo's
defaults since):

    held-out (16 x 4 samples, T=1.0)   before   after
    accuracy                           14.1%    100.0%
    tool-call rate                     43.8%    100.0%
    clean call rate                    23.4%    100.0%
    model turns per conversation       1.69     2.00

    iteration                      1     2     3     4     5     6     7     8
    training reward (score mean)   0.13  0.94  0.88  1.00  1.00  0.94  0.81  0.94
    num_turns/mean                 1.50  2.00  1.94  2.00  2.00  2.00  1.94  2.00
    tool/calls (of 16 samples)     4     16    14    16    16    16    15    16
    tool/failures                  5     0     1     0     0     0     0     0
    actor/entropy                  1.61  0.23  0.22  0.01  0.01  0.01  0.03  0.01

Measured twice, with identical metrics and accuracies (the same seed): first with these settings as flags
(``--prompts-per-iteration 4 --samples-per-prompt 4 --iterations 8 --lr 3e-5``, data and Megatron checkpoint reused,
load average 3-11): 690 s in the 8 iterations (33-172 s each), 1380 s for the run, the two evaluations 494 s and
121 s; then ``python -m mindspeed_llm.demo.run --tools`` with the defaults in a fresh folder (the model cached, load
falling from 5 to 0.2): 411 s in iterations (150 s for the first, 31-43 s for the others), 78 s and 50 s for the
evaluations, 610 s for the whole run (preprocessing and conversions included), 994 CPU-seconds (user + system). The learning is the call's format: one update takes the training reward from 0.13 to
0.94 and the entropy from 1.6 to 0.2; after it the model calls ``calculator`` with the question's expression and
copies the tool's answer. The first attempt, 15 iterations of 8 prompts x 4 samples at lr 1e-5 (the plain demo's
settings), was stopped after its first iteration: 328 s (rollout 95 s, update 233 s at load 8-11), about 80 minutes
for 15; its first iteration's reward was 0.16 with 12 calls in 32 samples.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

__all__ = ["ToolTaskVariant", "TOOL_VARIANTS", "DEFAULT_TOOL_VARIANT", "SYSTEM_PROMPTS", "make_tool_splits",
           "write_tool_splits", "write_tool_config", "final_answer", "last_assistant_text", "expression_value"]


# the system texts measured; "example" shows one call in the format of the Hermes block
SYSTEM_PROMPTS: Dict[str, str] = {
    "none": "",
    "hint": "Use the calculator tool for arithmetic. When it answers, reply with just the number.",
    "example": ("Use the calculator tool for arithmetic. For example, for \"What is 12 * 34?\" reply\n"
                "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}\n</tool_call>\n"
                "and when the tool answers 408, reply 408."),
}


@dataclass(frozen=True)
class ToolTaskVariant:
    """Questions ``template.format(expr=...)`` with ``terms`` operands drawn from ``operands`` (one range per
    term) joined by ``op``; ``system``: a key of `SYSTEM_PROMPTS`."""

    name: str
    operands: Tuple[Tuple[int, int], ...]
    op: str = "*"
    template: str = "What is {expr}? Answer with just the number."
    system: str = "none"
    shots: int = 1  # worked examples (user question, call, tool answer, reply) before the question
    description: str = ""

    def expression(self, rng: random.Random) -> str:
        return f" {self.op} ".join(str(rng.randint(lo, hi)) for lo, hi in self.operands)

    def space_size(self) -> int:
        size = 1
        for lo, hi in self.operands:
            size *= hi - lo + 1
        return size


_M32 = ((100, 999), (10, 99))
TOOL_VARIANTS: Dict[str, ToolTaskVariant] = {
    v.name: v
    for v in (
        ToolTaskVariant("mul3x2", _M32, description="a * b, a 3-digit, b 2-digit; one worked example"),
        ToolTaskVariant("mul3x2_2shot", _M32, shots=2, description="mul3x2, two worked examples"),
        ToolTaskVariant("mul3x2_0shot", _M32, shots=0, description="mul3x2, the tools' block only"),
        ToolTaskVariant("mul3x2_hint", _M32, shots=0, system="hint", description="mul3x2, an instruction, no example"),
        ToolTaskVariant("mul3x2_example", _M32, shots=0, system="example",
                        description="mul3x2, a call shown in the system text"),
        ToolTaskVariant("mul3x3", ((100, 999), (100, 999)), description="a * b, both 3-digit; one worked example"),
        ToolTaskVariant("add5x3", ((10000, 99999),) * 3, op="+", description="three 5-digit numbers summed"),
    )
}
# the worked examples, last first (one shot is the last of them), outside every variant's test split by their form
SHOTS = (("506 * 93", "47058"), ("250 * 17", "4250"), ("12 * 34", "408"))
DEFAULT_TOOL_VARIANT = "mul3x2_2shot"

_NUM_OP = re.compile(r"\s*(\d+)\s*([+*])?")


def expression_value(expr: str) -> int:
    """The value of ``a * b [* c]`` or ``a + b [+ c]`` (one operator), an independent check of the answers."""
    numbers, ops = [], set()
    for number, op in _NUM_OP.findall(expr):
        numbers.append(int(number))
        if op:
            ops.add(op)
    if len(numbers) < 2 or len(ops) != 1 or re.sub(r"[\d\s+*]", "", expr):
        raise ValueError(f"not a one-operator expression: {expr!r}")
    value = numbers[0]
    for n in numbers[1:]:
        value = value * n if ops == {"*"} else value + n
    return value


_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


def shot_messages(variant: ToolTaskVariant) -> List[dict]:
    """The worked examples of ``variant`` as chat messages: user, assistant (the call), tool (the result), assistant
    (the answer), oldest first."""
    out: List[dict] = []
    for expr, value in reversed(SHOTS[:variant.shots]):
        out += [{"role": "user", "content": variant.template.format(expr=expr)},
                {"role": "assistant", "content": _CALL % expr},
                {"role": "tool", "content": value},
                {"role": "assistant", "content": value}]
    return out


def _row(variant: ToolTaskVariant, expr: str) -> dict:
    digits = sum(len(x) for x in re.findall(r"\d+", expr))
    problem = variant.template.format(expr=expr)
    return {"problem": problem, "answer": str(expression_value(expr)), "solution": "", "difficulty": float(digits),
            "system": SYSTEM_PROMPTS[variant.system],
            "messages": shot_messages(variant) + [{"role": "user", "content": problem}]}


def make_tool_splits(variant: Union[str, ToolTaskVariant] = DEFAULT_TOOL_VARIANT, *, n_train: int = 2000,
                     n_test: int = 100, seed: int = 1234) -> Tuple[List[dict], List[dict]]:
    """``(train, test)`` rows, disjoint by expression (as unordered operands: ``a * b`` and ``b * a`` are one),
    deterministic for ``seed``: the first ``n_test`` distinct expressions drawn are the held-out split."""
    v = TOOL_VARIANTS[variant] if isinstance(variant, str) else variant
    if n_test < 0 or n_train < 0:
        raise ValueError("split sizes must be >= 0")
    if n_train + n_test > v.space_size() // 4:
        raise ValueError(f"variant {v.name!r}: {n_train + n_test} rows is too many for its {v.space_size()} expressions")
    rng = random.Random(seed)
    seen = {tuple(sorted(expr.split(f" {v.op} "))) for expr, _ in SHOTS}  # the examples are never asked
    exprs: List[str] = []
    while len(exprs) < n_train + n_test:
        expr = v.expression(rng)
        key = tuple(sorted(expr.split(f" {v.op} ")))
        if key not in seen:
            seen.add(key)
            exprs.append(expr)
    test = [_row(v, e) for e in exprs[:n_test]]
    train = [_row(v, e) for e in exprs[n_test:]]
    return train, test


def write_tool_splits(out_dir: Union[str, Path], variant: Union[str, ToolTaskVariant] = DEFAULT_TOOL_VARIANT, *,
                      n_train: int = 2000, n_test: int = 100, seed: int = 1234) -> Dict[str, Path]:
    """``train.json`` and ``test.json`` (JSON lists) in ``out_dir``; ``{"train": path, "test": path}``."""
    from mindspeed_llm.demo.task import write_json_splits

    train, test = make_tool_splits(variant, n_train=n_train, n_test=n_test, seed=seed)
    return write_json_splits(out_dir, train=train, test=test)


TOOL_CONFIG_YAML = """\
# The demo's tools (verl's / MindSpeed-RL's tool config schema): the built-in calculator.
tools:
  - class_name: calculator
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.
        parameters:
          type: object
          properties:
            expression: {type: string, description: "The expression, e.g. 12345 * 678"}
          required: [expression]
"""


def write_tool_config(path: Union[str, Path]) -> Path:
    """Write the demo's tool config YAML (the calculator) to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOOL_CONFIG_YAML, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------------------
# The reward
# ----------------------------------------------------------------------------------------------------------------

_SPECIAL = re.compile(r"<\|[^|<>]{1,40}\|>")
_ASSISTANT_TURN = "<|im_start|>assistant\n"


def last_assistant_text(text: str, trajectory: Optional[Mapping] = None) -> str:
    """The text of the last assistant turn, without special tokens: from ``trajectory["turns"]`` when given, else
    what follows the last ``<|im_start|>assistant`` of ``text`` (a whole multi-turn response decoded with its special
    tokens), else ``text``."""
    if trajectory:
        turns = [t for t in trajectory.get("turns") or () if t.get("role") == "assistant"]
        if turns:
            text = str(turns[-1].get("text") or "")
    elif _ASSISTANT_TURN in text:
        text = text.rsplit(_ASSISTANT_TURN, 1)[1]
    return _SPECIAL.sub("\n", text).strip()


def final_answer(response_text: str, label: Optional[str] = None, *, trajectory: Optional[Mapping] = None) -> float:
    """1.0 when the last assistant turn's first line answers with the label's number (`first_line_answer`'s rule);
    a tool call alone (no answer after it) scores 0. A verifier in the keyword style: ``trajectory`` is the
    multi-turn trajectory (None for a single-turn response)."""
    from mindspeed_llm.rl.verifiers import first_line_answer

    final = last_assistant_text(response_text or "", trajectory)
    if "<tool_call>" in final:
        return 0.0
    return first_line_answer(final, label)
