"""Held-out evaluation of a policy: greedy rollouts of held-out prompts, their scores, lengths and KL to the
reference (the stages' `evaluate`)."""

from __future__ import annotations

from typing import Dict, Sequence

from mindspeed_llm.rl.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.metrics import Timers
from mindspeed_llm.rl.passes import policy_logprobs
from mindspeed_llm.rl.roles import on_device
from mindspeed_llm.rl.rollout import rollout, sampling_config
from mindspeed_llm.rl.settings import SamplingSettings


def evaluate_policy(actor, reference, scorer, tokenizer, rows: Sequence[dict], sampling: SamplingSettings,
                    offload: bool = False) -> Dict[str, float]:
    """`eval/score/mean`, `eval/response_length/mean` and, with a reference, `eval/kl/mean` (the summed k1 KL of
    a response) of greedy responses to `rows` (this DP rank's share), `sampling`'s lengths and stop ids; `offload`: the
reference waits in host memory (--offload-ref-reward)."""
    timers = Timers()
    exp = rollout(actor.module, rows, sampling_config(sampling, tokenizer, greedy=True), 0, tokenizer)
    plan = MicroBatchPlan.build(exp, micro_batch_size=1)
    scores, _ = scorer(exp, plan, timers)
    out = {"eval/score/mean": float(scores.mean()),
           "eval/response_length/mean": float(exp.response_lengths.float().mean())}
    if reference is not None:
        logp, _ = policy_logprobs(actor.chunks, exp, plan, compare_routing=exp.routing_recorded)
        with on_device(reference, offload, timers) as ref_model:
            ref, _ = policy_logprobs([ref_model], exp, plan)
        out["eval/kl/mean"] = float(((logp - ref) * exp.action_mask).sum(-1).mean())  # the model's tokens
    return out
