"""Measuring one training step on CPU (or CUDA): the tensors saved for backward by module (`Regions`, `SavedCounter`),
the peak from the profiler's memory timeline (`profile_memory`, `memory_timeline`), its phase split
(`summarize_phases`), and the rollout's peak (`measure_generate`)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import time
import weakref
from collections import defaultdict
from dataclasses import asdict
from typing import Dict, List, Optional

from benchmarks.step_memory.shapes import KL_COEF, LOSS_ARGS, MARK, RECOMPUTE, Case, Shape


# ---------------------------------------------------------------------------------------------- measurement
def init_process(tp: int = 1, port: Optional[int] = None) -> None:
    """torch.distributed + megatron parallel state for this process (world size 1 unless spawned)."""
    from mindspeed_llm import distributed

    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    elif "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    distributed.initialize(tp, 1, seed=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(case: Case, trainable: bool):
    """The case's model (bf16, its recompute and attention options), as a `TrainableModel` when `trainable`."""
    from mindspeed_llm import device
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel

    overrides = dict(RECOMPUTE[case.recompute])
    if case.shape.experts:
        overrides.update(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.001)
    model = build_model(case.shape.spec(), params_dtype="bf16", attention=case.attention, **overrides)
    model = model.to(device.current_device())
    if not trainable:
        return model
    return TrainableModel(model, OptimizerSettings(lr=1e-6, params_dtype="bf16", adam_beta2=0.95), name="actor")


def synthetic_experience(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """`rows` samples of `prompt` + `response` random tokens (every response at full length), with the tensors
    grpo's loss reads (advantages, reference log-probs)."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.rl.experience import Experience

    dev = device.current_device()
    gen = torch.Generator().manual_seed(seed)
    total = prompt + response
    tokens = torch.randint(0, vocab, (rows, total), generator=gen)
    # a prompt group's samples share the prompt
    tokens[:, :prompt] = tokens[:1, :prompt]
    exp = Experience(tokens=tokens.to(dev), position_ids=torch.arange(total).expand(rows, -1).clone().to(dev),
                     prompt_lengths=torch.full((rows,), prompt, device=dev),
                     responses=tokens[:, prompt:].clone().to(dev),
                     response_mask=torch.ones(rows, response, device=dev),
                     ended_with_eos=torch.ones(rows, dtype=torch.bool, device=dev))
    exp.advantages = torch.randn(rows, response, generator=gen).to(dev)
    exp.ref_logp = (-torch.rand(rows, response, generator=gen) * 4).to(dev)
    return exp


def micro_batch_of(case: Case, exp):
    """The case's one micro-batch, cut by the real `MicroBatchPlan` (rows, or one packed prompt group)."""
    import torch

    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan

    n = exp.batch_size
    plan = MicroBatchPlan.build(exp, n, group_size=n if case.layout == "packed" else 1)
    mb = plan.micro_batches(exp)[0]
    tokens = exp.loss_mask.sum()
    mb.update(total_tokens=tokens, total_sequences=torch.tensor(float(n), device=tokens.device),
              total_value_tokens=tokens)
    return plan, mb


class Regions:
    """Which module is running (a stack kept by forward pre/post hooks) and profiler markers at its borders and
    when each layer's output gradient arrives (the start of that layer's backward)."""

    def __init__(self, model, markers: bool):
        self.stack: List[str] = []
        self.markers = markers
        self.in_backward = False
        self.handles = []
        unwrapped = model
        while hasattr(unwrapped, "module"):
            unwrapped = unwrapped.module
        self.model = unwrapped
        named = []
        if getattr(unwrapped, "embedding", None) is not None:
            named.append(("embedding", unwrapped.embedding, True))
        named.append(("decoder", unwrapped.decoder, False))
        for i, layer in enumerate(unwrapped.decoder.layers):
            named.append((f"layer{i}", layer, True))
            for child in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
                if hasattr(layer, child):
                    named.append((f"layer{i}.{child}", getattr(layer, child), False))
            core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if core is not None:
                named.append((f"layer{i}.self_attention.core_attention", core, False))
        if getattr(unwrapped.decoder, "final_layernorm", None) is not None:
            named.append(("final_layernorm", unwrapped.decoder.final_layernorm, True))
        if getattr(unwrapped, "output_layer", None) is not None:
            named.append(("output_layer", unwrapped.output_layer, True))
        for name, module, marked in named:
            self.handles.append(module.register_forward_pre_hook(self._enter(name, marked)))
            self.handles.append(module.register_forward_hook(self._exit(name, marked)))

    def current(self) -> str:
        return self.stack[-1] if self.stack else "model"

    def mark(self, name: str) -> None:
        if self.markers:
            import torch

            with torch.profiler.record_function(MARK + name):
                pass

    def _phase(self) -> str:
        return "rec" if self.in_backward else "fwd"

    def _enter(self, name, marked):
        def hook(module, args):
            self.stack.append(name)
            if marked:
                self.mark(f"{self._phase()}>{name}")
        return hook

    def _exit(self, name, marked):
        def hook(module, args, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if marked:
                self.mark(f"{self._phase()}<{name}")
                first = output[0] if isinstance(output, (tuple, list)) else output
                if getattr(first, "requires_grad", False) and self.markers:
                    first.register_hook(lambda grad: self.mark(f"bwd>{name}"))
        return hook

    @contextlib.contextmanager
    def region(self, name: str):
        self.stack.append(name)
        self.mark(f"{self._phase()}>{name}")
        try:
            yield
        finally:
            self.stack.pop()
            self.mark(f"{self._phase()}<{name}")

    def backward_started(self, grad=None):
        self.in_backward = True
        self.mark("bwd>loss")

    def close(self):
        for h in self.handles:
            h.remove()


def _layer_key(region: str) -> str:
    return region.split(".")[0]


class SavedCounter:
    """Bytes autograd saves for backward while `active`, each storage once, by the region that saved it first;
    a storage saved from several layers (or a layer and the head, or by several checkpoints) is "shared".

    It also keeps a weak reference to each storage (a storage's Python object lives as long as any tensor on
    it), so that `not_alive()` / `alive()` can tell which saved storages are gone when the backward starts (a
    graph branch the loss does not reach, freed with the forward's locals) and which outlive the step (the
    micro-batch's own tensors, module caches): neither is allocated in the step between its start and its
    backward, which is what the profiler's `live_at_backward` counts."""

    def __init__(self, regions: Regions, exclude_ptrs):
        self.regions = regions
        self.exclude = set(exclude_ptrs)
        self.active = False
        self.nbytes: Dict[int, int] = {}
        self.first: Dict[int, str] = {}
        self.layer_keys: Dict[int, set] = defaultdict(set)
        self.packs: Dict[int, int] = defaultdict(int)
        self.refs: Dict[int, weakref.ref] = {}

    def pack(self, tensor):
        if self.active:
            try:
                storage = tensor.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. sparse, meta)
                return tensor
            if ptr and ptr not in self.exclude:
                region = self.regions.current()
                self.nbytes.setdefault(ptr, size)
                self.first.setdefault(ptr, region)
                self.refs.setdefault(ptr, weakref.ref(storage))
                self.layer_keys[ptr].add(_layer_key(region))
                self.packs[ptr] += 1
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def alive(self, wanted: bool = True) -> Dict[str, int]:
        """Saved bytes by first region of the storages that are (`wanted`) or are not alive now."""
        gc.collect()
        out: Dict[str, int] = defaultdict(int)
        for ptr, ref in self.refs.items():
            if (ref() is not None) == wanted:
                out[self.first[ptr]] += self.nbytes[ptr]
        return dict(out)

    def by_region(self) -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for ptr, size in self.nbytes.items():
            # full recompute: every checkpoint saves from the decoder; what several of them save is shared
            shared = len(self.layer_keys[ptr]) > 1 or (self.first[ptr] == "decoder" and self.packs[ptr] > 1)
            out["shared" if shared else self.first[ptr]] += size
        return dict(out)


def _excluded_storages(module_or_tm) -> set:
    """Storages of parameters, buffers and DDP grad buffers: model state, not activations."""
    ptrs = set()
    module = module_or_tm.module if hasattr(module_or_tm, "ddp") else module_or_tm
    for tensor in list(module.parameters()) + list(module.buffers()):
        ptrs.add(tensor.untyped_storage().data_ptr())
    ddp = getattr(module_or_tm, "ddp", None)  # megatron DDP's `buffers` is its list of grad buffers
    for buffer in (ddp.buffers + ddp.expert_parallel_buffers) if ddp is not None else []:
        for name in ("grad_data", "param_data"):
            data = getattr(buffer, name, None)
            if data is not None:
                ptrs.add(data.untyped_storage().data_ptr())
    return ptrs


def _sync():
    from mindspeed_llm import device

    device.synchronize()


def _allocator(device_type: str):
    """`torch.cuda` / `torch.npu` (torch_npu's, with the same allocator statistics), whose peak the step's is; None on
    the CPU (the profiler's timeline)."""
    import torch

    return getattr(torch, device_type) if device_type in ("cuda", "npu") else None


def profile_memory(fn, device_type: str):
    """Runs `fn()` under the profiler; returns (result, timeline dict: peak, end, phases)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
        _sync()
    return result, memory_timeline(prof, device_type)


def memory_timeline(prof, device_type: str) -> dict:
    """From the profiler's allocation events on `device_type`, in time order: the running sum of allocated bytes
    from the start, its peak, its end value, and per phase (between consecutive markers) the live bytes at the
    phase's start and the most live during it."""
    from torch._C._profiler import _EventType

    items = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == device_type:
                items.append((event.start_time_ns, 1, int(fields.alloc_size)))
        elif event.tag == _EventType.TorchOp and event.name.startswith(MARK):
            items.append((event.start_time_ns, 0, event.name[len(MARK):]))
        stack.extend(event.children)
    items.sort(key=lambda item: (item[0], item[1]))
    live = peak = 0
    phases: List[dict] = []
    current = {"phase": "start", "start": 0, "max": 0}
    for _, is_alloc, value in items:
        if is_alloc:
            live += value
            peak = max(peak, live)
            current["max"] = max(current["max"], live)
        else:
            phases.append(current)
            current = {"phase": value, "start": live, "max": live}
    phases.append(current)
    return {"peak": peak, "end": live, "phases": phases, "allocations": sum(1 for i in items if i[1])}


def _global_buffer_bytes() -> int:
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    return sum(t.numel() * t.element_size() for t in buffers.values())


def _clear_global_buffer() -> None:
    from megatron.core import parallel_state

    parallel_state.get_global_memory_buffer().buffer.clear()


def measure(case: Case, device_type: str = "cpu", timing: bool = True) -> dict:
    """Saved bytes by region, peak and phases, and the time of one step of `case` (see the module docstring)."""
    import torch

    from mindspeed_llm.rl.update import engine
    from mindspeed_llm.rl.update.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings
    from mindspeed_llm.rl.update.passes import policy_logprobs

    rows, seq, prompt, response = case.rows_and_lengths()
    _clear_global_buffer()
    gc.collect()
    train = case.kind == "train"
    tm = build(case, trainable=train)
    model = tm.module if train else tm
    exp = synthetic_experience(case.samples, prompt, response, case.shape.vocab)
    plan, mb = micro_batch_of(case, exp)
    args = LossSettings(**LOSS_ARGS, max_new_tokens=response)
    regions = Regions(model, markers=False)
    counter = SavedCounter(regions, _excluded_storages(tm))
    outside: Dict[str, Dict[str, int]] = {}

    def saved_gone(grad):  # the counting pass only: what was saved but is no longer allocated at the backward
        outside["freed_before_backward"] = counter.alive(False)

    def loss_fn(output, micro_batch):
        with regions.region("logprob_loss"):
            loss, _ = clipped_policy_loss(args, output, micro_batch, KL_COEF)
        tracking, counter.active = counter.active, False  # the forward ends here; the schedule's backward next
        if loss.requires_grad:
            loss.register_hook(regions.backward_started)
            if tracking:
                loss.register_hook(saved_gone)
        return loss, {}

    def step():
        regions.in_backward = False
        if train:
            tm.ddp.train()
            tm.ddp.zero_grad_buffer()
            engine.run_schedule(tm.chunks, [mb], loss_fn, forward_only=False)
        else:
            with regions.region("logprob_pass"):
                policy_logprobs([model], exp, plan, 1.0)
            counter.active = False

    result = dict(case=case_dict(case), rows=rows, seq=seq, prompt=prompt, response=response, tokens=rows * seq,
                  samples=case.samples, read=case.samples * response)
    # 1: saved tensors (also the warm-up: rotary tables, the global buffer, first-touch pages)
    counter.active = True
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        step()
    _sync()
    counter.active = False
    result["saved"] = counter.by_region()
    result["saved_total"] = sum(result["saved"].values())
    # saved storages the profiled step does not allocate before its backward (see SavedCounter)
    outside["before_step"] = counter.alive(True)
    outside.setdefault("freed_before_backward", {})
    result["saved_outside_step"] = outside
    result["saved_outside_step_total"] = sum(sum(d.values()) for d in outside.values())
    counter.refs.clear()
    # 2: time of a plain step
    if timing:
        regions.close()
        start = time.perf_counter()
        step()
        _sync()
        result["time_s"] = time.perf_counter() - start
        regions = Regions(model, markers=True)
    else:
        regions.close()
        regions = Regions(model, markers=True)
    # 3: peak and phases
    allocator = _allocator(device_type)
    if allocator is not None:
        allocator.reset_peak_memory_stats()
        before = allocator.memory_allocated()
    _, timeline = profile_memory(step, device_type)
    regions.close()
    result["global_buffer"] = _global_buffer_bytes()
    result["profiler_peak"] = timeline["peak"]
    if allocator is not None:  # "cuda_peak" / "npu_peak"
        result[f"{device_type}_peak"] = allocator.max_memory_allocated() - before
    result["peak"] = result.get(f"{device_type}_peak", timeline["peak"]) + result["global_buffer"]
    result["phases"] = summarize_phases(timeline["phases"])
    result["per_layer"] = per_layer_saved(result["saved"], case.shape.layers, rows * seq)
    del tm, model, exp, plan, mb
    gc.collect()
    return result


def case_dict(case: Case) -> dict:
    d = asdict(case)
    d["name"] = case.name
    return d


def summarize_phases(phases: List[dict]) -> dict:
    """The most memory each part of the step adds above the live bytes when it starts: the forward of one layer
    (`fwd_layer`, the largest over layers) and of the head (`fwd_head`: final norm, output layer, log-probs, loss),
    the backward of the head (`bwd_head`: from the loss's gradient to the first layer's recompute or output
    gradient) and of one layer (`bwd_layer`: from its first backward marker -- recompute or output gradient -- to
    the next layer's); and the live bytes when the head and the backward start."""
    out = dict(fwd_layer=0, fwd_head=0, bwd_head=0, bwd_layer=0, live_at_head=0, live_at_backward=0)
    state, seg_key, seg_start = "pre", None, 0

    for p in phases:
        name = p["phase"]
        layer = re.match(r"^(fwd|rec|bwd)[<>]layer(\d+)$", name)
        if name == "fwd>final_layernorm" and state != "head_fwd":
            state, seg_start = "head_fwd", p["start"]
            out["live_at_head"] = p["start"]
        elif name == "bwd>loss":
            state, seg_start = "head_bwd", p["start"]
            out["live_at_backward"] = p["start"]
        elif layer and (layer.group(1) != "fwd") and (state != "bwd_layer" or seg_key != layer.group(2)):
            state, seg_key, seg_start = "bwd_layer", layer.group(2), p["start"]
        elif layer and layer.group(1) == "fwd" and name.startswith("fwd>"):
            state, seg_key, seg_start = "fwd_layer", layer.group(2), p["start"]
        elif name == "bwd>embedding" or name.startswith("fwd<layer"):
            state = "other"
        if state in ("fwd_layer", "head_fwd", "head_bwd", "bwd_layer"):
            key = {"fwd_layer": "fwd_layer", "head_fwd": "fwd_head", "head_bwd": "bwd_head",
                   "bwd_layer": "bwd_layer"}[state]
            out[key] = max(out[key], p["max"] - seg_start)
    return out


def per_layer_saved(saved: Dict[str, int], layers: int, tokens: int) -> dict:
    """Saved bytes per token per layer by part (mean over layers): norms, attention (with core attention), MLP,
    the layer's own (residual path), full recompute's checkpointed inputs; and the head / embedding / shared
    parts per token of the micro-batch."""
    parts = defaultdict(float)
    for region, size in saved.items():
        key = region.split(".", 1)
        if region.startswith("layer"):
            sub = key[1] if len(key) > 1 else "layer"
            group = {"input_layernorm": "norms", "pre_mlp_layernorm": "norms", "self_attention": "attention",
                     "self_attention.core_attention": "attention", "mlp": "mlp", "layer": "layer"}[sub]
            parts[group] += size / layers / tokens
        elif region == "decoder":
            parts["checkpoint"] += size / layers / tokens
        elif region in ("final_layernorm", "output_layer", "logprob_loss", "logprob_pass"):
            parts["head"] += size / tokens
        else:
            parts[region] += size / tokens  # embedding, shared, model
    parts["layer_total"] = sum(parts[k] for k in ("norms", "attention", "mlp", "layer", "checkpoint"))
    return dict(parts)


def measure_generate(shape: Shape, batch: int, prompt: int, new_tokens: int, attention: str,
                     device_type: str = "cpu") -> dict:
    """Peak of one rollout (`inference.generate`, megatron's static KV cache, batched prefill) of `batch` distinct
    prompts of `prompt` tokens generating exactly `new_tokens` tokens each (no EOS), and the KV cache's bytes by
    megatron's sizing: 2 (K, V) x layers x slots x batch x kv heads x head dim x 2 B."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.inference import SamplingConfig, generate

    _clear_global_buffer()
    gc.collect()
    model = build(Case(shape, prompt, attention), trainable=False)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape.vocab, (batch, prompt), generator=gen).tolist()
    sampling = SamplingConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    allocator = _allocator(device_type)
    if allocator is not None:
        allocator.reset_peak_memory_stats()
        before = allocator.memory_allocated()
    start = time.perf_counter()
    _, timeline = profile_memory(lambda: generate(model, prompts, sampling), device_type)
    elapsed = time.perf_counter() - start
    slots = prompt + new_tokens
    kv_cache = 2 * shape.layers * slots * batch * shape.kv * 2
    peak = allocator.max_memory_allocated() - before if allocator is not None else timeline["peak"]
    del model
    gc.collect()
    return dict(shape=asdict(shape), attention=attention, batch=batch, prompt=prompt, new_tokens=new_tokens,
                slots=slots, peak=peak,
                kv_cache=kv_cache, prefill_working_set=peak - kv_cache, time_s=elapsed,
                device=str(device.current_device()))
