"""How an iteration's samples feed the model: one `MicroBatchPlan`, built once per iteration, reused by every pass
(old / reference log-probs, values, reward scores) and by every step of the update.

Two layouts of model rows; the per-sample tensors (`[mb, R]`, `[mb]`) are the same in both:

* rows: one model row per sample, `prompt_i + response_i + padding` (the Experience's own `tokens`), the causal
  mask alone, position ids `arange(T)`.
* packed prompt groups (grpo's n samples of a prompt in consecutive rows, when the micro-batch holds whole
  groups): one model row per group, `[prompt | response_1 | ... | response_n]`, each response padded to the
  group's longest, attention that lets every response see the prompt and itself (causally) but not the other
  responses, and position ids that continue each response at the prompt's end. Every sample's outputs equal those
  of its own row (up to float rounding), while the prompt is computed once instead of n times. The attention
  pattern is described, not materialised: `PackedGroups` (`models/attention.py`: each row's prompt length and
  slot width, the group size, as Python ints computed once per plan) goes with every micro-batch
  (`micro_batch["packed_groups"]`); the fused core attention reads it as megatron's `packed_seq_params`, and only
  megatron's local attention gets the dense `[rows, 1, S, S]` mask, built per micro-batch
  (`PackedGroups.dense_mask`, `rl/engine.py`).

Either way a sample's outputs are read at `response_index` (the position whose output predicts response token
j, or the critic's state for it) and `last_token_index` (the reward model's read), relative to `logits_from`, the
micro-batch's first position that predicts a response token: the model computes outputs from there on only
(`mindspeed_llm.models.forward_layout`). Every read goes through `gather_response` / `gather_last_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from mindspeed_llm.models.attention import PackedGroups
from mindspeed_llm.rl.experience import Experience

MicroBatch = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Model rows and read indices of one iteration's samples, and how micro-batches of them are cut."""

    micro_batch_size: int  # samples per micro-batch
    group_size: int  # consecutive samples per model row: n when packed, else 1
    tokens: torch.Tensor  # [rows, S] model input
    position_ids: torch.Tensor  # [rows, S]
    groups: Optional[PackedGroups]  # the packed layout of every row; None: one row per sample, causal
    row_of_sample: torch.Tensor  # [B] the model row each sample is read from
    response_index: torch.Tensor  # [B, R] positions (in its row) whose outputs predict the response tokens
    last_token_index: torch.Tensor  # [B] position of the sample's last real token
    first_read: torch.Tensor  # [B] the sample's first position read (prompt length - 1)

    @classmethod
    def build(cls, exp: Experience, micro_batch_size: int, group_size: int = 1) -> "MicroBatchPlan":
        """The plan of `exp`: packed prompt groups when `group_size` n > 1 samples share each prompt and a
        micro-batch holds whole groups (`micro_batch_size` a multiple of n), else one row per sample."""
        if exp.batch_size % micro_batch_size:
            raise ValueError(f"{exp.batch_size} samples do not split into micro-batches of {micro_batch_size}")
        packed = group_size > 1 and micro_batch_size % group_size == 0
        if packed:
            return cls(micro_batch_size, group_size, *_packed_rows(exp, group_size), first_read=exp.prompt_lengths - 1)
        width = exp.responses.shape[1]
        response_index = exp.prompt_lengths[:, None] - 1 + torch.arange(width, device=exp.tokens.device)[None, :]
        return cls(
            micro_batch_size, 1, exp.tokens, exp.position_ids, None,
            row_of_sample=torch.arange(exp.batch_size, device=exp.tokens.device),
            response_index=response_index.clamp(max=exp.tokens.shape[1] - 1),  # columns past a response are masked
            last_token_index=exp.prompt_lengths + exp.response_lengths - 1,
            first_read=exp.prompt_lengths - 1,
        )

    @property
    def packed(self) -> bool:
        return self.groups is not None

    def micro_batches(self, exp: Experience, samples: Optional[torch.Tensor] = None) -> List[MicroBatch]:
        """Micro-batches of `samples` (indices into `exp`, in this order; default: all, in order): `exp`'s
        per-sample tensors, the model rows they read, and the read indices. When packed, `samples` must keep
        each prompt group whole and in order, as `ppo_loop` deals them."""
        device = exp.tokens.device
        if samples is None:
            samples = torch.arange(exp.batch_size, device=device)
        samples = torch.as_tensor(samples, dtype=torch.long, device=device)
        per_sample = {k: v for k, v in exp.tensors().items() if k not in ("tokens", "position_ids")}
        n = self.group_size
        # the rows of the packed micro-batches as Python ints: one host read per call, none in the forwards
        packed_rows = self.row_of_sample[samples[::n]].tolist() if self.groups is not None else None
        rows_per_batch = self.micro_batch_size // n
        out = []
        for index, chunk in enumerate(samples.split(self.micro_batch_size)):
            rows = self.row_of_sample[chunk[::n]]
            mb = {name: value[chunk] for name, value in per_sample.items()}
            mb.update(tokens=self.tokens[rows], position_ids=self.position_ids[rows],
                      row_index=torch.arange(len(rows), device=device).repeat_interleave(n),
                      response_index=self.response_index[chunk], last_token_index=self.last_token_index[chunk],
                      logits_from=self.first_read[chunk].min())
            if self.groups is not None:
                mb["packed_groups"] = self.groups.select(
                    packed_rows[index * rows_per_batch:(index + 1) * rows_per_batch])
            out.append(mb)
        return out


def _packed_rows(exp: Experience, n: int):
    """Model rows `[prompt | response_1 | ... | response_n]` per group, built with whole-tensor ops, and each
    sample's read indices: (tokens, position_ids, groups, row_of_sample, response_index, last_token_index)."""
    B, R = exp.responses.shape
    G, device = B // n, exp.tokens.device
    if B % n:
        raise ValueError(f"{B} samples do not form groups of {n}")
    prompt = exp.prompt_lengths.view(G, n)
    if not bool((prompt == prompt[:, :1]).all()):
        raise ValueError(f"samples of one group of {n} have prompts of different lengths: not a prompt group")
    P = prompt[:, 0]  # [G]
    lengths = exp.response_lengths.view(G, n)
    W = lengths.max(dim=1).values.clamp(min=1)  # each group's response slot width
    S = int((P + n * W).max())
    s = torch.arange(S, device=device)[None, :]  # [1, S]
    in_prompt = s < P[:, None]
    offset = s - P[:, None]
    block = torch.div(offset, W[:, None], rounding_mode="floor")  # which response slot (>= n: tail padding)
    j = offset - block * W[:, None]  # position in the slot
    in_block = ~in_prompt & (block < n)
    slot = block.clamp(0, n - 1)
    first = torch.arange(G, device=device) * n  # each group's first sample
    sample = first[:, None] + slot
    prompt_tokens = exp.tokens[first].gather(1, s.clamp(max=exp.tokens.shape[1] - 1).expand(G, S))
    response_tokens = exp.responses[sample, j.clamp(0, R - 1)]
    in_response = in_block & (j < lengths.gather(1, slot))
    zero = torch.zeros((), dtype=exp.tokens.dtype, device=device)
    tokens = torch.where(in_prompt, prompt_tokens, torch.where(in_response, response_tokens, zero))
    position_ids = torch.where(in_block, P[:, None] + j, s.expand(G, S))
    groups = PackedGroups(n, tuple(P.tolist()), tuple(W.tolist()), S)

    # sample b = g * n + k: its slot starts at P_g + k W_g; token 0 is predicted from the prompt's last position,
    # token j > 0 from response token j - 1
    k = torch.arange(B, device=device) % n
    group_of = torch.arange(B, device=device) // n
    start = P[group_of] + k * W[group_of]
    col = torch.arange(R, device=device)[None, :]
    response_index = torch.where(col == 0, P[group_of, None] - 1, start[:, None] + col - 1).clamp(max=S - 1)
    length = exp.response_lengths
    last_token_index = torch.where(length > 0, start + length - 1, P[group_of] - 1)
    return tokens, position_ids, groups, group_of, response_index, last_token_index


def gather_response(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Pick, from a model output `[rows, T - logits_from, ...]`, the positions that predict each sample's
    response tokens: `[mb, R, ...]`."""
    index = micro_batch["response_index"] - micro_batch["logits_from"]
    return output[micro_batch["row_index"][:, None], index]


def gather_last_token(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Pick, from `[rows, T - logits_from, ...]`, the output at each sample's last real token: `[mb, ...]`."""
    return output[micro_batch["row_index"], micro_batch["last_token_index"] - micro_batch["logits_from"]]
