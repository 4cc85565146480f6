"""Per-forward layout options of the models `build_model` returns: RoPE at given position ids, and output
(logits / values) only from a given sequence position on.

Megatron's `GPTModel` (0.16.1) applies rotary embeddings by slot, `0..S-1` for every row, and ignores
`position_ids` for RoPE; and it applies its output layer to every position. The RL passes need both to
differ: a packed micro-batch (`mindspeed_llm.rl.batch_plan`) holds a prompt followed by several responses,
each of which continues at the prompt's end (its own positions), and only the positions that predict
response tokens are read, so the prompt's logits are waste (TRL's `logits_to_keep`).

Both are done with PyTorch hooks registered when the model is built, not by patching megatron: a forward
hook on `model.rotary_pos_emb` turns its `[S, 1, 1, D]` table into `[S, B, 1, D]` rows indexed by the
position ids (the shape megatron's own mRoPE path hands to attention, which broadcasts it over heads; with
multi-latent attention, DeepSeek-V3, every layer's own rotary module, whose YaRN table comes with its mscale), and a
forward pre-hook on `model.output_layer` drops the hidden states before `logits_from`. The hooks read
options that `forward_layout(...)` sets for the duration of one forward (as `forward_state.per_forward` settings, so
that a recomputed layer sees them again); outside it they change nothing.
With `position_ids = arange(S)` and `logits_from = 0` the output is exactly megatron's.

Without an inference context megatron asks its rotary module for a table only as long as the forward's input
(`get_rotary_seq_len`), which is too short when the S tokens of a forward sit at later positions (a decode step
against a KV cache, `mindspeed_llm/inference/continuous.py`): `rotary_length` makes a forward pre-hook on each
rotary module ask for at least that many rows (a longer table has the same rows at the same positions; one length
per generate call keeps megatron's lru-cached table reused).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.utils import unwrap_model

from mindspeed_llm.models.forward_state import per_forward

_POSITIONS = "_layout_position_ids"
_LOGITS_FROM = "_layout_logits_from"
_ROTARY_LENGTH = "_layout_rotary_length"


def _rotary_at_least(module, args, kwargs):
    """Forward pre-hook: the rotary table is computed for at least `rotary_length` positions."""
    length = getattr(module, _ROTARY_LENGTH, None)
    if length is None:
        return None
    if args:
        return (max(int(args[0]), length), *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["max_seq_len"] = max(int(kwargs["max_seq_len"]), length)
    return args, kwargs


def _rotary_by_position_ids(module, args, output):
    position_ids = getattr(module, _POSITIONS, None)
    if position_ids is None:
        return output
    if (isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)
            and isinstance(output[1], (int, float))):
        # YaRN (multi-latent attention) returns (table, mscale): index the table, keep the scale. A pair of
        # tensors, e.g. (cos, sin), is not that and is refused below.
        return (_rotary_by_position_ids(module, args, output[0]), *output[1:])
    if not isinstance(output, torch.Tensor) or output.dim() != 4 or output.size(1) != 1 or output.size(2) != 1:
        # e.g. a rotary module that returns (cos, sin) or per-row tables: positions would silently be ignored
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise TypeError(f"forward_layout: the rotary embedding returned {shape}, not the [S, 1, 1, D] table these "
                        "hooks index by position ids; packed rows need that table")
    if position_ids.dim() != 2 or position_ids.size(1) > output.size(0):
        raise ValueError(f"forward_layout: position ids of shape {tuple(position_ids.shape)} do not fit the "
                         f"rotary table of {output.size(0)} slots")
    if int(position_ids.max()) >= output.size(0):
        raise ValueError(f"position id {int(position_ids.max())} is past the rotary table ({output.size(0)} slots)")
    table = output[:, 0, 0, :]  # [S, D]
    return table[position_ids.t()].unsqueeze(2)  # [S, B, 1, D]


def _output_from_position(module, args, kwargs):
    start = getattr(module, _LOGITS_FROM, 0)
    if not start:
        return None
    hidden_states = args[0] if args else kwargs.pop("input_")
    return (hidden_states[start:], *args[1:]), kwargs


def _rotary_modules(model):
    """The model's rotary embeddings: GPTModel's own (`model.rotary_pos_emb`), or with multi-latent attention
    (which has none at the model level) each attention layer's `self_attention.rotary_pos_emb`."""
    return [module for name, module in model.named_modules()
            if name == "rotary_pos_emb" or name.endswith(".rotary_pos_emb")]


def install_layout_hooks(model) -> None:
    """Register the hooks on a freshly built GPTModel (every pipeline stage; the output hook where there
    is an output layer). Idempotent."""
    if getattr(model, "has_layout_hooks", False):
        return
    model.layout_rotary_modules = _rotary_modules(model)  # found once: forward_layout runs per forward
    for rotary in model.layout_rotary_modules:
        rotary.register_forward_pre_hook(_rotary_at_least, with_kwargs=True)
        rotary.register_forward_hook(_rotary_by_position_ids)
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None:
        output_layer.register_forward_pre_hook(_output_from_position, with_kwargs=True)
    model.has_layout_hooks = True


@contextlib.contextmanager
def forward_layout(model, position_ids: Optional[torch.Tensor] = None, logits_from: int = 0,
                   rotary_length: Optional[int] = None):
    """Within this block, forwards of `model` (a GPTModel, possibly wrapped in DDP / Float16Module) rotate
    by `position_ids` `[B, S]` (None: by slot, megatron's default) and return outputs for positions
    `logits_from..S-1` only (`logits_from = S`: none). `rotary_length`: the rotary table has at least that many
    positions (position ids up to `rotary_length - 1`; module docstring)."""
    core = unwrap_model(model)
    if not getattr(core, "has_layout_hooks", False):
        raise RuntimeError("forward_layout: this model was not built by mindspeed_llm.models.build_model "
                           "(no layout hooks); its positions and output window cannot be set")
    rotaries = getattr(core, "layout_rotary_modules", None)
    if rotaries is None:
        rotaries = _rotary_modules(core)
    output_layer = getattr(core, "output_layer", None)
    with contextlib.ExitStack() as stack:
        # per_forward: a recomputed layer (activation recompute) rotates by these positions too, e.g. MLA's own
        # rotary inside each layer (models/forward_state.py)
        for rotary in rotaries:
            stack.enter_context(per_forward(rotary, _POSITIONS, position_ids))
            stack.enter_context(per_forward(rotary, _ROTARY_LENGTH,
                                            None if rotary_length is None else int(rotary_length)))
        if output_layer is not None:
            stack.enter_context(per_forward(output_layer, _LOGITS_FROM, int(logits_from)))
        yield
