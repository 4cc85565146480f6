"""LoRA adapters on megatron-core's parallel linears, tensor-parallel, switched off for the reference.

`apply_lora(model, config)` freezes a built (and loaded) `GPTModel` and gives every linear whose module name ends
in one of `config.target_modules` a low-rank adapter: the linear's output becomes

    base(x) + scaling * B (A dropout(x)),   scaling = alpha / r,  A [r, in], B [out, r]

(PEFT's LoRA). Only the adapters train, and a value model's head (the critic's, fully). The base keeps its names
and tensors (`load_megatron_weights` reads it unchanged); each adapter is a child `lora` of its linear (state dict
`...linear_qkv.lora.A` / `.B`) and acts through a forward hook on it, so megatron's modules run unmodified.

Targets (megatron's local-spec names): `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`; multi-latent
attention's `linear_q_proj`, `linear_q_down_proj`, `linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`.
A name matches every module of that name: `linear_fc1` is the dense MLP's, the shared experts' and each routed
expert's.

Tensor parallelism, so that each layer's output equals the unsharded computation at any TP:

* column-parallel base (W rows split over TP): A is replicated, B is split along its rows exactly as W's rows are
  (B's local rows are the rows of W this rank holds: `linear_qkv`'s per-query-group [q k v] layout and `linear_fc1`'s
  [gate; up] halves follow, since the local B extends the local W). `h = A x` is the same on every rank; its
  backward is all-reduced over TP (megatron's `copy_to_tensor_model_parallel_region`), so A's gradient and the input
  gradient of the adapter path are the full ones on every rank. With `gather_output` the delta is gathered too;
* row-parallel base (W columns split): A is split along its columns as W is, B replicated; the partial `A_r x_r`
  are all-reduced (`reduce_from_tensor_model_parallel_region`) before B, so B's gradient is the full one on every
  rank and needs no further reduction.

With a frozen base nothing before the first adapter requires grad, so a recomputed layer (megatron's checkpointed
forward) would give its adapters no gradient: the embedding's output is made to require grad in training forwards
(what MindSpeed-LLM's --lora-register-forward-hook does; later pipeline stages receive inputs that require grad).

Sequence parallelism (megatron's, read from the linear at every call: generation turns it off), so that the
adapters compute exactly what they compute without it:

* column-parallel: the linear's input is this rank's shard of the sequence, which the linear all-gathers; the
  adapter gathers it too (megatron's `gather_from_sequence_parallel_region`), after its dropout on the shard (under
  SP megatron's dropouts draw per rank, so the gathered mask is one mask, the same on every rank). Its backward
  splits instead of reduce-scattering: the input gradient of the adapter path is already whole on every rank
  (h's all-reduce), and A's gradient the full one, as without SP;
* row-parallel: the linear reduce-scatters its output to the sequence shard; the adapter reduce-scatters its
  partial `A_r x_r` (rank r, not the output width; `reduce_scatter_to_sequence_parallel_region`, backward an
  all-gather, so A's gradient is whole) and applies B to its positions. B's gradient is then a partial sum over
  the TP ranks: B carries `sequence_parallel = True`, as megatron's row-parallel bias and norms do, and
  `finalize_model_grads` all-reduces it over TP.

The split parameters carry megatron's tensor-parallel attributes (the gradient norm counts them once per rank, the
replicated ones on TP rank 0 only); an expert's adapter is an expert parameter (`allreduce=False`, reduced over the
expert-data-parallel group, as its linear). Routed experts with expert tensor parallelism > 1 are refused (an MoE
at TP > 1 trains under sequence parallelism, `rl/update/moe.check_trainable`: LoRA on its routed experts needs
--expert-tensor-parallel-size 1, where they run unsplit; its shared experts follow the rules above). Pipeline and
expert parallelism need nothing: each rank adapts its own layers and experts.

Initialisation is PEFT's: B = 0, A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)) over the FULL input
width, drawn from a generator seeded by the run's seed and the module's global name (global layer and expert
index), so the initial adapters are the same at every TP / PP / EP layout. A model in bf16 holds its adapters in
bf16; megatron's optimizer keeps their fp32 main copies (the fp32 masters).

`adapters_disabled(model)` bypasses every adapter in its block (the forward skips them; no weight is touched): the
reference model of a LoRA run is the actor so. `freeze_copy` / `frozen_copies` keep and use a frozen copy of the
adapters instead (the reference of a run that starts from a loaded adapter: the base with that adapter). Dropout
(`config.dropout`, train mode only) acts on the adapter's input; on a row-parallel input (a TP slice) under
megatron's model-parallel RNG, as its attention dropout does.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# megatron-core module names an adapter can target
DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MLA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
TARGETS = DENSE_TARGETS + MLA_TARGETS
ADAPTER = "lora"  # the child module's name: `<linear>.lora.A`, `<linear>.lora.B`

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*mlp\.experts\.local_experts\.)(\d+)(\..+)$")


@dataclass(frozen=True)
class LoRAConfig:
    """r, alpha, dropout and the target module names of a LoRA run; `ranks` {global module name: rank} where an
    adapter's rank is not `r` (a PEFT adapter read back with its q / k / v, or gate / up, A matrices stacked)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Tuple[str, ...] = ()
    ranks: Dict[str, int] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def rank_of(self, name: str) -> int:
        return self.ranks.get(name, self.r)

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "target_modules": list(self.target_modules),
                "ranks": dict(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        return cls(r=int(d["r"]), alpha=float(d["alpha"]), dropout=float(d.get("dropout", 0.0)),
                   target_modules=tuple(d["target_modules"]), ranks={k: int(v) for k, v in d.get("ranks", {}).items()})


def check_targets(targets: Sequence[str]) -> None:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a LoRA target here; the megatron-core linears are "
                         f"{', '.join(TARGETS)}")


def _linear_kind(module) -> Optional[str]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def _core(model):
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def global_names(model) -> Dict[str, str]:
    """{local module name: global module name} of the model's linears: layer indices of the whole model (megatron's
    `layer_number`), expert indices over all expert-parallel ranks."""
    from megatron.core import parallel_state

    core = _core(model)
    decoder = getattr(core, "decoder", None)
    offset = decoder.layers[0].layer_number - 1 if decoder is not None and len(decoder.layers) else 0
    spec = getattr(core, "model_spec", None)
    ep = parallel_state.get_expert_model_parallel_world_size() if spec is not None and spec.is_moe else 1
    local_experts = spec.num_experts // ep if spec is not None and spec.is_moe else 0
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0
    out = {}
    for name, module in core.named_modules():
        if _linear_kind(module) is None:
            continue
        full = name
        match = _LAYER.match(name)
        if match:
            full = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
        expert = _EXPERT.match(full)
        if expert and local_experts:
            full = f"{expert.group(1)}{ep_rank * local_experts + int(expert.group(2))}{expert.group(3)}"
        out[name] = full
    return out


class LoRAAdapter(torch.nn.Module):
    """The adapter of one parallel linear (see the module docstring for the TP rules). Called by the linear's
    forward hook with the linear's input; returns the delta to add to its output."""

    def __init__(self, base, kind: str, rank: int, scaling: float, dropout: float, generator: torch.Generator):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.kind = kind
        self.rank = rank
        self.scaling = scaling
        self.enabled = True
        self.frozen: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # a copy of (A, B) (`freeze_copy`)
        self.use_frozen = False
        self.tp_group = base.tp_group
        self.tp_size = base.tp_group.size()
        self.gather_output = bool(getattr(base, "gather_output", False))
        self.input_is_parallel = bool(getattr(base, "input_is_parallel", True))
        if getattr(base, "is_expert", False) and self.tp_size > 1:
            # an expert's linear at expert TP > 1 communicates through the token dispatcher, not its own group;
            # the adapters' TP rules above are not checked there
            raise ValueError("LoRA on routed experts needs expert tensor parallelism 1 (--expert-tensor-parallel-size "
                             "1; a mixture of experts at TP > 1 trains under --sequence-parallel)")
        weight = base.weight
        fan_in = base.input_size
        # the full linear's widths: B A has rank at most min(in, out) (`rl/update/lora.rank_note`)
        self.in_features, self.out_features = int(base.input_size), int(base.output_size)
        bound = 1.0 / math.sqrt(fan_in)
        full_a = torch.empty(rank, fan_in, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        tp_rank = base.tp_group.rank() if self.tp_size > 1 else 0
        if kind == "column":
            a = full_a
            b = torch.zeros(weight.shape[0], rank, dtype=torch.float32)
        else:
            width = weight.shape[1]
            a = full_a[:, tp_rank * width:(tp_rank + 1) * width]
            b = torch.zeros(weight.shape[0], rank, dtype=torch.float32)
        self.A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype).contiguous())
        split = self.B if kind == "column" else self.A
        set_tensor_model_parallel_attributes(split, self.tp_size > 1, 0 if kind == "column" else 1, 1)
        if kind == "row" and self.tp_size > 1:
            # under sequence parallelism B acts on this rank's sequence shard only, so its gradient is a partial sum
            # over the TP ranks: marked as megatron marks the row-parallel bias and the norms, finalize_model_grads
            # all-reduces it over TP (it reads the mark only while config.sequence_parallel is on)
            self.B.sequence_parallel = True
        for param in (self.A, self.B):
            param.allreduce = getattr(weight, "allreduce", True)  # an expert's: reduced over expert data parallel
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None

    def _dropped(self, x, shard: bool = False):
        """`shard`: x is this rank's sequence shard (a column adapter under sequence parallelism)."""
        if self.dropout is None or not self.training:
            return x
        if (self.kind == "row" or shard) and self.tp_size > 1:
            # a TP slice (channels, or positions): each rank its own mask, as megatron's attention dropout and its
            # dropouts under sequence parallelism
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def forward(self, x: torch.Tensor, gather_output: Optional[bool] = None,
                sequence_parallel: bool = False) -> torch.Tensor:
        """`sequence_parallel`: the linear runs megatron's sequence parallelism now (its input, for a column-parallel
        linear, or its output, for a row-parallel one, is this rank's shard of the sequence)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            gather_from_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region,
                                                            scatter_to_tensor_model_parallel_region)

        comm = self.tp_size > 1
        sequence_parallel = comm and sequence_parallel
        a, b = self.frozen if self.use_frozen else (self.A, self.B)
        if self.kind == "column":
            if sequence_parallel:
                # the whole sequence, as the linear gathers it. Dropout acts on the shard first: megatron draws
                # under SP from the per-rank model-parallel RNG, so after the gather every rank holds the same
                # dropped input (one mask, as without SP; A is replicated and its gradient must agree). The
                # adapter's input gradient comes out whole on every rank (h's backward all-reduce below), so each
                # rank keeps its shard of it: split, not reduce-scattered
                x = gather_from_sequence_parallel_region(self._dropped(x, shard=True),
                                                         tensor_parallel_output_grad=False, group=self.tp_group)
            else:
                x = self._dropped(x)
            h = F.linear(x, a)
            if comm:  # backward: sum the partial dh of every rank's B rows
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            delta = F.linear(h, b) * self.scaling
            if comm and (self.gather_output if gather_output is None else gather_output):
                delta = gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
            return delta
        if comm and not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        h = F.linear(self._dropped(x), a)
        if sequence_parallel:  # A x over the whole width, this rank's positions (the linear's output shard)
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif comm:  # forward: A x over the whole input width
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, b) * self.scaling


def _hook(module, args, kwargs, output):
    adapter = getattr(module, ADAPTER)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    # read at every call: generation turns the linears' sequence parallelism off (models/sequence_parallel.py); an
    # expert's linear with its own communication runs without it (as megatron's forward does)
    sequence_parallel = bool(getattr(module, "sequence_parallel", False)) and not getattr(
        module, "explicit_expert_comm", False)
    return out + adapter(x, kwargs.get("runtime_gather_output"), sequence_parallel).to(out.dtype), bias


def _input_requires_grad(module, args, output):
    """The embedding's output requires grad in a training forward: with a frozen base nothing before the first
    adapter does, and a recomputed (checkpointed) layer whose inputs require no grad would give its adapters none."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"lora:{seed}:{name}".encode()))


def apply_lora(model, config: LoRAConfig, seed: int = 0, salt: str = "") -> Dict[str, LoRAAdapter]:
    """Freeze `model` and add `config`'s adapters (see the module docstring); a value model's head stays trainable.
    The initial A matrices are drawn from `seed`, `salt` (the role) and each module's global name. Returns {local
    module name: adapter}. A target that names no linear of the model is a ValueError."""
    check_targets(config.target_modules)
    core = _core(model)
    if getattr(core, "lora_adapters", None):
        raise ValueError("the model already has LoRA adapters")
    for param in core.parameters():
        param.requires_grad_(False)
    names = global_names(core)
    found = {t: 0 for t in config.target_modules}
    adapters: Dict[str, LoRAAdapter] = {}
    for name, module in list(core.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        kind = _linear_kind(module)
        if leaf not in found or kind is None or getattr(module, "weight", None) is None:
            continue
        found[leaf] += 1
        full = names[name]
        adapter = LoRAAdapter(module, kind, config.rank_of(full), config.scaling, config.dropout,
                              _generator(seed, f"{salt}:{full}"))
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_hook, with_kwargs=True)
        adapters[name] = adapter
    missing = [t for t, n in found.items() if not n]
    if missing:
        present = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"--lora-target-modules {' '.join(missing)}: this model has no such linear (its linears: "
                         f"{', '.join(p for p in present if p in TARGETS)})")
    if getattr(core, "is_value_model", False) and getattr(core, "output_layer", None) is not None:
        for param in core.output_layer.parameters():
            param.requires_grad_(True)  # the critic's value head trains fully
    if getattr(core, "embedding", None) is not None:  # the first pipeline stage (later ones receive such inputs)
        core.embedding.register_forward_hook(_input_requires_grad)
    core.lora_adapters = adapters
    core.lora_config = config
    core.lora_global_names = {name: names[name] for name in adapters}
    return adapters


def adapters(model) -> Dict[str, LoRAAdapter]:
    return getattr(_core(model), "lora_adapters", None) or {}


def is_lora(model) -> bool:
    return bool(adapters(model))


def trained_names(model) -> Tuple[str, ...]:
    """State-dict names of what a LoRA model trains (its adapters, a value model's head), in state-dict order."""
    core = _core(model)
    return tuple(name for name, param in core.named_parameters() if param.requires_grad)


def trained_state(model) -> Dict[str, torch.Tensor]:
    names = set(trained_names(model))
    return {k: v for k, v in _core(model).state_dict().items() if k in names}


def adapter_tensors(model) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """{global module name: (A, B)} of this rank's adapters (its TP slices)."""
    core = _core(model)
    return {core.lora_global_names[name]: (a.A, a.B) for name, a in adapters(core).items()}


def freeze_copy(model) -> None:
    """Keep a frozen copy of every adapter's current (A, B) (not a parameter, not in the state dict): the
    reference of a run that starts from a loaded adapter is the base with that adapter (`frozen_copies`)."""
    with torch.no_grad():
        for adapter in adapters(model).values():
            adapter.frozen = (adapter.A.detach().clone(), adapter.B.detach().clone())


@contextlib.contextmanager
def frozen_copies(model) -> Iterator[None]:
    """Within the block every adapter computes with its frozen copy (`freeze_copy`) instead of its trained A, B."""
    found = list(adapters(model).values())
    if any(a.frozen is None for a in found):
        raise ValueError("frozen_copies: freeze_copy was not called on this model")
    for a in found:
        a.use_frozen = True
    try:
        yield
    finally:
        for a in found:
            a.use_frozen = False


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """Within the block every adapter of `model` is bypassed: the model computes its frozen base."""
    found = list(adapters(model).values())
    states = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, states):
            a.enabled = state
