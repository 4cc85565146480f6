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
A forward on `tokens` gives at position t the prediction of `tokens[:, t + 1]`, so response token j of row b
is predicted at position L_b - 1 + j (`rl/update/batch_plan.py` reads it there).

(How `generate` lays rows out inside its KV cache is internal to it; a `Rollout` always has the layout above.)

Partial rollouts: `generate(..., max_decode_steps=k)` may stop before a sample is done; such a sample's finish
reason is "unfinished" and `Rollout.continuations[b]` holds what continuing it needs (its response so far, their
log-probs, the iteration whose random stream it draws from). Passing those back as
`generate(..., continuations=...)` (with the same prompts and sample ids) carries on where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch


class SequenceBatch(NamedTuple):
    """The right-padded training layout: `tokens, position_ids, attention_mask = rollout.sequences()`."""

    tokens: torch.Tensor  # [B, T] long, right-padded prompt+response
    position_ids: torch.Tensor  # [B, T] long, 0..T-1
    attention_mask: torch.Tensor  # [B, T] long, 1 for real (prompt or response) tokens, 0 for padding


@dataclass(frozen=True)
class Continuation:
    """A sample stopped by a decode budget, to be continued by a later `generate` call: its response so far and the
    behaviour log-probs of those tokens (kept as they are: the later call generates under other weights), and the
    RL iteration whose uniform stream (`sampling.sample_uniforms`) draws its tokens, so that continuing with unchanged
    weights gives the tokens of one uninterrupted generation."""

    response: Sequence[int]
    log_probs: Optional[Sequence[float]]  # None: generated without log-probs
    iteration: int
    # multi-turn: the response spans [a, b) that were observations (tool output, fed, not sampled): token positions,
    # the engine's (it decides where an answer lands, or that it does not fit); what they mean is the handler's record
    observed: Sequence[Tuple[int, int]] = ()
    # multi-turn: the turn handler's own record of the trajectory so far (`Rollout.trajectories`), handed back to it
    state: Optional[Dict[str, object]] = None

    @property
    def turn_start(self) -> int:
        """Where the current model turn began: after the last observation (0 before any). Carried in the spans; the
        engine keeps it as a field of its own `Sample`, read at every decode step for the per-turn token limit."""
        return int(self.observed[-1][1]) if self.observed else 0


@dataclass
class Rollout:
    prompts: torch.Tensor  # [B, P] long, right-padded with pad_token_id
    prompt_lengths: torch.Tensor  # [B] long
    responses: torch.Tensor  # [B, R] long, right-padded with pad_token_id; R = largest per-row budget
    response_mask: torch.Tensor  # [B, R] long, 1 for generated tokens (incl. the EOS/stop token), 0 after
    response_lengths: torch.Tensor  # [B] long
    ended_with_eos: torch.Tensor  # [B] bool: the response ends with one of the EOS ids (TRL missing_eos_penalty)
    finish_reasons: List[str]  # per row: "eos" | "stop" (a stop_token_ids id) | "length" | "unfinished"
    log_probs: Optional[torch.Tensor]  # [B, R] float32: log softmax(logits / temperature) of each token; 0 at pad
    pad_token_id: int
    seed: Optional[int] = None  # the sampling seed (None for greedy); see sampling.sample_uniforms
    # [B, layers of this rank, T, topk] int16: each token's experts per MoE layer, in the `sequences()` layout
    # (T = max(L_b + r_b)); -1 on padding and where unknown. Only with generate(record_routing=True) on MoE.
    routing: Optional[torch.Tensor] = None
    # per row: a Continuation where the row is "unfinished" (generate's max_decode_steps), else None; None when
    # every row finished
    continuations: Optional[List[Optional[Continuation]]] = None
    # what the engine did (`generation.generate`: decode forwards and row-steps, rows that had finished, KV bytes)
    stats: Dict[str, int] = field(default_factory=dict)
    # [B, R] long: 1 at response positions fed as observations (multi-turn: tool output), not sampled; their
    # log-probs are 0. None for a single-turn rollout.
    tool_mask: Optional[torch.Tensor] = None
    # per row: the turn handler's record of the trajectory (multi-turn: its turns, calls, tool reward), which a
    # continuation hands back (`Continuation.state`); None without a handler
    trajectories: Optional[List[Dict[str, object]]] = None

    # ------------------------------------------------------------------ basic views
    @property
    def batch_size(self) -> int:
        return int(self.responses.size(0))

    @property
    def stopped(self) -> torch.Tensor:
        """[B] bool: the row ended on an EOS or stop token (not truncated by a length limit, not unfinished)."""
        return torch.tensor([r in ("eos", "stop") for r in self.finish_reasons], dtype=torch.bool,
                            device=self.responses.device)

    @property
    def unfinished(self) -> torch.Tensor:
        """[B] bool: the row was stopped by generate's decode budget before it was done (see `continuations`)."""
        return torch.tensor([r == "unfinished" for r in self.finish_reasons], dtype=torch.bool,
                            device=self.responses.device)

    def prompt_token_lists(self) -> List[List[int]]:
        return [self.prompts[b, : int(n)].tolist() for b, n in enumerate(self.prompt_lengths)]

    def response_token_lists(self) -> List[List[int]]:
        return [self.responses[b, : int(n)].tolist() for b, n in enumerate(self.response_lengths)]

    def decode(self, tokenizer, skip_special_tokens: bool = True) -> List[str]:
        """Response texts, with a `transformers` tokenizer."""
        return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in self.response_token_lists()]

    # ------------------------------------------------------------------ training layout
    def sequences(self) -> SequenceBatch:
        """(tokens, position_ids, attention_mask) in the right-padded layout (module docstring)."""
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
        position_ids = cols.expand(B, T).clone()
        return SequenceBatch(tokens, position_ids, attention_mask)


def observation_mask(spans: Sequence[Sequence[Tuple[int, int]]], width: int) -> torch.Tensor:
    """[len(spans), width] long (host): 1 in each row's response spans [a, b) of observations (`Rollout.tool_mask`)."""
    mask = torch.zeros((len(spans), width), dtype=torch.long)
    for b, row in enumerate(spans):
        for start, end in row:
            mask[b, start:end] = 1
    return mask


__all__ = ["Rollout", "SequenceBatch", "Continuation", "observation_mask"]
