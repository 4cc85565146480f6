"""``python -m mindspeed_llm.demo.run --tools``: the demo with a calculator tool (multi-turn rollouts).

What ``--tools`` changes in the pipeline of :mod:`mindspeed_llm.demo.run`:

1. the task is :mod:`mindspeed_llm.demo.tool_task`'s (default ``mul3x2_2shot``: 3-digit x 2-digit products, two
   worked examples as chat turns) and the demo writes ``tools.yaml`` (verl's / MindSpeed-RL's schema, the built-in
   calculator);
2. ``preprocess_data.py --prompt-type chatml --map-keys '{"prompt": "messages", ...}'`` stores the chat rows without
   tools; the stage puts the calculator's schema (the Hermes ``<tools>`` block: SmolLM2's template has no tools
   section) in the system message at rollout time, from its own ``--tool-config`` (`rl/tools/prompts.py`);
3. the stage runs multi-turn rollouts (`stage_flags`): ``--tool-config``, ``--max-assistant-turns 2`` (a call, then
   the answer), ``--max-tool-calls 1``, ``--max-new-tokens`` per model turn, ``--max-total-response-length``, and
   the reward ``--custom-reward-function mindspeed_llm/demo/tool_task.py:final_answer`` (the last assistant turn's
   first line is the number);
4. the held-out accuracy before / after is measured with the conversations of
   :mod:`mindspeed_llm.demo.tool_eval` (transformers, the calculator executed), each of 16 held-out problems sampled
   4 times at the stage's temperature (1.0; greedy is right every time from the start with two worked examples),
   with the tool-call rate (the share of conversations whose first turn is a well-formed call);
5. the report adds turns and tool calls per iteration (``num_turns/mean``, ``tool/calls``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from mindspeed_llm.demo.tool_task import DEFAULT_TOOL_VARIANT, write_tool_config, write_tool_splits

__all__ = ["DEFAULTS", "DEFAULT_TOOL_VARIANT", "TURNS", "loop_settings", "stage_flags", "evaluate",
           "write_tool_config", "write_tool_splits"]

ROOT = Path(__file__).resolve().parents[2]
REWARD = ROOT / "mindspeed_llm" / "demo" / "tool_task.py"

# (real model, tiny); the others come from run.DEFAULTS. A call is 36 tokens with SmolLM2's tokenizer
# (<tool_call>\n{"name": "calculator", "arguments": {"expression": "896 * 66"}}\n</tool_call><|im_end|>), the
# tool's delta about 15 (tool/response_length/mean), the answer about 4; the prompt (the tools' block and two worked
# examples) 393.
# The real run's settings are the measured ones of tool_task's docstring (8 iterations of 4 prompts x 4 samples at
# lr 3e-5; the training reward is 0.8-1.0 from the second iteration on). The plain demo's 8 x 4 at lr 1e-5 took 328 s
# for its first iteration here (load average 8-11), about 80 minutes for 15.
DEFAULTS = {
    "iterations": (8, 2),
    "prompts_per_iteration": (4, 2),
    "samples_per_prompt": (4, 2),
    "lr": (3e-5, 1e-4),
    "max_new_tokens": (48, 16),
    "temperature": (1.0, 1.0),
    "eval_problems": (16, 4),
}
# the held-out evaluation samples each problem this many times at the stage's temperature (greedy would be 100%
# right from the start with two worked examples: see tool_task's measurements)
EVAL_SAMPLES = (4, 2)
TURNS = dict(max_assistant_turns=2, max_tool_calls=1, max_tool_response_length=32, max_total_response_length=128)
MAX_PROMPT_LENGTH = 512  # the prompts: 311 tokens with one worked example, 393 with two, 475 with three
MAX_LENGTH = MAX_PROMPT_LENGTH + TURNS["max_total_response_length"]  # prompt + trajectory


def loop_settings(args):
    """The conversation limits of the stage's flags, for the transformers evaluation."""
    from mindspeed_llm.demo.tool_eval import ToolLoopSettings

    return ToolLoopSettings(max_new_tokens=args.max_new_tokens, **TURNS)


def stage_flags(args, tool_config) -> List:
    """The stage's task flags with tools (instead of the newline stop ids and the first-line verifier)."""
    return ["--max-prompt-length", MAX_PROMPT_LENGTH, "--max-length", MAX_LENGTH, "--tool-config", tool_config,
            "--max-assistant-turns", TURNS["max_assistant_turns"], "--max-tool-calls", TURNS["max_tool_calls"],
            "--max-tool-response-length", TURNS["max_tool_response_length"],
            "--max-total-response-length", TURNS["max_total_response_length"],
            "--custom-reward-function", f"{REWARD}:final_answer"]


def evaluate(model_dir, rows, tool_config, args) -> dict:
    """Held-out accuracy and tool use of the model with the calculator (`tool_eval.evaluate_tools_hf`): each problem
    sampled `EVAL_SAMPLES` times at the stage's ``--temperature`` (pure sampling, top-k 0, top-p 1, as in the
    rollouts), the same random seed before and after."""
    import torch

    from mindspeed_llm.demo.tool_eval import evaluate_tools_hf

    threads = torch.get_num_threads()
    try:
        return evaluate_tools_hf(model_dir, rows, str(tool_config), loop_settings(args), do_sample=True,
                                 temperature=args.temperature, n_samples=EVAL_SAMPLES[1 if args.tiny else 0],
                                 batch_size=32, seed=args.seed)
    finally:
        torch.set_num_threads(threads)
