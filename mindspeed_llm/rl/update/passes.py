"""Forward passes of the stage's models over an `Experience` (in its `MicroBatchPlan`), and the per-micro-batch
reads they share.

A policy output is the logits shard `[mb, T, V/TP]` each TP rank holds; a value model output is
`[mb, T, 1]`. Reads go through `batch_plan.read_outputs`, so the index arithmetic lives in one place
(`batch_plan.py`). Under context parallelism a rank holds the outputs of its own positions only: each read is
computed where its position lives, put in place in a zero tensor and summed over the CP ranks
(`models/context_parallel.sum_over_context_parallel`), so every CP rank returns (and a loss sees) every sample's
whole result.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from megatron.core import parallel_state

from mindspeed_llm.models import routing
from mindspeed_llm.models.context_parallel import sum_over_context_parallel
from mindspeed_llm.rl.core_algos import response_mask_p1
from mindspeed_llm.rl.core_algos.distill import TeacherTopK, forward_kl_on_teacher_topk, teacher_topk
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan, read_outputs
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.logprobs import _group_world_rank, vocab_parallel_logprobs
from mindspeed_llm.rl.update.engine import forward_only


def _in_place(values: torch.Tensor, held, shape) -> torch.Tensor:
    """`values` of the read positions as `shape`: as they are without context parallelism; else the held ones put
    in place (zeros elsewhere) and summed over the CP ranks (each position is held by one of them)."""
    if held is None:
        return values.reshape(shape)
    out = values.new_zeros(shape)
    out[held] = values
    return sum_over_context_parallel(out)


def response_logprobs(
    logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = False
):
    """Log-probs `[mb, R]` of the response tokens (and their entropies) from a vocab-parallel logits shard."""
    picked, held = read_outputs(logits, micro_batch, micro_batch["response_index"])  # [mb, R or K, V/TP]
    targets = micro_batch["responses"] if held is None else micro_batch["responses"][held]
    shape = micro_batch["responses"].shape
    result = vocab_parallel_logprobs(
        picked.reshape(-1, picked.size(-1)),
        targets.reshape(-1),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        temperature=temperature,
        with_entropy=with_entropy,
    )
    if with_entropy:
        logp, entropy = result
        return _in_place(logp, held, shape), _in_place(entropy, held, shape)
    return _in_place(result, held, shape)


def response_values(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Critic values `[mb, R]`: the value of the state each response token is emitted from."""
    picked, held = read_outputs(output, micro_batch, micro_batch["response_index"])
    return _in_place(picked.squeeze(-1).float(), held, micro_batch["response_index"].shape)


def last_token_values(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A value model's output `[mb]` at each sample's last real token (the reward model's score)."""
    picked, held = read_outputs(output, micro_batch, micro_batch["last_token_index"])
    return _in_place(picked.reshape(-1).float(), held, micro_batch["last_token_index"].shape)


def policy_logprobs(model, exp: Experience, plan: MicroBatchPlan, temperature: float = 1.0,
                    compare_routing: bool = False) -> Tuple[torch.Tensor, Optional[float]]:
    """Log-probs `[B, R]` of the response tokens, and the routing mismatch: `compare_routing` says this is the forward
    of the policy that generated `exp` (the stages' old-log-prob pass passes `exp.routing_recorded`; a reference never
    asks); for a mixture of experts it then compares its routing with the rollout's and returns the share of response
    token x MoE layer pairs routed differently (`models/routing.py`; 0 with --moe-routing-replay, which routes by the
    rollout's choice), else None. The caller logs it (`rollout.mismatch_metrics`)."""
    width = exp.responses.shape[1]
    # the same on every rank (the model's config): a pipeline stage without MoE layers adds zeros
    compare = compare_routing and routing.is_moe(model)
    with routing.compare_routing(model, enabled=compare) as counts:
        logp = forward_only(
            model, plan.micro_batches(exp),
            lambda out, mb: response_logprobs(out, mb, temperature) * mb["response_mask"], (width,),
        )
    return logp, (routing.mismatch_fraction(counts, model) if compare else None)


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
        lambda out, mb: last_token_values(out, mb), (),
    )



# the logit of a teacher's padding row past the actor's vocabulary: exp() of it, less any real logit, is 0 in fp32
PADDING_LOGIT = -1e30


def _without_padding_rows(flat: torch.Tensor, vocab_size: Optional[int], group) -> torch.Tensor:
    """A teacher's vocab shard `[N, V_t / TP]` with its rows at global ids >= `vocab_size` (the actor's vocabulary,
    None: the same as the teacher's) set to `PADDING_LOGIT`, so that its distribution is over the actor's ids."""
    if vocab_size is None:
        return flat
    shard = flat.size(-1)
    _, rank = _group_world_rank(group)
    ids = torch.arange(rank * shard, (rank + 1) * shard, device=flat.device)
    if int(ids[-1]) < vocab_size:
        return flat
    return flat.masked_fill(ids >= vocab_size, PADDING_LOGIT)


def response_teacher_scores(logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor], temperature: float,
                            topk: Optional[int] = None, vocab_size: Optional[int] = None) -> torch.Tensor:
    """A teacher's reads at the response positions, `[mb, R, 1 + 2k]` (k = `topk`, 0 without): its log-prob of each
    sampled token, then with `topk` its top-k ids (as float32, exact below 2^24) and their log-probs over the whole
    vocabulary (`core_algos.teacher_topk`: each TP rank's top-k of its vocab shard, no vocabulary gather).
    `vocab_size`: the actor's, when the teacher is padded to more rows (`roles.RoleFactory.teacher`): the rows past
    it are masked out, so both log-probs are over the actor's token ids."""
    picked, held = read_outputs(logits, micro_batch, micro_batch["response_index"])
    group = parallel_state.get_tensor_model_parallel_group()
    flat = _without_padding_rows(picked.reshape(-1, picked.size(-1)), vocab_size, group)
    targets = micro_batch["responses"] if held is None else micro_batch["responses"][held]
    columns = [vocab_parallel_logprobs(flat, targets.reshape(-1), tp_group=group, temperature=temperature)[:, None]]
    if topk:
        top = teacher_topk(flat, topk, tp_group=group, temperature=temperature)
        columns += [top.ids.float(), top.logp]
    values = torch.cat(columns, dim=-1)
    return _in_place(values, held, (*micro_batch["responses"].shape, values.size(-1)))


def response_topk_kl(logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor],
                     temperature: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(kl, topk_mass) `[mb, R]`: the student's forward KL to the teacher on the teacher's top-k of each response
    position (`micro_batch["teacher_topk_ids"]`, `["teacher_topk_logp"]`; `core_algos.forward_kl_on_teacher_topk`),
    differentiable w.r.t. the student's logits."""
    picked, held = read_outputs(logits, micro_batch, micro_batch["response_index"])
    ids, logp = micro_batch["teacher_topk_ids"], micro_batch["teacher_topk_logp"]
    if held is not None:
        ids, logp = ids[held], logp[held]
    k = ids.size(-1)
    kl, mass = forward_kl_on_teacher_topk(
        picked.reshape(-1, picked.size(-1)), TeacherTopK(ids.reshape(-1, k), logp.reshape(-1, k)),
        tp_group=parallel_state.get_tensor_model_parallel_group(), temperature=temperature)
    shape = micro_batch["responses"].shape
    return _in_place(kl, held, shape), _in_place(mass, held, shape)


def teacher_scores(model, exp: Experience, plan: MicroBatchPlan, temperature: float, topk: Optional[int] = None,
                   vocab_size: Optional[int] = None) -> Tuple[torch.Tensor, Optional[TeacherTopK]]:
    """The teacher's log-probs `[B, R]` of the sampled response tokens at `temperature` and, with `topk`, its top-k
    per response position (`TeacherTopK`, `[B, R, k]` each); zeros past each response. `vocab_size`: the actor's
    (`response_teacher_scores`)."""
    width, k = exp.responses.shape[1], int(topk or 0)
    out = forward_only(
        model, plan.micro_batches(exp),
        lambda out, mb: response_teacher_scores(out, mb, temperature, k, vocab_size) * mb["response_mask"][..., None],
        (width, 1 + 2 * k),
    )
    if not k:
        return out[..., 0], None
    return out[..., 0], TeacherTopK(out[..., 1:1 + k].round().long(), out[..., 1 + k:].contiguous())


def student_topk_kl(model, exp: Experience, plan: MicroBatchPlan, temperature: float) -> torch.Tensor:
    """The policy's forward KL `[B, R]` to the teacher on the teacher's top-k (`exp.teacher_topk_ids` / `_logp`),
    without gradient: the per-token KL of the reward mode of --distill-loss topk_forward_kl."""
    return forward_only(
        model, plan.micro_batches(exp),
        lambda out, mb: response_topk_kl(out, mb, temperature)[0] * mb["response_mask"], (exp.responses.shape[1],),
    )
