"""The batch that flows through one RL iteration, and its split into micro-batches.

Layout: each row is `prompt_i + response_i + padding` (right padded to T = max(prompt + response)), so the
causal mask alone is correct and position ids are plain `arange(T)`. Per-token RL tensors (log-probs,
values, rewards, advantages) are response-aligned `[B, R]`: column j is response token j, which the model
predicts from position `prompt_len_i - 1 + j` (`response_index`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Dict, List, Optional

import torch


@dataclass
class Experience:
    tokens: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long
    prompt_lengths: torch.Tensor  # [B] long
    responses: torch.Tensor  # [B, R] long, pad after the response
    response_mask: torch.Tensor  # [B, R] float, 1 on response tokens (EOS included)
    ended_with_eos: torch.Tensor  # [B] bool
    # Filled in as the iteration goes.
    old_logp: Optional[torch.Tensor] = None  # [B, R]
    ref_logp: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    scores: Optional[torch.Tensor] = None  # [B]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    extras: Dict[str, object] = field(default_factory=dict)  # per-row python data (labels, texts)

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
        )

    # ------------------------------------------------------------------ shapes
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    @property
    def response_index(self) -> torch.Tensor:
        """[B, R]: the position whose output predicts response token j (and the critic's state for it)."""
        width = self.responses.shape[1]
        index = self.prompt_lengths[:, None] - 1 + torch.arange(width)[None, :]
        return index.clamp(max=self.tokens.shape[1] - 1)  # columns past a response are masked anyway

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B]: position of the last real token (where the reward model is read)."""
        return self.prompt_lengths + self.response_lengths - 1

    # ------------------------------------------------------------------ selection and micro-batches
    def _tensor_fields(self) -> List[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, rows) -> "Experience":
        rows = torch.as_tensor(rows, dtype=torch.long)
        updates = {name: getattr(self, name)[rows] for name in self._tensor_fields()}
        extras = {k: [v[i] for i in rows.tolist()] for k, v in self.extras.items()}
        return replace(self, extras=extras, **updates)

    def micro_batches(self, micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
        """Dicts of tensors (plus `response_index` and `last_token_index`) of `micro_batch_size` rows each."""
        if self.batch_size % micro_batch_size:
            raise ValueError(f"{self.batch_size} rows do not split into micro-batches of {micro_batch_size}")
        full = {name: getattr(self, name) for name in self._tensor_fields()}
        full["response_index"] = self.response_index
        full["last_token_index"] = self.last_token_index
        return [
            {k: v[start:start + micro_batch_size] for k, v in full.items()}
            for start in range(0, self.batch_size, micro_batch_size)
        ]


def gather_response(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Pick, from a model output `[mb, T, ...]`, the positions that predict each response token: `[mb, R, ...]`."""
    index = micro_batch["response_index"]
    index = index.reshape(*index.shape, *([1] * (output.dim() - 2))).expand(*index.shape, *output.shape[2:])
    return output.gather(1, index)


def gather_last_token(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Pick, from `[mb, T, ...]`, the output at each row's last real token: `[mb, ...]`."""
    rows = torch.arange(output.shape[0])
    return output[rows, micro_batch["last_token_index"]]
