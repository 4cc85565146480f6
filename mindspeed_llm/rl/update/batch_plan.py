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
  (`PackedGroups.dense_mask`, `rl/update/engine.py`).

Either way a sample's outputs are read at `response_index` (the position whose output predicts response token
j, or the critic's state for it) and `last_token_index` (the reward model's read), relative to `logits_from`, the
micro-batch's first position that predicts a response token: the model computes outputs from there on only
(`mindspeed_llm.models.forward_layout`). Every read goes through `gather_response` / `gather_last_token`.

How micro-batches are cut:

* every micro-batch is cut to its own length: its model rows to its longest row, its response-aligned tensors
  (`experience.RESPONSE_FIELDS`) to its longest response and one column more (TRL's value mask covers the
  position after a response's last token); read indices past a row's end (masked columns) are clamped into it;
  a packed micro-batch's `PackedGroups` is as wide as it. `forward_only` pads per-token outputs back to the
  batch's width.
* by count (`--micro-batch-size` samples, in the order given), or by a token budget (`max_tokens`, verl's dynamic
  batch size, `--max-tokens-per-micro-batch`): the units (samples; whole prompt groups when packed) are sorted by
  their row's length, longest first, and consecutive units share a micro-batch while rows x longest row <= the
  budget (`token_budget_groups`). Every DP rank then runs as many micro-batches as the rank with the most
  (`equalize`: expert-parallel peers exchange tokens in every forward, and the MoE loss weighting counts them), by
  halving the costliest. The losses are normalised by the mini-batch's global counts, so how the units are grouped
  changes float rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from mindspeed_llm.models.attention import PackedGroups
from mindspeed_llm.rl.experience import RESPONSE_FIELDS, Experience
from mindspeed_llm.rl.settings import BatchSettings

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
    row_lengths: torch.Tensor  # [rows] positions of each model row that hold data (prompt + response slots)
    # A token budget per micro-batch (None: `micro_batch_size` samples each), for the update's steps and for the
    # forward-only passes; `equalize(count)` -> the largest count over the DP ranks (None: no DP to agree with).
    max_tokens: Optional[int] = None
    forward_max_tokens: Optional[int] = None
    equalize: Optional[Callable[[int], int]] = None

    @classmethod
    def build(cls, exp: Experience, micro_batch_size: int, group_size: int = 1, *, max_tokens: Optional[int] = None,
              forward_max_tokens: Optional[int] = None,
              equalize: Optional[Callable[[int], int]] = None) -> "MicroBatchPlan":
        """The plan of `exp`: packed prompt groups when `group_size` n > 1 samples share each prompt and a
        micro-batch holds whole groups (`micro_batch_size` a multiple of n), else one row per sample. With
        `max_tokens` (the update) / `forward_max_tokens` (the forward-only passes; default `max_tokens`),
        micro-batches are cut by that token budget instead of by `micro_batch_size` (see the module doc)."""
        if exp.batch_size % micro_batch_size:
            raise ValueError(f"{exp.batch_size} samples do not split into micro-batches of {micro_batch_size}")
        for name, budget in (("max_tokens", max_tokens), ("forward_max_tokens", forward_max_tokens)):
            if budget is not None and budget < 1:
                raise ValueError(f"{name} {budget} must be >= 1")
        budgets = dict(max_tokens=max_tokens, forward_max_tokens=forward_max_tokens if forward_max_tokens is not None
                       else max_tokens, equalize=equalize)
        packed = group_size > 1 and micro_batch_size % group_size == 0
        if packed:
            tokens, position_ids, groups, row_of_sample, response_index, last_token_index, row_lengths = _packed_rows(
                exp, group_size)
            return cls(micro_batch_size, group_size, tokens, position_ids, groups, row_of_sample, response_index,
                       last_token_index, first_read=exp.prompt_lengths - 1, row_lengths=row_lengths, **budgets)
        width = exp.responses.shape[1]
        response_index = exp.prompt_lengths[:, None] - 1 + torch.arange(width, device=exp.tokens.device)[None, :]
        return cls(
            micro_batch_size, 1, exp.tokens, exp.position_ids, None,
            row_of_sample=torch.arange(exp.batch_size, device=exp.tokens.device),
            response_index=response_index.clamp(max=exp.tokens.shape[1] - 1),  # columns past a response are masked
            last_token_index=exp.prompt_lengths + exp.response_lengths - 1,
            first_read=exp.prompt_lengths - 1,
            row_lengths=exp.prompt_lengths + exp.response_lengths,
            **budgets,
        )

    @classmethod
    def for_run(cls, exp: Experience, batch: BatchSettings, group_size: int = 1) -> "MicroBatchPlan":
        """The plan of a stage's iteration from the run's `batch` settings: `--micro-batch-size`,
        `--max-tokens-per-micro-batch` (the update), `--forward-max-tokens-per-micro-batch` (the passes), micro-batch
        counts agreed over DP. The budgets count the tokens one rank holds: under `--context-parallel-size` N a
        micro-batch of N times as many (each rank holds 1/N of every row)."""
        from mindspeed_llm.distributed import max_over_data_parallel

        def budget(value):
            return None if value is None else value * batch.context_parallel_size

        return cls.build(exp, batch.micro_batch_size, group_size, max_tokens=budget(batch.max_tokens_per_micro_batch),
                         forward_max_tokens=budget(batch.forward_max_tokens_per_micro_batch),
                         equalize=max_over_data_parallel)

    @property
    def packed(self) -> bool:
        return self.groups is not None

    def micro_batches(self, exp: Experience, samples: Optional[torch.Tensor] = None,
                      update: bool = False) -> List[MicroBatch]:
        """Micro-batches of `samples` (indices into `exp`, in this order; default: all, in order): `exp`'s
        per-sample tensors, the model rows they read and the read indices, each cut to its own length. When
        packed, `samples` must keep each prompt group whole and in order, as `ppo_loop` deals them. `update`: a
        step of the update (its token budget), else a forward-only pass."""
        device = exp.tokens.device
        per_sample = {k: v for k, v in exp.tensors().items()
                      if k not in ("tokens", "position_ids", "truncated_out", "filtered_out")}
        per_sample["loss_mask"] = exp.loss_mask  # derived from the masks (`Experience.loss_mask`)
        n = self.group_size
        # host copies, once per call: no device sync per micro-batch
        sample_list = list(range(exp.batch_size)) if samples is None else torch.as_tensor(samples).tolist()
        row_lengths, rows_of_sample = self.row_lengths.tolist(), self.row_of_sample.tolist()
        response_lengths = exp.response_lengths.tolist()
        out = []
        for positions in self._chunks(sample_list, rows_of_sample, row_lengths,
                                      self.max_tokens if update else self.forward_max_tokens):
            chunk_list = [sample_list[i] for i in positions]
            chunk = torch.tensor(chunk_list, dtype=torch.long, device=device)
            rows = self.row_of_sample[chunk[::n]]
            width = max(row_lengths[rows_of_sample[b]] for b in chunk_list[::n])
            # the longest response and one column more: the critic's value mask reaches one past the last token
            response_width = min(max(response_lengths[b] for b in chunk_list) + 1, exp.responses.shape[1])
            mb = {name: value[chunk] for name, value in per_sample.items()}
            for name in RESPONSE_FIELDS:
                if name in mb:
                    mb[name] = mb[name][:, :response_width]
            mb.update(tokens=self.tokens[rows, :width], position_ids=self.position_ids[rows, :width],
                      row_index=torch.arange(len(rows), device=device).repeat_interleave(n),
                      # columns past a response (masked) read the row's last position
                      response_index=self.response_index[chunk, :response_width].clamp(max=width - 1),
                      last_token_index=self.last_token_index[chunk], logits_from=self.first_read[chunk].min(),
                      # where its samples stand in `samples`: a token budget takes them in another order
                      order=torch.tensor(positions, dtype=torch.long, device=device))
            if self.groups is not None:  # the micro-batch's rows, cut to its width (Python ints, no sync)
                mb["packed_groups"] = self.groups.select([rows_of_sample[b] for b in chunk_list[::n]], width)
            out.append(mb)
        return out

    def _chunks(self, samples: List[int], rows_of_sample: List[int], row_lengths: List[int],
                max_tokens: Optional[int]) -> List[List[int]]:
        """`samples` cut into micro-batches (as positions in `samples`): `micro_batch_size` at a time, or whole
        units (samples; prompt groups when packed) by the token budget, as many on every DP rank."""
        positions = list(range(len(samples)))
        if max_tokens is None:
            size = self.micro_batch_size
            return [positions[i:i + size] for i in range(0, len(samples), size)]
        n = self.group_size
        units = [positions[i:i + n] for i in range(0, len(samples), n)]
        widths = [row_lengths[rows_of_sample[samples[unit[0]]]] for unit in units]
        groups = token_budget_groups(widths, max_tokens)
        if self.equalize is not None:
            count = self.equalize(len(groups))
            if count > len(groups):
                groups = token_budget_groups(widths, max_tokens, count)
        return [[i for u in group for i in units[u]] for group in groups]


def token_budget_groups(widths: Sequence[int], max_tokens: int, count: int = 0) -> List[List[int]]:
    """Units of these row widths grouped into micro-batches of at most `max_tokens` padded tokens (rows x the
    longest row): sorted by width, longest first (ties in the given order), consecutive units share a micro-batch
    while the budget holds; a unit wider than the budget goes alone. With `count` above the number of groups, the
    group with the most padded tokens (of those with 2+ units) is halved until there are `count` (at most one a
    unit). Returns the units' indices per micro-batch."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    groups: List[List[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * widths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    count = min(count, len(widths))
    while len(groups) < count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        g = max(splittable, key=lambda g: (len(groups[g]) * widths[groups[g][0]], -g))
        half = (len(groups[g]) + 1) // 2
        groups[g:g + 1] = [groups[g][:half], groups[g][half:]]
    return groups


def _packed_rows(exp: Experience, n: int):
    """Model rows `[prompt | response_1 | ... | response_n]` per group, built with whole-tensor ops, and each
    sample's read indices: (tokens, position_ids, groups, row_of_sample, response_index, last_token_index,
    row_lengths)."""
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
    row_lengths = P + n * W  # the prompt and n response slots; the tail past them is padding
    return tokens, position_ids, groups, group_of, response_index, last_token_index, row_lengths


def gather_response(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Pick, from a model output `[rows, T - logits_from, ...]`, the positions that predict each sample's
    response tokens: `[mb, R, ...]` (a forward without context parallelism; `read_outputs` serves both)."""
    return read_outputs(output, micro_batch, micro_batch["response_index"])[0]


def gather_last_token(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Pick, from `[rows, T - logits_from, ...]`, the output at each sample's last real token: `[mb, ...]`."""
    return read_outputs(output, micro_batch, micro_batch["last_token_index"])[0]


def read_outputs(output: torch.Tensor, micro_batch: MicroBatch, positions: torch.Tensor):
    """The outputs at the global `positions` (`[mb]` or `[mb, R]`, each sample's own row): (`[*positions.shape,
    ...]`, None) on a whole-sequence forward; under context parallelism (`micro_batch["cp_layout"]`, set by the
    forward) (`[K, ...]` at the K positions this rank holds, in row-major order, the bool `held` mask of
    `positions`): `rl/update/passes.py` puts them back in place and sums over the CP ranks."""
    rows = micro_batch["row_index"].view(-1, *([1] * (positions.dim() - 1))).expand_as(positions)
    logits_from = micro_batch["logits_from"]
    layout = micro_batch.get("cp_layout")
    if layout is None:
        return output[rows, positions - logits_from], None
    index, held = layout.local_index(positions, int(logits_from))
    return output[rows[held], index[held]], held
