"""Held-out evaluation of a policy: greedy rollouts of held-out prompts (trajectories with the run's tools under
--tool-config), their scores, lengths and KL to the reference (the stages' `evaluate`)."""

from __future__ import annotations

from typing import Dict, Sequence

from mindspeed_llm.rl.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.metrics import Timers
from mindspeed_llm.rl.passes import policy_logprobs
from mindspeed_llm.rl.roles import on_device
from mindspeed_llm.rl.rollout import rollout, sampling_config
from mindspeed_llm.rl.settings import SamplingSettings


def evaluate_policy(actor, reference, scorer, tokenizer, rows: Sequence[dict], sampling: SamplingSettings,
                    offload: bool = False, toolbox=None) -> Dict[str, float]:
    """`eval/score/mean`, `eval/response_length/mean` and, with a reference, `eval/kl/mean` (the summed k1 KL of
    a response) of greedy responses to `rows` (this DP rank's share), `sampling`'s lengths and stop ids; `offload`: the
    reference waits in host memory (--offload-ref-reward). With the run's `toolbox` (`multi_turn.ToolBox`,
    --tool-config) the responses are trajectories, and `eval/num_turns/mean`, `eval/tool/calls` say how they used
    the tools."""
    timers = Timers()
    greedy = sampling_config(sampling, tokenizer, greedy=True)
    tool_use = {}
    if toolbox is None:
        exp = rollout(actor.module, rows, greedy, 0, tokenizer)
    else:
        from mindspeed_llm.rl.multi_turn import tool_rollout

        exp, metrics = tool_rollout(actor.module, rows, greedy, tokenizer, toolbox)
        tool_use = {"eval/num_turns/mean": metrics["num_turns/mean"], "eval/tool/calls": metrics["tool/calls"]}
    plan = MicroBatchPlan.build(exp, micro_batch_size=1)
    scores, _ = scorer(exp, plan, timers)
    out = {"eval/score/mean": float(scores.mean()),
           "eval/response_length/mean": float(exp.action_lengths.float().mean()), **tool_use}
    if reference is not None:
        logp, _ = policy_logprobs(actor.chunks, exp, plan, compare_routing=exp.routing_recorded)
        with on_device(reference, offload, timers) as ref_model:
            ref, _ = policy_logprobs([ref_model], exp, plan)
        out["eval/kl/mean"] = float(((logp - ref) * exp.action_mask).sum(-1).mean())  # the model's tokens
    return out
