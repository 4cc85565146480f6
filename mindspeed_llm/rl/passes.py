"""Forward passes of the stage's models over an `Experience` (in its `MicroBatchPlan`), and the per-micro-batch
reads they share.

A policy output is the logits shard `[mb, T, V/TP]` each TP rank holds; a value model output is
`[mb, T, 1]`. Reads go through `gather_response` / `gather_last_token`, so the index arithmetic lives in
one place (`batch_plan.py`).
"""

from __future__ import annotations

from typing import Dict

import torch
from megatron.core import parallel_state

from mindspeed_llm.models import routing
from mindspeed_llm.rl.core_algos import response_mask_p1
from mindspeed_llm.rl.batch_plan import MicroBatchPlan, gather_last_token, gather_response
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.logprobs import vocab_parallel_logprobs
from mindspeed_llm.rl.engine import forward_only


def response_logprobs(
    logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = False
):
    """Log-probs `[mb, R]` of the response tokens (and their entropies) from a vocab-parallel logits shard."""
    picked = gather_response(logits, micro_batch)  # [mb, R, V/TP]
    rows, width = micro_batch["responses"].shape
    result = vocab_parallel_logprobs(
        picked.reshape(rows * width, -1),
        micro_batch["responses"].reshape(-1),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        temperature=temperature,
        with_entropy=with_entropy,
    )
    if with_entropy:
        logp, entropy = result
        return logp.view(rows, width), entropy.view(rows, width)
    return result.view(rows, width)


def response_values(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Critic values `[mb, R]`: the value of the state each response token is emitted from."""
    return gather_response(output, micro_batch).squeeze(-1).float()


def policy_logprobs(model, exp: Experience, plan: MicroBatchPlan, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs `[B, R]` of the response tokens. With a mixture of experts, the forward of the model that generated
    `exp` (the old-log-prob pass) also compares its routing with the rollout's: `exp.extras["routing_mismatch"]`
    (`models/routing.py`; 0 with --moe-routing-replay, which routes by the rollout's choice)."""
    width = exp.responses.shape[1]
    compare = routing.generated(model)  # the same on every rank: a stage without MoE layers adds zeros
    with routing.compare_routing(model, enabled=compare) as counts:
        logp = forward_only(
            model, plan.micro_batches(exp),
            lambda out, mb: response_logprobs(out, mb, temperature) * mb["response_mask"], (width,),
        )
    if compare:
        exp.extras["routing_mismatch"] = routing.mismatch_fraction(counts)
    return logp


def critic_values(model, exp: Experience, plan: MicroBatchPlan) -> torch.Tensor:
    """Values `[B, R]` on TRL's value mask: the response plus one position past its last token."""
    width = exp.responses.shape[1]
    return forward_only(
        model, plan.micro_batches(exp),
        lambda out, mb: response_values(out, mb) * response_mask_p1(mb["response_mask"]), (width,),
    )


def reward_scores(model, exp: Experience, plan: MicroBatchPlan) -> torch.Tensor:
    """Reward-model score `[B]`: the value head at the last real token of prompt + response."""
    return forward_only(
        model, plan.micro_batches(exp),
        lambda out, mb: gather_last_token(out, mb).reshape(-1).float(), (),
    )

