"""Rule-based reward verifiers, one registry.

A verifier is a plain function ``fn(response_text: str, label: str | None) -> float`` registered by name
(`registry.py`); the stages select them with ``--verifier-function NAME ...`` and weigh them with
``--verifier-weight W ...`` (the weighted mix with a reward model is `rl/scoring.py`). Built in:

* ``math_acc`` (needs a label): the final answer equals the label mathematically (`math.py`, with the answer
  extraction and LaTeX normalisation of `answers.py`, ``math_verify``'s comparison in `equality.py` and the
  sandboxed worker of `worker.py`);
  ``base_acc`` is the same check under MindSpeed-RL's name; ``math_17k_acc`` (needs a label) puts the last
  ``Answer: ...`` line first, the format DAPO-Math-17k's prompts ask for; MindSpeed-RL's ``acc_for_ppo`` (the last
  box only), ``acc_for_dapo`` (``math_17k_acc``'s check scored +1 / -1), ``retool_reward`` (the last box scored +1 / -1,
  a wrong answer raised by 0.1 per tool call up to 0: its multi-turn DAPO config's) and ``math_verify_reward``
  (the boxed answer inside the whole R1 template);
* ``first_line_answer`` (needs a label): the first line answers with that number (`first_line.py`);
* ``format`` (the R1 ``<think>``/``<answer>`` template) and ``boxed_format`` (one non-empty box) (`format.py`).

A new verifier is one function and one ``@register_verifier("name")``. One that declares ``row`` (every column of
the sample's dataset row) and / or ``trajectory`` (the multi-turn trajectory, `trajectory.py`; None for a
single-turn response) gets them by name, and verl's ``compute_score(data_source, solution_str, ground_truth,
extra_info)`` is understood too: the signature is read once, at registration (`calling.py`). A user's function
in a file of their own is ``--custom-reward-function PATH:NAME`` (`rl/reward_functions.py`).
"""

from mindspeed_llm.rl.verifiers.answers import ExtractedAnswer, extract_answer, last_boxed_content
from mindspeed_llm.rl.verifiers.batch import BatchScores, RewardFunction, reward_metrics, score_batch, score_rows
from mindspeed_llm.rl.verifiers.calling import CallPlan, SignatureError, as_score, call_plan
from mindspeed_llm.rl.verifiers.first_line import first_line_answer, parse_first_line_answer
from mindspeed_llm.rl.verifiers.format import boxed_format_reward, format_reward
from mindspeed_llm.rl.verifiers.math import (
    MathAccConfig, get_math_acc_config, math_17k_acc, math_acc, math_equal, set_math_acc_config,
)
from mindspeed_llm.rl.verifiers.registry import (
    MissingLabelError, VerifierTimeout, available_verifiers, check_verifiers, get_verifier, register_verifier,
    verifier_requires_label,
)
from mindspeed_llm.rl.verifiers.trajectory import Trajectory, check_trajectory

__all__ = [
    "MissingLabelError", "VerifierTimeout", "MathAccConfig", "register_verifier", "get_verifier",
    "check_verifiers", "verifier_requires_label", "available_verifiers", "first_line_answer",
    "parse_first_line_answer", "get_math_acc_config", "set_math_acc_config", "last_boxed_content",
    "extract_answer", "ExtractedAnswer", "math_equal", "math_acc", "math_17k_acc", "format_reward", "boxed_format_reward",
    "score_batch", "reward_metrics", "score_rows", "BatchScores", "RewardFunction", "CallPlan", "SignatureError",
    "as_score", "call_plan", "Trajectory", "check_trajectory",
]
