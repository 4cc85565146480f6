"""`Rollout`: the result of `generate`, and the sequence layout the training forward uses.

Sequence layout ("right-padded concatenation per row")
------------------------------------------------------
Row b of `Rollout.sequences().tokens` is

    [ prompt_b (L_b tokens) | response_b (r_b tokens, incl. a final EOS/stop token) | pad ... ]

with T = max_b (L_b + r_b). Position ids are 0..T-1 on every row, i.e. each real token sits at its true
position. This is the only padding that is exact for Megatron: its rotary embedding (training forward and
the static KV cache alike) takes positions from the index in the sequence, not from `position_ids`, so a
left-padded prompt would shift the positions. Padding only ever follows the real tokens of a row, so the
plain causal mask Megatron applies by default is enough: no real token attends to a pad. `attention_mask`
is returned as a [B, T] 1/0 padding mask for consumers that want it (e.g. a `transformers` forward).

Next-token alignment: a forward on `tokens` gives at position t the prediction of `tokens[:, t + 1]`
(Megatron's `labels` convention). `loss_mask[b, t] == 1` exactly when `tokens[b, t + 1]` is a real response
token, i.e. for t in [L_b - 1, L_b + r_b - 2]. `gather_response` maps such per-position values (log-probs,
values, entropies) to the [B, R] response layout; `scatter_response` goes back.

(How `generate` lays rows out inside Megatron's KV cache, left-padded or stepwise, is internal to it; a
`Rollout` always has the layout above.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch


class SequenceBatch(NamedTuple):
    """What the training forward consumes: `tokens, loss_mask, position_ids, attention_mask = ...`."""

    tokens: torch.Tensor  # [B, T] long, right-padded prompt+response
    loss_mask: torch.Tensor  # [B, T] float, 1 where the next-token target tokens[:, t+1] is a response token
    position_ids: torch.Tensor  # [B, T] long, 0..T-1
    attention_mask: torch.Tensor  # [B, T] long, 1 for real (prompt or response) tokens, 0 for padding

    @property
    def labels(self) -> torch.Tensor:
        """Next-token targets [B, T]: tokens shifted left by one. The last column has no target; it repeats
        the last token and is always 0 in `loss_mask`."""
        labels = torch.empty_like(self.tokens)
        labels[:, :-1] = self.tokens[:, 1:]
        labels[:, -1] = self.tokens[:, -1]
        return labels


@dataclass
class Rollout:
    prompts: torch.Tensor  # [B, P] long, right-padded with pad_token_id
    prompt_lengths: torch.Tensor  # [B] long
    responses: torch.Tensor  # [B, R] long, right-padded with pad_token_id; R = largest per-row budget
    response_mask: torch.Tensor  # [B, R] long, 1 for generated tokens (incl. the EOS/stop token), 0 after
    response_lengths: torch.Tensor  # [B] long
    ended_with_eos: torch.Tensor  # [B] bool: the response ends with one of the EOS ids (TRL missing_eos_penalty)
    finish_reasons: List[str]  # per row: "eos" | "stop" (a stop_token_ids id) | "length"
    log_probs: Optional[torch.Tensor]  # [B, R] float32: log softmax(logits / temperature) of each token; 0 at pad
    pad_token_id: int
    seed: Optional[int] = None  # the sampling seed (None for greedy); see sampling.sample_uniforms

    # ------------------------------------------------------------------ basic views
    @property
    def batch_size(self) -> int:
        return int(self.responses.size(0))

    @property
    def stopped(self) -> torch.Tensor:
        """[B] bool: the row ended on an EOS or stop token (not truncated by a length limit)."""
        return torch.tensor([r != "length" for r in self.finish_reasons], dtype=torch.bool,
                            device=self.responses.device)

    def prompt_token_lists(self) -> List[List[int]]:
        return [self.prompts[b, : int(n)].tolist() for b, n in enumerate(self.prompt_lengths)]

    def response_token_lists(self) -> List[List[int]]:
        return [self.responses[b, : int(n)].tolist() for b, n in enumerate(self.response_lengths)]

    def decode(self, tokenizer, skip_special_tokens: bool = True) -> List[str]:
        """Response texts, with an `HFTokenizerAdapter` or a `transformers` tokenizer."""
        detok = getattr(tokenizer, "detokenize", None)
        out = []
        for ids in self.response_token_lists():
            if detok is not None:
                out.append(detok(ids, skip_special_tokens=skip_special_tokens))
            else:
                out.append(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return out

    # ------------------------------------------------------------------ training layout
    def sequences(self) -> SequenceBatch:
        """(tokens, loss_mask, position_ids, attention_mask) in the right-padded layout (module docstring)."""
        device = self.responses.device
        B = self.batch_size
        P = self.prompt_lengths.to(device)
        r = self.response_lengths.to(device)
        total = P + r
        T = max(int(total.max().item()) if B else 0, 1)
        cols = torch.arange(T, device=device).unsqueeze(0)  # [1, T]
        tokens = torch.full((B, T), self.pad_token_id, dtype=torch.long, device=device)
        prompt_width = min(self.prompts.size(1), T)
        in_prompt = cols[:, :prompt_width] < P.unsqueeze(1)
        tokens[:, :prompt_width] = torch.where(in_prompt, self.prompts[:, :prompt_width].to(device),
                                               tokens[:, :prompt_width])
        resp_idx = (cols - P.unsqueeze(1)).clamp(0, max(self.responses.size(1) - 1, 0))
        in_resp = (cols >= P.unsqueeze(1)) & (cols < total.unsqueeze(1))
        if self.responses.size(1):
            tokens = torch.where(in_resp, self.responses.gather(1, resp_idx), tokens)
        attention_mask = (cols < total.unsqueeze(1)).long()
        # target tokens[:, t + 1] is a response token  <=>  P - 1 <= t < P + r - 1
        loss_mask = ((cols >= (P - 1).unsqueeze(1)) & (cols < (total - 1).unsqueeze(1))).float()
        position_ids = cols.expand(B, T).clone()
        return SequenceBatch(tokens, loss_mask, position_ids, attention_mask)

    def gather_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] values aligned to next-token targets (e.g. log-probs of `labels`) -> [B, R, ...]:
        out[b, j] = per_position[b, L_b - 1 + j] for j < r_b, 0 elsewhere."""
        B, R = self.responses.shape
        device = per_position.device
        T = per_position.size(1)
        j = torch.arange(R, device=device).unsqueeze(0)
        idx = (self.prompt_lengths.to(device).unsqueeze(1) - 1 + j).clamp(0, T - 1)
        valid = j < self.response_lengths.to(device).unsqueeze(1)
        extra = per_position.shape[2:]
        idx_full = idx.view(B, R, *([1] * len(extra))).expand(B, R, *extra)
        out = per_position.gather(1, idx_full)
        return out * valid.view(B, R, *([1] * len(extra))).to(out.dtype)

    def scatter_response(self, per_response: torch.Tensor, T: Optional[int] = None) -> torch.Tensor:
        """Inverse of `gather_response` for [B, R] values: -> [B, T] (0 outside the loss mask)."""
        B, R = per_response.shape[:2]
        device = per_response.device
        if T is None:
            T = int((self.prompt_lengths + self.response_lengths).max().item())
        out = torch.zeros((B, T) + tuple(per_response.shape[2:]), dtype=per_response.dtype, device=device)
        for b in range(B):
            start, n = int(self.prompt_lengths[b]) - 1, int(self.response_lengths[b])
            out[b, start: start + n] = per_response[b, :n]
        return out


__all__ = ["Rollout", "SequenceBatch"]
