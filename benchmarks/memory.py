"""Activation and model-state memory of one RL training step, measured on CPU at a scaled-down shape, fitted per
layer, and projected to every shipped launcher's devices.

What is measured (``--device cpu``; ``--device cuda`` runs the same code with CUDA's allocator statistics):

* one training forward + backward of the policy on the real path: `MicroBatchPlan` rows or packed prompt groups ->
  the actor's `TrainableModel` (megatron DDP with its fp32 grad buffer, bf16 weights) through megatron's schedule
  (`rl.engine._run_schedule`, what `train_step` runs before the optimizer step) -> `rl.losses.clipped_policy_loss`
  (`passes.response_logprobs` -> `rl.logprobs.vocab_parallel_logprobs` with entropy, the clipped surrogate, the
  low_var_kl loss), with grpo's settings;
* **saved for backward**: every tensor autograd packs during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters left out, attributed to
  the module that was running (forward pre/post hooks on the embedding, each layer and its norms, attention,
  core attention and MLP, the final norm, the output layer; the log-prob + loss closure; the decoder itself for
  full recompute's checkpointed layer inputs). A storage saved in more than one layer (the rotary table, the
  causal or packed mask) is counted once, as "shared";
* **peak**: on CPU, ``torch.profiler`` with ``profile_memory=True``: the running sum of every allocation and free
  event (``alloc_size`` of the profiler's allocation events, in time order) from the step's start; its maximum is
  the step's peak above what was live before it. Megatron's global memory buffer (the local attention's score
  matmul target, ``[b * heads, s, s]``, allocated once and kept) is added: it is steady-state memory. Checked
  (JSON ``peak_check``): the method gives the exact bytes of a scripted allocation sequence, and a fresh process
  whose only work is one step rises in ``ru_maxrss`` by about the profiler's peak (glibc maps large tensors
  with mmap, so RSS follows them). On CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before
  the step (the profiler's timeline is still used for the phase split);
* the phase split of the peak (markers in the profiler's timeline from the same module hooks and from gradient
  hooks on each layer's output, `summarize_phases`): one layer's forward and backward, the head's forward and
  backward, each as the most memory live above the live bytes when it starts;
* the time of one plain step (no hooks, no profiler) after a warm-up step;
* the forward-only log-prob pass (`passes.policy_logprobs`, no grad) and the rollout (`inference.generate` on
  megatron's static KV cache), by the same peak method;
* model-state bytes per parameter of a real `TrainableModel` after one optimizer step (weights, DDP grad
  buffer, fp32 main weights, Adam moments; each storage once) and of a frozen model;
* the same saved-bytes measurement at TP2 on two gloo processes, and the distributed optimizer at DP2 where it
  runs (else megatron's rule, 2 + 4 + 12 / DP bytes per parameter, is used and the failure is reported).

Levers, one parameter each (`Case`): ``recompute`` none / selective (megatron's core_attn) / full (uniform, one
layer per checkpoint); ``attention`` local (megatron's unfused attention, which keeps ``[b, heads, s, s]``
scores) / sdpa (passed to `build_model(..., attention=...)` once it accepts the option; until then those cases
say so); ``layout`` row / packed (`[prompt | r1 .. rn]` with its mask); micro-batching (padding analysis below).

What is computed: coefficients fitted to the measurements (`fit_model`: least squares with non-negative
coefficients) -- saved bytes per token per layer by part as linear functions of hidden, FFN, q and kv widths and,
for the local attention's ``s^2`` part, heads x s (MoE: experts, top-k x hidden, top-k x expert FFN); one layer's
working set without recompute (a recomputed layer's backward adds what recompute did not keep, checked against the
measured selective / full cases) and the head's; held-out shapes check them (`check_fit`: saved bytes and the
composed peak); their division under tensor parallelism (hidden-sized tensors stay replicated without sequence
parallelism, the rest divides; checked against the TP2 measurement); the padding of today's / own-length /
token-budget micro-batches at a skewed length mix; and the per-device projection of each launcher
(`examples/mcore/*/*.sh`, read through its own command line and `arguments.parse_args`) for the rollout, the
forward-only passes and the update at its worst pipeline stage, with and without each lever (`Levers`), against
64 GB and 80 GB, and the cheapest levers that fit 56 GB (`recommend`). Every assumption is printed and in the JSON
(``assumptions``). Cases a shared 24 GB machine cannot hold are skipped by a rough estimate (``--max-case-gb``) and
say so; ``--reuse`` / ``--only`` add cases to an earlier JSON without measuring the rest again.

Usage::

    python benchmarks/memory.py --json runs/memory.json              # default shape, 2k/4k/8k, ~25 min on 2 cores
    python benchmarks/memory.py --reuse runs/memory.json --only "s=4096 none" --max-case-gb 14 --json runs/m2.json
    python benchmarks/memory.py --toy --no-tp2 --json /tmp/m.json    # seconds (tests/test_benchmark_memory.py)
    python benchmarks/memory.py --project-only runs/memory.json      # redo fit + projection from a JSON
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import random
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GB = 1e9  # projections are in GB (10^9 bytes), as device memory is sold; measurements keep bytes
MARK = "membench:"  # profiler markers

# ---------------------------------------------------------------------------------------------- data: shapes
# The real models' shapes, from their Hugging Face config.json (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim (else hidden / heads), vocab_size, tie_word_embeddings,
# attention bias, q/k norms, experts). published_params: the model card's parameter count, checked against the
# count these shapes give (`param_count`).
MODELS = {
    "Qwen2.5-7B": dict(source="Qwen/Qwen2.5-7B-Instruct config.json", hidden=3584, ffn=18944, layers=28, heads=28,
                       kv_heads=4, head_dim=128, vocab=152064, qkv_bias=True, tied=False, published_params=7.62e9),
    "Qwen2.5-32B": dict(source="Qwen/Qwen2.5-32B-Instruct config.json", hidden=5120, ffn=27648, layers=64, heads=40,
                        kv_heads=8, head_dim=128, vocab=152064, qkv_bias=True, tied=False, published_params=32.76e9),
    "Qwen3-30B-A3B": dict(source="Qwen/Qwen3-30B-A3B config.json (as in tests/test_examples.py)", hidden=2048,
                          ffn=6144, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936, qk_norm=True,
                          tied=False, experts=128, topk=8, moe_ffn=768, published_params=30.53e9),
    "Llama-3.2-1B": dict(source="meta-llama/Llama-3.2-1B config.json", hidden=2048, ffn=8192, layers=16, heads=32,
                         kv_heads=8, head_dim=64, vocab=128256, qkv_bias=False, tied=True, published_params=1.24e9),
}
# launcher -> the models it loads (the critic / reward model are value-head models of the named trunk)
LAUNCHERS = {
    "examples/mcore/qwen25/grpo_qwen25_7b.sh": dict(model="Qwen2.5-7B", reward_model="Qwen2.5-7B"),
    "examples/mcore/qwen25/ppo_qwen25_32b.sh": dict(model="Qwen2.5-32B", reward_model="Qwen2.5-32B"),
    "examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh": dict(model="Qwen3-30B-A3B", reward_model="Qwen3-30B-A3B"),
    "examples/mcore/llama32/trl_ppo_llama32_1b.sh": dict(model="Llama-3.2-1B", reward_model="Llama-3.2-1B"),
}
DEVICES_GB = {"Ascend 910B": 64, "H100": 80}
ACCELERATOR = "npu"  # the projection's log-prob work buffer: the accelerators' chunk size (rl/logprobs.py)
TARGET_TRAIN_GB = 56


@dataclass(frozen=True)
class Shape:
    """A decoder's shape; `spec()` gives the `ModelSpec` `build_model` takes."""

    hidden: int = 1024
    ffn: int = 2816
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    vocab: int = 32000
    qkv_bias: bool = True
    qk_norm: bool = False
    tied: bool = False
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def spec(self, max_positions: int = 32768):
        from mindspeed_llm.models import ModelSpec

        family = "qwen3_moe" if self.experts else "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"
        moe = dict(num_experts=self.experts, moe_ffn_hidden_size=self.moe_ffn, moe_router_topk=self.topk) \
            if self.experts else {}
        return ModelSpec(family=family, num_layers=self.layers, hidden_size=self.hidden, ffn_hidden_size=self.ffn,
                         num_attention_heads=self.heads, num_query_groups=self.kv_heads, kv_channels=self.head_dim,
                         vocab_size=self.vocab, max_position_embeddings=max_positions,
                         tie_word_embeddings=self.tied, add_qkv_bias=self.qkv_bias and not self.experts,
                         qk_layernorm=self.qk_norm, **moe)


def model_shape(name: str) -> Shape:
    return Shape(**{k: v for k, v in MODELS[name].items() if k not in ("source", "published_params")})


DEFAULT_SHAPE = Shape()
TOY_SHAPE = Shape(hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512)

# Shapes the per-layer coefficients are fitted on (with the main shape), and the held-out shapes that check them.
# Each varies hidden, FFN, q width, kv width and heads apart (q = heads x head_dim) so the fit can tell them apart.
FIT_GRIDS = {
    "default": dict(
        lengths=(512, 1024),
        dense=[Shape(hidden=768, ffn=2048, heads=16, kv_heads=4, head_dim=64, layers=2, vocab=16000),
               Shape(hidden=1024, ffn=3584, heads=8, kv_heads=8, head_dim=64, layers=2, vocab=24000),
               Shape(hidden=512, ffn=1536, heads=8, kv_heads=2, head_dim=128, layers=2, vocab=32000),
               Shape(hidden=1280, ffn=2560, heads=10, kv_heads=2, head_dim=64, layers=2, vocab=8000)],
        held_out=[Shape(hidden=1536, ffn=4096, heads=12, kv_heads=4, head_dim=128, layers=2, vocab=20000)],
        qk_norm=[Shape(hidden=1024, ffn=2816, heads=16, kv_heads=4, head_dim=64, layers=2, vocab=16000,
                       qkv_bias=False, qk_norm=True)],
        moe=[Shape(hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=8000, qk_norm=True,
                   qkv_bias=False, experts=8, topk=2, moe_ffn=256),
             Shape(hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=8000, qk_norm=True,
                   qkv_bias=False, experts=16, topk=4, moe_ffn=384),
             Shape(hidden=768, ffn=1024, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=8000, qk_norm=True,
                   qkv_bias=False, experts=8, topk=2, moe_ffn=512),
             Shape(hidden=512, ffn=1024, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=8000, qk_norm=True,
                   qkv_bias=False, experts=32, topk=8, moe_ffn=128)],
        moe_held_out=[Shape(hidden=640, ffn=1024, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=8000,
                            qk_norm=True, qkv_bias=False, experts=16, topk=4, moe_ffn=256)],
    ),
    "toy": dict(
        lengths=(32, 64),
        dense=[Shape(hidden=48, ffn=96, heads=4, kv_heads=1, head_dim=16, layers=2, vocab=256),
               Shape(hidden=64, ffn=256, heads=2, kv_heads=2, head_dim=16, layers=2, vocab=384),
               Shape(hidden=32, ffn=64, heads=2, kv_heads=1, head_dim=32, layers=2, vocab=512),
               Shape(hidden=80, ffn=160, heads=5, kv_heads=1, head_dim=8, layers=2, vocab=128)],
        held_out=[Shape(hidden=96, ffn=192, heads=6, kv_heads=2, head_dim=16, layers=2, vocab=320)],
        qk_norm=[Shape(hidden=64, ffn=176, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=256, qkv_bias=False,
                       qk_norm=True)],
        moe=[Shape(hidden=32, ffn=64, heads=2, kv_heads=1, head_dim=16, layers=2, vocab=128, qk_norm=True,
                   qkv_bias=False, experts=4, topk=2, moe_ffn=32),
             Shape(hidden=32, ffn=64, heads=2, kv_heads=1, head_dim=16, layers=2, vocab=128, qk_norm=True,
                   qkv_bias=False, experts=8, topk=4, moe_ffn=48),
             Shape(hidden=48, ffn=64, heads=2, kv_heads=1, head_dim=16, layers=2, vocab=128, qk_norm=True,
                   qkv_bias=False, experts=4, topk=2, moe_ffn=64),
             Shape(hidden=32, ffn=64, heads=2, kv_heads=1, head_dim=16, layers=2, vocab=128, qk_norm=True,
                   qkv_bias=False, experts=8, topk=2, moe_ffn=16)],
        moe_held_out=[Shape(hidden=40, ffn=64, heads=2, kv_heads=1, head_dim=16, layers=2, vocab=128, qk_norm=True,
                            qkv_bias=False, experts=8, topk=4, moe_ffn=32)],
    ),
}

# grpo's loss settings (the launchers'): what `clipped_policy_loss` reads
LOSS_ARGS = dict(temperature=1.0, policy_loss="vanilla", clip_ratio=0.2, clip_ratio_high=None, dual_clip=None,
                 loss_agg_mode="token-mean", kl_penalty="low_var_kl", entropy_coeff=0.0, rollout_is="none",
                 rollout_is_threshold=2.0, gspo_clip_ratio=3e-4, gspo_clip_ratio_high=4e-4)
KL_COEF = 0.001
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),  # megatron's default recompute_modules: ["core_attn"]
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@dataclass(frozen=True)
class Case:
    """One measured training step (or pass): shape x levers x micro-batch."""

    shape: Shape
    seq: int  # the model row's length (packed: prompt + n responses)
    recompute: str = "none"
    attention: str = "local"
    layout: str = "row"  # "row" | "packed"
    group: int = 1  # samples of one prompt (packed: in one row; row: that many rows)
    kind: str = "train"  # "train" | "forward" (no-grad log-prob pass)
    tag: str = "main"  # main | fit | held_out | qk_norm | moe | moe_held_out | packed

    def rows_and_lengths(self):
        """(model rows, row length, prompt length, response length) of the micro-batch."""
        if self.layout == "packed" or self.group > 1:
            prompt, response = self.seq // 4, 3 * self.seq // (4 * self.group)
            if self.layout == "packed":
                return 1, prompt + self.group * response, prompt, response
            return self.group, prompt + response, prompt, response
        return 1, self.seq, self.seq // 2, self.seq - self.seq // 2

    @property
    def samples(self) -> int:
        """Samples in the micro-batch (a packed row holds `group` of them)."""
        return self.group if (self.layout == "packed" or self.group > 1) else 1

    @property
    def name(self) -> str:
        s = self.shape
        moe = f" E{s.experts}k{s.topk}f{s.moe_ffn}" if s.experts else ""
        return (f"{self.kind} {self.layout}{'' if self.group == 1 else f'x{self.group}'} s={self.seq} "
                f"{self.recompute} {self.attention} h{s.hidden} f{s.ffn} n{s.heads}/{s.kv_heads}x{s.head_dim} "
                f"L{s.layers} V{s.vocab}{' qkn' if s.qk_norm else ''}{moe}")


def sdpa_available() -> bool:
    """`build_model` takes an `attention` option (branch attn): then "sdpa" cases run."""
    from mindspeed_llm.models import build_model

    return "attention" in inspect.signature(build_model).parameters


def rough_case_bytes(case: Case, tp: int = 1) -> float:
    """A guess, on the high side, of a case's memory (peak + model state), to skip what the machine cannot hold
    before trying; calibrated on the default shape at 2k: the local attention's [rows, heads, s, s] elements
    cost 6 B saved per layer (none) and about 13 B in one layer's backward or a no-grad forward, a token about
    20 B per hidden unit + 14 B per FFN unit per saved layer, a read logit 6 B, a parameter 18 B."""
    s = case.shape
    rows, seq, _, response = case.rows_and_lengths()
    squares = rows * s.heads / tp * seq * seq if case.attention == "local" else 0.0
    tokens = rows * seq
    params = s.layers * (4 * s.hidden * s.q + 3 * s.hidden * max(s.ffn, s.topk * s.moe_ffn)) + 2 * s.vocab * s.hidden
    f_eff = max(s.ffn, s.topk * (s.moe_ffn + s.hidden))
    if case.kind == "forward":
        return squares * 14 + tokens * (20 * s.hidden + 14 * f_eff) + case.samples * response * s.vocab * 6 \
            + params * 2 + 0.3 * GB
    saved_layers = s.layers if case.recompute == "none" else 0
    layer_tokens = (s.layers if case.recompute != "full" else 1) * tokens
    return (squares * (6 * saved_layers + 13) + layer_tokens * (20 * s.hidden + 14 * f_eff) / tp
            + case.samples * response * s.vocab * 6 / tp + params * 18 / tp + 0.3 * GB)


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
    from mindspeed_llm.rl.engine import OptimizerSettings, TrainableModel

    overrides = dict(RECOMPUTE[case.recompute])
    if case.shape.experts:
        overrides.update(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.001)
    if case.attention != "local":
        overrides["attention"] = case.attention
    model = build_model(case.shape.spec(), params_dtype="bf16", **overrides).to(device.current_device())
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

    from mindspeed_llm.rl.batch_plan import MicroBatchPlan

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
    a storage saved from several layers (or a layer and the head, or by several checkpoints) is "shared"."""

    def __init__(self, regions: Regions, exclude_ptrs):
        self.regions = regions
        self.exclude = set(exclude_ptrs)
        self.active = False
        self.nbytes: Dict[int, int] = {}
        self.first: Dict[int, str] = {}
        self.layer_keys: Dict[int, set] = defaultdict(set)
        self.packs: Dict[int, int] = defaultdict(int)

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
                self.layer_keys[ptr].add(_layer_key(region))
                self.packs[ptr] += 1
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

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

    from mindspeed_llm.rl import engine
    from mindspeed_llm.rl.losses import clipped_policy_loss
    from mindspeed_llm.rl.passes import policy_logprobs

    rows, seq, prompt, response = case.rows_and_lengths()
    _clear_global_buffer()
    gc.collect()
    train = case.kind == "train"
    tm = build(case, trainable=train)
    model = tm.module if train else tm
    exp = synthetic_experience(case.samples, prompt, response, case.shape.vocab)
    plan, mb = micro_batch_of(case, exp)
    args = SimpleNamespace(**LOSS_ARGS, max_new_tokens=response)
    regions = Regions(model, markers=False)
    counter = SavedCounter(regions, _excluded_storages(tm))

    def loss_fn(output, micro_batch):
        with regions.region("logprob_loss"):
            loss, _ = clipped_policy_loss(args, output, micro_batch, KL_COEF)
        counter.active = False  # the forward ends here; the schedule's backward comes next
        if loss.requires_grad:
            loss.register_hook(regions.backward_started)
        return loss, {}

    def step():
        regions.in_backward = False
        if train:
            tm.ddp.train()
            tm.ddp.zero_grad_buffer()
            engine._run_schedule(tm.chunks, [mb], loss_fn, forward_only=False)
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
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    _, timeline = profile_memory(step, device_type)
    regions.close()
    result["global_buffer"] = _global_buffer_bytes()
    result["profiler_peak"] = timeline["peak"]
    if device_type == "cuda":
        result["cuda_peak"] = torch.cuda.max_memory_allocated() - before
    result["peak"] = result.get("cuda_peak", timeline["peak"]) + result["global_buffer"]
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


def measure_generate(shape: Shape, batch: int, prompt: int, new_tokens: int, device_type: str = "cpu") -> dict:
    """Peak of one rollout (`inference.generate`, megatron's static KV cache, batched prefill) of `batch` distinct
    prompts of `prompt` tokens generating exactly `new_tokens` tokens each (no EOS), and the KV cache's bytes by
    megatron's sizing: 2 (K, V) x layers x slots x batch x kv heads x head dim x 2 B."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.inference import SamplingConfig, generate

    _clear_global_buffer()
    gc.collect()
    model = build(Case(shape, prompt), trainable=False)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape.vocab, (batch, prompt), generator=gen).tolist()
    sampling = SamplingConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    _, timeline = profile_memory(lambda: generate(model, prompts, sampling), device_type)
    elapsed = time.perf_counter() - start
    slots = prompt + new_tokens
    kv_cache = 2 * shape.layers * slots * batch * shape.kv * 2
    peak = torch.cuda.max_memory_allocated() - before if device_type == "cuda" else timeline["peak"]
    del model
    gc.collect()
    return dict(shape=asdict(shape), batch=batch, prompt=prompt, new_tokens=new_tokens, slots=slots, peak=peak,
                kv_cache=kv_cache, prefill_working_set=peak - kv_cache, time_s=elapsed,
                device=str(device.current_device()))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_model_state(shape: Shape, distributed_optimizer: bool = False) -> dict:
    """Bytes per parameter of a trainable bf16 model after one optimizer step (weights, DDP grad buffer, the
    optimizer's fp32 main weights and Adam moments) and of a frozen bf16 model, each storage once."""
    import torch

    from mindspeed_llm.rl import roles

    gc.collect()
    case = Case(shape, 64)
    tm = build(case, trainable=False)
    tm = __import__("mindspeed_llm.rl.engine", fromlist=["x"]).TrainableModel(
        tm, __import__("mindspeed_llm.rl.engine", fromlist=["x"]).OptimizerSettings(
            lr=1e-6, params_dtype="bf16", use_distributed_optimizer=distributed_optimizer), name="actor")
    exp = synthetic_experience(1, 32, 32, shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = SimpleNamespace(**LOSS_ARGS, max_new_tokens=32)
    from mindspeed_llm.rl.losses import clipped_policy_loss

    tm.train_step([mb], lambda out, m: clipped_policy_loss(args, out, m, KL_COEF))
    params = list(tm.module.parameters())
    numel = sum(p.numel() for p in params)
    weights = storage_bytes(params)
    grad_buffers = storage_bytes([b.grad_data for b in tm.ddp.buffers + tm.ddp.expert_parallel_buffers])
    param_buffers = storage_bytes([getattr(b, "param_data", None) for b in tm.ddp.buffers
                                   + tm.ddp.expert_parallel_buffers])
    inner = [getattr(o, "optimizer", None) for o in getattr(tm.optimizer, "chained_optimizers", [tm.optimizer])]
    main, moments = [], []
    for opt in inner:
        if opt is None:
            continue
        for group in opt.param_groups:
            main.extend(p for p in group["params"] if p.dtype == torch.float32)
        for state in opt.state.values():
            moments.extend(v for k, v in state.items() if torch.is_tensor(v) and k != "step" and v.dim() > 0)
    main_bytes, moment_bytes = storage_bytes(main), storage_bytes(moments)
    result = dict(shape=asdict(shape), params=numel, distributed_optimizer=distributed_optimizer,
                  bytes=dict(weights=weights, param_buffer_extra=max(0, param_buffers - weights),
                             grad_buffer=grad_buffers, main_params=main_bytes, adam_moments=moment_bytes))
    result["bytes_per_param"] = {k: v / numel for k, v in result["bytes"].items()}
    result["bytes_per_param"]["total"] = sum(result["bytes"].values()) / numel
    del tm
    gc.collect()
    frozen = roles.frozen(build(case, trainable=False))
    result["frozen_bytes_per_param"] = storage_bytes(list(frozen.parameters())) / sum(
        p.numel() for p in frozen.parameters())
    del frozen
    gc.collect()
    return result


def _tp_worker(rank: int, world: int, port: int, cases: List[Case], queue) -> None:
    """One of the two gloo processes: the cases at TP2, then (TP1, DP2) the distributed optimizer's model state."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MINDSPEED_DEVICE="cpu")
    try:
        import torch

        torch.set_num_threads(1)
        init_process(2, port)
        results = [measure(case, "cpu", timing=False) for case in cases]
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        try:
            dist_opt = measure_model_state(cases[0].shape if cases else TOY_SHAPE, distributed_optimizer=True)
        except Exception as exc:  # it does not run on CPU yet in every branch: say why
            dist_opt = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        queue.put((rank, "ok", json.dumps(dict(cases=results, distributed_optimizer_dp2=dist_opt))))
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc()))


def run_tp2(cases: List[Case]) -> dict:
    """`cases` on two gloo processes at TP2 (rank 0's figures; both ranks hold the same shapes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, cases, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(2):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = json.loads(payload)
        else:
            errors.append(f"rank {rank}: {payload}")
            break
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    if errors:
        return {"error": "\n".join(errors)[-3000:]}
    return results[0]


def check_peak_method(device_type: str = "cpu") -> dict:
    """The profiler running-sum method on a scripted sequence whose peak is known: a, b live (3 MiB + 5 MiB), a freed,
    c (7 MiB) allocated -> peak 12 MiB; and a view adds nothing."""
    import torch

    from mindspeed_llm import device

    dev = device.current_device()

    def script():
        a = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
        b = torch.empty(5 << 20, dtype=torch.uint8, device=dev)
        del a
        c = torch.empty(7 << 20, dtype=torch.uint8, device=dev)
        view = c[: 1 << 20]
        del b, c, view

    _, timeline = profile_memory(script, device_type)
    return dict(expected=12 << 20, measured=timeline["peak"], end=timeline["end"])


def _rss_child(case_json: str, out_path: str) -> None:
    """In a fresh process: one cold training step of the case under the profiler (the peak method), and the rise of
    ru_maxrss over the resident size just before it."""
    import psutil
    import torch

    from mindspeed_llm.rl import engine
    from mindspeed_llm.rl.losses import clipped_policy_loss

    torch.set_num_threads(1)
    init_process(1)
    d = json.loads(case_json)
    case = Case(shape=Shape(**d.pop("shape")), **{k: v for k, v in d.items() if k != "name"})
    rows, seq, prompt, response = case.rows_and_lengths()
    tm = build(case, trainable=True)
    exp = synthetic_experience(case.samples, prompt, response, case.shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = SimpleNamespace(**LOSS_ARGS, max_new_tokens=response)
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step():
        tm.ddp.zero_grad_buffer()
        engine._run_schedule(tm.chunks, [mb], lambda o, m: (clipped_policy_loss(args, o, m, KL_COEF)[0], {}), False)

    _, timeline = profile_memory(step, "cpu")
    max_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out_path, "w") as f:
        json.dump(dict(profiler_peak=timeline["peak"], rss_before=rss_before, maxrss_before=max_before,
                       maxrss_after=max_after, rss_rise=max_after - rss_before,
                       rise_visible=max_after > max_before), f)


def check_peak_rss(case: Case) -> dict:
    """ru_maxrss of a fresh process over one step against the profiler's peak of the same case (its own process).
    The maximum RSS before the step (model building) must stay below the step's level for the rise to be seen; it
    is reported."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rss.json")
        code = ("import sys; sys.path.insert(0, %r); import benchmarks.memory as m; m._rss_child(%r, %r)"
                % (ROOT, json.dumps(case_dict(case)), out))
        env = dict(os.environ, MINDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        with open(out) as f:
            result = json.load(f)
    result["case"] = case.name
    return result


# ---------------------------------------------------------------------------------------------- micro-batching
def skewed_mix(samples: int, group: int, prompt_cap: int, response_cap: int, seed: int = 0):
    """The skewed length mix: 10% of the responses (rounded up) at the cap, the rest uniform in 10-50% of it; one
    prompt per group of `group` samples, uniform in 5-15% of the prompt cap (DeepScaleR-like short prompts).
    Returns (prompt lengths, response lengths), one per sample, a group's samples consecutive."""
    rng = random.Random(seed)
    at_cap = set(rng.sample(range(samples), math.ceil(samples / 10)))
    responses = [response_cap if i in at_cap else rng.randint(max(1, response_cap // 10), max(1, response_cap // 2))
                 for i in range(samples)]
    prompts = []
    for _ in range(samples // group):
        p = rng.randint(max(1, prompt_cap // 20), max(1, (3 * prompt_cap) // 20))
        prompts.extend([p] * group)
    return prompts, responses


def token_budget_micro_batches_local(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """LOCAL STAND-IN for the lead's token-budget micro-batches (`--max-tokens-per-micro-batch`, to land in
    rl/batch_plan.py): samples sorted by length, longest first; a micro-batch takes the next sample while
    (its rows + 1) x its longest row <= `budget` (rows at the micro-batch's own width); a sample longer than the
    budget goes alone. Returns lists of sample indices."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: List[List[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _cost(batches: List[List[int]], lengths: Sequence[int], width=None):
    """(processed tokens, attention work sum s^2, largest micro-batch tokens) of rows padded to `width` (None: each
    micro-batch's own longest)."""
    tokens = work = largest = 0
    for mb in batches:
        w = width if width is not None else max(lengths[i] for i in mb)
        tokens += len(mb) * w
        work += len(mb) * w * w
        largest = max(largest, len(mb) * w)
    return tokens, work, largest


def micro_batch_costs(prompts: Sequence[int], responses: Sequence[int], group: int, micro_batch_size: int,
                      budget: int, seed: int = 0) -> dict:
    """Processed tokens / real tokens and attention work (sum of s^2 over model rows) / real for today's
    micro-batches (`micro_batch_size` samples in the update's shuffled order, every one at the width of the whole
    local batch's longest sequence), own-length micro-batches (the same micro-batches, each at its own longest), and
    length-sorted token-budget micro-batches (`token_budget_micro_batches_local`); with prompt groups (group > 1)
    also the packed rows `[prompt | r1 .. rn]` (each response slot at the group's longest)."""
    lengths = [p + r for p, r in zip(prompts, responses)]
    real_tokens, real_work = sum(lengths), sum(s * s for s in lengths)
    rng = random.Random(seed)
    units = list(range(len(lengths) // group))
    rng.shuffle(units)  # ppo_loop deals prompt groups (units) to mini-batches in a drawn order
    order = [u * group + k for u in units for k in range(group)]
    chunks = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    modes = {
        "today": _cost(chunks, lengths, width=max(lengths)),
        "own_length": _cost(chunks, lengths),
        "token_budget": _cost(token_budget_micro_batches_local(lengths, budget), lengths),
    }
    if group > 1:
        packed = [prompts[g * group] + group * max(responses[g * group:(g + 1) * group])
                  for g in range(len(lengths) // group)]
        groups_per_mb = max(1, micro_batch_size // group)
        packed_chunks = [units[i:i + groups_per_mb] for i in range(0, len(units), groups_per_mb)]
        modes["packed_today"] = _cost(packed_chunks, packed, width=max(packed))
        modes["packed_token_budget"] = _cost(token_budget_micro_batches_local(packed, budget), packed)
    out = dict(samples=len(lengths), group=group, micro_batch_size=micro_batch_size, budget=budget,
               real_tokens=real_tokens, real_attention_work=real_work, longest=max(lengths),
               mean_length=real_tokens / len(lengths))
    for name, (tokens, work, largest) in modes.items():
        out[name] = dict(processed_tokens=tokens, tokens_ratio=tokens / real_tokens, attention_work=work,
                         attention_ratio=work / real_work, largest_micro_batch_tokens=largest)
    return out


# ---------------------------------------------------------------------------------------------- fit
# Per-token features of each part of a layer's saved bytes (TP=1): what each tensor's width is made of. "split"
# names the features that divide under tensor parallelism (the rest -- hidden-sized tensors, per-token scalars --
# stay replicated on every TP rank without sequence parallelism); checked against the TP2 measurement.
PART_FEATURES = {
    "norms": (("1", "h"), ()),
    "attention": (("1", "h", "q", "kv", "heads*s", "qk_norm*(q+kv)"), ("q", "kv", "heads*s", "qk_norm*(q+kv)")),
    "mlp": (("1", "h", "f"), ("f",)),
    "moe_mlp": (("1", "h", "E", "topk*h", "topk*f_moe"), ()),  # experts split by EP; per routed token alike
    "layer": (("1", "h"), ()),
    "checkpoint": (("1", "h"), ()),
}
# Bytes per micro-batch of one layer's working set (`summarize_phases`), as sums over its tokens / rows, and the
# sizes of its largest weights (fc1: 2 x FFN x h, qkv: h x (q + 2 kv) elements), whose bf16 gradient exists until
# DDP adds it to the fp32 buffer (without recompute; selective and full recompute add the recomputed saved set,
# see `predict_working_set`).
WORKING_SET_FEATURES = (("tokens*h", "tokens*q", "tokens*f", "tokens*topk*h", "rows*heads*s^2", "w_fc1", "w_qkv"),
                        ("tokens*q", "tokens*f", "rows*heads*s^2", "w_fc1", "w_qkv"))
# Bytes per micro-batch of the head (final norm, output layer, log-probs, loss): per token of the micro-batch, per
# read position (rows x response), and the output layer's weight gradient (bf16 V x h before DDP adds it to the
# fp32 buffer); the log-prob kernel's fp32 work buffer is computed (`logprob_work_bytes`), not fitted.
HEAD_FEATURES = (("tokens*h", "read*h", "read*V", "V*h"), ("read*V", "V*h"))
def feature_values(shape: Shape, seq: int, tp: int = 1, rows: int = 1, ep: int = 1, read: int = 0) -> Dict[str, float]:
    """Every feature's value for `shape` at row length `seq`, `rows` model rows and `read` read positions."""
    s = shape
    f_eff = s.topk * s.moe_ffn if s.experts else s.ffn
    tokens = rows * seq
    values = {"1": 1.0, "h": s.hidden, "q": s.q, "kv": s.kv, "heads*s": s.heads * seq,
              "qk_norm*(q+kv)": (s.q + s.kv) if s.qk_norm else 0.0, "f": s.ffn, "E": s.experts,
              "topk*h": s.topk * s.hidden, "topk*f_moe": s.topk * s.moe_ffn, "V": s.vocab,
              "tokens": tokens, "tokens*h": tokens * s.hidden, "tokens*q": tokens * s.q, "tokens*f": tokens * f_eff,
              "tokens*topk*h": tokens * s.topk * s.hidden, "rows*heads*s^2": rows * s.heads * seq * seq,
              "read*h": read * s.hidden, "read*V": read * s.vocab, "V*h": s.vocab * s.hidden,
              "w_fc1": 2 * (s.moe_ffn if s.experts else s.ffn) * s.hidden, "w_qkv": s.hidden * (s.q + 2 * s.kv)}
    return values


def _tp_divide(values: Dict[str, float], split: Sequence[str], tp: int) -> Dict[str, float]:
    return {k: (v / tp if k in split else v) for k, v in values.items()}


def lstsq(rows: List[List[float]], targets: List[float], relative: bool = True):
    """Least squares with non-negative coefficients: the most negative feature is dropped and the rest refitted
    until none is negative (every feature is a tensor size; bytes per element cannot be negative). `relative`:
    each row weighed by 1 / its target (small shapes count as much as large ones), else absolute errors (the
    largest cases, the regime the projection extrapolates to, dominate)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    coef = np.zeros(a.shape[1]) if a.ndim == 2 else np.zeros(0)
    if not len(a):
        return coef.tolist()
    weight = 1.0 / np.maximum(np.abs(b), 1.0) if relative else np.ones_like(b)
    used = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    while used:
        cols = a[:, used] * weight[:, None]
        scale = np.abs(cols).max(axis=0)
        solution, *_ = np.linalg.lstsq(cols / scale, b * weight, rcond=None)
        solution = solution / scale
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[used] = solution
            break
        worst = int(np.argmin(solution))
        used = [j for k, j in enumerate(used) if k != worst]
    return coef.tolist()


def _predict(coef: Dict[str, float], values: Dict[str, float]) -> float:
    return sum(c * values[k] for k, c in coef.items())


def part_of(shape: Shape, part: str) -> str:
    return "moe_mlp" if part == "mlp" and shape.experts else part


def logprob_work_bytes(read: int, vocab_shard: int, device_type: str = "cpu") -> float:
    """`vocab_parallel_logprobs`' two fp32 chunk buffers (its forward and its backward each allocate them):
    2 x rows x V/TP x 4 B, rows = CHUNK_ELEMENTS // (V/TP) capped at the tokens (rl/logprobs.py)."""
    elements = (1 << 20) if device_type == "cpu" else (1 << 24)
    rows = max(1, min(read, elements // max(1, vocab_shard)))
    return 2.0 * rows * vocab_shard * 4


def _fit_rows(cases, names, target):
    rows, targets = [], []
    for c in cases:
        shape = Shape(**c["case"]["shape"])
        values = feature_values(shape, c["seq"], rows=c["rows"], read=c.get("read", c["rows"] * c["response"]))
        rows.append([values[n] for n in names])
        targets.append(target(c, shape))
    return rows, targets


def fit_model(cases: List[dict]) -> dict:
    """Least-squares coefficients (`lstsq`) of each saved part (per token per layer, by recompute mode), of one
    layer's working set without recompute (per micro-batch; train and no-grad forward; dense and MoE) and of the
    head (per micro-batch), from the measured cases tagged main / fit / qk_norm / moe in the row layout; held-out
    and packed cases are predicted, not fitted."""
    fitted = [c for c in cases if c["case"]["tag"] in ("main", "fit", "qk_norm", "moe") and "saved" in c
              and c["case"]["layout"] == "row" and c["case"]["group"] == 1]
    coefficients: Dict[str, dict] = {}
    for mode in RECOMPUTE:
        train = [c for c in fitted if c["case"]["recompute"] == mode and c["case"]["kind"] == "train"]
        for part, (names, _split) in PART_FEATURES.items():
            key = "mlp" if part == "moe_mlp" else part
            group = [c for c in train if part_of(Shape(**c["case"]["shape"]), key) == part]
            if group:
                rows, targets = _fit_rows(group, names, lambda c, shape: c["per_layer"].get(key, 0.0))
                coefficients[f"saved.{mode}.{part}"] = dict(zip(names, lstsq(rows, targets)))
    for kind, phase in (("train", "bwd_layer"), ("forward", "fwd_layer")):
        for moe in (False, True):
            group = [c for c in fitted if c["case"]["recompute"] == "none" and c["case"]["kind"] == kind
                     and bool(c["case"]["shape"]["experts"]) == moe]
            if group:
                rows, targets = _fit_rows(group, WORKING_SET_FEATURES[0], lambda c, shape: c["phases"][phase])
                name = f"working_set.{kind}{'.moe' if moe else ''}"
                coefficients[name] = dict(zip(WORKING_SET_FEATURES[0], lstsq(rows, targets, relative=False)))

    def head_saved(c):
        return c["per_layer"].get("head", 0.0) * c["tokens"]

    def work(c, shape):
        return logprob_work_bytes(c.get("read", c["rows"] * c["response"]), shape.vocab)

    train = [c for c in fitted if c["case"]["kind"] == "train"]
    forward = [c for c in fitted if c["case"]["kind"] == "forward"]
    for name, group, target in (
            ("head_saved", train, lambda c, shape: head_saved(c)),
            ("head_backward.train", train, lambda c, shape: max(0.0, head_saved(c) + c["phases"]["bwd_head"]
                                                                - work(c, shape))),
            ("head_forward.train", train, lambda c, shape: max(0.0, c["phases"]["fwd_head"] - work(c, shape))),
            ("head_forward.forward", forward, lambda c, shape: max(0.0, c["phases"]["fwd_head"] - work(c, shape)))):
        if group:
            rows, targets = _fit_rows(group, HEAD_FEATURES[0], target)
            coefficients[name] = dict(zip(HEAD_FEATURES[0], lstsq(rows, targets, relative=name == "head_saved")))
    return coefficients


def predict_layer_saved(coef: dict, shape: Shape, mode: str, seq: int, tp: int = 1) -> Dict[str, float]:
    """Saved bytes per token per layer by part at TP `tp` (the split features divided by `tp`)."""
    out = {}
    for part in ("norms", "attention", "mlp", "layer", "checkpoint"):
        name = part_of(shape, part)
        c = coef.get(f"saved.{mode}.{name}")
        if c is None:
            continue
        out[part] = max(0.0, _predict(c, _tp_divide(feature_values(shape, seq), PART_FEATURES[name][1], tp)))
    out["layer_total"] = sum(out.values())
    return out


def predict_working_set(coef: dict, shape: Shape, kind: str, mode: str, seq: int, rows: int, tp: int = 1) -> float:
    """One layer's working set (bytes above the live memory when it starts): fitted without recompute; a
    recomputed layer's backward also rebuilds what recompute did not save (full: the whole layer's saved set;
    selective: the core attention's), checked against the measured selective / full cases (`check_fit`)."""
    c = coef.get(f"working_set.{kind}{'.moe' if shape.experts else ''}") or coef.get(f"working_set.{kind}")
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, seq, rows=rows), WORKING_SET_FEATURES[1], tp)
    ws = max(0.0, _predict(c, values))
    if kind == "train" and mode != "none":
        none = predict_layer_saved(coef, shape, "none", seq, tp)["layer_total"]
        kept = predict_layer_saved(coef, shape, mode, seq, tp)["layer_total"] if mode == "selective" else 0.0
        ws += max(0.0, none - kept) * rows * seq
    return ws


def predict_head(coef: dict, name: str, shape: Shape, tokens: int, read: int, tp: int = 1,
                 device_type: str = "cpu") -> float:
    """A head part's bytes for one micro-batch (the log-prob work buffer of `device_type` added to working sets)."""
    c = coef.get(name)
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, tokens, read=read), HEAD_FEATURES[1], tp)
    values["tokens*h"] = tokens * shape.hidden
    fitted = max(0.0, _predict(c, values))
    return fitted if name == "head_saved" else fitted + logprob_work_bytes(read, shape.vocab // tp, device_type)


def shared_bytes(shape: Shape, rows: int, seq: int, packed: bool) -> float:
    """What every layer reads but is stored once per micro-batch: the rotary table indexed by position ids
    ([s, rows, 1, head dim] fp32), the packed mask ([rows, 1, s, s] bool) or megatron's cached causal mask
    ([s, s] bool), and the token ids the embedding saves (int64)."""
    return rows * seq * shape.head_dim * 4 + (rows if packed else 1) * seq * seq + rows * seq * 8


def predict_peak(coef: dict, shape: Shape, mode: str, seq: int, rows: int, read: int, kind: str = "train",
                 tp: int = 1, packed: bool = False, layers: Optional[int] = None, head: bool = True,
                 attention: str = "local", device_type: str = "cpu") -> Dict[str, float]:
    """One micro-batch's activation peak from the fitted parts: saved layers + shared + the largest of (head saved
    + its backward, the head's forward, one layer's backward), plus megatron's global buffer (local attention)."""
    layers = shape.layers if layers is None else layers
    tokens = rows * seq
    buffer = rows * shape.heads / tp * seq * seq * 2 if attention == "local" else 0.0
    if kind == "forward":
        ws = predict_working_set(coef, shape, "forward", "none", seq, rows, tp)
        head_fwd = predict_head(coef, "head_forward.forward", shape, tokens, read, tp, device_type) if head else 0.0
        return dict(saved=0.0, transient=max(ws, head_fwd), global_buffer=buffer, peak=max(ws, head_fwd) + buffer)
    per_token = predict_layer_saved(coef, shape, mode, seq, tp)["layer_total"]
    saved = layers * per_token * tokens + shared_bytes(shape, rows, seq, packed)
    head_saved = predict_head(coef, "head_saved", shape, tokens, read, tp) if head else 0.0
    candidates = [predict_working_set(coef, shape, "train", mode, seq, rows, tp)]
    if head:
        candidates += [predict_head(coef, "head_backward.train", shape, tokens, read, tp, device_type),
                       predict_head(coef, "head_forward.train", shape, tokens, read, tp, device_type)]
    transient = max(candidates)
    return dict(saved=saved + head_saved, head_saved=head_saved, transient=transient, global_buffer=buffer,
                peak=saved + transient + buffer)


def check_fit(coef: dict, cases: List[dict]) -> List[dict]:
    """Measured against predicted, per case: saved bytes per token per layer, and the step's peak."""
    out = []
    for c in cases:
        if "saved" not in c:
            continue
        shape, case = Shape(**c["case"]["shape"]), c["case"]
        entry = dict(name=case["name"], tag=case["tag"], kind=case["kind"])
        if case["kind"] == "train":
            predicted = predict_layer_saved(coef, shape, case["recompute"], c["seq"])["layer_total"]
            measured = c["per_layer"]["layer_total"]
            entry.update(saved_per_layer_token=measured, predicted=predicted,
                         error=(predicted - measured) / measured if measured else 0.0)
        peak = predict_peak(coef, shape, case["recompute"], c["seq"], c["rows"],
                            c.get("read", c["rows"] * c["response"]), case["kind"],
                            packed=case["layout"] == "packed")["peak"]
        entry.update(peak=c["peak"], predicted_peak=peak, peak_error=(peak - c["peak"]) / c["peak"])
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------- projection
def param_counts(shape: Shape, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0,
                 value_head: bool = False) -> Dict[str, float]:
    """Parameters one rank holds at pipeline stage `stage`: dense (attention, norms, embeddings, dense MLPs,
    routers) and expert (its E / EP experts' MLPs), as megatron lays them out (q/k/v/o, fc1 and fc2 split by TP;
    norms, routers replicated; the embedding on the first stage, the output layer on the last -- a tied output
    layer is a second copy only when PP > 1; a value head is h weights)."""
    s = shape
    layers = s.layers // pp
    attention = (2 * s.hidden * s.q + 2 * s.hidden * s.kv + ((s.q + 2 * s.kv) if s.qkv_bias else 0)) / tp
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    dense_mlp, expert = 0.0, 0.0
    if s.experts:
        dense_mlp = s.experts * s.hidden  # router
        expert = layers * (s.experts // ep) * 3 * s.hidden * s.moe_ffn
    else:
        dense_mlp = 3 * s.hidden * s.ffn / tp
    dense = layers * (attention + norms + dense_mlp)
    first, last = stage == 0, stage == pp - 1
    if first:
        dense += s.vocab * s.hidden / tp
    if last:
        dense += s.hidden  # final norm
        if value_head:
            dense += s.hidden
        elif not s.tied or pp > 1:
            dense += s.vocab * s.hidden / tp
    return dict(dense=dense, expert=expert, total=dense + expert)


@dataclass
class Role:
    name: str
    shape: Shape
    trainable: bool
    value_head: bool
    offloadable: bool  # --offload-ref-reward applies (reference, reward model)


@dataclass
class Launch:
    """What the projection reads from a launcher (through its own command line and `parse_args`)."""

    name: str
    stage: str
    world: int
    tp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int
    micro_batch_size: int
    global_batch_size: int
    n_samples: int
    prompt_cap: int
    response_cap: int
    max_length: int
    mini_batch: int  # samples per optimizer step over all DP ranks
    distributed_optimizer: bool
    offload_ref_reward: bool
    routing_replay: bool
    roles: List[Role]
    flags: Dict[str, object] = field(default_factory=dict)

    @property
    def rollout_rows(self) -> int:
        return self.global_batch_size * self.n_samples // self.dp

    @property
    def unique_prompts(self) -> int:
        return self.global_batch_size // self.dp


def read_launcher(path: str) -> Launch:
    """Runs the launcher with a stub in place of python (as tests/test_examples.py does) at its own default node
    count, 8 devices a node (launch_env.sh), and parses the posttrain command line with the real parser."""
    from mindspeed_llm.arguments import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        stub, record = os.path.join(tmp, "stub.py"), os.path.join(tmp, "argv.json")
        with open(stub, "w") as f:
            f.write("import json, sys\njson.dump(sys.argv[2:], open(sys.argv[1], 'w'))\n")
        env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NPUS_PER_NODE", "NODE_RANK", "TP", "PP",
                                                                "EP", "MASTER_ADDR", "CURRENT_IP")}
        env.update(PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=os.path.join(tmp, "log"), NODE_RANK="0",
                   MASTER_ADDR="10.0.0.1")
        proc = subprocess.run(["bash", os.path.join(ROOT, path)], cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{path}: {proc.stderr[-1000:]}")
        with open(record) as f:
            argv = json.load(f)
    world = int(argv[argv.index("--nproc_per_node") + 1]) * int(argv[argv.index("--nnodes") + 1])
    posttrain = argv[argv.index("posttrain_gpt.py") + 1:]
    args = parse_args(posttrain, world_size=world)
    info = LAUNCHERS[path]
    shape, rm_shape = model_shape(info["model"]), model_shape(info["reward_model"])
    roles = [Role("actor", shape, True, False, False)]
    if args.stage == "grpo":
        if args.kl_coef > 0:
            roles.append(Role("reference", shape, False, False, True))
        if args.reward_model:
            roles.append(Role("reward", rm_shape, False, True, True))
    else:
        roles.append(Role("reference", shape, False, False, True))
        roles.append(Role("critic", rm_shape, True, True, False))
        if args.reward_model_weight != 0 or not args.verifier_function:
            roles.append(Role("reward", rm_shape, False, True, True))
    n = args.n_samples_per_prompt or 1
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size
    flags = {k: getattr(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                           "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
                                           "n_samples_per_prompt", "max_prompt_length", "max_new_tokens",
                                           "max_length", "ppo_mini_batch_size", "use_distributed_optimizer",
                                           "offload_ref_reward", "recompute_granularity", "kl_coef",
                                           "reward_model_weight")}
    return Launch(name=path, stage=args.stage, world=world, tp=tp, pp=pp, ep=ep, dp=args.data_parallel_size,
                  expert_dp=world // (pp * ep * etp), micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, n_samples=n,
                  prompt_cap=args.max_prompt_length or (args.max_length - args.max_new_tokens),
                  response_cap=args.max_new_tokens, max_length=args.max_length,
                  mini_batch=args.ppo_mini_batch_size, distributed_optimizer=bool(args.use_distributed_optimizer),
                  offload_ref_reward=bool(args.offload_ref_reward),
                  routing_replay=bool(getattr(args, "moe_routing_replay", False)), roles=roles, flags=flags)


@dataclass(frozen=True)
class Levers:
    """One parameter per lever of the projection."""

    recompute: str = "none"  # none | selective | full
    recompute_layers: Optional[int] = None  # full: layers per stage recomputed (block method); None: all
    attention: str = "local"  # local (measured) | sdpa_bound (computed: no [s, s] tensor anywhere; pending)
    distributed_optimizer: bool = False
    offload_ref_reward: bool = False
    offload_train_state: bool = False  # grads and optimizer state off the device during the rollout (modelstate)
    micro_batch_tokens: Optional[int] = None  # token-budget micro-batches; None: today's (mbs rows at the cap)
    rollout_rows: Optional[int] = None  # rows generated at a time (KV cache rows); None: the whole local rollout
    expert_parallel: Optional[int] = None  # a mixture of experts' EP (None: the launcher's)

    def label(self) -> str:
        parts = [self.attention if self.attention != "local" else "",
                 {"none": "", "selective": "recompute selective"}.get(self.recompute, "")]
        if self.recompute == "full":
            parts.append("recompute full" + (f" {self.recompute_layers}/stage" if self.recompute_layers else ""))
        parts += ["dist-opt" if self.distributed_optimizer else "", "offload-ref" if self.offload_ref_reward else "",
                  "offload-train-state" if self.offload_train_state else "",
                  f"budget {self.micro_batch_tokens}" if self.micro_batch_tokens else "",
                  f"rollout rows {self.rollout_rows}" if self.rollout_rows else "",
                  f"EP{self.expert_parallel}" if self.expert_parallel else ""]
        return ", ".join(p for p in parts if p) or "as launched"


def _no_squares(coef: dict) -> dict:
    """The SDPA bound: the fitted coefficients without the local attention's s^2 terms."""
    out = {}
    for name, c in coef.items():
        out[name] = {k: (0.0 if k in ("heads*s", "rows*heads*s^2") else v) for k, v in c.items()}
    return out


def role_state_bytes(role: Role, launch: Launch, levers: Levers, stage: int, phase: str,
                     in_its_pass: bool = False) -> float:
    """One role's model-state bytes on one rank of `stage` in `phase` (rollout | passes | train): trainable =
    2 (bf16 weights) + 4 (fp32 grad buffer) + 12 (fp32 main weights and two Adam moments), the 12 divided over DP
    (expert DP for experts) with the distributed optimizer; frozen = 2; offloaded frozen models count only in their
    own pass; with offload_train_state a trained model keeps only its weights during the rollout."""
    counts = param_counts(role.shape, launch.tp, launch.pp, launch.ep, stage, role.value_head)
    if not role.trainable:
        offloaded = role.offloadable and levers.offload_ref_reward and not in_its_pass
        return 0.0 if offloaded else 2.0 * counts["total"]
    if phase == "rollout" and levers.offload_train_state:
        return 2.0 * counts["total"]
    distributed = levers.distributed_optimizer
    dense = counts["dense"] * (6 + 12 / (launch.dp if distributed else 1))
    expert = counts["expert"] * (6 + 12 / (launch.expert_dp if distributed else 1))
    return dense + expert


def _train_micro_batch(launch: Launch, levers: Levers):
    """(rows, row length) of the largest training micro-batch: today every micro-batch has `mbs` rows at the local
    batch's longest sequence (taken at the cap: some response reaches it); with a token budget, as many rows at
    the cap as fit in it (at least one)."""
    length = launch.prompt_cap + launch.response_cap
    if levers.micro_batch_tokens:
        return max(1, levers.micro_batch_tokens // length), length
    return launch.micro_batch_size, length


def project(launch: Launch, coef: dict, levers: Levers) -> dict:
    """Per-device bytes of each phase at the worst pipeline stage: the rollout (model states + KV cache + the
    prefill's or a decode step's working set), the forward-only passes (old / reference log-probs, values, scores:
    states + one micro-batch's forward working set, the on-loaded frozen model with --offload-ref-reward) and the
    update (states + the micro-batches in flight under 1F1B + one backward's working set)."""
    c = _no_squares(coef) if levers.attention == "sdpa_bound" else coef
    attention = "none" if levers.attention == "sdpa_bound" else "local"
    if levers.expert_parallel:
        launch = replace(launch, ep=levers.expert_parallel,
                         expert_dp=launch.world // (launch.pp * levers.expert_parallel))
    policy = launch.roles[0].shape
    stages = sorted({0, launch.pp - 1})
    result = dict(levers=asdict(levers), label=levers.label(), stages={})
    for stage in stages:
        layers = policy.layers // launch.pp
        last = stage == launch.pp - 1
        states = {phase: {r.name: role_state_bytes(r, launch, levers, stage, phase) for r in launch.roles}
                  for phase in ("rollout", "passes", "train")}
        # rollout: KV cache of this stage's layers for every row generated at a time, + prefill or decode
        rows = levers.rollout_rows or launch.rollout_rows
        prompts = max(1, math.ceil(rows / launch.n_samples))  # repeated prompts are prefilled once
        slots = launch.prompt_cap + launch.response_cap
        kv_heads = max(1, policy.kv_heads // launch.tp)
        kv_cache = 2 * layers * slots * rows * kv_heads * policy.head_dim * 2
        prefill = predict_working_set(c, policy, "forward", "none", launch.prompt_cap, prompts, launch.tp)
        prefill_buffer = prompts * policy.heads / launch.tp * launch.prompt_cap ** 2 * 2 if attention == "local" else 0
        # a decode step on accelerators: megatron repeat_interleaves one layer's K and V cache to all query heads
        # (the CPU patch that avoids it is CPU-only), and samples from [rows, V] logits (bf16, fp32 copy, probs)
        decode = (2 * slots * rows * (policy.heads // launch.tp) * policy.head_dim * 2
                  + (rows * policy.vocab * 10 if last else 0))
        # passes: one micro-batch's forward (no grad) at today's micro-batch
        mb_rows, mb_len = _train_micro_batch(launch, levers)
        read = mb_rows * launch.response_cap
        passes = predict_peak(c, policy, "none", mb_len, mb_rows, read, kind="forward", tp=launch.tp,
                              layers=layers, head=last, attention=attention, device_type=ACCELERATOR)
        # update: micro-batches in flight on this stage under 1F1B, each with its saved activations
        micro_batches = max(1, launch.mini_batch // launch.dp // launch.micro_batch_size)
        in_flight = min(launch.pp - stage, micro_batches)
        full_layers = (layers if levers.recompute_layers is None else min(layers, levers.recompute_layers)) \
            if levers.recompute == "full" else 0
        other = levers.recompute if levers.recompute != "full" else "none"
        tokens = mb_rows * mb_len
        per_token = {mode: predict_layer_saved(c, policy, mode, mb_len, launch.tp)["layer_total"]
                     for mode in (other, "full")}
        saved = tokens * ((layers - full_layers) * per_token[other] + full_layers * per_token["full"])
        saved += shared_bytes(policy, mb_rows, mb_len, False)
        candidates = []
        if layers - full_layers:
            candidates.append(predict_working_set(c, policy, "train", other, mb_len, mb_rows, launch.tp))
        if full_layers:  # a recomputed layer's backward: its recomputed saved set + the backward's working set
            candidates.append(predict_working_set(c, policy, "train", "full", mb_len, mb_rows, launch.tp))
        if last:
            saved += predict_head(c, "head_saved", policy, tokens, read, launch.tp)
            candidates += [predict_head(c, "head_backward.train", policy, tokens, read, launch.tp, ACCELERATOR),
                           predict_head(c, "head_forward.train", policy, tokens, read, launch.tp, ACCELERATOR)]
        transient = max(candidates)
        train_buffer = mb_rows * policy.heads / launch.tp * mb_len ** 2 * 2 if attention == "local" else 0
        buffer = max(prefill_buffer, train_buffer, passes["global_buffer"])  # kept once allocated
        offloaded_pass = max([2.0 * param_counts(r.shape, launch.tp, launch.pp, launch.ep, stage, r.value_head)["total"]
                              for r in launch.roles if r.offloadable and levers.offload_ref_reward] or [0.0])
        phases = {
            "rollout": dict(states=sum(states["rollout"].values()), kv_cache=kv_cache,
                            working_set=max(prefill, decode), global_buffer=buffer),
            "passes": dict(states=sum(states["passes"].values()) + offloaded_pass,
                           working_set=passes["transient"], global_buffer=buffer),
            "train": dict(states=sum(states["train"].values()), activations_in_flight=in_flight * saved,
                          in_flight=in_flight, working_set=transient, global_buffer=buffer),
        }
        for phase in phases.values():
            phase["total"] = sum(v for k, v in phase.items() if k not in ("in_flight",))
        result["stages"][stage] = dict(phases=phases, states_by_role=states["train"], prefill=prefill,
                                       decode=decode, micro_batch=dict(rows=mb_rows, length=mb_len),
                                       micro_batches_per_step=micro_batches)
    for phase in ("rollout", "passes", "train"):
        result[phase] = max(result["stages"][s]["phases"][phase]["total"] for s in stages)
    return result


def lever_changes(launch: Launch, levers: Levers) -> List[str]:
    """What `levers` change against the launcher, as flags where the flag exists."""
    layers = launch.roles[0].shape.layers // launch.pp
    out = []
    if levers.recompute == "selective":
        out.append("--recompute-granularity selective")
    elif levers.recompute == "full":
        k = levers.recompute_layers or layers
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" if k >= layers
                   else f"--recompute-granularity full --recompute-method block --recompute-num-layers {k}")
    if levers.distributed_optimizer and not launch.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    if levers.offload_ref_reward and not launch.offload_ref_reward:
        out.append("--offload-ref-reward")
    if levers.offload_train_state:
        out.append("offload grads + optimizer state during the rollout (branch modelstate)")
    if levers.micro_batch_tokens:
        out.append(f"--max-tokens-per-micro-batch {levers.micro_batch_tokens}")
    if levers.rollout_rows:
        out.append(f"generate {levers.rollout_rows} rows at a time (KV cache of {levers.rollout_rows} rows of "
                   f"{launch.rollout_rows}; no flag yet)")
    if levers.expert_parallel and levers.expert_parallel != launch.ep:
        out.append(f"EP={levers.expert_parallel}")
    if levers.attention == "sdpa_bound":
        out.append("SDPA attention (branch attn; computed bound, not measured)")
    return out


def recommend(launch: Launch, coef: dict, limit_gb: float = TARGET_TRAIN_GB) -> dict:
    """The cheapest levers under which the update, the passes and the rollout each fit `limit_gb`: the distributed
    optimizer wherever DP > 1 (it costs no extra communication volume), then the recompute ladder (none, selective,
    full recompute of k layers per stage, smallest k first), first without and then with --offload-ref-reward, then
    (mixtures of experts) larger EP; with all of it not enough, the same with the SDPA bound. Then the largest token
    budget (1, 2, 4 or 8 rows at the cap) that keeps the update within the limit, and for the rollout the rows in
    flight (halving), first without and then with the training state's offload. Recompute is not offered with
    --moe-routing-replay (refused together)."""
    layers = launch.roles[0].shape.layers // launch.pp
    base = dict(distributed_optimizer=launch.distributed_optimizer or launch.dp > 1 or launch.expert_dp > 1,
                offload_ref_reward=launch.offload_ref_reward)
    state_options = [dict(base)]
    if any(r.offloadable for r in launch.roles) and not base["offload_ref_reward"]:
        state_options.append(dict(base, offload_ref_reward=True))
    experts = launch.roles[0].shape.experts
    if experts:  # a larger EP (a divisor of the experts that the world divides into) shards the experts' state
        eps = [ep for ep in range(launch.ep * 2, min(experts, launch.world // launch.pp) + 1)
               if experts % ep == 0 and launch.world % (launch.pp * ep) == 0]
        state_options += [dict(state_options[-1], expert_parallel=ep) for ep in eps]
    recompute = [dict(recompute="none")]
    if not launch.routing_replay:
        recompute += [dict(recompute="selective")] + [dict(recompute="full", recompute_layers=k)
                                                      for k in range(1, layers + 1)]
    limit = limit_gb * GB
    chosen, notes = None, []
    for attention in ("local", "sdpa_bound"):
        for state in state_options:
            for rc in recompute:
                levers = Levers(**state, **rc, attention=attention)
                p = project(launch, coef, levers)
                if p["train"] <= limit and p["passes"] <= limit:
                    chosen = levers
                    break
            if chosen:
                break
        if chosen:
            break
    if chosen is None:
        chosen = Levers(**state_options[-1], **recompute[-1], attention="sdpa_bound")
        notes.append(f"the update does not fit {limit_gb:g} GB with any of these levers, SDPA included")
    elif chosen.attention != "local":
        notes.append("only with SDPA (computed bound): local attention does not fit with any other lever")
    cap = launch.prompt_cap + launch.response_cap
    for rows in (8, 4, 2):  # more rows per micro-batch: fewer, larger steps, as long as the update fits
        candidate = replace(chosen, micro_batch_tokens=rows * cap)
        if rows > launch.micro_batch_size and project(launch, coef, candidate)["train"] <= limit:
            chosen = candidate
            break
    else:  # today's rows, each micro-batch cut to its own samples (the same peak, less padding)
        chosen = replace(chosen, micro_batch_tokens=cap * launch.micro_batch_size)
    total = launch.rollout_rows
    for offload in (False, True):
        r = total
        while r >= 1:
            candidate = replace(chosen, offload_train_state=offload, rollout_rows=None if r == total else r)
            if project(launch, coef, candidate)["rollout"] <= limit:
                break
            r //= 2
        if r >= 1:
            chosen = candidate
            break
    else:
        notes.append(f"the rollout does not fit {limit_gb:g} GB even one row at a time")
    p = project(launch, coef, chosen)
    return dict(levers=asdict(chosen), label=chosen.label(), changes=lever_changes(launch, chosen),
                rollout_gb=p["rollout"] / GB, passes_gb=p["passes"] / GB, train_gb=p["train"] / GB, notes=notes)


LEVER_ROWS = [
    ("as launched", {}),
    ("+ dist-opt", dict(distributed_optimizer=True)),
    ("+ dist-opt, selective", dict(distributed_optimizer=True, recompute="selective")),
    ("+ dist-opt, full", dict(distributed_optimizer=True, recompute="full")),
    ("+ dist-opt, full, offload-ref", dict(distributed_optimizer=True, recompute="full", offload_ref_reward=True)),
    ("+ dist-opt, full, offload-ref, offload-train-state", dict(distributed_optimizer=True, recompute="full",
                                                                offload_ref_reward=True, offload_train_state=True)),
    ("+ dist-opt, budget = 1 row at the cap", dict(distributed_optimizer=True, micro_batch_tokens="cap")),
    ("+ dist-opt, rollout rows / 2", dict(distributed_optimizer=True, rollout_rows="half")),
    ("+ dist-opt, SDPA bound (computed)", dict(distributed_optimizer=True, attention="sdpa_bound")),
    ("+ dist-opt, SDPA bound, full", dict(distributed_optimizer=True, attention="sdpa_bound", recompute="full")),
]
MOE_LEVER_ROWS = [
    ("+ dist-opt, offload-ref, EP x2", dict(distributed_optimizer=True, offload_ref_reward=True, expert_parallel="x2")),
]


def project_launchers(coef: dict, launchers: Sequence[str]) -> dict:
    out = {}
    for path in launchers:
        launch = read_launcher(path)
        base = dict(distributed_optimizer=launch.distributed_optimizer, offload_ref_reward=launch.offload_ref_reward)
        rows = []
        experts = launch.roles[0].shape.experts
        for label, extra in LEVER_ROWS + (MOE_LEVER_ROWS if experts else []):
            extra = dict(extra)
            if extra.get("micro_batch_tokens") == "cap":
                extra["micro_batch_tokens"] = launch.prompt_cap + launch.response_cap
            if extra.get("rollout_rows") == "half":
                extra["rollout_rows"] = max(1, launch.rollout_rows // 2)
            if extra.get("expert_parallel") == "x2":
                if experts % (2 * launch.ep) or launch.world % (launch.pp * 2 * launch.ep):
                    continue
                extra["expert_parallel"] = 2 * launch.ep
            levers = Levers(**dict(base, **extra))
            note = ("needs --moe-routing-replay dropped (it refuses recompute)"
                    if launch.routing_replay and levers.recompute != "none" else "")
            p = project(launch, coef, levers)
            rows.append(dict(label=label, note=note, levers=asdict(levers), rollout_gb=p["rollout"] / GB,
                             passes_gb=p["passes"] / GB, train_gb=p["train"] / GB,
                             stages={str(s): {ph: {k: (v / GB if k != "in_flight" else v) for k, v in d.items()}
                                              for ph, d in st["phases"].items()}
                                     for s, st in p["stages"].items()},
                             states_by_role_gb={str(s): {k: v / GB for k, v in st["states_by_role"].items()}
                                                for s, st in p["stages"].items()}))
        model = LAUNCHERS[path]["model"]
        counted = param_counts(model_shape(model))["total"]
        out[path] = dict(
            model=model, stage=launch.stage, world=launch.world, tp=launch.tp, pp=launch.pp, ep=launch.ep,
            dp=launch.dp, expert_dp=launch.expert_dp,
            roles=[dict(name=r.name, trainable=r.trainable, value_head=r.value_head, offloadable=r.offloadable)
                   for r in launch.roles],
            rollout_rows=launch.rollout_rows, unique_prompts=launch.unique_prompts,
            micro_batch_size=launch.micro_batch_size, prompt_cap=launch.prompt_cap, response_cap=launch.response_cap,
            mini_batch=launch.mini_batch, flags=launch.flags, params_counted=counted,
            params_published=MODELS[model]["published_params"], rows=rows, recommended=recommend(launch, coef),
            recommended_without_routing_replay=(recommend(replace(launch, routing_replay=False), coef)
                                                if launch.routing_replay else None),
            micro_batching=micro_batch_costs(*skewed_mix(launch.rollout_rows, launch.n_samples, launch.prompt_cap,
                                                         launch.response_cap), launch.n_samples,
                                             launch.micro_batch_size, launch.prompt_cap + launch.response_cap))
    return out


# ---------------------------------------------------------------------------------------------- cases and driver
def main_cases(shape: Shape, lengths: Sequence[int], attentions: Sequence[str]) -> List[Case]:
    cases = []
    for attention in attentions:
        for seq in lengths:
            for mode in RECOMPUTE:
                cases.append(Case(shape, seq, recompute=mode, attention=attention))
            cases.append(Case(shape, seq, attention=attention, kind="forward"))
    # the same 4 samples of one prompt as 4 rows and as one packed row [prompt | r1 .. r4] of `seq` tokens
    for seq in lengths[:2]:
        cases.append(Case(shape, seq, layout="packed", group=4, tag="packed"))
        cases.append(Case(shape, seq, layout="row", group=4, tag="packed"))
    return cases


def grid_cases(grid: dict) -> List[Case]:
    cases = []
    for tag in ("dense", "held_out"):
        for shape in grid[tag]:
            for seq in grid["lengths"]:
                for mode in RECOMPUTE:
                    cases.append(Case(shape, seq, recompute=mode, tag="fit" if tag == "dense" else tag))
                cases.append(Case(shape, seq, kind="forward", tag="fit" if tag == "dense" else tag))
    for tag in ("qk_norm", "moe", "moe_held_out"):
        for shape in grid[tag]:
            for seq in grid["lengths"]:
                for mode in RECOMPUTE:
                    cases.append(Case(shape, seq, recompute=mode, tag=tag))
                cases.append(Case(shape, seq, kind="forward", tag=tag))
    return cases


def run_cases(cases: Sequence[Case], device_type: str, max_bytes: float, log, timing_tags=("main", "packed"),
              reuse: Optional[Dict[str, dict]] = None, only: Optional[str] = None):
    results = []
    for i, case in enumerate(cases):
        if reuse and case.name in reuse:
            results.append(reuse[case.name])
            continue
        if only and not re.search(only, case.name):
            results.append(dict(case=case_dict(case), skipped=f"not selected (--only {only})"))
            continue
        guess = rough_case_bytes(case)
        if case.attention != "local" and not sdpa_available():
            results.append(dict(case=case_dict(case), skipped="build_model has no attention option yet (branch attn)"))
            continue
        if guess > max_bytes:
            results.append(dict(case=case_dict(case), skipped=f"needs about {guess / GB:.1f} GB by a rough estimate "
                                f"(--max-case-gb {max_bytes / GB:g})"))
            log(f"[{i + 1}/{len(cases)}] skip {case.name}: ~{guess / GB:.1f} GB")
            continue
        start = time.perf_counter()
        try:
            r = measure(case, device_type, timing=case.tag in timing_tags)
        except Exception as exc:  # a lever that does not run is a result, not the end of the benchmark
            results.append(dict(case=case_dict(case), error=f"{type(exc).__name__}: {exc}"[:500]))
            log(f"[{i + 1}/{len(cases)}] error {case.name}: {exc}")
            continue
        results.append(r)
        log(f"[{i + 1}/{len(cases)}] {case.name}: saved/layer/token {r['per_layer']['layer_total']:.0f} B, "
            f"peak {r['peak'] / 2**20:.1f} MiB ({time.perf_counter() - start:.1f} s)")
    return results


def tp_check(coef: dict, tp1: List[dict], tp2: List[dict]) -> List[dict]:
    """Measured TP2 saved bytes per token per layer (rank 0) against the TP rule's prediction from the TP1 fit, and
    the replicated / divided split the two measurements give (m1 = r + d, m2 = r + d / 2)."""
    by_name = {c["case"]["name"]: c for c in tp1 if "saved" in c}
    out = []
    for c in tp2:
        if "saved" not in c:
            continue
        shape, mode = Shape(**c["case"]["shape"]), c["case"]["recompute"]
        measured = c["per_layer"]["layer_total"]
        predicted = predict_layer_saved(coef, shape, mode, c["seq"], tp=2)["layer_total"]
        entry = dict(name=c["case"]["name"], measured_tp2=measured, predicted_tp2=predicted,
                     error=(predicted - measured) / measured if measured else 0.0, peak_tp2=c["peak"])
        ref = by_name.get(c["case"]["name"])
        if ref is not None:
            m1 = ref["per_layer"]["layer_total"]
            entry.update(measured_tp1=m1, replicated=2 * measured - m1, divided=2 * (m1 - measured))
            entry["parts"] = {k: dict(tp1=ref["per_layer"].get(k, 0.0), tp2=c["per_layer"].get(k, 0.0))
                              for k in ("norms", "attention", "mlp", "layer", "checkpoint")}
        out.append(entry)
    return out


ASSUMPTIONS = [
    "Shapes are the models' config.json values (MODELS); parameter counts computed from them are checked against "
    "the published ones (JSON launchers.*.params_counted).",
    "Launcher flags come from running each launcher (its default node count, 8 devices a node) with a stub python "
    "and mindspeed_llm.arguments.parse_args; critic / reward models are value-head models of the same trunk.",
    "Rollout: all gbs x n / DP rows of a rank are generated at once (rl/rollout.py -> generate); the static KV cache "
    "is 2 x layers x (prompt cap + response cap) x rows x kv heads / TP x head dim x 2 B per stage; repeated "
    "prompts are prefilled once; the prefill runs the longest prompt (the cap) for every distinct prompt.",
    "A decode step on an accelerator adds megatron's repeat_interleave of one layer's K and V cache to all query "
    "heads (the patch that avoids it is CPU-only) and [rows, V] logits x 10 B for sampling; computed, not measured.",
    "Training micro-batches are at the cap (prompt cap + response cap): today's micro-batch takes the width of the "
    "local batch's longest sample, and a batch with one response at the cap has that width; with a token budget "
    "the largest micro-batch is floor(budget / cap) rows at the cap (at least one).",
    "Pipeline: 1F1B keeps min(PP - stage, micro-batches) micro-batches' saved activations in flight; the first and "
    "last stages are projected and the larger is reported (the last holds the output layer and the logits).",
    "Model state: trainable bf16 = 2 (weights) + 4 (fp32 grad buffer) + 4 (fp32 main weights) + 8 (Adam) B per "
    "parameter (measured); distributed optimizer: the 12 B of main weights and moments divided by DP (expert DP "
    "for experts), megatron's rule (it does not run on CPU here); frozen = 2 B; --offload-ref-reward: frozen "
    "models count only in their own pass; offload-train-state keeps only the weights on the device in the rollout.",
    "Activations per token per layer and working sets come from the fit at TP1; under TP the hidden-sized terms "
    "stay replicated (no sequence parallelism) and the q / kv / FFN / heads terms divide (checked at TP2).",
    "Mixture of experts: a rank's routed tokens per local token equal top-k on average (balanced routing, "
    "dropless); the all-to-all dispatcher was measured at EP1.",
    "Megatron's global memory buffer (local attention's [b x heads, s, s] bf16 score target) keeps its largest "
    "size once allocated (prefill or update) and is counted in every phase.",
    "Optimizer step temporaries, communication buffers, the allocator's fragmentation and the framework's own "
    "workspace are not counted: the 56 GB target leaves 8 GB of a 64 GB device for them.",
    "SDPA bound: the fitted terms without the s^2 parts (saved and working sets) and without the global buffer; "
    "computed, to be replaced by the measured SDPA cases when build_model accepts attention='sdpa'.",
    "Skewed mix: 10% of responses at the cap, the rest uniform in 10-50% of it; prompts uniform in 5-15% of the "
    "prompt cap, one per prompt group; token budget = prompt cap + response cap unless said.",
]


def fmt_gb(x) -> str:
    return "-" if x is None else f"{x:6.1f}"


def print_table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(str(h).ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def report(data: dict) -> str:
    out = []
    cases = [c for c in data["cases"] if c["case"]["tag"] in ("main", "packed")]
    rows = []
    for c in cases:
        name = c["case"]["name"].split(" h")[0]
        if "saved" not in c:
            rows.append([name, "-", "-", "-", "-", "-", c.get("skipped") or c.get("error", "")])
            continue
        pl = c["per_layer"]
        rows.append([name, c["tokens"], f"{pl['layer_total']:.0f}", f"{pl.get('attention', 0):.0f}",
                     f"{c['peak'] / 2**20:.0f}", f"{c['global_buffer'] / 2**20:.0f}",
                     f"{c['time_s']:.1f}" if "time_s" in c else "-"])
    out.append("Measured (" + data["meta"]["shape_text"] + "):")
    out.append(print_table(rows, ["case", "tokens", "saved B/tok/layer", "of it attention", "peak MiB",
                                  "buffer MiB", "time s"]))
    fit = data["fit"]
    out.append("\nFit check (saved per token per layer; peak of the step):")
    rows = [[e["name"].split(" L")[0], e["tag"], f"{e.get('saved_per_layer_token', 0):.0f}",
             f"{e.get('predicted', 0):.0f}", f"{100 * e.get('error', 0):+.1f}%", f"{e['peak'] / 2**20:.0f}",
             f"{e['predicted_peak'] / 2**20:.0f}", f"{100 * e['peak_error']:+.1f}%"]
            for e in fit["check"] if e["tag"] in ("main", "held_out", "moe_held_out", "packed")]
    out.append(print_table(rows, ["case", "tag", "measured", "fit", "err", "peak MiB", "fit MiB", "err"]))
    out.append(f"held-out max |error|: saved {100 * fit['held_out_max_error']:.1f}%, "
               f"peak {100 * fit['held_out_max_peak_error']:.1f}%")
    if data.get("tp2", {}).get("check"):
        out.append("\nTP2 (2 gloo processes, rank 0) against the TP rule:")
        rows = [[e["name"].split(" h")[0], f"{e.get('measured_tp1', 0):.0f}", f"{e['measured_tp2']:.0f}",
                 f"{e['predicted_tp2']:.0f}", f"{100 * e['error']:+.1f}%", f"{e.get('replicated', 0):.0f}",
                 f"{e.get('divided', 0):.0f}"] for e in data["tp2"]["check"]]
        out.append(print_table(rows, ["case", "TP1", "TP2", "TP2 fit", "err", "replicated", "divided"]))
    if data.get("generate"):
        out.append("\nRollout (generate, static KV cache; peak vs KV cache + the no-grad forward fit + buffer):")
        rows = []
        for g in data["generate"]:
            shape = Shape(**g["shape"])
            fit = (predict_working_set(data["fit"]["coefficients"], shape, "forward", "none", g["prompt"], g["batch"])
                   + g["batch"] * shape.heads * g["prompt"] ** 2 * 2 + g["kv_cache"])
            error = 100 * (fit - g["peak"]) / g["peak"]
            rows.append([g["batch"], g["prompt"], g["new_tokens"], f"{g['kv_cache'] / 2**20:.1f}",
                         f"{g['peak'] / 2**20:.1f}", f"{fit / 2**20:.1f}", f"{error:+.1f}%"])
        out.append(print_table(rows, ["rows", "prompt", "new", "KV MiB", "peak MiB", "fit MiB", "err"]))
        for k in data.get("kv_check", []):
            out.append(f"KV check: {k['new_tokens'][0]} -> {k['new_tokens'][1]} new tokens: peak rises "
                       f"{k['peak_rise'] / 2**20:.2f} MiB, megatron's KV sizing {k['kv_cache_rise'] / 2**20:.2f} MiB")
    ms = data["model_state"]
    out.append("\nModel state, bytes per parameter (measured): " + ", ".join(
        f"{k} {v:.2f}" for k, v in ms["bytes_per_param"].items()) + f"; frozen {ms['frozen_bytes_per_param']:.2f}")
    dist = data.get("tp2", {}).get("distributed_optimizer_dp2") or {}
    out.append("Distributed optimizer at DP2: " + (
        ", ".join(f"{k} {v:.2f}" for k, v in dist["bytes_per_param"].items()) if "bytes_per_param" in dist
        else f"did not run ({dist.get('error', 'not measured')[:160]}); megatron's rule 2 + 4 + 12 / DP is used"))
    out.append("\nMicro-batches at the skewed mix (processed / real tokens, attention work / real):")
    rows = []
    for name, mb in data["micro_batching"].items():
        for mode in ("today", "own_length", "token_budget", "packed_today", "packed_token_budget"):
            if mode in mb:
                rows.append([name, mode, f"{mb[mode]['tokens_ratio']:.2f}x", f"{mb[mode]['attention_ratio']:.2f}x",
                             mb[mode]["largest_micro_batch_tokens"]])
    out.append(print_table(rows, ["batch", "micro-batches", "tokens", "attention", "largest mb tokens"]))
    for path, p in data["projection"].items():
        ep = f" EP{p['ep']}" if p["ep"] > 1 else ""
        out.append(f"\n{path}: {p['model']} {p['stage']}, world {p['world']} = TP{p['tp']} PP{p['pp']} "
                   f"DP{p['dp']}{ep}, rollout rows/rank "
                   f"{p['rollout_rows']}, mbs {p['micro_batch_size']}, caps {p['prompt_cap']}+{p['response_cap']}"
                   f" (params {p['params_counted'] / 1e9:.2f}B, published {p['params_published'] / 1e9:.2f}B)")
        rows = []
        for r in p["rows"]:
            if "skipped" in r:
                rows.append([r["label"], "-", "-", "-", "-", r["skipped"]])
                continue
            worst = max(r["rollout_gb"], r["passes_gb"], r["train_gb"])
            fits = "/".join(name for name, gb in DEVICES_GB.items() if worst <= gb) or "neither"
            rows.append([r["label"], fmt_gb(r["rollout_gb"]), fmt_gb(r["passes_gb"]), fmt_gb(r["train_gb"]),
                         "yes" if r["train_gb"] <= TARGET_TRAIN_GB else "no", fits, r.get("note", "")])
        out.append(print_table(rows, ["levers", "rollout GB", "passes GB", "train GB", f"train<={TARGET_TRAIN_GB}",
                                      "all phases fit", ""]))
        rec = p["recommended"]
        out.append(f"needs (<= {TARGET_TRAIN_GB} GB in every phase): " + ("; ".join(rec["changes"]) or "nothing")
                   + f" -> rollout {rec['rollout_gb']:.1f}, passes {rec['passes_gb']:.1f}, "
                     f"train {rec['train_gb']:.1f} GB"
                   + (f" ({'; '.join(rec['notes'])})" if rec["notes"] else ""))
        alt = p.get("recommended_without_routing_replay")
        if alt:
            out.append("without --moe-routing-replay (which refuses recompute): " + "; ".join(alt["changes"])
                       + f" -> rollout {alt['rollout_gb']:.1f}, passes {alt['passes_gb']:.1f}, "
                         f"train {alt['train_gb']:.1f} GB" + (f" ({'; '.join(alt['notes'])})" if alt["notes"] else ""))
    out.append("\nTargets:")
    for t in data["targets"]:
        out.append(f"  [{t['status']}] {t['target']}: {t['measured']}")
    out.append("\nAssumptions:")
    out += [f"  - {a}" for a in data["assumptions"]]
    return "\n".join(out)


def targets(data: dict) -> List[dict]:
    """The project's targets, with what was measured or projected (met / not met / pending)."""
    out = []
    for path in ("examples/mcore/qwen25/ppo_qwen25_32b.sh", "examples/mcore/qwen25/grpo_qwen25_7b.sh"):
        p = data["projection"].get(path)
        if p is None:
            continue
        rec = p["recommended"]
        out.append(dict(target=f"{os.path.basename(path)} training peak <= {TARGET_TRAIN_GB} GB with the right levers",
                        status="met" if rec["train_gb"] <= TARGET_TRAIN_GB else "not met",
                        measured=f"{rec['train_gb']:.1f} GB with {'; '.join(rec['changes'])} (as launched "
                                 f"{p['rows'][0].get('train_gb', float('nan')):.1f} GB)"))
    sdpa = [c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["attention"] == "sdpa"
            and c["case"]["recompute"] == "none" and c["case"]["kind"] == "train" and "saved" in c]
    if len(sdpa) >= 2:
        per_token = [c["per_layer"]["attention"] for c in sorted(sdpa, key=lambda c: c["seq"])]
        linear = max(per_token) <= 1.05 * min(per_token)
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s",
                        status="met" if linear else "not met",
                        measured="attention B/token/layer " + ", ".join(f"{x:.0f}" for x in per_token)))
    else:
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s (2k -> 4k -> 8k)",
                        status="pending", measured="build_model has no attention option yet (branch attn); local "
                        "attention's grow as s^2 (see the fit's heads*s term)"))
    full = [c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["recompute"] == "full"
            and c["case"]["kind"] == "train" and "saved" in c]
    if full:
        h = full[0]["case"]["shape"]["hidden"]
        worst = max(c["per_layer"]["layer_total"] for c in full)
        out.append(dict(target="full recompute keeps at most about 2*H bytes per token per layer",
                        status="met" if worst <= 2.05 * h else "not met",
                        measured=f"{worst:.1f} B/token/layer = {worst / h:.3f} H (H = {h}); shared per micro-batch "
                                 "(rotary table, mask, token ids) counted apart"))
    generic = data["micro_batching"].get("skewed mix (generic)")
    if generic:
        out.append(dict(target="token-budget micro-batches process <= 1.2x the real tokens at the skewed mix "
                               "(2.4x today)",
                        status="met" if generic["token_budget"]["tokens_ratio"] <= 1.2 else "not met",
                        measured=f"token budget {generic['token_budget']['tokens_ratio']:.2f}x, today "
                                 f"{generic['today']['tokens_ratio']:.2f}x, own length "
                                 f"{generic['own_length']['tokens_ratio']:.2f}x (local stand-in rule)"))
    return out


def summarize_fit(coef: dict, cases: List[dict]) -> dict:
    check = check_fit(coef, cases)
    held = [e for e in check if e["tag"] in ("held_out", "moe_held_out")]
    return dict(coefficients=coef, check=check,
                held_out_max_error=max([abs(e.get("error", 0)) for e in held] or [0.0]),
                held_out_max_peak_error=max([abs(e["peak_error"]) for e in held] or [0.0]),
                main_max_error=max([abs(e.get("error", 0)) for e in check if e["tag"] == "main"] or [0.0]))


def analyse(data: dict, launchers: Sequence[str]) -> dict:
    """Fit, checks, micro-batching, projection and targets from the measurements in `data`."""
    coef = fit_model(data["cases"])
    data["fit"] = summarize_fit(coef, data["cases"])
    if data.get("tp2", {}).get("cases"):
        data["tp2"]["check"] = tp_check(coef, data["cases"], data["tp2"]["cases"])
    generic = micro_batch_costs(*skewed_mix(256, 8, 2048, 2048), 8, 4, 4096)
    data["micro_batching"] = {"skewed mix (generic)": generic}
    data["projection"] = project_launchers(coef, launchers) if launchers else {}
    for path, p in data["projection"].items():
        data["micro_batching"][os.path.basename(path)] = p["micro_batching"]
    data["kv_check"] = kv_check(data.get("generate", []))
    data["targets"] = targets(data)
    data["assumptions"] = ASSUMPTIONS
    return data


def kv_check(generations: List[dict]) -> List[dict]:
    """Rollouts that differ only in new tokens: the rise of the peak against megatron's KV-cache sizing."""
    out = []
    for a in generations:
        for b in generations:
            if (a["batch"], a["prompt"]) == (b["batch"], b["prompt"]) and b["new_tokens"] > a["new_tokens"]:
                out.append(dict(batch=a["batch"], prompt=a["prompt"], new_tokens=(a["new_tokens"], b["new_tokens"]),
                                peak_rise=b["peak"] - a["peak"], kv_cache_rise=b["kv_cache"] - a["kv_cache"]))
    return out


def versions() -> dict:
    import megatron.core
    import torch

    return dict(python=platform.python_version(), torch=torch.__version__,
                megatron_core=getattr(megatron.core, "__version__", "?"))


def machine() -> dict:
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), load_average=os.getloadavg())
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            info["memory_gb"] = int(f.readline().split()[1]) / 1e6
    except OSError:
        pass
    return info


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="model row lengths (tokens)")
    p.add_argument("--hidden", type=int, default=DEFAULT_SHAPE.hidden)
    p.add_argument("--ffn", type=int, default=DEFAULT_SHAPE.ffn)
    p.add_argument("--heads", type=int, default=DEFAULT_SHAPE.heads)
    p.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE.kv_heads)
    p.add_argument("--head-dim", type=int, default=DEFAULT_SHAPE.head_dim)
    p.add_argument("--layers", type=int, default=DEFAULT_SHAPE.layers)
    p.add_argument("--vocab", type=int, default=DEFAULT_SHAPE.vocab)
    p.add_argument("--toy", action="store_true", help="toy shape, lengths 64 / 128 and the toy fit grid (seconds)")
    p.add_argument("--max-case-gb", type=float, default=8.0,
                   help="skip a case whose rough estimate exceeds this (the machine is shared)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-tp2", action="store_true", help="skip the two-process TP2 measurement")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--no-fit-grid", action="store_true",
                   help="fit on the main shape's cases only (no other shapes, no held-out check)")
    p.add_argument("--no-rss-check", action="store_true")
    p.add_argument("--launchers", nargs="*", default=list(LAUNCHERS))
    p.add_argument("--project-only", metavar="JSON", help="redo fit and projection from an earlier --json")
    p.add_argument("--reuse", metavar="JSON",
                   help="take the cases an earlier --json measured (same name), the rollout, model-state, TP2 and "
                        "peak-check results from it, and measure only the rest")
    p.add_argument("--only", metavar="REGEX", help="measure only the cases whose name matches (with --reuse)")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.project_only:
        with open(opts.project_only) as f:
            data = json.load(f)
        analyse(data, opts.launchers)
        print(report(data))
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(data, f, indent=1)
        return 0
    os.environ["MINDSPEED_DEVICE"] = opts.device
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    import torch

    torch.set_num_threads(opts.threads)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 1
    if opts.toy:
        shape, lengths, grid = TOY_SHAPE, [64, 128], FIT_GRIDS["toy"]
    else:
        shape = Shape(hidden=opts.hidden, ffn=opts.ffn, heads=opts.heads, kv_heads=opts.kv_heads,
                      head_dim=opts.head_dim, layers=opts.layers, vocab=opts.vocab)
        lengths, grid = opts.lengths, FIT_GRIDS["default"]
    started = time.time()
    log = lambda msg: print(f"[{time.time() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    init_process(1)
    attentions = ["local"] + (["sdpa"] if sdpa_available() else [])
    data = dict(meta=dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                          device=opts.device, threads=opts.threads, versions=versions(), machine=machine(),
                          shape=asdict(shape), lengths=lengths, attentions=attentions, sdpa_available=sdpa_available(),
                          shape_text=f"hidden {shape.hidden}, FFN {shape.ffn}, {shape.heads} heads / {shape.kv_heads} "
                                     f"KV x {shape.head_dim}, {shape.layers} layers, vocabulary {shape.vocab}, bf16"))
    max_bytes = opts.max_case_gb * GB
    old = {}
    if opts.reuse:
        with open(opts.reuse) as f:
            old = json.load(f)
        data["meta"]["reused_from"] = dict(path=opts.reuse, date=old["meta"]["date"],
                                           earlier=old["meta"].get("reused_from"))
    data["peak_check"] = dict(scripted=check_peak_method(opts.device))
    log(f"peak method on a scripted sequence: {data['peak_check']['scripted']}")
    if "rss" in old.get("peak_check", {}):
        data["peak_check"]["rss"] = old["peak_check"]["rss"]
    elif opts.device == "cpu" and not opts.no_rss_check:
        rss_case = Case(shape, lengths[0])
        data["peak_check"]["rss"] = check_peak_rss(rss_case)
        log(f"RSS check: {data['peak_check']['rss']}")
    cases = main_cases(shape, lengths, attentions) + ([] if opts.no_fit_grid else grid_cases(grid))
    reuse = {c["case"]["name"]: c for c in old.get("cases", []) if "saved" in c}
    data["cases"] = run_cases(cases, opts.device, max_bytes, log, reuse=reuse, only=opts.only)
    for key in ("generate", "model_state", "model_state_distributed_optimizer_dp1", "tp2"):
        if key in old:
            data[key] = old[key]
    if "generate" not in data and not opts.no_generate:
        p1, p2 = (lengths[0] // 4, lengths[0] // 2)
        data["generate"] = [measure_generate(shape, b, p, n, opts.device)
                            for b, p, n in ((2, p1, 2), (2, p2, 2), (4, p2, 2), (4, p2, 2 + p2 // 4))]
        log(f"generate: {[(g['peak'], g['kv_cache']) for g in data['generate']]}")
    if "model_state" not in data:
        data["model_state"] = measure_model_state(grid["dense"][0])
        try:
            data["model_state_distributed_optimizer_dp1"] = measure_model_state(grid["dense"][0], True)
        except Exception as exc:
            data["model_state_distributed_optimizer_dp1"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if "tp2" not in data and not opts.no_tp2 and opts.device == "cpu":
        tp_cases = [Case(shape, seq, recompute=mode) for seq in lengths[:1] for mode in RECOMPUTE]
        data["tp2"] = run_tp2(tp_cases)
        log(f"TP2: {'error' if 'error' in data['tp2'] else 'done'}")
    analyse(data, opts.launchers)
    data["meta"]["wall_s"] = time.time() - started
    data["meta"]["machine"]["load_average_end"] = os.getloadavg()
    print(report(data))
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
