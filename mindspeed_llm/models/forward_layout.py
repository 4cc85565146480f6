"""Per-forward layout options of the models `build_model` returns: RoPE at given position ids, and output
(logits / values) only from a given sequence position on.

Megatron's `GPTModel` (0.16.1) applies rotary embeddings by slot, `0..S-1` for every row, and ignores
`position_ids` for RoPE; and it applies its output layer to every position. The RL passes need both to
differ: a packed micro-batch (`mindspeed_llm.rl.update.batch_plan`) holds a prompt followed by several responses,
each of which continues at the prompt's end (its own positions), and only the positions that predict
response tokens are read, so the prompt's logits are waste (TRL's `logits_to_keep`).

Both are done with PyTorch hooks registered when the model is built, not by patching megatron: a forward
hook on `model.rotary_pos_emb` turns its `[S, 1, 1, D]` table into `[S, B, 1, D]` rows indexed by the
position ids (the shape megatron's own mRoPE path hands to attention, which broadcasts it over heads; with
multi-latent attention, DeepSeek-V3, every layer's own rotary module, whose YaRN table comes with its mscale), and a
forward pre-hook on `model.output_layer` drops the hidden states before `logits_from` (or, on a context-parallel
rank, keeps the local spans at or after it, `models/context_parallel.py`). Under sequence parallelism the hidden
states reach the output layer split over the TP ranks: the pre-hook gathers them first (its backward keeps each
rank's share of the full gradient, which every TP rank computes alike) when it cuts a window, and always for the
value head, which megatron's gather inside its own output layer does not serve; the output layer then runs
without sequence parallelism for that call. The hooks read options that `forward_layout(...)` sets for the
duration of one forward (as `forward_state.per_forward` settings, so that a recomputed layer sees them again);
outside it they change nothing. With `position_ids = arange(S)` and `logits_from = 0` the output is exactly
megatron's.

Without an inference context megatron asks its rotary module for a table only as long as the forward's input
(`get_rotary_seq_len`), which is too short when the S tokens of a forward sit at later positions (a decode step
against a KV cache, `mindspeed_llm/inference/continuous.py`): `rotary_length` makes a forward pre-hook on each
rotary module ask for at least that many rows (a longer table has the same rows at the same positions; one length
per generate call keeps megatron's lru-cached table reused).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import unwrap_model

from mindspeed_llm.forward_state import per_forward

_POSITIONS = "_layout_position_ids"
_OUTPUT_SPANS = "_layout_output_spans"  # ((start, stop or None), ...) of the output layer's input; None: all
_GATHERED = "_layout_gathered"
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


def _output_window(module, args, kwargs):
    """The output layer's input: the positions of the forward's output spans only, gathered over the TP ranks
    first under sequence parallelism when the layer itself would not (a window, or the value head)."""
    spans = getattr(module, _OUTPUT_SPANS, None)
    config = getattr(module, "_layout_config", None)
    sequence_parallel = bool(config is not None and config.sequence_parallel)
    linear = hasattr(module, "sequence_parallel")  # megatron's ColumnParallelLinear gathers by itself
    if spans is None and not (sequence_parallel and not linear):
        return None
    hidden_states = args[0] if args else kwargs.pop("input_")
    if sequence_parallel:
        # the whole sequence on every TP rank; every rank computes the same outputs from it, so the gradient of
        # its own positions is its share of the (identical) full gradient: split, not reduce-scattered
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        if linear:
            module.sequence_parallel = False  # for this call (`_restore_sequence_parallel`)
            setattr(module, _GATHERED, True)
    if spans is not None:
        pieces = [hidden_states[start:stop] for start, stop in spans]
        hidden_states = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return (hidden_states, *args[1:]), kwargs


def _restore_sequence_parallel(module, args, output):
    if getattr(module, _GATHERED, False):
        module.sequence_parallel = True
        setattr(module, _GATHERED, False)


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
        # megatron slices its table for the context-parallel rank by itself; the position ids these hooks index by
        # are split with the tokens instead (models/context_parallel.py), so the table stays whole
        rotary.cp_group = None
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None:
        output_layer._layout_config = model.config  # sequence parallel or not: read at every forward
        output_layer.register_forward_pre_hook(_output_window, with_kwargs=True)
        output_layer.register_forward_hook(_restore_sequence_parallel)
    model.has_layout_hooks = True


@contextlib.contextmanager
def forward_layout(model, position_ids: Optional[torch.Tensor] = None, logits_from: int = 0,
                   output_spans: Optional[Sequence[Tuple[int, Optional[int]]]] = None,
                   rotary_length: Optional[int] = None):
    """Within this block, forwards of `model` (a GPTModel, possibly wrapped in DDP / Float16Module) rotate
    by `position_ids` `[B, S]` (None: by slot, megatron's default) and return outputs for positions
    `logits_from..S-1` only (`logits_from = S`: none), or (`output_spans`, instead) for the local positions
    `[start, stop)` of each span in turn (a context-parallel rank's two chunks, `models/context_parallel.py`).
    `rotary_length`: the rotary table has at least that many positions (position ids up to `rotary_length - 1`;
    module docstring)."""
    if output_spans is None and logits_from:
        output_spans = ((int(logits_from), None),)
    elif output_spans is not None:
        output_spans = tuple((int(a), None if b is None else int(b)) for a, b in output_spans)
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
        # rotary inside each layer (mindspeed_llm/forward_state.py)
        for rotary in rotaries:
            stack.enter_context(per_forward(rotary, _POSITIONS, position_ids))
            stack.enter_context(per_forward(rotary, _ROTARY_LENGTH,
                                            None if rotary_length is None else int(rotary_length)))
        if output_layer is not None:
            stack.enter_context(per_forward(output_layer, _OUTPUT_SPANS, output_spans))
        yield
