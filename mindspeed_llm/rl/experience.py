"""The batch that flows through one RL iteration: a container of tensors, filled in as the iteration goes.

Each sample is `prompt_i + response_i + padding` in `tokens` (right padded to T = max(prompt + response)),
position ids `arange(T)`. Per-token RL tensors (log-probs, values, rewards, advantages, masks) are
response-aligned `[B, R]`: column j is response token j. How samples feed the model (rows or packed prompt
groups, the read positions) is `rl/batch_plan.py`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, Optional

import torch


# The per-token fields, response-aligned `[B, R]` (column j is response token j): a micro-batch may cut them to its
# own longest response (`rl/batch_plan.py`).
RESPONSE_FIELDS = ("responses", "response_mask", "rollout_logp", "loss_mask", "old_logp", "ref_logp", "values",
                   "advantages", "returns")


@dataclass
class Experience:
    tokens: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long
    prompt_lengths: torch.Tensor  # [B] long
    responses: torch.Tensor  # [B, R] long, pad after the response
    response_mask: torch.Tensor  # [B, R] float, 1 on response tokens (EOS included)
    ended_with_eos: torch.Tensor  # [B] bool
    rollout_logp: Optional[torch.Tensor] = None  # [B, R] the sampler's log-probs (generation logits / temperature)
    # [B, R] the tokens that take part in the losses: the response mask, less what the stage leaves out (grpo's
    # --filter-groups, --mask-truncated-completions). Lengths, read positions and packing always follow
    # `response_mask`.
    loss_mask: Optional[torch.Tensor] = None
    # Filled in as the iteration goes.
    old_logp: Optional[torch.Tensor] = None  # [B, R]
    ref_logp: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    scores: Optional[torch.Tensor] = None  # [B]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    extras: Dict[str, object] = field(default_factory=dict)  # per-row python data (labels, texts)
    # [B, MoE layers of this rank, T, topk] int16: the rollout's experts of each token (-1 unknown / padding), for
    # --moe-routing-replay and the moe/routing_mismatch metric (`mindspeed_llm.models.routing`); None: dense model
    routing: Optional[torch.Tensor] = None
    # The generating policy is a mixture of experts that recorded its routing into `routing` (on the ranks holding MoE
    # layers; a pipeline stage without them has None): the old-log-prob pass of that policy compares its own routing
    # with the rollout's (`rl/passes.policy_logprobs(compare_routing=...)`). The same on every rank.
    routing_recorded: bool = False

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.clone()

    @classmethod
    def from_rollout(cls, rollout) -> "Experience":
        """Take tokens and layout from `mindspeed_llm.inference.Rollout.sequences()` (same convention)."""
        seq = rollout.sequences()
        return cls(
            tokens=seq.tokens,
            position_ids=seq.position_ids,
            prompt_lengths=rollout.prompt_lengths.long(),
            responses=rollout.responses.long(),
            response_mask=rollout.response_mask.float(),
            ended_with_eos=rollout.ended_with_eos.bool(),
            rollout_logp=None if rollout.log_probs is None else rollout.log_probs.float(),
            routing=getattr(rollout, "routing", None),
        )

    # ------------------------------------------------------------------ shapes
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor field that is set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
