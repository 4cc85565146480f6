"""The math of on-policy distillation: the student samples, a frozen teacher scores the same tokens, and the student
is moved towards the teacher (issue 48; the teacher role, its flags and the stages' use of this: `rl/distillation.py`).

Two signals, with ``s`` the student's and ``t`` the teacher's log-prob of a token, both at the rollout temperature:

* **Reverse KL on the sampled tokens** (the tokens come from the student, so a one-sample estimate of
  ``KL(student || teacher)`` per position; J. Schulman, "Approximating KL divergence", 2020): ``k1 = s - t`` and
  ``k3 = exp(t - s) - (t - s) - 1``. Used as a per-token reward, ``-coef * KL`` (:func:`distill_token_rewards`:
  the policy-gradient form of Thinking Machines' on-policy distillation and verl's "PG OPD"), or, for ``k3``, as a
  loss (:func:`reverse_kl_loss`). ``k1`` is no loss: its gradient is that of ``s`` alone, with no teacher in it.
* **Forward KL over the teacher's top-k tokens** (GKD, Agarwal et al. 2024, arXiv:2306.13649, on the teacher's
  top-k support): ``sum_{i in topk_T} p_T(i) (log p_T(i) - log p_S(i))`` with both log-probs normalised over the
  whole vocabulary, no renormalisation over the k tokens (verl's ``forward_kl_topk``, "the truncated forward-KL
  contribution on the teacher's top-k support"; NeMo-RL's ``zero_outside_topk: true`` keeps full-vocabulary
  log-probs too, its default renormalises both over the k tokens). It is the exact forward KL when ``k = V`` and
  otherwise leaves out the teacher's mass outside the top-k, reported as ``topk_mass = sum_{i in topk} p_T(i)``.

Tensor parallelism. The logits are vocab-parallel shards ``[..., V / TP]`` (rank ``r`` holds ids
``[r V/TP, (r + 1) V/TP)``, as in :mod:`mindspeed_llm.rl.logprobs`); ``tp_group`` is that group (None: the logits
hold the whole vocabulary, no communication). The whole vocabulary is never gathered: each rank takes its shard's
top-k, the ranks all-gather those k values and ids (``[tokens, k]`` each), and the top-k of the ``TP * k``
candidates is the global top-k (every global top-k token is in its own rank's top-k). A log-prob over the whole
vocabulary is the top-1 token's, from :func:`~mindspeed_llm.rl.logprobs.vocab_parallel_logprobs` (the
log-sum-exp over the group: one MAX and one SUM all-reduce), plus the logit gap to it; the student's logits at the
k ids take one SUM all-reduce of ``[tokens, k]``. Every result is the same on every rank of the group, and each rank's
backward fills its own shard's gradient without communication. These are the only collectives in ``core_algos``.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.core_algos.kl import K3_LOG_RATIO_BOUND
from mindspeed_llm.rl.core_algos.losses import aggregation_weights
from mindspeed_llm.rl.logprobs import _group_world_rank, vocab_parallel_logprobs

DISTILL_ESTIMATORS = ("k1", "k3")
# how the distillation signal enters training: a per-token reward, or a loss of its own added to the policy loss
DISTILL_MODES = ("reward", "loss")


class DistillLoss(NamedTuple):
    """What a distillation signal needs and how it may be used (the next step's choices check against these).

    ``inputs``: ``"sampled"`` -- the student's and the teacher's log-probs of the sampled tokens ``[B, T]``;
    ``"teacher_topk"`` -- the teacher's top-k ids and log-probs (:func:`teacher_topk`) and the student's logits.
    ``as_loss``: whether its gradient carries the teacher's signal, so it may be a direct loss (any of them may be a
    per-token reward, :func:`distill_token_rewards`)."""

    inputs: str
    as_loss: bool


DISTILL_LOSSES = Registry({
    "k1": DistillLoss(inputs="sampled", as_loss=False),
    "k3": DistillLoss(inputs="sampled", as_loss=True),
    "topk_forward_kl": DistillLoss(inputs="teacher_topk", as_loss=True),
})


class TeacherTopK(NamedTuple):
    """The teacher's top-k tokens at each position, the same on every TP rank: ``ids`` ``[..., k]`` (global vocabulary
    ids, by descending teacher logit) and ``logp`` ``[..., k]`` (fp32 log-probs over the whole vocabulary)."""

    ids: torch.Tensor
    logp: torch.Tensor


def reverse_kl(logp: torch.Tensor, teacher_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(student || teacher)`` from the log-probs of tokens the student sampled (unmasked).

    With ``d = teacher_logp - logp``: ``k1 = -d = logp - teacher_logp``; ``k3 = exp(d) - d - 1`` (>= 0), ``d``
    clamped to [-20, 20] before ``exp`` so it cannot overflow. Unlike the reference-KL term (``kl_penalty``), the
    value is not clamped to [-10, 10]: that clamp would zero the gradient exactly on the tokens the teacher most
    wants moved (``d`` above about 2.6 nats), and a teacher is far from the student where a reference model is not.
    """
    if estimator == "k1":
        return logp - teacher_logp
    if estimator == "k3":
        d = (teacher_logp - logp).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown distillation KL estimator {estimator!r}; valid estimators are: "
                     f"{', '.join(DISTILL_ESTIMATORS)}")


def distill_token_rewards(kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token rewards ``-coef * kl * mask`` (detached): the distillation term of the token rewards, added to the
    verifier / reward-model rewards (or alone, for pure distillation). ``kl`` is any per-token KL of this module
    (:func:`reverse_kl`, the ``kl`` of :func:`forward_kl_on_teacher_topk`); ``mask`` the loss mask (tool tokens
    and padding get no reward)."""
    with torch.no_grad():
        return -coef * kl * mask.to(kl.dtype)


def _agg_and_token_weights(mask, agg, max_len, total_tokens, total_sequences, dtype):
    m = mask.to(dtype)
    return (aggregation_weights(m, agg, max_len, total_tokens=total_tokens, total_sequences=total_sequences),
            aggregation_weights(m, "token-mean", total_tokens=total_tokens))


def reverse_kl_loss(logp, teacher_logp, mask, estimator="k3", agg="token-mean", *, max_len=None, total_tokens=None,
                    total_sequences=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The sampled-token reverse KL as a direct loss: ``agg(reverse_kl(logp, teacher_logp, estimator))``.

    ``agg`` and the totals of a split batch as in ``losses.aggregate_loss`` (the loss is then this part's share).
    The gradient w.r.t. ``logp`` is ``(1 - exp(teacher_logp - logp)) * w`` per token (``w`` the aggregation
    weight). ``k1`` is refused (no teacher in its gradient; use it as a reward).

    Metrics (detached, token means over ``mask``): ``kl``, ``teacher_logp``, ``loss``.
    """
    spec = DISTILL_LOSSES.get(estimator)
    if spec is None or spec.inputs != "sampled":
        raise ValueError(f"unknown distillation KL estimator {estimator!r}; valid estimators are: "
                         f"{', '.join(DISTILL_ESTIMATORS)}")
    if not spec.as_loss:
        raise ValueError(f"the {estimator} estimator cannot be a distillation loss: its gradient is that of the "
                         "student's log-prob alone, with no teacher in it; use it as a per-token reward, or use k3")
    kl = reverse_kl(logp, teacher_logp, estimator)
    loss_w, token_w = _agg_and_token_weights(mask, agg, max_len, total_tokens, total_sequences, kl.dtype)
    loss = (kl * loss_w).sum()
    with torch.no_grad():
        metrics = {"kl": (kl * token_w).sum(), "teacher_logp": (teacher_logp * token_w).sum(), "loss": loss.detach()}
    return loss, metrics


def _check_temperature(temperature) -> float:
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    return temperature


def _full_vocab_logp(logits2d, ids, z_at_ids, group, temperature):
    """log-probs over the whole vocabulary at ``ids`` ``[N, k]``, given ``z_at_ids`` (``logits / T`` there, fp32):
    the top-1's from the vocab-parallel log-softmax plus each id's logit gap to it (``log p_i = z_i - log Z``)."""
    top1 = vocab_parallel_logprobs(logits2d, ids[:, 0], tp_group=group, temperature=temperature)
    return top1.unsqueeze(-1) + (z_at_ids - z_at_ids[:, :1])


def teacher_topk(teacher_logits: torch.Tensor, k: int, tp_group=None, temperature: float = 1.0) -> TeacherTopK:
    """The teacher's top-k tokens of ``softmax(teacher_logits / T)`` at each position (no gradient).

    ``teacher_logits``: ``[..., V / TP]``, this rank's vocab shard (module docstring); ``k`` in ``[1, V]``. Under TP
    each rank takes ``min(k, V / TP)`` candidates from its shard and the ranks all-gather only those values and ids.
    Ties between equal logits are broken by ``torch.topk`` (which of them is taken is not specified).
    """
    temperature = _check_temperature(temperature)
    world, rank = _group_world_rank(tp_group)
    shard = teacher_logits.size(-1)
    k = int(k)
    if not 1 <= k <= shard * world:
        raise ValueError(f"the top-k size k must be in [1, {shard * world}] (the vocabulary size), got {k}")
    lead = teacher_logits.shape[:-1]
    with torch.no_grad():
        flat = teacher_logits.reshape(-1, shard)
        values, ids = flat.topk(min(k, shard), dim=-1)
        values, ids = values.float(), ids + rank * shard
        if world > 1:
            all_values = [torch.empty_like(values) for _ in range(world)]
            all_ids = [torch.empty_like(ids) for _ in range(world)]
            dist.all_gather(all_values, values.contiguous(), group=tp_group)
            dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
            values, pick = torch.cat(all_values, dim=-1).topk(k, dim=-1)
            ids = torch.cat(all_ids, dim=-1).gather(-1, pick)
        logp = _full_vocab_logp(flat, ids, values / temperature, tp_group, temperature)
    return TeacherTopK(ids.view(*lead, k), logp.view(*lead, k))


class _GatherVocabParallel(torch.autograd.Function):
    """``float32(logits)[n, ids[n, j]]`` from vocab-parallel logits ``[N, V / TP]``: each rank reads the ids its shard
    holds (0 elsewhere) and a SUM all-reduce completes them; the backward puts each rank's own ids' gradient into its
    shard, without communication (the output, and so its gradient, is the same on every rank)."""

    @staticmethod
    def forward(ctx, logits, ids, group):
        world, rank = _group_world_rank(group)
        local = ids - rank * logits.size(-1)
        owned = (local >= 0) & (local < logits.size(-1))
        safe = torch.where(owned, local, torch.zeros_like(local))
        picked = logits.gather(-1, safe).float()
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        if world > 1:
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(safe, owned)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return picked

    @staticmethod
    def backward(ctx, grad):
        safe, owned = ctx.saved_tensors
        grad_logits = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad.device)
        own_grad = torch.where(owned, grad, torch.zeros_like(grad)).to(ctx.logits_dtype)
        grad_logits.scatter_add_(-1, safe, own_grad)  # the top-k ids of a row are distinct: nothing accumulates
        return grad_logits, None, None


def forward_kl_on_teacher_topk(student_logits: torch.Tensor, topk: TeacherTopK, tp_group=None,
                               temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(kl, topk_mass)``, each ``[...]`` fp32: ``kl = sum_i p_T(i) (log p_T(i) - log p_S(i))`` over the teacher's
    top-k ``i`` (``topk``, from :func:`teacher_topk`) with ``log p_S = log_softmax(student_logits / T)`` over the
    whole vocabulary, and ``topk_mass = sum_i p_T(i)``.

    ``student_logits``: ``[..., V / TP]``, this rank's vocab shard. ``kl`` is differentiable w.r.t. them:
    ``d kl / d z_j = topk_mass * p_S(j) - p_T(j) [j in topk]`` with ``z = student_logits / T``.
    """
    temperature = _check_temperature(temperature)
    ids, teacher_logp = topk
    if tuple(ids.shape[:-1]) != tuple(student_logits.shape[:-1]):
        raise ValueError(f"teacher top-k ids {tuple(ids.shape)} do not match the student logits "
                         f"{tuple(student_logits.shape)} (the same positions, k last)")
    lead, k = ids.shape[:-1], ids.size(-1)
    flat = student_logits.reshape(-1, student_logits.size(-1))
    flat_ids = ids.reshape(-1, k).long()
    z_at_ids = _GatherVocabParallel.apply(flat, flat_ids, tp_group) / temperature
    student_logp = _full_vocab_logp(flat, flat_ids, z_at_ids, tp_group, temperature)
    teacher_logp = teacher_logp.reshape(-1, k).float()
    teacher_p = teacher_logp.exp()
    kl = (teacher_p * (teacher_logp - student_logp)).sum(-1)
    return kl.view(lead), teacher_p.sum(-1).view(lead)


def topk_forward_kl(student_logits, teacher_logits, k: int, tp_group=None,
                    temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_kl_on_teacher_topk` with the teacher's top-k taken here from its logits (the same positions and
    shard layout as the student's): ``(kl, topk_mass)``. With ``k = V`` it is the exact forward KL."""
    return forward_kl_on_teacher_topk(student_logits, teacher_topk(teacher_logits, k, tp_group, temperature),
                                      tp_group, temperature)


def topk_forward_kl_loss(student_logits, topk: TeacherTopK, mask, tp_group=None, temperature: float = 1.0,
                         agg: str = "token-mean", *, max_len=None, total_tokens=None, total_sequences=None,
                         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The top-k forward KL as a loss: ``agg(kl)`` over ``mask`` ``[B, T]`` (``student_logits`` ``[B, T, V / TP]``),
    ``agg`` and the totals of a split batch as in ``losses.aggregate_loss``.

    Metrics (detached, token means over ``mask``): ``kl``, ``topk_mass`` (the teacher's probability the top-k covers),
    ``loss``. The same on every TP rank.
    """
    kl, mass = forward_kl_on_teacher_topk(student_logits, topk, tp_group, temperature)
    return topk_kl_loss(kl, mass, mask, agg, max_len=max_len, total_tokens=total_tokens,
                        total_sequences=total_sequences)


def topk_kl_loss(kl, topk_mass, mask, agg: str = "token-mean", *, max_len=None, total_tokens=None,
                 total_sequences=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """:func:`topk_forward_kl_loss` from the per-token ``kl`` and ``topk_mass`` ``[B, T]`` of
    :func:`forward_kl_on_teacher_topk` (the stages compute them where each position's logits live, under context
    parallelism too): ``agg(kl)`` over ``mask``, and the metrics ``kl``, ``topk_mass``, ``loss``."""
    loss_w, token_w = _agg_and_token_weights(mask, agg, max_len, total_tokens, total_sequences, kl.dtype)
    loss = (kl * loss_w).sum()
    with torch.no_grad():
        metrics = {"kl": (kl * token_w).sum(), "topk_mass": (topk_mass * token_w).sum(), "loss": loss.detach()}
    return loss, metrics


__all__ = [
    "DISTILL_ESTIMATORS", "DISTILL_LOSSES", "DISTILL_MODES", "DistillLoss", "TeacherTopK", "reverse_kl",
    "distill_token_rewards", "reverse_kl_loss", "teacher_topk", "forward_kl_on_teacher_topk", "topk_forward_kl",
    "topk_forward_kl_loss", "topk_kl_loss",
]
