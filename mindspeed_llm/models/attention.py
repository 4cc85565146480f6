"""Core attention that never keeps an `[s, s]` tensor per head: `SDPAttention`, megatron's local
`DotProductAttention` with its forward on the device's fused kernel (`mindspeed_llm.device.attention`:
`torch.nn.functional.scaled_dot_product_attention` on CPU / CUDA, `torch_npu.npu_fusion_attention` on NPU).

Megatron's local attention (the reference; `--attention-backend local`) materialises the scores and saves the fp32
softmax and the half-precision probabilities for backward: about 6 x (heads / TP) x s^2 bytes per layer in bf16,
12 x (heads / TP) x s^2 transiently. The fused kernels save q, k, v, the output and a log-sum-exp per query:
linear in s. Construction (head counts per partition, `hidden_size_per_partition`, `softmax_scale` incl. MLA's /
YaRN's, dropout) is megatron's own, the output `[sq, b, np * hv]` too. What it serves:

* causal (no mask, causal mask type): one causal call, the training forwards and the stepwise prefill;
* an explicit megatron mask (bool `[b or 1, 1, sq, sk]`, True = masked): the rollout's batched prefill (causal +
  key padding) and decode steps over the static KV cache (`sq` = 1 or a few, `sk` = the cache, key padding);
  grouped-query attention reads the key / value heads in place (no `repeat_interleave` copies);
* multi-latent attention (value head dim != key's): see `device.attention`;
* packed prompt groups (`rl/update/batch_plan.py`) without a dense mask: the micro-batch's rows `[prompt | r1 | .. | rn]`
  are described by `PackedGroups` (each row's prompt length P and slot width W, the group size n: Python ints,
  so the attention never waits for the host), which reaches every layer as megatron's `packed_seq_params` (a
  `PackedSeqParams` with `qkv_format='sbhd'`, which megatron passes through to core attention and through its
  activation-recompute closures, and otherwise only reads for `max_seqlen_q / _kv` = the row width, the rotary
  table's length). Per row: one causal call over the prompt, one call for its n responses as a batch of n, queries
  `[n, W]` against the prompt's keys followed by the response's own `[n, P + W]` (lower-right causal); the tail
  padding gets zeros (never read). Megatron's local attention gets the same layout as the dense mask
  `PackedGroups.dense_mask()` (built per micro-batch, only for it).

`build_model(spec, attention="sdpa" | "local")` picks the module (`use_core_attention` swaps it into megatron's
local layer spec); `--attention-backend` / `--use-flash-attn` choose (Megatron-LM's flag names, see
`mindspeed_llm.arguments`). Not supported (refused when built): megatron's off-by-one / learnable softmax and
sliding-window attention (`--attention-backend local` runs them).

Verified on CPU against megatron's local attention (tests/dist/test_attention.py: the module alone in fp32 and bf16,
whole models at TP1 / TP2 / PP2 in both layouts, GQA, MLA, greedy generation). CUDA runs torch's own SDPA kernels:
unverified until `scripts/gpu_check.sh` runs on a GPU; NPU: see `device.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from mindspeed_llm import device
from mindspeed_llm.models.context_parallel import ContextParallelLayout, all_gather_sequence

ATTENTIONS = ("sdpa", "local")  # build_model(attention=...): this module, or megatron's DotProductAttention


@dataclass(frozen=True)
class PackedGroups:
    """The packed prompt-group layout of a micro-batch's rows (`rl/update/batch_plan.py`): row r is
    `[prompt (prompt_lengths[r]) | n response slots of widths[r] | tail padding]`, `seq_length` wide. Slot k of row
    r covers positions `P + k W .. P + (k + 1) W - 1` and sees the prompt and itself, causally."""

    group_size: int  # n
    prompt_lengths: Tuple[int, ...]  # P per row
    widths: Tuple[int, ...]  # W per row
    seq_length: int  # S, the rows' width (>= P + n W of every row)

    def __post_init__(self):
        if len(self.prompt_lengths) != len(self.widths):
            raise ValueError(f"PackedGroups: {len(self.prompt_lengths)} prompt lengths for {len(self.widths)} rows")
        for P, W in zip(self.prompt_lengths, self.widths):
            if P < 1 or W < 1 or P + self.group_size * W > self.seq_length:
                raise ValueError(f"PackedGroups: a row with prompt {P} and {self.group_size} slots of {W} does not "
                                 f"fit {self.seq_length} positions")

    @property
    def rows(self) -> int:
        return len(self.prompt_lengths)

    def select(self, rows: Sequence[int], seq_length: Optional[int] = None) -> "PackedGroups":
        """The description of these rows (Python ints, in this order), `seq_length` wide (default: as now; a
        micro-batch cut to its own longest row passes its width)."""
        return PackedGroups(self.group_size, tuple(self.prompt_lengths[r] for r in rows),
                            tuple(self.widths[r] for r in rows), self.seq_length if seq_length is None else seq_length)

    def seq_params(self) -> "PackedGroupsParams":
        """Megatron's `packed_seq_params` carrying this layout to `SDPAttention`."""
        return layout_params(self, None, self.seq_length)

    def dense_mask(self, device_=None) -> torch.Tensor:
        """`[rows, 1, S, S]` bool, True = masked (megatron's), the same layout for megatron's local attention: a
        query sees, causally, the prompt and its own segment (a response slot, or the tail padding)."""
        P = torch.tensor(self.prompt_lengths, dtype=torch.long, device=device_)[:, None]
        W = torch.tensor(self.widths, dtype=torch.long, device=device_)[:, None]
        n, S = self.group_size, self.seq_length
        s = torch.arange(S, device=device_)[None, :]
        block = torch.div(s - P, W, rounding_mode="floor")
        segment = torch.where(s < P, -1, block.clamp(max=n))  # -1 prompt, k response slot k, n tail
        key_visible = (segment[:, None, :] == -1) | (segment[:, None, :] == segment[:, :, None])
        causal = torch.ones((S, S), dtype=torch.bool, device=device_).tril()
        return ~(key_visible & causal)[:, None]


@dataclass
class PackedGroupsParams(PackedSeqParams):
    """`PackedSeqParams` in the `sbhd` format (megatron treats only `thd` specially) carrying the layout of one
    forward: `PackedGroups` (None: rows of one sample each, causal) and / or a context-parallel split
    (`models/context_parallel.py`; None: the whole sequence on this rank). `max_seqlen_q / _kv` are the whole
    rows' width, which megatron reads as the rotary table's length."""

    groups: Optional[PackedGroups] = None
    context_parallel: Optional[ContextParallelLayout] = None


def layout_params(groups: Optional[PackedGroups], context_parallel: Optional[ContextParallelLayout],
                  seq_length: int) -> PackedGroupsParams:
    """Megatron's `packed_seq_params` for rows `seq_length` wide in this layout."""
    return PackedGroupsParams(qkv_format="sbhd", max_seqlen_q=seq_length, max_seqlen_kv=seq_length, groups=groups,
                              context_parallel=context_parallel)


class SDPAttention(DotProductAttention):
    """Megatron's local core attention computed by the device's fused kernel (module docstring)."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        # multi-latent attention passes its key / value head dims (TE's keywords); the output width is
        # config.kv_channels, which build_model sets to the value head dim (see patches/mla.py)
        config = kwargs.get("config", args[0] if args else None)
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"multi-latent attention: value head dim {v_channels} != kv_channels "
                             f"{config.kv_channels}; set kv_channels to v_head_dim")
        super().__init__(*args, **kwargs)
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={self.config.softmax_type!r} has no fused kernel here; "
                             "use --attention-backend local")
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError("SDPAttention: sliding-window attention is not supported; use --attention-backend local")
        # megatron divides softmax_scale by the layer number under apply_query_key_layer_scaling and multiplies the
        # scores by it again in its softmax: the scale the scores really get
        coeff = self.scale_mask_softmax.scale
        self.attention_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query `[sq, b, np, hn]`, key `[sk, b, ng, hn]`, value `[sk, b, ng, hv]` -> `[sq, b, np * hv]`."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported (neither is it by megatron's local "
                             "DotProductAttention)")
        if isinstance(packed_seq_params, PackedGroupsParams):
            return self._laid_out(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"SDPAttention: packed sequences in the {packed_seq_params.qkv_format!r} format are not "
                             "supported (only PackedGroups)")
        sq, b, sk = query.size(0), query.size(1), key.size(0)
        q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
        if attention_mask is not None:
            out = self._attend(q, k, v, masked=attention_mask)
        else:
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and sq > 1
            # sq < sk without a mask: a block of queries continuing cached keys (megatron asserts sq == sk there)
            variant = None if not causal else "upper_left" if sq == sk else "lower_right"
            out = self._attend(q, k, v, causal=variant)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _attend(self, query, key, value, masked=None, causal=None):
        """device.attention with this layer's scale and (in training) its dropout, in megatron's RNG stream."""
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout == 0.0:
            return device.attention(query, key, value, scale=self.attention_scale, masked=masked, causal=causal)
        if self.config.sequence_parallel:
            return device.attention(query, key, value, scale=self.attention_scale, masked=masked, causal=causal,
                                    dropout_p=dropout)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return device.attention(query, key, value, scale=self.attention_scale, masked=masked, causal=causal,
                                    dropout_p=dropout)

    def _laid_out(self, query, key, value, params: "PackedGroupsParams"):
        """Packed prompt groups and / or a context-parallel split (module docstring): `[sq, rows, np * hv]`.

        Under context parallelism the local queries are this rank's two chunks; the keys and values of the whole
        sequence are gathered over the CP group first. Each chunk of queries attends to the keys up to its own
        positions: causally in a row of one sample, by the packed layout's segments in a prompt-group row."""
        layout, groups = params.context_parallel, params.groups
        if layout is not None:
            key, value = all_gather_sequence(key, layout), all_gather_sequence(value, layout)
            spans = layout.spans()
        else:
            spans = ((0, query.size(0)),)
        if groups is not None and (key.size(0) != groups.seq_length or query.size(1) != groups.rows):
            raise ValueError(f"SDPAttention: packed groups of {groups.rows} rows x {groups.seq_length} positions for "
                             f"a micro-batch of {query.size(1)} x {key.size(0)}")
        sq, b = query.size(0), query.size(1)
        out, offset = [], 0
        for start, end in spans:
            q = query[offset:offset + end - start]
            offset += end - start
            if groups is None:  # causal: queries [start, end) over keys [0, end)
                attended = self._attend(_heads_first(q), _heads_first(key[:end]), _heads_first(value[:end]),
                                        causal="upper_left" if start == 0 else "lower_right")
                out.append(attended.permute(2, 0, 1, 3).reshape(end - start, b, self.hidden_size_per_partition))
            else:
                out.append(torch.stack([
                    self._packed_span(q[:, r], key[:, r], value[:, r], P, W, groups.group_size, start, end)
                    for r, (P, W) in enumerate(zip(groups.prompt_lengths, groups.widths))], dim=1))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _packed_span(self, q, k, v, P: int, W: int, n: int, start: int, end: int):
        """One packed row `[prompt P | n slots of W | tail]`: queries at positions `[start, end)` (`[end - start,
        heads, dim]`) against the row's keys and values `[S, groups, dim]`; `[end - start, np * hv]`, zeros on the
        tail. The prompt's queries attend causally; whole response slots go as one batch, queries `[m, W]` against
        the prompt's keys followed by the slot's own (lower-right causal); a slot cut by the span's ends alone."""
        width = self.hidden_size_per_partition

        def one(t):  # [s, g, d] -> [1, g, s, d]
            return t.transpose(0, 1)[None]

        def flat(o):  # [batch, np, s, hv] -> [batch * s, np * hv]
            return o.transpose(1, 2).reshape(-1, width)

        pieces, pos = [], start
        if pos < min(end, P):
            e = min(end, P)
            pieces.append(flat(self._attend(one(q[pos - start:e - start]), one(k[:e]), one(v[:e]),
                                            causal="upper_left" if pos == 0 else "lower_right")))
            pos = e
        stop = min(end, P + n * W)
        while pos < stop:
            first = P + (pos - P) // W * W  # the slot's first position
            whole = (stop - pos) // W if pos == first else 0
            if whole:
                e = pos + whole * W

                def slots(t):  # [S, g, d] -> [m, g, P + W, d]: the prompt's keys before each slot's own
                    own = t[pos:e].reshape(whole, W, t.size(1), t.size(2))
                    prompt = t[:P].unsqueeze(0).expand(whole, P, t.size(1), t.size(2))
                    return torch.cat([prompt, own], dim=1).transpose(1, 2)

                queries = q[pos - start:e - start].reshape(whole, W, q.size(1), q.size(2)).transpose(1, 2)
                pieces.append(flat(self._attend(queries, slots(k), slots(v), causal="lower_right")))
            else:
                e = min(stop, first + W)

                def part(t):  # the prompt's keys, then the slot's up to e
                    return one(torch.cat([t[:P], t[first:e]]))

                pieces.append(flat(self._attend(one(q[pos - start:e - start]), part(k), part(v),
                                                causal="lower_right")))
            pos = e
        if pos < end:
            pieces.append(q.new_zeros((end - pos, width)))
        return torch.cat(pieces)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """Megatron's `[s, b, heads, dim]` as the kernels' `[b, heads, s, dim]` (a view)."""
    return t.permute(1, 2, 0, 3)


def use_core_attention(layer_spec, attention: str):
    """Megatron's local layer spec (one layer's, or a decoder block's) with `attention`'s core attention: "sdpa"
    puts `SDPAttention` where the spec has megatron's `DotProductAttention`; "local" leaves it. Changes the spec in
    place (get_gpt_*_spec build a new one per call) and returns it."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}; use one of {ATTENTIONS}")
    if attention == "local":
        return layer_spec
    # a block spec (TransformerBlockSubmodules, or a ModuleSpec of one) lists its layers; a layer spec is one
    block = getattr(layer_spec, "layer_specs", None) or getattr(getattr(layer_spec, "submodules", None), "layer_specs",
                                                                 None)
    layers = block or [layer_spec]
    swapped = 0
    for layer in layers:
        attention_spec = layer.submodules.self_attention
        core = attention_spec.submodules.core_attention
        if core is DotProductAttention or core is SDPAttention:
            attention_spec.submodules.core_attention = SDPAttention
            swapped += 1
    if not swapped:
        raise ValueError("use_core_attention: the layer spec has no megatron DotProductAttention to replace")
    return layer_spec


def model_attention(model) -> str:
    """"sdpa" or "local": the core attention of a model (`build_model` records it; else found by module type)."""
    from megatron.core.utils import unwrap_model

    core = unwrap_model(model)
    kind = getattr(core, "attention_kind", None)
    if kind in ATTENTIONS:
        return kind
    return "sdpa" if any(isinstance(m, SDPAttention) for m in core.modules()) else "local"
