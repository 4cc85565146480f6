"""The batch that flows through one RL iteration, and its split into micro-batches.

Layout: each row is `prompt_i + response_i + padding` (right padded to T = max(prompt + response)), so the
causal mask alone is correct and position ids are plain `arange(T)`. Per-token RL tensors (log-probs,
values, rewards, advantages) are response-aligned `[B, R]`: column j is response token j, which the model
predicts from position `prompt_len_i - 1 + j` (`response_index`).

Micro-batches feed the model in one of two layouts; the per-sample tensors (`[mb, R]`, `[mb]`) are the same
in both, and reads go through `gather_response` / `gather_last_token`, which map samples to model rows
(`row_index`) and positions (`response_index`, `last_token_index`, relative to `logits_from`):

* rows: one model row per sample, as above.
* packed prompt groups (`group_size` n > 1, grpo's n samples of one prompt in consecutive rows): one model
  row per group, `[prompt | response_1 | ... | response_n]`, each response padded to the group's longest,
  with an attention mask that lets every response see the prompt and itself (causally) but not the other
  responses, and position ids that continue each response at the prompt's end. Every sample's logits equal
  those of its own row (up to float rounding), while the prompt is computed once instead of n times.

Either way the model computes outputs only from `logits_from` (the micro-batch's first position that
predicts a response token) on: `mindspeed_llm.models.forward_layout`.
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
    rollout_logp: Optional[torch.Tensor] = None  # [B, R] the sampler's log-probs (generation logits / temperature)
    # [B, R] the tokens that take part in the losses: the response mask, less what the stage leaves out (grpo's
    # --filter-groups). Lengths, read positions and packing always follow `response_mask`.
    loss_mask: Optional[torch.Tensor] = None
    # Filled in as the iteration goes.
    old_logp: Optional[torch.Tensor] = None  # [B, R]
    ref_logp: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    scores: Optional[torch.Tensor] = None  # [B]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    extras: Dict[str, object] = field(default_factory=dict)  # per-row python data (labels, texts)
    group_size: int = 1  # consecutive rows that share one prompt (grpo's samples per prompt)

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
        index = self.prompt_lengths[:, None] - 1 + torch.arange(width, device=self.tokens.device)[None, :]
        return index.clamp(max=self.tokens.shape[1] - 1)  # columns past a response are masked anyway

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B]: position of the last real token (where the reward model is read)."""
        return self.prompt_lengths + self.response_lengths - 1

    # ------------------------------------------------------------------ selection and micro-batches
    def _tensor_fields(self) -> List[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, rows) -> "Experience":
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        updates = {name: getattr(self, name)[rows] for name in self._tensor_fields()}
        extras = {k: [v[i] for i in rows.tolist()] for k, v in self.extras.items()}
        return replace(self, extras=extras, **updates)

    def packs_groups(self, micro_batch_size: int) -> bool:
        """Whether `micro_batches` packs prompt groups: n > 1 samples per prompt, whole groups per
        micro-batch, and every group of n consecutive rows really holds one prompt."""
        n = self.group_size
        if n <= 1 or micro_batch_size % n or self.batch_size % n:
            return False
        lengths = self.prompt_lengths.view(-1, n)
        if not bool((lengths == lengths[:, :1]).all()):
            return False
        width = int(self.prompt_lengths.max())
        prompts = self.tokens[:, :width].view(-1, n, width)
        in_prompt = torch.arange(width, device=self.tokens.device)[None, :] < lengths[:, :1]
        same = (prompts == prompts[:, :1]) | ~in_prompt[:, None, :]
        return bool(same.all())

    def micro_batches(self, micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
        """Dicts of `micro_batch_size` samples each: the per-sample tensors, the model inputs (`tokens`,
        `position_ids`, `attention_mask` when packed) and the read indices (module docstring)."""
        if self.batch_size % micro_batch_size:
            raise ValueError(f"{self.batch_size} rows do not split into micro-batches of {micro_batch_size}")
        per_sample = {name: getattr(self, name) for name in self._tensor_fields()
                      if name not in ("tokens", "position_ids")}
        if self.packs_groups(micro_batch_size):
            model_rows, reads = self._packed_groups()
            rows_per_mb = micro_batch_size // self.group_size
        else:
            model_rows = {"tokens": self.tokens, "position_ids": self.position_ids}
            reads = {"row_index": torch.arange(self.batch_size, device=self.tokens.device),
                     "response_index": self.response_index, "last_token_index": self.last_token_index}
            rows_per_mb = micro_batch_size
        reads["first_read"] = self.prompt_lengths - 1  # each sample's first position read, in either layout
        out = []
        for i, start in enumerate(range(0, self.batch_size, micro_batch_size)):
            mb = {k: v[start:start + micro_batch_size] for k, v in per_sample.items()}
            mb.update({k: v[i * rows_per_mb:(i + 1) * rows_per_mb] for k, v in model_rows.items()})
            mb.update({k: v[start:start + micro_batch_size] for k, v in reads.items()})
            mb["row_index"] = mb["row_index"] - i * rows_per_mb
            mb["logits_from"] = mb.pop("first_read").min()
            out.append(mb)
        return out

    def _packed_groups(self):
        """Model rows `[prompt | response_1 | ... | response_n]` per group, and each sample's read indices."""
        n, groups, dev = self.group_size, self.batch_size // self.group_size, self.tokens.device
        prompt_lengths = self.prompt_lengths.view(groups, n)[:, 0]
        lengths = self.response_lengths.view(groups, n)
        widths = lengths.max(dim=1).values.clamp(min=1)
        S = int((prompt_lengths + n * widths).max())
        tokens = torch.zeros((groups, S), dtype=torch.long, device=dev)
        position_ids = torch.zeros((groups, S), dtype=torch.long, device=dev)
        segment = torch.full((groups, S), n, dtype=torch.long, device=dev)  # -1 prompt, k response k, n tail padding
        response_index = torch.empty_like(self.responses)
        last_token_index = torch.empty_like(self.prompt_lengths)
        j = torch.arange(self.responses.shape[1], device=dev)
        for g in range(groups):
            P, w = int(prompt_lengths[g]), int(widths[g])
            tokens[g, :P] = self.tokens[g * n, :P]
            position_ids[g] = torch.arange(S, device=dev)
            segment[g, :P] = -1
            for k in range(n):
                row, begin = g * n + k, P + k * w
                length = int(lengths[g, k])
                tokens[g, begin:begin + length] = self.responses[row, :length]
                position_ids[g, begin:begin + w] = P + torch.arange(w, device=dev)
                segment[g, begin:begin + w] = k
                # token 0 is predicted from the prompt's last position, token j > 0 from response token j - 1
                response_index[row] = torch.where(j == 0, P - 1, begin + j - 1).clamp(max=S - 1)
                last_token_index[row] = begin + length - 1 if length else P - 1
        key_visible = (segment[:, None, :] == -1) | (segment[:, None, :] == segment[:, :, None])
        causal = torch.ones((S, S), dtype=torch.bool, device=dev).tril()
        attention_mask = ~(key_visible & causal)[:, None]  # [G, 1, S, S], True = masked (megatron)
        model_rows = {"tokens": tokens, "position_ids": position_ids, "attention_mask": attention_mask}
        reads = {"row_index": torch.arange(groups, device=dev).repeat_interleave(n), "response_index": response_index,
                 "last_token_index": last_token_index}
        return model_rows, reads


def gather_response(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Pick, from a model output `[rows, T - logits_from, ...]`, the positions that predict each sample's
    response tokens: `[mb, R, ...]`."""
    index = micro_batch["response_index"] - micro_batch["logits_from"]
    return output[micro_batch["row_index"][:, None], index]


def gather_last_token(output: torch.Tensor, micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Pick, from `[rows, T - logits_from, ...]`, the output at each sample's last real token: `[mb, ...]`."""
    return output[micro_batch["row_index"], micro_batch["last_token_index"] - micro_batch["logits_from"]]
