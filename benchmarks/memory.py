"""Activation and model-state memory of one RL training step, measured on CPU at a scaled-down shape, fitted per
layer, and projected to every shipped launcher's devices.

What is measured (``--device cpu``; ``--device cuda`` runs the same code with CUDA's allocator statistics), for
each core attention (``--attentions``: every case names its own, `build_model(..., attention=...)`):

* one training forward + backward of the policy on the real path: `MicroBatchPlan` rows or packed prompt groups ->
  the actor's `TrainableModel` (megatron DDP with its fp32 grad buffer, bf16 weights) through megatron's schedule
  (`rl.engine._run_schedule`, what `train_step` runs before the optimizer step) -> `rl.loss_closures.clipped_policy_loss`
  (`passes.response_logprobs` -> `rl.logprobs.vocab_parallel_logprobs` with entropy, the clipped surrogate, the
  low_var_kl loss), with grpo's settings;
* **saved for backward**: every tensor autograd packs during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters left out, attributed to
  the module that was running (forward pre/post hooks on the embedding, each layer and its norms, attention,
  core attention and MLP, the final norm, the output layer; the log-prob + loss closure; the decoder itself for
  full recompute's checkpointed layer inputs). A storage saved in more than one layer (the rotary table, the
  causal or packed mask) is counted once, as "shared". Which saved storages the step does not allocate before
  its backward is measured too (``saved_outside_step``, weak references to the storages): those from before the
  step (the micro-batch's token ids, megatron's cached causal mask) and those freed before the backward (a graph
  branch the loss does not reach);
* **peak**: on CPU, ``torch.profiler`` with ``profile_memory=True``: the running sum of every allocation and free
  event (``alloc_size`` of the profiler's allocation events, in time order) from the step's start; its maximum is
  the step's peak above what was live before it. Megatron's global memory buffer (the local attention's score
  matmul target, ``[b * heads, s, s]``, allocated once and kept) is added: it is steady-state memory. Checked
  (JSON ``peak_check``): the method gives the exact bytes of a scripted allocation sequence, and a fresh process
  whose only work is one step rises in ``ru_maxrss`` by about the profiler's peak when glibc's mmap threshold is
  fixed (by default glibc raises it and keeps freed blocks in its heap, which RSS counts on top). On CUDA:
  ``torch.cuda.max_memory_allocated`` minus the allocation before the step (the profiler's timeline is still used
  for the phase split);
* the phase split of the peak (markers in the profiler's timeline from the same module hooks and from gradient
  hooks on each layer's output, `summarize_phases`): one layer's forward and backward, the head's forward and
  backward, each as the most memory live above the live bytes when it starts;
* the time of one plain step (no hooks, no profiler) after a warm-up step;
* the forward-only log-prob pass (`passes.policy_logprobs`, no grad) and the rollout (`inference.generate` on
  megatron's static KV cache), by the same peak method;
* model-state bytes per parameter by part of a real `TrainableModel` after one optimizer step
  (`rl/model_state.bytes_per_parameter`: weights, DDP grad buffer, fp32 main weights, Adam moments), at DP1 and at
  DP2 (two gloo processes) with megatron's optimizer and the distributed optimizer, what `TrainableModel.offload()`
  leaves on the device for each --offload-train-* flag (actor and critic, `roles.offload_parts`), and a frozen
  model's;
* the same saved-bytes measurement at TP2 on two gloo processes;
* the token-budget micro-batches on the real `MicroBatchPlan` (`plan_micro_batch_tokens`) at a skewed length mix.

Levers, one parameter each (`Case`): ``recompute`` none / selective (megatron's core_attn) / full (uniform, one
layer per checkpoint); ``attention`` sdpa (the fused core attention, the default) / local (megatron's unfused
attention, which keeps ``[b, heads, s, s]`` scores); ``layout`` row / packed (`[prompt | r1 .. rn]`); micro-batching
by count or by a token budget (`batch_plan.token_budget_groups`, the rule `MicroBatchPlan` runs).

What is computed: coefficients fitted to the measurements of each attention (`fit_model`: least squares with
non-negative coefficients) -- saved bytes per token per layer by part as linear functions of hidden, FFN, q and
kv widths, heads and, for the local attention's ``s^2`` part, heads x s (MoE: experts, top-k x hidden, top-k x
expert FFN); one layer's working set without recompute (a recomputed layer's backward adds what recompute did not
keep, checked against the measured selective / full cases) and the head's; held-out shapes check them
(`check_fit`: saved bytes and the composed peak); their division under tensor parallelism (hidden-sized tensors
stay replicated without sequence parallelism, the rest divides; checked against the TP2 measurement); the padding
of micro-batches at a skewed length mix; the model-state table (`StateBytes.measured`: which parts the distributed
optimizer divides, what offload leaves); and the per-device projection of each launcher (`examples/mcore/*/*.sh`,
read through its own command line and `arguments.parse_args`) for the rollout (its rows in flight
``--rollout-max-num-seqs``, its prefill ``--rollout-max-num-batched-tokens``), the forward-only passes and the
update at its worst pipeline stage, as launched and with each lever flipped (`Levers`, `lever_rows`; sequence
parallelism and context parallelism among them, computed from the TP1 fit, not measured: the hidden-sized terms
divided by TP, a CP rank's 1/CP of the tokens plus each layer's all-gathered keys and values), against 64 GB and
80 GB, the 7B and 32B launchers also at a 16k response (`long_response_rows`: as launched, + SP, + SP + CP 2, and
what then fits 56 GB), and the cheapest levers and layout that fit 56 GB in every phase (`recommend`; it does not
flip SP or CP). DeepSeek-V3 (multi-latent attention, not measured) gets its
model state only. Every assumption is printed and in the JSON (``assumptions``). Cases a shared 24 GB machine
cannot hold are skipped by a rough estimate (``--max-case-gb``) and say so; ``--reuse`` / ``--only`` /
``--remeasure`` add cases to an earlier JSON without measuring the rest again (an earlier JSON format gives its
cases only).

Usage::

    python benchmarks/memory.py --json runs/memory.json              # default shape, 2k/4k/8k, ~1 h on 2 cores
    python benchmarks/memory.py --reuse runs/memory.json --only "s=4096 none" --max-case-gb 14 --json runs/m2.json
    python benchmarks/memory.py --toy --no-tp2 --json /tmp/m.json  # a minute (tests/dist/test_benchmark_memory_dist.py)
    python benchmarks/memory.py --project-only runs/memory.json      # redo fit + projection from a JSON"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

JSON_FORMAT = 2  # 2: cases choose their attention; model state by part (rl/model_state), offload, DP2 dist-opt
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
    "Qwen3-30B-A3B": dict(source="Qwen/Qwen3-30B-A3B config.json (as in tests/dist/test_examples.py)", hidden=2048,
                          ffn=6144, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936, qk_norm=True,
                          tied=False, experts=128, topk=8, moe_ffn=768, published_params=30.53e9),
    "Llama-3.2-1B": dict(source="meta-llama/Llama-3.2-1B config.json", hidden=2048, ffn=8192, layers=16, heads=32,
                         kv_heads=8, head_dim=64, vocab=128256, qkv_bias=False, tied=True, published_params=1.24e9),
    # model state only (multi-latent attention and shared experts are not measured here); published: without the
    # multi-token-prediction layer, which the conversion skips
    "DeepSeek-V3": dict(source="deepseek-ai/DeepSeek-V3 config.json", hidden=7168, ffn=18432, layers=61, heads=128,
                        kv_heads=128, head_dim=128, vocab=129280, qkv_bias=False, tied=False, experts=256, topk=8,
                        moe_ffn=2048, dense_layers=3, shared_ffn=2048, q_lora=1536, kv_lora=512, qk_rope=64,
                        v_head=128, published_params=671e9),
}
# launcher -> the models it loads (the critic / reward model are value-head models of the named trunk)
LAUNCHERS = {
    "examples/mcore/qwen25/grpo_qwen25_7b.sh": dict(model="Qwen2.5-7B", reward_model="Qwen2.5-7B"),
    "examples/mcore/qwen25/ppo_qwen25_32b.sh": dict(model="Qwen2.5-32B", reward_model="Qwen2.5-32B"),
    "examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh": dict(model="Qwen3-30B-A3B", reward_model="Qwen3-30B-A3B"),
    "examples/mcore/llama32/trl_ppo_llama32_1b.sh": dict(model="Llama-3.2-1B", reward_model="Llama-3.2-1B"),
    "examples/mcore/deepseek3/grpo_deepseek3_671b.sh": dict(model="DeepSeek-V3", reward_model="DeepSeek-V3",
                                                            state_only=True),
}
DEVICES_GB = {"Ascend 910B": 64, "H100": 80}
ACCELERATOR = "npu"  # the projection's log-prob work buffer: the accelerators' chunk size (rl/logprobs.py)
TARGET_TRAIN_GB = 56


@dataclass(frozen=True)
class Shape:
    """A decoder's shape; `spec()` gives the `ArchitectureSpec` `build_model` takes."""

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
    # DeepSeek-V3's extras (model state only: no case measures them): the first `dense_layers` layers have a dense
    # MLP, every MoE layer a shared expert of `shared_ffn`; multi-latent attention when `kv_lora` > 0 (q / kv LoRA
    # ranks, the rotary part of a query / key head, the value head dim; head_dim is the non-rotary part)
    dense_layers: int = 0
    shared_ffn: int = 0
    q_lora: int = 0
    kv_lora: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def spec(self, max_positions: int = 32768):
        from mindspeed_llm.models import ArchitectureSpec

        if self.kv_lora or self.dense_layers or self.shared_ffn:
            raise ValueError("memory.py measures dense, q/k-norm and plain MoE shapes only (not MLA / shared experts)")

        family = "qwen3_moe" if self.experts else "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"
        moe = dict(num_experts=self.experts, moe_ffn_hidden_size=self.moe_ffn, moe_router_topk=self.topk) \
            if self.experts else {}
        return ArchitectureSpec(
            family=family, num_layers=self.layers, hidden_size=self.hidden, ffn_hidden_size=self.ffn,
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
    attention: str  # "sdpa" | "local": given by every case (build_model's default is sdpa)
    recompute: str = "none"
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
    from mindspeed_llm.rl.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings
    from mindspeed_llm.rl.passes import policy_logprobs

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
    return dict(shape=asdict(shape), attention=attention, batch=batch, prompt=prompt, new_tokens=new_tokens,
                slots=slots, peak=peak,
                kv_cache=kv_cache, prefill_working_set=peak - kv_cache, time_s=elapsed,
                device=str(device.current_device()))


# What each --offload-train-* flag moves off the device between updates (`rl/roles.offload_parts`), by role
OFFLOAD_FLAGS = {"optimizer": "offload_train_optimizer", "grad": "offload_train_grad", "param": "offload_train_param"}


def _offload_args(flags: Sequence[str]) -> SimpleNamespace:
    return SimpleNamespace(**{OFFLOAD_FLAGS[f]: f in flags for f in OFFLOAD_FLAGS})


def measure_model_state(shape: Shape, distributed_optimizer: bool = False, offload: bool = True) -> dict:
    """Bytes per parameter of each part of a trainable bf16 model's state (`rl/model_state.bytes_per_parameter`:
    weights, DDP grad buffer, fp32 main weights, Adam moments, each storage once) after one optimizer step, at this
    process's data-parallel size, with or without the distributed optimizer; and (`offload`) what is left on the
    device after `TrainableModel.offload()` (what the stages call before the rollout) for each --offload-train-*
    flag alone and all three, for the actor and the critic (`roles.offload_parts`: the critic's weights go too),
    and after `onload()`; and the bytes per parameter of a frozen bf16 model."""
    from mindspeed_llm import distributed  # noqa: F401  (parallel state is set by the caller)
    from megatron.core import parallel_state

    from mindspeed_llm.rl import model_state, roles
    from mindspeed_llm.rl.engine import OptimizerSettings, TrainableModel
    from mindspeed_llm.rl.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings

    gc.collect()
    case = Case(shape, 64, "sdpa")
    exp = synthetic_experience(1, 32, 32, shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = LossSettings(**LOSS_ARGS, max_new_tokens=32)

    def trained(parts=()):
        tm = TrainableModel(build(case, trainable=False), OptimizerSettings(
            lr=1e-6, params_dtype="bf16", adam_beta2=0.95, use_distributed_optimizer=distributed_optimizer),
            name="actor", offload=parts)
        tm.train_step([mb], lambda out, m: clipped_policy_loss(args, out, m, KL_COEF))
        return tm

    tm = trained()
    result = dict(shape=asdict(shape), distributed_optimizer=distributed_optimizer,
                  data_parallel=parallel_state.get_data_parallel_world_size(),
                  params=model_state.device_bytes(tm)["parameters"],
                  bytes_per_param=model_state.bytes_per_parameter(tm))
    del tm
    gc.collect()
    if offload:
        result["offloaded"] = {}
        for name in ("actor", "critic"):
            for flags in (("optimizer",), ("grad",), ("param",), tuple(OFFLOAD_FLAGS)):
                parts = roles.offload_parts(_offload_args(flags), name)
                tm = trained(parts)
                tm.offload()
                left = model_state.bytes_per_parameter(tm)
                tm.onload()
                back = model_state.bytes_per_parameter(tm)
                result["offloaded"][f"{name}: " + " ".join(f"--offload-train-{f}" for f in flags)] = dict(
                    role=name, flags=list(flags), parts=list(parts), on_device_during_rollout=left,
                    after_onload=back)
                del tm
                gc.collect()
    frozen = roles.frozen(build(case, trainable=False))
    result["frozen_bytes_per_param"] = sum(s.nbytes() for s in model_state._unique(frozen.parameters())) / sum(
        p.numel() for p in frozen.parameters())
    del frozen
    gc.collect()
    return result


def _tp_worker(rank: int, world: int, port: int, cases: List[Case], state_shape: Shape, queue) -> None:
    """One of the two gloo processes: the cases at TP2, then at TP1 DP2 the model state of `state_shape` with
    megatron's optimizer and with the distributed optimizer (with its offloads)."""
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
        states = {}
        for key, distributed_optimizer in (("dp2", False), ("distributed_optimizer_dp2", True)):
            try:
                states[key] = measure_model_state(state_shape, distributed_optimizer, offload=distributed_optimizer)
            except Exception as exc:  # a result, not the end of the benchmark: say why
                states[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        queue.put((rank, "ok", json.dumps(dict(cases=results, model_state=states))))
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc()))


def run_tp2(cases: List[Case], state_shape: Shape) -> dict:
    """`cases` on two gloo processes at TP2, then the DP2 model state (rank 0's figures; both ranks hold the
    same shapes)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, cases, state_shape, queue)) for r in range(2)]
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
    from mindspeed_llm.rl.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings

    torch.set_num_threads(1)
    init_process(1)
    d = json.loads(case_json)
    case = Case(shape=Shape(**d.pop("shape")), **{k: v for k, v in d.items() if k != "name"})
    rows, seq, prompt, response = case.rows_and_lengths()
    tm = build(case, trainable=True)
    exp = synthetic_experience(case.samples, prompt, response, case.shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = LossSettings(**LOSS_ARGS, max_new_tokens=response)
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


def check_peak_rss(case: Case, mmap_threshold: Optional[int] = None) -> dict:
    """ru_maxrss of a fresh process over one step against the profiler's peak of the same case (its own process).
    The maximum RSS before the step (model building) must stay below the step's level for the rise to be seen; it
    is reported. `mmap_threshold`: glibc's MALLOC_MMAP_THRESHOLD_ for the child (a fixed threshold: every block
    above it is mmap'ed and returned when freed; glibc's default raises the threshold to the largest block freed,
    up to 32 MiB, and keeps freed blocks below it in the heap, which RSS then counts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rss.json")
        code = ("import sys; sys.path.insert(0, %r); import benchmarks.memory as m; m._rss_child(%r, %r)"
                % (ROOT, json.dumps(case_dict(case)), out))
        env = dict(os.environ, MINDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
        if mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        with open(out) as f:
            result = json.load(f)
    result.update(case=case.name, mmap_threshold=mmap_threshold)
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


def _drawn_order(units: int, seed: int) -> List[int]:
    """The order `ppo_loop` deals prompt groups (units) to mini-batches: a drawn permutation."""
    order = list(range(units))
    random.Random(seed).shuffle(order)
    return order


def micro_batch_costs(prompts: Sequence[int], responses: Sequence[int], group: int, micro_batch_size: int,
                      budget: int, seed: int = 0) -> dict:
    """Processed tokens / real tokens and attention work (sum of s^2 over model rows) / real, computed, for:
    `padded` (every micro-batch at the whole local batch's longest sequence: the micro-batches before
    `batch_plan` cut them to their own length, the 2.4x of the first memory run), `by_count` (`--micro-batch-size`
    samples in the update's drawn order, each micro-batch at its own longest: `MicroBatchPlan` without a budget)
    and `token_budget` (`--max-tokens-per-micro-batch budget`: the units sorted by length, grouped by
    `batch_plan.token_budget_groups`, the rule `MicroBatchPlan` runs); with prompt groups (group > 1) also the
    packed rows `[prompt | r1 .. rn]` (each response slot at the group's longest) by count and by the budget."""
    from mindspeed_llm.rl.batch_plan import token_budget_groups

    lengths = [p + r for p, r in zip(prompts, responses)]
    real_tokens, real_work = sum(lengths), sum(s * s for s in lengths)
    units = _drawn_order(len(lengths) // group, seed)
    order = [u * group + k for u in units for k in range(group)]
    chunks = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    modes = {
        "padded": _cost(chunks, lengths, width=max(lengths)),
        "by_count": _cost(chunks, lengths),
        "token_budget": _cost(token_budget_groups(lengths, budget), lengths),
    }
    if group > 1:
        packed = [prompts[g * group] + group * max(responses[g * group:(g + 1) * group])
                  for g in range(len(lengths) // group)]
        groups_per_mb = max(1, micro_batch_size // group)
        packed_chunks = [units[i:i + groups_per_mb] for i in range(0, len(units), groups_per_mb)]
        modes["packed_by_count"] = _cost(packed_chunks, packed)
        if budget >= max(packed):
            modes["packed_token_budget"] = _cost(token_budget_groups(packed, budget), packed)
    out = dict(samples=len(lengths), group=group, micro_batch_size=micro_batch_size, budget=budget,
               real_tokens=real_tokens, real_attention_work=real_work, longest=max(lengths),
               mean_length=real_tokens / len(lengths))
    for name, (tokens, work, largest) in modes.items():
        out[name] = dict(processed_tokens=tokens, tokens_ratio=tokens / real_tokens, attention_work=work,
                         attention_ratio=work / real_work, largest_micro_batch_tokens=largest)
    return out


def skewed_experience(prompts: Sequence[int], responses: Sequence[int]):
    """An `Experience` of these prompt and response lengths (token ids 1, a group's samples sharing their prompt's
    length), laid out as the rollout lays one out: prompt, response, padding to the batch's longest."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.rl.experience import Experience

    dev = device.current_device()
    b, width, total = len(prompts), max(responses), max(p + r for p, r in zip(prompts, responses))
    prompt_lengths = torch.tensor(prompts, device=dev)
    response_lengths = torch.tensor(responses, device=dev)
    response_mask = (torch.arange(width, device=dev)[None, :] < response_lengths[:, None]).float()
    tokens = (torch.arange(total, device=dev)[None, :] < (prompt_lengths + response_lengths)[:, None]).long()
    return Experience(tokens=tokens, position_ids=torch.arange(total, device=dev).expand(b, -1).clone(),
                      prompt_lengths=prompt_lengths, responses=response_mask.long(), response_mask=response_mask,
                      ended_with_eos=torch.ones(b, dtype=torch.bool, device=dev))


def plan_micro_batch_tokens(prompts: Sequence[int], responses: Sequence[int], group: int, micro_batch_size: int,
                            budget: Optional[int], seed: int = 0) -> dict:
    """Measured on the real path: the update's micro-batches of a `MicroBatchPlan` (`micro_batches(...,
    update=True)`, the samples in `ppo_loop`'s drawn prompt-group order) of an Experience of these lengths, by
    count (`budget` None) or by `max_tokens=budget`; packed when `micro_batch_size` holds whole groups. Returns
    the model rows' processed tokens (sum of each micro-batch's `tokens` numel), sum of s^2 over its rows, the
    largest micro-batch's tokens and the count."""
    import torch

    from mindspeed_llm.rl.batch_plan import MicroBatchPlan

    exp = skewed_experience(prompts, responses)
    plan = MicroBatchPlan.build(exp, micro_batch_size, group, max_tokens=budget)
    units = _drawn_order(len(prompts) // group, seed)
    samples = torch.tensor([u * group + k for u in units for k in range(group)])
    mbs = plan.micro_batches(exp, samples, update=True)
    real = sum(p + r for p, r in zip(prompts, responses))
    processed = sum(mb["tokens"].numel() for mb in mbs)
    work = sum(mb["tokens"].shape[0] * mb["tokens"].shape[1] ** 2 for mb in mbs)
    return dict(packed=plan.packed, micro_batches=len(mbs), processed_tokens=processed,
                tokens_ratio=processed / real, attention_work=work,
                largest_micro_batch_tokens=max(mb["tokens"].numel() for mb in mbs))


# ---------------------------------------------------------------------------------------------- fit
# Per-token features of each part of a layer's saved bytes (TP=1): what each tensor's width is made of. "split"
# names the features that divide under tensor parallelism (the rest -- hidden-sized tensors, per-token scalars --
# stay replicated on every TP rank without sequence parallelism); checked against the TP2 measurement.
PART_FEATURES = {
    "norms": (("1", "h"), ()),
    # heads: the fused kernel's fp32 log-sum-exp per query and head; heads*s: the local attention's scores
    "attention": (("1", "h", "q", "kv", "heads", "heads*s", "qk_norm*(q+kv)"),
                  ("q", "kv", "heads", "heads*s", "qk_norm*(q+kv)")),
    "mlp": (("1", "h", "f"), ("f",)),
    "moe_mlp": (("1", "h", "E", "topk*h", "topk*f_moe"), ()),  # experts split by EP; per routed token alike
    "layer": (("1", "h"), ()),
    "checkpoint": (("1", "h"), ()),
}
# Bytes per micro-batch of one layer's working set (`summarize_phases`), as sums over its tokens / rows, and the
# sizes of its largest weights (fc1: 2 x FFN x h, qkv: h x (q + 2 kv) elements), whose bf16 gradient exists until
# DDP adds it to the fp32 buffer (without recompute; selective and full recompute add the recomputed saved set,
# see `predict_working_set`).
WORKING_SET_FEATURES = (("tokens*h", "tokens*q", "tokens*kv", "tokens*f", "tokens*topk*h", "rows*heads*s^2", "w_fc1",
                         "w_qkv"), ("tokens*q", "tokens*kv", "tokens*f", "rows*heads*s^2", "w_fc1", "w_qkv"))
# Bytes per micro-batch of the head (final norm, output layer, log-probs, loss): per token of the micro-batch, per
# read position (rows x response), and the output layer's weight gradient (bf16 V x h before DDP adds it to the
# fp32 buffer); the log-prob kernel's fp32 work buffer is computed (`logprob_work_bytes`), not fitted.
HEAD_FEATURES = (("tokens*h", "read*h", "read*V", "V*h"), ("read*V", "V*h"))
def feature_values(shape: Shape, seq: int, tp: int = 1, rows: int = 1, ep: int = 1, read: int = 0) -> Dict[str, float]:
    """Every feature's value for `shape` at row length `seq`, `rows` model rows and `read` read positions."""
    s = shape
    f_eff = s.topk * s.moe_ffn if s.experts else s.ffn
    tokens = rows * seq
    values = {"1": 1.0, "h": s.hidden, "q": s.q, "kv": s.kv, "heads": s.heads, "heads*s": s.heads * seq,
              "qk_norm*(q+kv)": (s.q + s.kv) if s.qk_norm else 0.0, "f": s.ffn, "E": s.experts,
              "topk*h": s.topk * s.hidden, "topk*f_moe": s.topk * s.moe_ffn, "V": s.vocab,
              "tokens": tokens, "tokens*h": tokens * s.hidden, "tokens*q": tokens * s.q, "tokens*kv": tokens * s.kv,
              "tokens*f": tokens * f_eff,
              "tokens*topk*h": tokens * s.topk * s.hidden, "rows*heads*s^2": rows * s.heads * seq * seq,
              "read*h": read * s.hidden, "read*V": read * s.vocab, "V*h": s.vocab * s.hidden,
              "w_fc1": 2 * (s.moe_ffn if s.experts else s.ffn) * s.hidden, "w_qkv": s.hidden * (s.q + 2 * s.kv)}
    return values


def _tp_divide(values: Dict[str, float], split: Sequence[str], tp: int,
               per_token: Sequence[str] = ()) -> Dict[str, float]:
    """`values` with the `split` features divided by `tp`; under sequence parallelism the caller passes the
    per-token features (`per_token`, the hidden-sized ones included) to divide as well."""
    return {k: (v / tp if k in split or k in per_token else v) for k, v in values.items()}


# Under sequence parallelism a TP rank holds 1/TP of the sequence outside the TP regions: the hidden-sized per-token
# tensors (residual, norms, the layer input the linears save) divide by TP like the rest; weights do not
SP_WORKING_SET = ("tokens*h", "tokens*topk*h")


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


def fit_model(cases: List[dict]) -> Dict[str, dict]:
    """The coefficients of each core attention (`fit_attention`), fitted on its own cases: {"sdpa": .., "local": ..}."""
    attentions = sorted({c["case"]["attention"] for c in cases if "saved" in c})
    return {a: fit_attention([c for c in cases if c["case"]["attention"] == a]) for a in attentions}


def fit_attention(cases: List[dict]) -> dict:
    """Least-squares coefficients (`lstsq`) of each saved part (per token per layer, by recompute mode), of one
    layer's working set without recompute (per micro-batch; train and no-grad forward; dense and MoE) and of the
    head (per micro-batch), from the measured cases (of one core attention) tagged main / fit / qk_norm / moe in the
    row layout; held-out and packed cases are predicted, not fitted."""
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


def predict_layer_saved(coef: dict, shape: Shape, mode: str, seq: int, tp: int = 1,
                        sp: bool = False) -> Dict[str, float]:
    """Saved bytes per token per layer by part at TP `tp` (the split features divided by `tp`; under sequence
    parallelism `sp` every feature: each is a per-token width)."""
    out = {}
    for part in ("norms", "attention", "mlp", "layer", "checkpoint"):
        name = part_of(shape, part)
        c = coef.get(f"saved.{mode}.{name}")
        if c is None:
            continue
        names = PART_FEATURES[name][0] if sp else ()
        out[part] = max(0.0, _predict(c, _tp_divide(feature_values(shape, seq), PART_FEATURES[name][1], tp,
                                                    names)))
    out["layer_total"] = sum(out.values())
    return out


def predict_working_set(coef: dict, shape: Shape, kind: str, mode: str, seq: int, rows: float, tp: int = 1,
                        sp: bool = False) -> float:
    """One layer's working set (bytes above the live memory when it starts): fitted without recompute; a
    recomputed layer's backward also rebuilds what recompute did not save (full: the whole layer's saved set;
    selective: the core attention's), checked against the measured selective / full cases (`check_fit`). `rows`
    may be a fraction (a context-parallel rank's share of the rows' tokens). Under sequence parallelism `sp` the
    hidden-sized terms divide by TP too, and the bf16 layer input all-gathered for the column-parallel linears
    (tokens x h, the whole sequence) is added (computed, not measured)."""
    c = coef.get(f"working_set.{kind}{'.moe' if shape.experts else ''}") or coef.get(f"working_set.{kind}")
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, seq, rows=rows), WORKING_SET_FEATURES[1], tp,
                        SP_WORKING_SET if sp else ())
    ws = max(0.0, _predict(c, values)) + (2.0 * rows * seq * shape.hidden if sp else 0.0)
    if kind == "train" and mode != "none":
        none = predict_layer_saved(coef, shape, "none", seq, tp, sp)["layer_total"]
        kept = predict_layer_saved(coef, shape, mode, seq, tp, sp)["layer_total"] if mode == "selective" else 0.0
        ws += max(0.0, none - kept) * rows * seq
    return ws


def predict_head(coef: dict, name: str, shape: Shape, tokens: float, read: float, tp: int = 1,
                 device_type: str = "cpu", sp: bool = False) -> float:
    """A head part's bytes for one micro-batch (the log-prob work buffer of `device_type` added to working sets);
    under sequence parallelism `sp` its per-token hidden-sized term (the final norm's) divides by TP."""
    c = coef.get(name)
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, tokens, read=read), HEAD_FEATURES[1], tp)
    values["tokens*h"] = tokens * shape.hidden / (tp if sp else 1)
    fitted = max(0.0, _predict(c, values))
    return fitted if name == "head_saved" else fitted + logprob_work_bytes(read, shape.vocab // tp, device_type)


def shared_bytes(shape: Shape, rows: int, seq: int, packed: bool, attention: str) -> float:
    """What every layer reads but is stored once per micro-batch: the rotary table indexed by position ids
    ([s, rows, 1, head dim] fp32), the token ids the embedding saves (int64) and, for the local attention only, the
    packed mask ([rows, 1, s, s] bool) or megatron's cached causal mask ([s, s] bool); the fused attention takes
    no mask (causal flag; packed groups as `PackedGroups`)."""
    mask = (rows if packed else 1) * seq * seq if attention == "local" else 0
    return rows * seq * shape.head_dim * 4 + mask + rows * seq * 8


def predict_peak(coef: dict, shape: Shape, mode: str, seq: int, rows: int, read: int, kind: str = "train",
                 tp: int = 1, packed: bool = False, layers: Optional[int] = None, head: bool = True,
                 attention: str = "local", device_type: str = "cpu", sp: bool = False) -> Dict[str, float]:
    """One micro-batch's activation peak from the fitted parts: saved layers + shared + the largest of (head saved
    + its backward, the head's forward, one layer's backward), plus megatron's global buffer (local attention);
    `sp`: under sequence parallelism. `rows` may be a fraction (a CP rank's share)."""
    layers = shape.layers if layers is None else layers
    tokens = rows * seq
    buffer = rows * shape.heads / tp * seq * seq * 2 if attention == "local" else 0.0
    if kind == "forward":
        ws = predict_working_set(coef, shape, "forward", "none", seq, rows, tp, sp)
        head_fwd = (predict_head(coef, "head_forward.forward", shape, tokens, read, tp, device_type, sp)
                    if head else 0.0)
        return dict(saved=0.0, transient=max(ws, head_fwd), global_buffer=buffer, peak=max(ws, head_fwd) + buffer)
    per_token = predict_layer_saved(coef, shape, mode, seq, tp, sp)["layer_total"]
    saved = layers * per_token * tokens + shared_bytes(shape, rows, seq, packed, attention)
    head_saved = predict_head(coef, "head_saved", shape, tokens, read, tp, sp=sp) if head else 0.0
    candidates = [predict_working_set(coef, shape, "train", mode, seq, rows, tp, sp)]
    if head:
        candidates += [predict_head(coef, "head_backward.train", shape, tokens, read, tp, device_type, sp),
                       predict_head(coef, "head_forward.train", shape, tokens, read, tp, device_type, sp)]
    transient = max(candidates)
    return dict(saved=saved + head_saved, head_saved=head_saved, transient=transient, global_buffer=buffer,
                peak=saved + transient + buffer)


def check_fit(coefs: Dict[str, dict], cases: List[dict]) -> List[dict]:
    """Measured against predicted (by the fit of the case's attention), per case: saved bytes per token per layer,
    and the step's peak."""
    out = []
    for c in cases:
        if "saved" not in c or c["case"]["attention"] not in coefs:
            continue
        shape, case = Shape(**c["case"]["shape"]), c["case"]
        coef = coefs[case["attention"]]
        entry = dict(name=case["name"], tag=case["tag"], kind=case["kind"], attention=case["attention"])
        if case["kind"] == "train":
            predicted = predict_layer_saved(coef, shape, case["recompute"], c["seq"])["layer_total"]
            measured = c["per_layer"]["layer_total"]
            entry.update(saved_per_layer_token=measured, predicted=predicted,
                         error=(predicted - measured) / measured if measured else 0.0)
        peak = predict_peak(coef, shape, case["recompute"], c["seq"], c["rows"],
                            c.get("read", c["rows"] * c["response"]), case["kind"],
                            packed=case["layout"] == "packed", attention=case["attention"])["peak"]
        entry.update(peak=c["peak"], predicted_peak=peak, peak_error=(peak - c["peak"]) / c["peak"])
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------- projection
def param_counts(shape: Shape, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0,
                 value_head: bool = False) -> Dict[str, float]:
    """Parameters one rank holds at pipeline stage `stage`: dense (attention, norms, embeddings, dense MLPs,
    routers, shared experts) and expert (its E / EP routed experts' MLPs), as megatron lays them out (q/k/v/o, fc1
    and fc2 split by TP; norms, routers and multi-latent attention's down projections replicated; the embedding on
    the first stage, the output layer on the last -- a tied output layer is a second copy only when PP > 1; a
    value head is h weights)."""
    s = shape
    layers = s.layers // pp
    if s.kv_lora:  # multi-latent attention: q / kv down projections (+ their norms) replicated, the rest split
        qk_head = s.head_dim + s.qk_rope
        q = (s.hidden * s.q_lora + s.q_lora + s.q_lora * s.heads * qk_head / tp if s.q_lora
             else s.hidden * s.heads * qk_head / tp)
        kv = s.hidden * (s.kv_lora + s.qk_rope) + s.kv_lora + s.kv_lora * s.heads * (s.head_dim + s.v_head) / tp
        attention = q + kv + s.heads * s.v_head * s.hidden / tp
    else:
        attention = (2 * s.hidden * s.q + 2 * s.hidden * s.kv + ((s.q + 2 * s.kv) if s.qkv_bias else 0)) / tp
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    dense, expert = 0.0, 0.0
    for layer in range(stage * layers, (stage + 1) * layers):
        dense += attention + norms
        if s.experts and layer >= s.dense_layers:
            dense += s.experts * s.hidden + 3 * s.hidden * s.shared_ffn / tp  # router, shared expert
            expert += (s.experts // ep) * 3 * s.hidden * s.moe_ffn
        else:
            dense += 3 * s.hidden * s.ffn / tp
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


STATE_PARTS = ("weights", "grads", "masters", "moments")  # rl/model_state.PARTS
# megatron's rule for bf16 weights (fp32 grad buffer, fp32 main weights, Adam's two fp32 moments), the distributed
# optimizer dividing main weights and moments over DP: used only where the model state was not measured
RULE_BYTES = dict(weights=2.0, grads=4.0, masters=4.0, moments=8.0)


@dataclass
class StateBytes:
    """Model-state bytes per parameter of a trained bf16 model, by part (`rl/model_state.PARTS`), as the projection
    uses them: `plain` with megatron's optimizer (any DP); with the distributed optimizer `distributed` at DP 1
    equivalence (a part in `sharded` is that / DP at DP ranks); `left`: role -> part -> the fraction of a part an
    --offload-train-* flag moves that stays on the device after `TrainableModel.offload()`; `frozen`: a frozen
    model's; `source`: where the numbers come from."""

    plain: Dict[str, float]
    distributed: Dict[str, float]
    sharded: Dict[str, bool]
    left: Dict[str, Dict[str, float]]
    frozen: float
    source: str

    def per_param(self, part: str, distributed_optimizer: bool, dp: int) -> float:
        if not distributed_optimizer:
            return self.plain[part]
        return self.distributed[part] / dp if self.sharded[part] else self.distributed[part]

    @classmethod
    def rule(cls) -> "StateBytes":
        return cls(plain=dict(RULE_BYTES), distributed=dict(RULE_BYTES),
                   sharded=dict(weights=False, grads=False, masters=True, moments=True), left={}, frozen=2.0,
                   source="megatron's rule (not measured)")

    @classmethod
    def measured(cls, data: dict) -> "StateBytes":
        """From the JSON's `model_state` (DP1) and `tp2.model_state.distributed_optimizer_dp2` (two gloo processes):
        a part is sharded when its DP2 bytes are below 3/4 of the plain ones; offload fractions from the DP1 runs.
        Missing measurements fall back to megatron's rule, said in `source`."""
        rule = cls.rule()
        plain_run = data.get("model_state") or {}
        dist_run = ((data.get("tp2") or {}).get("model_state") or {}).get("distributed_optimizer_dp2") or {}
        plain = {p: plain_run["bytes_per_param"][p] for p in STATE_PARTS} if "bytes_per_param" in plain_run \
            else dict(rule.plain)
        sources = ["DP1 measured" if "bytes_per_param" in plain_run else "DP1 by megatron's rule"]
        if "bytes_per_param" in dist_run:
            dp = dist_run.get("data_parallel", 2)
            got = {p: dist_run["bytes_per_param"][p] for p in STATE_PARTS}
            sharded = {p: got[p] < 0.75 * plain[p] for p in STATE_PARTS}
            distributed = {p: got[p] * dp if sharded[p] else got[p] for p in STATE_PARTS}
            sources.append(f"distributed optimizer measured at DP{dp}")
        else:
            sharded, distributed = dict(rule.sharded), dict(rule.distributed)
            sources.append("distributed optimizer by megatron's rule (not measured: "
                           f"{dist_run.get('error', 'no DP2 run')[:120]})")
        left: Dict[str, Dict[str, float]] = {}
        for entry in (plain_run.get("offloaded") or {}).values():
            full, now = entry["after_onload"], entry["on_device_during_rollout"]
            for part in entry["parts"]:
                fraction = now[part] / full[part] if full[part] else 0.0
                left.setdefault(entry["role"], {})[part] = max(left.get(entry["role"], {}).get(part, 0.0), fraction)
        if not left:
            sources.append("offload assumed to leave nothing on the device (not measured)")
        return cls(plain=plain, distributed=distributed, sharded=sharded, left=left,
                   frozen=plain_run.get("frozen_bytes_per_param", rule.frozen), source="; ".join(sources))


@dataclass
class Role:
    name: str
    shape: Shape
    trainable: bool
    value_head: bool
    offloadable: bool  # --offload-ref-reward applies (reference, reward model)


@dataclass(frozen=True)
class Levers:
    """One parameter per lever of the projection; `Launch.levers` are a launcher's own."""

    attention: str = "sdpa"  # sdpa | local (--attention-backend local), each with its own measured fit
    recompute: str = "none"  # none | selective (core_attn) | full
    recompute_layers: Optional[int] = None  # full: layers per stage recomputed (block method); None: all (uniform 1)
    layout: str = "row"  # row | packed (prompt groups packed into one row: --micro-batch-size a multiple of n)
    distributed_optimizer: bool = False
    offload_ref_reward: bool = False
    offload_optimizer: bool = False  # --offload-train-optimizer (and -grad, -param): between updates, in host memory
    offload_grad: bool = False
    offload_param: bool = False
    micro_batch_tokens: Optional[int] = None  # --max-tokens-per-micro-batch; None: --micro-batch-size samples
    forward_micro_batch_tokens: Optional[int] = None  # --forward-max-tokens-per-micro-batch (None: the update's)
    rollout_max_num_seqs: Optional[int] = None  # --rollout-max-num-seqs: rows in flight; None: all at once
    rollout_max_num_batched_tokens: Optional[int] = None  # --rollout-max-num-batched-tokens: a prefill's tokens
    expert_parallel: Optional[int] = None  # layout: EP (None: the launcher's)
    pipeline_parallel: Optional[int] = None  # layout: PP (None: the launcher's)
    sequence_parallel: bool = False  # --sequence-parallel: the update's and the passes' activations split over TP
    context_parallel: Optional[int] = None  # layout: --context-parallel-size (None: the launcher's)

    @property
    def offload_flags(self) -> Tuple[str, ...]:
        return tuple(f for f in OFFLOAD_FLAGS if getattr(self, f"offload_{f}"))

    def label(self) -> str:
        full = "recompute full" + (f" {self.recompute_layers}/stage" if self.recompute_layers else "")
        parts = [self.attention, {"none": "no recompute", "selective": "recompute selective", "full": full}[
            self.recompute], "packed" if self.layout == "packed" else "",
                 "dist-opt" if self.distributed_optimizer else "",
                 ("offload " + "+".join(self.offload_flags)) if self.offload_flags else "",
                 "offload-ref" if self.offload_ref_reward else "",
                 f"budget {self.micro_batch_tokens}" if self.micro_batch_tokens else "",
                 f"fwd budget {self.forward_micro_batch_tokens}" if self.forward_micro_batch_tokens else "",
                 f"max-num-seqs {self.rollout_max_num_seqs}" if self.rollout_max_num_seqs else "",
                 f"max-num-batched-tokens {self.rollout_max_num_batched_tokens}"
                 if self.rollout_max_num_batched_tokens else "",
                 f"EP{self.expert_parallel}" if self.expert_parallel else "",
                 f"PP{self.pipeline_parallel}" if self.pipeline_parallel else "",
                 "SP" if self.sequence_parallel else "",
                 f"CP{self.context_parallel}" if self.context_parallel else ""]
        return ", ".join(p for p in parts if p)


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
    roles: List[Role]
    levers: Levers = Levers()  # as launched
    flags: Dict[str, object] = field(default_factory=dict)
    state_only: bool = False  # the activations of this model are not described (e.g. multi-latent attention)
    cp: int = 1  # --context-parallel-size; `dp` excludes it (megatron's data-parallel size)

    @property
    def rollout_rows(self) -> int:
        # each CP rank generates its own samples as a DP replica does: prompts are dealt over DP x CP
        return max(1, self.global_batch_size * self.n_samples // (self.dp * self.cp))


def read_launcher(path: str) -> Launch:
    """Runs the launcher with a stub in place of python (as tests/dist/test_examples.py does) at its own default node
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
    layers = shape.layers // pp
    recompute = args.recompute_granularity or "none"
    recompute_layers = None
    if recompute == "full" and not (args.recompute_method == "uniform" and args.recompute_num_layers == 1):
        # block k: k layers per stage checkpointed; uniform N > 1 is taken as all layers (it saves a little less)
        recompute_layers = args.recompute_num_layers if args.recompute_method == "block" else None
    if recompute == "selective" and list(args.recompute_modules or []) != ["core_attn"]:
        recompute = "selective"  # only core_attn was measured; other modules are projected as core_attn alone
    levers = Levers(attention=getattr(args, "attention", "sdpa"), recompute=recompute,
                    recompute_layers=recompute_layers if recompute_layers != layers else None,
                    layout="packed" if n > 1 and args.micro_batch_size % n == 0 else "row",
                    distributed_optimizer=bool(args.use_distributed_optimizer),
                    offload_ref_reward=bool(args.offload_ref_reward),
                    offload_optimizer=bool(args.offload_train_optimizer), offload_grad=bool(args.offload_train_grad),
                    offload_param=bool(args.offload_train_param),
                    micro_batch_tokens=args.max_tokens_per_micro_batch,
                    forward_micro_batch_tokens=args.forward_max_tokens_per_micro_batch,
                    rollout_max_num_seqs=args.rollout_max_num_seqs,
                    rollout_max_num_batched_tokens=args.rollout_max_num_batched_tokens,
                    sequence_parallel=bool(args.sequence_parallel),
                    context_parallel=args.context_parallel_size if args.context_parallel_size > 1 else None)
    flags = {k: getattr(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                           "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
                                           "n_samples_per_prompt", "max_prompt_length", "max_new_tokens",
                                           "max_length", "ppo_mini_batch_size", "use_distributed_optimizer",
                                           "offload_ref_reward", "offload_train_optimizer", "offload_train_grad",
                                           "offload_train_param", "recompute_granularity", "recompute_method",
                                           "recompute_num_layers", "recompute_modules", "attention",
                                           "max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch",
                                           "moe_routing_replay", "kl_coef", "reward_model_weight",
                                           "sequence_parallel", "context_parallel_size")}
    return Launch(name=path, stage=args.stage, world=world, tp=tp, pp=pp, ep=ep, dp=args.data_parallel_size,
                  expert_dp=world // (pp * ep * etp), micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, n_samples=n,
                  prompt_cap=args.max_prompt_length or (args.max_length - args.max_new_tokens),
                  response_cap=args.max_new_tokens, max_length=args.max_length,
                  mini_batch=args.ppo_mini_batch_size, roles=roles, levers=levers, flags=flags,
                  state_only=bool(info.get("state_only")), cp=args.context_parallel_size)


def layouts(launch: Launch) -> List[Tuple[int, int]]:
    """(PP, EP) layouts of the launcher's world and TP that its model splits into: PP dividing the layers, EP (a
    mixture of experts) dividing the experts, the world a multiple of TP x PP and of PP x EP, the prompts of an
    iteration dividing over DP; the launcher's first, then by growing PP, then EP."""
    shape = launch.roles[0].shape
    out = []
    for pp in range(1, shape.layers + 1):
        if shape.layers % pp or launch.world % (launch.tp * pp):
            continue
        dp = launch.world // (launch.tp * pp)
        if launch.global_batch_size % dp or launch.mini_batch % (dp * launch.micro_batch_size):
            continue
        for ep in ([e for e in range(1, shape.experts + 1) if shape.experts % e == 0 and launch.world % (pp * e) == 0]
                   if shape.experts else [1]):
            out.append((pp, ep))
    out.sort(key=lambda l: (l != (launch.pp, launch.ep), l[0], -l[1]))
    return out


def with_layout(launch: Launch, levers: Levers) -> Launch:
    """The launch at the levers' PP / EP / CP (DP, expert DP follow from the world). CP takes its ranks from DP
    (megatron's DP excludes them); where the world has too few devices for TP x PP x CP (DP 1 already), the world
    grows to TP x PP x CP devices at DP 1 (`world` says how many)."""
    pp, ep = levers.pipeline_parallel or launch.pp, levers.expert_parallel or launch.ep
    cp = levers.context_parallel or launch.cp
    if (pp, ep, cp) == (launch.pp, launch.ep, launch.cp):
        return launch
    world = max(launch.world, launch.tp * pp * cp)
    return replace(launch, pp=pp, ep=ep, cp=cp, world=world, dp=world // (launch.tp * pp * cp),
                   expert_dp=world // (pp * ep))


def micro_batch_shape(launch: Launch, levers: Levers, budget: Optional[int]) -> Tuple[float, int, float]:
    """(rows, row length, read positions) of the largest micro-batch, over all its CP ranks. By count:
    `--micro-batch-size` rows at the cap (a micro-batch with a response at the cap is that wide); packed: mbs / n
    prompt groups, each one row of prompt cap + n x response cap. With a token budget B (at least the widest row's
    share of a rank, width / CP: a budget counts the tokens one rank holds, `arguments._check_token_budgets`): B x CP
    tokens, as B x CP / cap rows of the cap (the largest sum of s^2 they can have), every token read (an upper
    bound: prompts can be short)."""
    n = launch.n_samples
    if levers.layout == "packed":  # --micro-batch-size a multiple of n (at least n)
        width, rows, read = launch.prompt_cap + n * launch.response_cap, max(1, launch.micro_batch_size // n), n
    else:
        width, rows, read = launch.prompt_cap + launch.response_cap, launch.micro_batch_size, 1
    if budget is None:
        return rows, width, rows * read * launch.response_cap
    budget = max(budget, -(-width // launch.cp)) * launch.cp
    return budget / width, width, float(budget)


def model_states(launch: Launch, levers: Levers, table: StateBytes, stage: int) -> Dict[str, Dict[str, float]]:
    """Bytes of every role's model state on one rank of `stage` in each phase: `rollout`, `passes` (old / reference
    log-probs, values, scores) and `update.ROLE` for each trained role. A trained role holds every part of its state
    in its own update; otherwise the parts its --offload-train-* flags move (`roles.offload_parts`) are in host
    memory (their measured `left` fraction stays), except the critic's weights in the passes and the actor's update
    (on-loaded for its values pass, offloaded after its own update: stages/trl_ppo.py). A frozen role holds 2 B a
    parameter, or with --offload-ref-reward nothing outside its own pass (the passes phase holds the largest)."""
    from mindspeed_llm.rl.roles import offload_parts

    counts = {r.name: param_counts(r.shape, launch.tp, launch.pp, launch.ep, stage, r.value_head)
              for r in launch.roles}
    away = {r.name: offload_parts(_offload_args(levers.offload_flags), r.name) for r in launch.roles if r.trainable}

    def trained(role: Role, phase: str) -> float:
        total = 0.0
        for part in STATE_PARTS:
            # the distributed optimizer shards over megatron's dp_cp group (DP x CP: CP ranks hold whole layers)
            per_param = (counts[role.name]["dense"] * table.per_param(part, levers.distributed_optimizer,
                                                                      launch.dp * launch.cp)
                         + counts[role.name]["expert"] * table.per_param(part, levers.distributed_optimizer,
                                                                        launch.expert_dp))
            on_device = 1.0
            if phase != f"update.{role.name}" and part in away[role.name] and not (
                    role.name == "critic" and part == "weights" and phase != "rollout"):
                on_device = table.left.get(role.name, {}).get(part, 0.0)
            total += per_param * on_device
        return total

    def frozen(role: Role, phase: str) -> float:
        return 0.0 if role.offloadable and levers.offload_ref_reward else table.frozen * counts[role.name]["total"]

    phases = ["rollout", "passes"] + [f"update.{r.name}" for r in launch.roles if r.trainable]
    out = {phase: {r.name: (trained if r.trainable else frozen)(r, phase) for r in launch.roles} for phase in phases}
    onloaded = [table.frozen * counts[r.name]["total"] for r in launch.roles
                if not r.trainable and r.offloadable and levers.offload_ref_reward]
    out["passes"]["on-loaded for its pass"] = max(onloaded or [0.0])
    return out


def project(launch: Launch, coefs: Dict[str, dict], levers: Levers, table: StateBytes) -> dict:
    """Per-device bytes of each phase at the worst pipeline stage: the rollout (model states + KV cache of the rows
    in flight + the prefill's or a decode step's working set), the forward-only passes (states + one micro-batch's
    forward working set) and the update (states + the micro-batches in flight under 1F1B + one backward's working
    set), by the fit of the levers' attention. A launcher whose activations are not described (`state_only`) gets
    its model states alone (a lower bound). Sequence parallelism divides the update's and the passes' hidden-sized
    activations by TP as well (the rollout runs without it); context parallelism CP gives a rank 1/CP of each
    micro-batch's tokens, plus the keys and values of the whole rows that each layer all-gathers (`kv_gathered`),
    and 1/CP of the rollout's rows (computed, not measured: `assumptions`)."""
    launch = with_layout(launch, levers)
    coef = coefs.get(levers.attention)
    local = levers.attention == "local"
    policy = launch.roles[0].shape
    stages = sorted({0, launch.pp - 1})
    sp, cp = levers.sequence_parallel and launch.tp > 1, launch.cp
    result = dict(levers=asdict(levers), label=levers.label(), stages={},
                  layout=dict(tp=launch.tp, pp=launch.pp, ep=launch.ep, dp=launch.dp, expert_dp=launch.expert_dp,
                              cp=cp, world=launch.world),
                  activations_described=not launch.state_only and coef is not None)
    for stage in stages:
        layers = policy.layers // launch.pp
        last = stage == launch.pp - 1
        states = model_states(launch, levers, table, stage)
        update_states = max(sum(v.values()) for k, v in states.items() if k.startswith("update."))
        phases = {"rollout": dict(states=sum(states["rollout"].values())),
                  "passes": dict(states=sum(states["passes"].values())),
                  "train": dict(states=update_states)}
        entry = dict(phases=phases, states_by_role=states)
        if result["activations_described"]:
            # rollout: KV cache of this stage's layers for the rows in flight, + the prefill or a decode step
            rows = min(levers.rollout_max_num_seqs or launch.rollout_rows, launch.rollout_rows)
            prompts = max(1, math.ceil(rows / launch.n_samples))  # a prompt's samples share one prefill
            if levers.rollout_max_num_batched_tokens:  # the engine prefills at most that many tokens at once
                prompts = min(prompts, max(1, levers.rollout_max_num_batched_tokens // launch.prompt_cap))
            slots = launch.prompt_cap + launch.response_cap
            kv_heads = max(1, policy.kv_heads // launch.tp)
            kv_cache = 2 * layers * slots * rows * kv_heads * policy.head_dim * 2
            prefill = predict_working_set(coef, policy, "forward", "none", launch.prompt_cap, prompts, launch.tp)
            prefill_buffer = prompts * policy.heads / launch.tp * launch.prompt_cap ** 2 * 2 if local else 0.0
            # a decode step: with the local attention megatron repeat_interleaves one layer's K and V cache to all
            # query heads on accelerators (the CPU patch that avoids it is CPU-only; the fused attention reads the
            # groups in place); sampling reads [rows, V] logits (bf16, an fp32 copy, probabilities)
            decode = ((2 * slots * rows * (policy.heads // launch.tp) * policy.head_dim * 2 if local else 0.0)
                      + (rows * policy.vocab * 10 if last else 0.0))
            # passes: one forward-only micro-batch (no grad)
            f_rows, f_len, f_read = micro_batch_shape(launch, levers, levers.forward_micro_batch_tokens
                                                      or levers.micro_batch_tokens)
            passes = predict_peak(coef, policy, "none", f_len, f_rows / cp, f_read / cp, kind="forward",
                                  tp=launch.tp, layers=layers, head=last, attention=levers.attention,
                                  device_type=ACCELERATOR, sp=sp)
            kv_width = max(1, policy.kv_heads // launch.tp) * policy.head_dim
            # CP: one layer's keys and values all-gathered for its whole rows (bf16): transient in a no-grad pass
            passes_gathered = f_rows * f_len * 2 * kv_width * 2 if cp > 1 else 0.0
            # update: micro-batches in flight on this stage under 1F1B, each with its saved activations
            mb_rows, mb_len, read = micro_batch_shape(launch, levers, levers.micro_batch_tokens)
            micro_batches = (max(1, launch.mini_batch // launch.dp // launch.micro_batch_size)
                             if levers.micro_batch_tokens is None else launch.pp)  # a budget: at least PP, say
            in_flight = min(launch.pp - stage, micro_batches)
            full_layers = (layers if levers.recompute_layers is None else min(layers, levers.recompute_layers)) \
                if levers.recompute == "full" else 0
            other = levers.recompute if levers.recompute != "full" else "none"
            tokens = mb_rows * mb_len / cp  # this rank's: 1/CP of each row's positions
            per_token = {mode: predict_layer_saved(coef, policy, mode, mb_len, launch.tp, sp)["layer_total"]
                         for mode in (other, "full")}
            saved = tokens * ((layers - full_layers) * per_token[other] + full_layers * per_token["full"])
            saved += shared_bytes(policy, mb_rows / cp, mb_len, levers.layout == "packed", levers.attention)
            # CP: a layer's keys and values all-gathered for the whole rows (bf16), saved by the core attention for
            # its backward where it is not recomputed; selective recompute checkpoints the core attention, which
            # gathers inside, and full recompute keeps the layer input only: there the gather is redone in the
            # backward (transient, with its gradient before the reduce-scatter)
            gathered = mb_rows * mb_len * 2 * kv_width * 2 if cp > 1 else 0.0
            kv_kept_layers = layers - full_layers if other == "none" else 0
            saved += kv_kept_layers * gathered
            candidates = []
            if layers - full_layers:
                candidates.append(predict_working_set(coef, policy, "train", other, mb_len, mb_rows / cp, launch.tp,
                                                      sp) + gathered * (1 if other == "none" else 2))
            if full_layers:  # a recomputed layer's backward: its recomputed saved set + the backward's working set
                candidates.append(predict_working_set(coef, policy, "train", "full", mb_len, mb_rows / cp,
                                                      launch.tp, sp) + 2 * gathered)
            if last:
                saved += predict_head(coef, "head_saved", policy, tokens, read / cp, launch.tp, sp=sp)
                candidates += [predict_head(coef, f"head_{way}.train", policy, tokens, read / cp, launch.tp,
                                            ACCELERATOR, sp=sp) for way in ("backward", "forward")]
            train_buffer = mb_rows * policy.heads / launch.tp * mb_len ** 2 * 2 if local else 0.0
            buffer = max(prefill_buffer, train_buffer, passes["global_buffer"])  # megatron's, kept once allocated
            phases["rollout"].update(kv_cache=kv_cache, working_set=max(prefill, decode), global_buffer=buffer)
            phases["passes"].update(working_set=passes["transient"] + passes_gathered, global_buffer=buffer)
            phases["train"].update(activations_in_flight=in_flight * saved, in_flight=in_flight,
                                   working_set=max(candidates), global_buffer=buffer)
            entry.update(kv_gathered=dict(per_layer=gathered, kept_layers=kv_kept_layers))
            entry.update(prefill=prefill, decode=decode, rollout_rows=rows,
                         micro_batch=dict(rows=mb_rows, length=mb_len, read=read),
                         forward_micro_batch=dict(rows=f_rows, length=f_len, read=f_read))
        for phase in phases.values():
            phase["total"] = sum(v for k, v in phase.items() if k != "in_flight")
        result["stages"][stage] = entry
    for phase in ("rollout", "passes", "train"):
        result[phase] = max(result["stages"][s]["phases"][phase]["total"] for s in stages)
        result[f"{phase}_states"] = max(result["stages"][s]["phases"][phase]["states"] for s in stages)
    return result


def lever_flags(launch: Launch, levers: Levers) -> List[str]:
    """The command-line flags of `levers`, and the layout variables of the launchers."""
    layers = launch.roles[0].shape.layers // (levers.pipeline_parallel or launch.pp)
    out = []
    if levers.attention == "local":
        out.append("--attention-backend local")
    if levers.recompute == "selective":
        out.append("--recompute-granularity selective")
    elif levers.recompute == "full":
        k = levers.recompute_layers or layers
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" if k >= layers
                   else f"--recompute-granularity full --recompute-method block --recompute-num-layers {k}")
    if levers.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    out += [f"--offload-train-{f}" for f in levers.offload_flags]
    if levers.offload_ref_reward:
        out.append("--offload-ref-reward")
    if levers.micro_batch_tokens:
        out.append(f"--max-tokens-per-micro-batch {levers.micro_batch_tokens}")
    if levers.forward_micro_batch_tokens:
        out.append(f"--forward-max-tokens-per-micro-batch {levers.forward_micro_batch_tokens}")
    if levers.rollout_max_num_seqs:
        out.append(f"--rollout-max-num-seqs {levers.rollout_max_num_seqs}")
    if levers.rollout_max_num_batched_tokens:
        out.append(f"--rollout-max-num-batched-tokens {levers.rollout_max_num_batched_tokens}")
    if levers.pipeline_parallel and levers.pipeline_parallel != launch.pp:
        out.append(f"PP={levers.pipeline_parallel}")
    if levers.expert_parallel and levers.expert_parallel != launch.ep:
        out.append(f"EP={levers.expert_parallel}")
    if levers.sequence_parallel:
        out.append("--sequence-parallel")
    if (levers.context_parallel or launch.cp) > 1:
        out.append(f"--context-parallel-size {levers.context_parallel or launch.cp}")
    world = with_layout(launch, levers).world
    if world != launch.world:  # CP without the devices to take from DP (8 a node, launch_env.sh)
        out.append(f"NNODES={world // 8}" if world % 8 == 0 else f"{world} devices")
    return out


# The recommendation's headroom for the fit: a phase fits when its model state plus its other bytes (KV cache,
# activations, working sets, buffers) with this share added stay within the limit (the fit's peaks are within
# about +-10% at the main shape; see the fit check)
FIT_MARGIN = 0.10


def _fits(p: dict, limit: float, phases=("rollout", "passes", "train")) -> bool:
    return all(p[ph] + FIT_MARGIN * (p[ph] - p[f"{ph}_states"]) <= limit for ph in phases)


def _padding_ratio(launch: Launch, budget: Optional[int]) -> float:
    """Processed / real tokens of the update's micro-batches at the skewed mix of the launcher's rollout (by count
    when `budget` is None)."""
    launch_prompts, responses = skewed_mix(launch.rollout_rows, launch.n_samples, launch.prompt_cap,
                                           launch.response_cap)
    costs = micro_batch_costs(launch_prompts, responses, launch.n_samples, launch.micro_batch_size,
                              budget or launch.prompt_cap + launch.response_cap)
    return costs["by_count" if budget is None else "token_budget"]["tokens_ratio"]


def recommend(launch: Launch, coefs: Dict[str, dict], table: StateBytes, limit_gb: float = TARGET_TRAIN_GB) -> dict:
    """The cheapest levers under which the update, the passes and the rollout each fit `limit_gb` (with the fit's
    headroom, `FIT_MARGIN`), with the fused
    attention and the distributed optimizer wherever DP > 1 (no extra communication volume): at the launcher's
    layout first, then other (PP, EP) layouts (`layouts`). Cheapest first: recompute (none, selective, full of k
    layers per stage, smallest k first) outside, model-state offload inside (nothing, --offload-ref-reward, the
    --offload-train-* flags too), for the update and the passes at one row at the cap; then the largest token
    budget (4, 2 or 1 rows at the cap) that keeps the update within the limit and the largest forward budget
    (8 .. 1 rows) for the passes (a budget that pads more than micro-batches by count is not taken); then the
    rollout: all rows at once, with the offloads chosen, then with every --offload-train-* flag, then with the rows
    in flight halving (--rollout-max-num-seqs)."""
    limit = limit_gb * GB
    cap = launch.prompt_cap + launch.response_cap
    notes: List[str] = []
    state_options = [dict(offload_ref_reward=launch.levers.offload_ref_reward)]
    if any(r.offloadable for r in launch.roles) and not launch.levers.offload_ref_reward:
        state_options.append(dict(offload_ref_reward=True))
    state_options.append(dict(state_options[-1], offload_optimizer=True, offload_grad=True, offload_param=True))
    chosen = None
    for pp, ep in layouts(launch):
        lay = with_layout(launch, Levers(pipeline_parallel=pp, expert_parallel=ep))
        layers = launch.roles[0].shape.layers // pp
        ladder = [dict(recompute="none"), dict(recompute="selective")] + [
            dict(recompute="full", recompute_layers=k if k < layers else None) for k in range(1, layers + 1)]
        base = dict(attention="sdpa", distributed_optimizer=launch.levers.distributed_optimizer or lay.dp > 1
                    or lay.expert_dp > 1,
                    micro_batch_tokens=cap, forward_micro_batch_tokens=cap,
                    pipeline_parallel=pp if pp != launch.pp else None, expert_parallel=ep if ep != launch.ep else None)
        for rc in ladder:
            for state in state_options:
                levers = Levers(**base, **rc, **state)
                if _fits(project(launch, coefs, levers, table), limit, ("passes", "train")):
                    chosen = levers
                    break
            if chosen:
                break
        if chosen:
            if (pp, ep) != (launch.pp, launch.ep):
                notes.append(f"does not fit at the launcher's layout (PP{launch.pp} EP{launch.ep}); fits at PP{pp} "
                             f"EP{ep}")
            break
    if chosen is None:
        notes.append(f"the update does not fit {limit_gb:g} GB at any layout with these levers")
        chosen = Levers(attention="sdpa", distributed_optimizer=True, recompute="full", offload_ref_reward=True,
                        offload_optimizer=True, offload_grad=True, offload_param=True, micro_batch_tokens=cap,
                        forward_micro_batch_tokens=cap)
    # budgets of at most 4 (update) / 8 (passes) rows at the cap: beyond that fewer, larger micro-batches save
    # little and only take the margin; a budget that pads more than 1.2x (or than micro-batches by count) at the
    # skewed mix is not taken (a few samples in one budget micro-batch are padded to their longest); a budget of
    # one row at the cap only replaces micro-batches of one sample (it lets short samples share one), or is the
    # last resort where micro-batches by count do not fit
    padding = max(1.2, _padding_ratio(launch, None))
    for key, phase, sizes in (("micro_batch_tokens", "train", (4, 2)),
                              ("forward_micro_batch_tokens", "passes", (8, 4, 2))):
        options = [rows * cap for rows in sizes if _padding_ratio(launch, rows * cap) <= padding]
        options += ([cap] if launch.micro_batch_size == 1 else []) + [None, cap]
        for budget in options:
            candidate = replace(chosen, **{key: budget})
            if _fits(project(launch, coefs, candidate, table), limit, (phase,)):
                chosen = candidate
                break
    # the rollout: all rows at once, with the training state's offload if needed, then fewer rows in flight
    total = with_layout(launch, chosen).rollout_rows
    offload = dict(offload_optimizer=True, offload_grad=True, offload_param=True)
    found = None
    for option, rows in [(dict(), None), (offload, None)] + [(offload, r) for r in
                                                             (total // 2 ** k for k in range(1, 12)) if r >= 1]:
        candidate = replace(chosen, **option, rollout_max_num_seqs=rows)
        if _fits(project(launch, coefs, candidate, table), limit, ("rollout",)):
            found = candidate
            break
    if found is None:
        notes.append(f"the rollout does not fit {limit_gb:g} GB even one row at a time")
    else:
        chosen = found
    p = project(launch, coefs, chosen, table)
    return dict(levers=asdict(chosen), label=chosen.label(), flags=lever_flags(launch, chosen),
                rollout_gb=p["rollout"] / GB, passes_gb=p["passes"] / GB, train_gb=p["train"] / GB, notes=notes)


def lever_rows(launch: Launch, recommended: Levers) -> List[Tuple[str, Levers]]:
    """The projection's rows: as launched, each lever flipped from there, the recommendation (and each of its
    levers taken back, where it differs from the launcher)."""
    base = launch.levers
    cap = launch.prompt_cap + launch.response_cap
    rows = [("as launched", base)]
    flips = [
        ("attention " + ("local" if base.attention == "sdpa" else "sdpa"),
         dict(attention="local" if base.attention == "sdpa" else "sdpa")),
        ("no recompute", dict(recompute="none", recompute_layers=None)),
        ("recompute selective", dict(recompute="selective", recompute_layers=None)),
        ("recompute full", dict(recompute="full", recompute_layers=None)),
        ("dist-opt " + ("off" if base.distributed_optimizer else "on"),
         dict(distributed_optimizer=not base.distributed_optimizer)),
        ("offload-train " + ("off" if base.offload_flags else "on (optimizer, grad, param)"),
         dict(offload_optimizer=not base.offload_flags, offload_grad=not base.offload_flags,
              offload_param=not base.offload_flags)),
        ("offload-ref " + ("off" if base.offload_ref_reward else "on"),
         dict(offload_ref_reward=not base.offload_ref_reward)),
        ("micro-batches by count" if base.micro_batch_tokens else "token budget = 1 row at the cap",
         dict(micro_batch_tokens=None, forward_micro_batch_tokens=None) if base.micro_batch_tokens
         else dict(micro_batch_tokens=cap)),
        ("token budget x2", dict(micro_batch_tokens=2 * (base.micro_batch_tokens or cap))),
        ("rollout rows in flight / 2", dict(rollout_max_num_seqs=max(1, (base.rollout_max_num_seqs
                                                                         or launch.rollout_rows) // 2))),
        ("rollout rows in flight / 4", dict(rollout_max_num_seqs=max(1, (base.rollout_max_num_seqs
                                                                         or launch.rollout_rows) // 4))),
    ]
    if launch.n_samples > 1 and base.layout == "row":
        flips.append((f"packed prompt groups (mbs {launch.n_samples})", dict(layout="packed")))
    if launch.tp > 1 and not base.sequence_parallel:
        flips.append(("+ sequence parallel", dict(sequence_parallel=True)))
    # CP needs the fused attention (arguments.py) and refuses a mixture of experts (rl/moe.model_options); it takes
    # its ranks from DP, or more devices where DP is 1 already (`with_layout`)
    if launch.cp == 1 and base.attention == "sdpa" and not launch.roles[0].shape.experts:
        cp_dp = launch.world // (launch.tp * launch.pp * 2)
        where = f"DP{cp_dp}" if cp_dp else f"{launch.tp * launch.pp * 2} devices, DP1"
        flips.append((f"+ CP 2 ({where})", dict(context_parallel=2)))
        if base.micro_batch_tokens:  # a budget counts a rank's tokens: halved, a micro-batch holds the same rows
            flips.append((f"+ CP 2 ({where}), budgets / 2", dict(
                context_parallel=2, micro_batch_tokens=max(-(-cap // 2), base.micro_batch_tokens // 2),
                forward_micro_batch_tokens=max(-(-cap // 2), (base.forward_micro_batch_tokens
                                                              or base.micro_batch_tokens) // 2))))
    if launch.state_only:  # the model state's levers only
        flips = [f for f in flips if f[0].startswith(("dist-opt", "offload"))]
    for label, change in flips:
        levers = replace(base, **change)
        if levers != base:
            rows.append((label, levers))
    if recommended != base:
        rows.append(("recommended", recommended))
    return rows


# The long-response config: the launcher at a 16k response (prompt 2048, --max-new-tokens 16384 --max-length 18432)
LONG_RESPONSE = dict(prompt_cap=2048, response_cap=16384, max_length=18432)
LONG_RESPONSE_LAUNCHERS = ("examples/mcore/qwen25/grpo_qwen25_7b.sh", "examples/mcore/qwen25/ppo_qwen25_32b.sh")


def long_response_rows(launch: Launch) -> Tuple[Launch, List[Tuple[str, Levers]]]:
    """The launcher at `LONG_RESPONSE`, and its rows: as launched (its token budgets raised to one row where they
    are below it: `arguments._check_token_budgets` refuses them), + sequence parallelism, + SP + CP 2 (budgets one
    row's share of a rank), then what it needs to fit `TARGET_TRAIN_GB` (fewer rollout rows in flight; full
    recompute for the update's margin)."""
    long = replace(launch, **LONG_RESPONSE)
    n = long.n_samples
    width = long.prompt_cap + (n if launch.levers.layout == "packed" else 1) * long.response_cap
    base = launch.levers

    def budgets(levers: Levers, cp: int) -> Levers:
        row = -(-width // cp)
        return replace(levers, micro_batch_tokens=max(levers.micro_batch_tokens, row)
                       if levers.micro_batch_tokens else None,
                       forward_micro_batch_tokens=max(levers.forward_micro_batch_tokens, row)
                       if levers.forward_micro_batch_tokens else None)

    launched = budgets(base, 1)
    sp = replace(launched, sequence_parallel=long.tp > 1)
    cp2 = budgets(replace(sp, context_parallel=2, micro_batch_tokens=-(-width // 2) if base.micro_batch_tokens
                          else None), 2)
    rows = [("as launched at 16k" + (" (budgets raised to one row)" if launched != base else ""), launched),
            ("+ sequence parallel", sp), ("+ SP + CP 2", cp2)]
    # the rollout's KV cache grows with the response: fewer rows in flight (of a rank's rows at CP 2)
    in_flight = int(min(base.rollout_max_num_seqs or math.inf, with_layout(long, cp2).rollout_rows))
    for k in (2, 4):
        rows.append((f"+ SP + CP 2, rollout rows in flight / {k} ({max(1, in_flight // k)})",
                     replace(cp2, rollout_max_num_seqs=max(1, in_flight // k))))
    rows.append(("+ SP + CP 2 + full recompute, rollout rows in flight / 2",
                 replace(cp2, recompute="full", recompute_layers=None, rollout_max_num_seqs=max(1, in_flight // 2))))
    return long, rows


def _row_entry(label: str, launch: Launch, levers: Levers, p: dict) -> dict:
    return dict(label=label, levers=asdict(levers), flags=lever_flags(launch, levers),
                activations_described=p["activations_described"], layout=p["layout"],
                **{f"{k}_gb": p[k] / GB for k in ("rollout", "passes", "train", "rollout_states",
                                                  "passes_states", "train_states")},
                stages={str(s): {ph: {k: (v / GB if k != "in_flight" else v) for k, v in d.items()}
                                 for ph, d in st["phases"].items()}
                        for s, st in p["stages"].items()},
                states_by_role_gb={str(s): {ph: {k: v / GB for k, v in roles_.items()}
                                            for ph, roles_ in st["states_by_role"].items()}
                                   for s, st in p["stages"].items()})


def project_launchers(coefs: Dict[str, dict], table: StateBytes, launchers: Sequence[str]) -> dict:
    out = {}
    for path in launchers:
        launch = read_launcher(path)
        model = LAUNCHERS[path]["model"]
        rec = recommend(launch, coefs, table) if not launch.state_only else None
        rows = []
        for label, levers in lever_rows(launch, Levers(**rec["levers"]) if rec else launch.levers):
            rows.append(_row_entry(label, launch, levers, project(launch, coefs, levers, table)))
        long_rows = None
        if path in LONG_RESPONSE_LAUNCHERS and not launch.state_only:
            long, variants = long_response_rows(launch)
            long_rows = [_row_entry(label, long, levers, project(long, coefs, levers, table))
                         for label, levers in variants]
        if launch.state_only:  # what the distributed optimizer and the offloads leave at best
            best = replace(launch.levers, distributed_optimizer=True, offload_ref_reward=True, offload_optimizer=True,
                           offload_grad=True, offload_param=True)
            p = project(launch, coefs, best, table)
            rows.append(dict(label="best model state (dist-opt, every offload)", levers=asdict(best),
                             flags=lever_flags(launch, best), activations_described=False, layout=p["layout"],
                             **{f"{k}_gb": p[k] / GB for k in ("rollout", "passes", "train", "rollout_states",
                                                               "passes_states", "train_states")}))
        counted = param_counts(model_shape(model))["total"]
        mb = None
        if not launch.state_only:
            prompts, responses = skewed_mix(launch.rollout_rows, launch.n_samples, launch.prompt_cap,
                                            launch.response_cap)
            mb = micro_batch_costs(prompts, responses, launch.n_samples, launch.micro_batch_size,
                                   (Levers(**rec["levers"]).micro_batch_tokens if rec else None)
                                   or launch.prompt_cap + launch.response_cap)
        out[path] = dict(
            model=model, stage=launch.stage, world=launch.world, tp=launch.tp, pp=launch.pp, ep=launch.ep,
            dp=launch.dp, expert_dp=launch.expert_dp, state_only=launch.state_only,
            roles=[dict(name=r.name, trainable=r.trainable, value_head=r.value_head, offloadable=r.offloadable)
                   for r in launch.roles],
            rollout_rows=launch.rollout_rows, micro_batch_size=launch.micro_batch_size, prompt_cap=launch.prompt_cap,
            response_cap=launch.response_cap, mini_batch=launch.mini_batch, flags=launch.flags,
            as_launched=asdict(launch.levers), params_counted=counted,
            params_published=MODELS[model]["published_params"], rows=rows, recommended=rec, micro_batching=mb,
            long_response=dict(config=LONG_RESPONSE, rows=long_rows) if long_rows else None)
    return out


# ---------------------------------------------------------------------------------------------- cases and driver
def main_cases(shape: Shape, lengths: Sequence[int], attentions: Sequence[str]) -> List[Case]:
    cases = []
    for attention in attentions:
        for seq in lengths:
            for mode in RECOMPUTE:
                cases.append(Case(shape, seq, attention, recompute=mode))
            cases.append(Case(shape, seq, attention, kind="forward"))
    # the same 4 samples of one prompt as 4 rows and as one packed row [prompt | r1 .. r4] of `seq` tokens
    for attention in attentions:
        for seq in lengths[:2]:
            cases.append(Case(shape, seq, attention, layout="packed", group=4, tag="packed"))
            cases.append(Case(shape, seq, attention, layout="row", group=4, tag="packed"))
    return cases


def grid_cases(grid: dict, attentions: Sequence[str]) -> List[Case]:
    cases = []
    for attention in attentions:
        for tag in ("dense", "held_out", "qk_norm", "moe", "moe_held_out"):
            for shape in grid[tag]:
                for seq in grid["lengths"]:
                    name = "fit" if tag == "dense" else tag
                    for mode in RECOMPUTE:
                        cases.append(Case(shape, seq, attention, recompute=mode, tag=name))
                    cases.append(Case(shape, seq, attention, kind="forward", tag=name))
    return cases


def run_cases(cases: Sequence[Case], device_type: str, max_bytes: float, log, timing_tags=("main", "packed"),
              reuse: Optional[Dict[str, dict]] = None, only: Optional[str] = None, save=None, date: str = ""):
    """Measures `cases` (those in `reuse` taken from it, those `only` does not match skipped), calling `save`
    with the results so far after each measured case (a long run keeps what it measured); each measured case
    records its run's `date` (`measured_on`), which reuse keeps."""
    results = []
    for i, case in enumerate(cases):
        if reuse and case.name in reuse:
            results.append(reuse[case.name])
            continue
        if only and not re.search(only, case.name):
            results.append(dict(case=case_dict(case), skipped=f"not selected (--only {only})"))
            continue
        guess = rough_case_bytes(case)
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
        r["measured_on"] = date
        results.append(r)
        log(f"[{i + 1}/{len(cases)}] {case.name}: saved/layer/token {r['per_layer']['layer_total']:.0f} B, "
            f"peak {r['peak'] / 2**20:.1f} MiB ({time.perf_counter() - start:.1f} s)")
        if save is not None:
            save(results + [dict(case=case_dict(c), skipped="not reached yet") for c in cases[len(results):]])
    return results


def tp_check(coefs: Dict[str, dict], tp1: List[dict], tp2: List[dict]) -> List[dict]:
    """Measured TP2 saved bytes per token per layer (rank 0) against the TP rule's prediction from the TP1 fit of
    the case's attention, and the replicated / divided split the two measurements give (m1 = r + d, m2 = r + d/2)."""
    by_name = {c["case"]["name"]: c for c in tp1 if "saved" in c}
    out = []
    for c in tp2:
        if "saved" not in c or c["case"]["attention"] not in coefs:
            continue
        shape, mode = Shape(**c["case"]["shape"]), c["case"]["recompute"]
        measured = c["per_layer"]["layer_total"]
        predicted = predict_layer_saved(coefs[c["case"]["attention"]], shape, mode, c["seq"], tp=2)["layer_total"]
        entry = dict(name=c["case"]["name"], attention=c["case"]["attention"], measured_tp2=measured,
                     predicted_tp2=predicted, error=(predicted - measured) / measured if measured else 0.0,
                     peak_tp2=c["peak"])
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
    "the published ones (JSON projection.*.params_counted).",
    "Launcher flags come from running each launcher (its default node count, 8 devices a node) with a stub python "
    "and mindspeed_llm.arguments.parse_args; critic / reward models are value-head models of the same trunk.",
    "Rollout: without --rollout-max-num-seqs all gbs x n / DP rows of a rank are in flight at once; the engine's KV "
    "cache is 2 x layers x (prompt cap + response cap) x rows x kv heads / TP x head dim x 2 B per stage; with N "
    "rows in flight it holds N rows; a prompt's n samples share one prefill, which runs the prompt cap for "
    "ceil(rows / n) prompts at once, or for --rollout-max-num-batched-tokens / prompt cap of them.",
    "A decode step on an accelerator with the local attention adds megatron's repeat_interleave of one layer's K "
    "and V cache to all query heads (the fused attention reads the KV groups in place), and [rows, V] logits x "
    "10 B for sampling; computed, not measured.",
    "Training micro-batches: by count, --micro-batch-size rows at the cap (a micro-batch with a response at the cap "
    "is cut to that width); with a token budget B: B tokens as B / cap rows at the cap (the largest sum of s^2), "
    "every token read (prompts may be short); packed: mbs / n rows of prompt cap + n x response cap.",
    "Pipeline: 1F1B keeps min(PP - stage, micro-batches) micro-batches' saved activations in flight (with a token "
    "budget PP of them); the first and last stages are projected and the larger is reported.",
    "Model state by part (weights, grads, masters, moments) in bytes per parameter as measured (rl/model_state."
    "bytes_per_parameter of a real TrainableModel after an Adam step): at DP1 with megatron's optimizer, and with "
    "the distributed optimizer at DP2 on two gloo processes; a part whose DP2 bytes are below 3/4 of the plain "
    "ones is taken as divided by DP (expert DP for experts). Frozen models: the measured frozen bytes per "
    "parameter. --offload-train-*: the parts roles.offload_parts names leave the device from one update to the "
    "next (the measured fraction stays), the critic's weights come back for its values pass; --offload-ref-reward: "
    "a frozen model counts only in its own pass.",
    "Activations per token per layer and working sets come from the fit of each attention at TP1; under TP the "
    "hidden-sized terms stay replicated (no sequence parallelism) and the q / kv / FFN / heads terms divide "
    "(checked at TP2).",
    "Sequence parallelism (--sequence-parallel; computed, not measured): in the update and the passes every "
    "per-token term of the saved bytes (the hidden-sized ones and the per-token scalars too) and the hidden-sized "
    "terms of a layer's working set and of the head's per-token part divide by TP; a layer's working set adds the "
    "bf16 layer input all-gathered over TP for the column-parallel linears (tokens x h, the whole sequence). "
    "Weights and their gradients, the rotary table and token ids are unchanged. Generation runs without it "
    "(the rollout is unchanged).",
    "Context parallelism CP N (--context-parallel-size; computed, not measured): in the update and the passes a "
    "rank holds 1/N of each micro-batch's positions: saved bytes, working sets, the head and its reads per token "
    "/ N. A token budget counts a rank's tokens (arguments._check_token_budgets), so a micro-batch of budget B "
    "holds B x N tokens of rows. Each layer all-gathers its keys and values for the whole rows (rows x S x 2 x "
    "kv heads / TP x head dim x 2 B): kept for the backward by every layer that is not recomputed (counted on "
    "top of the local k and v the fit already holds, an overestimate of 1/N of it); selective recompute "
    "checkpoints the core attention, which gathers inside, and full recompute keeps the layer input only: there "
    "the gather is redone in the backward (two gathered sizes in the working set: the keys and values and their "
    "gradients before the reduce-scatter; one where they are kept). A no-grad pass adds one layer's gather. The "
    "padding of rows to a multiple of 2N is not counted.",
    "Context parallelism in the rollout and the model state: each CP rank generates its own samples as a DP "
    "replica does (prompts dealt over DP x CP, rows a rank gbs x n / (DP x CP)); CP ranks hold whole layers, so "
    "the model state divides by neither, except that the distributed optimizer shards over megatron's dp_cp "
    "group (its divided parts / (DP x CP)). CP takes its ranks from DP at the same world; where DP is 1 already "
    "the world grows to TP x PP x CP devices (the layout column says how many).",
    "The fused attention's fit is of torch's CPU kernel (saves q, k, v, the output and one fp32 log-sum-exp per "
    "query and head); NPU's npu_fusion_attention keeps [b, heads, s, 8] fp32 softmax max and sum instead (60 B more "
    "per token and head), CUDA's flash kernels the log-sum-exp: not measured here.",
    "Mixture of experts: a rank's routed tokens per local token equal top-k on average (balanced routing, "
    "dropless); the all-to-all dispatcher was measured at EP1.",
    "Megatron's global memory buffer (the local attention's [b x heads, s, s] bf16 score target) keeps its largest "
    "size once allocated (prefill or update) and is counted in every phase; the fused attention does not use it.",
    "Optimizer step temporaries, communication buffers, the allocator's fragmentation and the framework's own "
    "workspace are not counted: the 56 GB target leaves 8 GB of a 64 GB device for them.",
    "Skewed mix: 10% of responses at the cap, the rest uniform in 10-50% of it; prompts uniform in 5-15% of the "
    "prompt cap, one per prompt group.",
]


def fmt_gb(x) -> str:
    return "-" if x is None else f"{x:6.1f}"


def print_table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(str(h).ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _state_text(run: dict) -> str:
    if "bytes_per_param" not in run:
        return f"did not run ({run.get('error', 'not measured')[:160]})"
    return ", ".join(f"{k} {v:.2f}" for k, v in run["bytes_per_param"].items())


def _lever_table(entries: List[dict]) -> str:
    rows = []
    for r in entries:
        worst = max(r["rollout_gb"], r["passes_gb"], r["train_gb"])
        fits = "/".join(str(gb) for gb in DEVICES_GB.values() if worst <= gb) or "neither"
        bound = "" if r["activations_described"] else ">="
        lay = r["layout"]
        where = f"TP{lay['tp']} PP{lay['pp']} CP{lay.get('cp', 1)} DP{lay['dp']} ({lay.get('world', '?')})"
        rows.append([r["label"], where, bound + fmt_gb(r["rollout_gb"]).strip(),
                     bound + fmt_gb(r["passes_gb"]).strip(), bound + fmt_gb(r["train_gb"]).strip(),
                     fmt_gb(r["rollout_states_gb"]).strip(), fmt_gb(r["train_states_gb"]).strip(),
                     "yes" if worst <= TARGET_TRAIN_GB else "no", fits])
    return print_table(rows, ["levers", "layout (devices)", "rollout GB", "passes GB", "train GB", "state@rollout",
                              "state@train", f"all<={TARGET_TRAIN_GB}", "fits GB"])


def report(data: dict) -> str:
    out = []
    cases = [c for c in data["cases"] if c["case"]["tag"] in ("main", "packed")]
    rows = []
    for c in cases:
        name = c["case"]["name"].split(" h")[0]
        if "saved" not in c:
            rows.append([name, "-", "-", "-", "-", "-", "-", c.get("skipped") or c.get("error", "")])
            continue
        pl = c["per_layer"]
        rows.append([name, c["tokens"], f"{pl['layer_total']:.0f}", f"{pl.get('attention', 0):.0f}",
                     f"{c['peak'] / 2**20:.0f}", f"{c['global_buffer'] / 2**20:.0f}",
                     f"{c['time_s']:.1f}" if "time_s" in c else "-", c.get("measured_on", "")])
    out.append("Measured (" + data["meta"]["shape_text"] + "):")
    out.append(print_table(rows, ["case", "tokens", "saved B/tok/layer", "of it attention", "peak MiB",
                                  "buffer MiB", "time s", "measured"]))
    checks = data.get("peak_check", {})
    scripted = checks.get("scripted", {})
    out.append(f"\nPeak method: a scripted sequence {scripted.get('measured')} B measured, "
               f"{scripted.get('expected')} B expected")
    for key, label in (("rss", "glibc's default"), ("rss_fixed_mmap_threshold", "MALLOC_MMAP_THRESHOLD_=131072")):
        rss = checks.get(key)
        if rss and "rss_rise" in rss:
            out.append(f"  RSS of a fresh process over one step ({rss['case'].split(' h')[0]}, {label}): rises "
                       f"{rss['rss_rise'] / 2**20:.0f} MiB, the profiler's peak {rss['profiler_peak'] / 2**20:.0f} MiB "
                       f"({100 * (rss['rss_rise'] / rss['profiler_peak'] - 1):+.0f}%)")
    fit = data["fit"]
    out.append("\nFit check (saved per token per layer; peak of the step), by the fit of the case's attention:")
    rows = [[e["name"].split(" L")[0], e["tag"], f"{e.get('saved_per_layer_token', 0):.0f}",
             f"{e.get('predicted', 0):.0f}", f"{100 * e.get('error', 0):+.1f}%", f"{e['peak'] / 2**20:.0f}",
             f"{e['predicted_peak'] / 2**20:.0f}", f"{100 * e['peak_error']:+.1f}%"]
            for e in fit["check"] if e["tag"] in ("main", "held_out", "moe_held_out", "packed")]
    out.append(print_table(rows, ["case", "tag", "measured", "fit", "err", "peak MiB", "fit MiB", "err"]))
    for attention, errors in fit["held_out"].items():
        out.append(f"{attention}: held-out max |error| saved {100 * errors['saved']:.1f}%, "
                   f"peak {100 * errors['peak']:.1f}%")
    if data.get("tp2", {}).get("check"):
        out.append("\nTP2 (2 gloo processes, rank 0) against the TP rule:")
        rows = [[e["name"].split(" h")[0], f"{e.get('measured_tp1', 0):.0f}", f"{e['measured_tp2']:.0f}",
                 f"{e['predicted_tp2']:.0f}", f"{100 * e['error']:+.1f}%", f"{e.get('replicated', 0):.0f}",
                 f"{e.get('divided', 0):.0f}"] for e in data["tp2"]["check"]]
        out.append(print_table(rows, ["case", "TP1", "TP2", "TP2 fit", "err", "replicated", "divided"]))
    elif data.get("tp2", {}).get("error"):
        out.append("\nTP2 did not run: " + data["tp2"]["error"][-300:])
    if data.get("generate"):
        out.append("\nRollout (generate, static KV cache; peak vs KV cache + the no-grad forward fit + buffer):")
        rows = []
        coefs = data["fit"]["coefficients"]
        for g in data["generate"]:
            shape, attention = Shape(**g["shape"]), g.get("attention", "local")
            if attention not in coefs:
                continue
            buffer = g["batch"] * shape.heads * g["prompt"] ** 2 * 2 if attention == "local" else 0
            fit_bytes = (predict_working_set(coefs[attention], shape, "forward", "none", g["prompt"], g["batch"])
                         + buffer + g["kv_cache"])
            rows.append([attention, g["batch"], g["prompt"], g["new_tokens"], f"{g['kv_cache'] / 2**20:.1f}",
                         f"{g['peak'] / 2**20:.1f}", f"{fit_bytes / 2**20:.1f}",
                         f"{100 * (fit_bytes - g['peak']) / g['peak']:+.1f}%"])
        out.append(print_table(rows, ["attention", "rows", "prompt", "new", "KV MiB", "peak MiB", "fit MiB", "err"]))
        for k in data.get("kv_check", []):
            out.append(f"KV check ({k['attention']}): {k['new_tokens'][0]} -> {k['new_tokens'][1]} new tokens: peak "
                       f"rises {k['peak_rise'] / 2**20:.2f} MiB, megatron's KV sizing {k['kv_cache_rise'] / 2**20:.2f}"
                       " MiB")
    ms = data["model_state"]
    states = (data.get("tp2") or {}).get("model_state") or {}
    out.append("\nModel state, bytes per parameter (measured, rl/model_state.bytes_per_parameter):")
    out.append(f"  DP1, megatron's optimizer: {_state_text(ms)}; frozen {ms['frozen_bytes_per_param']:.2f}")
    out.append(f"  DP1, distributed optimizer: {_state_text(data.get('model_state_distributed_optimizer_dp1', {}))}")
    for key, label in (("dp2", "DP2, megatron's optimizer"),
                       ("distributed_optimizer_dp2", "DP2, distributed optimizer")):
        if key in states:
            out.append(f"  {label}: {_state_text(states[key])}")
    for source, run in (("DP1", ms), ("DP2 dist-opt", states.get("distributed_optimizer_dp2", {}))):
        for name, entry in (run.get("offloaded") or {}).items():
            left = entry["on_device_during_rollout"]
            out.append(f"  {source} {name}: on the device during the rollout " + ", ".join(
                f"{k} {v:.2f}" for k, v in left.items()) + " B/param")
    out.append(f"  projection's table: {data['model_state_table']['source']}")
    out.append("\nMicro-batches at the skewed mix (processed / real tokens, attention work / real):")
    rows = []
    for name, mb in data["micro_batching"].items():
        if not mb:
            continue
        for mode in ("padded", "by_count", "token_budget", "packed_by_count", "packed_token_budget"):
            if mode in mb:
                rows.append([name, mode, "computed", f"{mb[mode]['tokens_ratio']:.2f}x",
                             f"{mb[mode]['attention_ratio']:.2f}x", mb[mode]["largest_micro_batch_tokens"]])
        for mode, plan in (mb.get("plan") or {}).items():
            rows.append([name, mode, "MicroBatchPlan", f"{plan['tokens_ratio']:.2f}x", "-",
                         plan["largest_micro_batch_tokens"]])
    out.append(print_table(rows, ["batch", "micro-batches", "how", "tokens", "attention", "largest mb tokens"]))
    for path, p in data["projection"].items():
        ep = f" EP{p['ep']}" if p["ep"] > 1 else ""
        out.append(f"\n{path}: {p['model']} {p['stage']}, world {p['world']} = TP{p['tp']} PP{p['pp']} "
                   f"DP{p['dp']}{ep}, rollout rows/rank {p['rollout_rows']}, mbs {p['micro_batch_size']}, caps "
                   f"{p['prompt_cap']}+{p['response_cap']} (params {p['params_counted'] / 1e9:.2f}B, published "
                   f"{p['params_published'] / 1e9:.2f}B)" + (" -- model state only (activations not described)"
                                                             if p["state_only"] else ""))
        out.append(_lever_table(p["rows"]))
        if p.get("long_response"):
            c = p["long_response"]["config"]
            out.append(f"long-response config (prompt {c['prompt_cap']}, --max-new-tokens {c['response_cap']} "
                       f"--max-length {c['max_length']}):")
            out.append(_lever_table(p["long_response"]["rows"]))
        rec = p["recommended"]
        if rec:
            out.append(f"recommended (<= {TARGET_TRAIN_GB} GB in every phase): {rec['label']}\n  flags: "
                       + (" ".join(rec["flags"]) or "nothing") + f"\n  -> rollout {rec['rollout_gb']:.1f}, passes "
                       f"{rec['passes_gb']:.1f}, train {rec['train_gb']:.1f} GB"
                       + (f" ({'; '.join(rec['notes'])})" if rec["notes"] else ""))
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
        launched = p["rows"][0]
        out.append(dict(target=f"{os.path.basename(path)} training peak <= {TARGET_TRAIN_GB} GB per device",
                        status="met" if launched["train_gb"] <= TARGET_TRAIN_GB else "not met",
                        measured=f"as launched ({Levers(**launched['levers']).label()}): train "
                                 f"{launched['train_gb']:.1f}, rollout {launched['rollout_gb']:.1f}, passes "
                                 f"{launched['passes_gb']:.1f} GB; recommended {p['recommended']['train_gb']:.1f} GB"))
    sdpa = sorted((c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["attention"] == "sdpa"
                   and c["case"]["recompute"] == "none" and c["case"]["kind"] == "train" and "saved" in c),
                  key=lambda c: c["seq"])
    if len(sdpa) >= 2:
        per_token = [c["per_layer"]["attention"] for c in sdpa]
        linear = max(per_token) <= 1.05 * min(per_token)
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s",
                        status="met" if linear else "not met",
                        measured="attention B/token/layer at s = " + ", ".join(
                            f"{c['seq']}: {x:.0f}" for c, x in zip(sdpa, per_token))
                                 + " (constant per token = linear per layer)"))
    else:
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s",
                        status="pending", measured="fewer than two SDPA lengths measured"))
    full = [c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["recompute"] == "full"
            and c["case"]["kind"] == "train" and "saved" in c]
    if full:
        h = full[0]["case"]["shape"]["hidden"]
        worst = max(c["per_layer"]["layer_total"] for c in full)
        out.append(dict(target="full recompute keeps at most about 2*H bytes per token per layer",
                        status="met" if worst <= 2.05 * h else "not met",
                        measured=f"{worst:.1f} B/token/layer = {worst / h:.3f} H (H = {h}, {len(full)} cases); shared "
                                 "per micro-batch (rotary table, mask, token ids) counted apart"))
    generic = data["micro_batching"].get("skewed mix (generic)")
    if generic:
        plan = generic.get("plan", {}).get("token_budget")
        ratio = plan["tokens_ratio"] if plan else generic["token_budget"]["tokens_ratio"]
        out.append(dict(target="token-budget micro-batches process <= 1.2x the real tokens at the skewed mix",
                        status="met" if ratio <= 1.2 else "not met",
                        measured=f"MicroBatchPlan with max_tokens {generic['budget']}: {ratio:.2f}x (by count "
                                 f"{generic['by_count']['tokens_ratio']:.2f}x, padded to the batch's longest "
                                 f"{generic['padded']['tokens_ratio']:.2f}x)"))
    for path, p in data["projection"].items():
        launched = p["rows"][0]
        worst = max(launched["rollout_gb"], launched["passes_gb"], launched["train_gb"])
        out.append(dict(target=f"{os.path.basename(path)} fits {TARGET_TRAIN_GB} GB in every phase as launched",
                        status="met" if worst <= TARGET_TRAIN_GB and launched["activations_described"] else "not met",
                        measured=f"rollout {launched['rollout_gb']:.1f}, passes {launched['passes_gb']:.1f}, train "
                                 f"{launched['train_gb']:.1f} GB" + ("" if launched["activations_described"] else
                                                                      " (model state alone: a lower bound)")))
    return out


def summarize_fit(coefs: Dict[str, dict], cases: List[dict]) -> dict:
    check = check_fit(coefs, cases)
    held = {a: [e for e in check if e["tag"] in ("held_out", "moe_held_out") and e["attention"] == a] for a in coefs}
    return dict(coefficients=coefs, check=check,
                held_out={a: dict(saved=max([abs(e.get("error", 0)) for e in h] or [0.0]),
                                  peak=max([abs(e["peak_error"]) for e in h] or [0.0])) for a, h in held.items()},
                main_max_error=max([abs(e.get("error", 0)) for e in check if e["tag"] == "main"] or [0.0]))


def generic_micro_batching() -> dict:
    """The skewed mix of 256 samples in prompt groups of 8, caps 2048 + 2048, micro-batches of 4 samples and a
    token budget of 4096: computed (`micro_batch_costs`) and measured on `MicroBatchPlan` (by count, by the budget,
    and packed by count with micro-batches of 8 = one prompt group)."""
    prompts, responses = skewed_mix(256, 8, 2048, 2048)
    out = micro_batch_costs(prompts, responses, 8, 4, 4096)
    out["plan"] = {"by_count": plan_micro_batch_tokens(prompts, responses, 8, 4, None),
                   "token_budget": plan_micro_batch_tokens(prompts, responses, 8, 4, 4096),
                   "packed_by_count": plan_micro_batch_tokens(prompts, responses, 8, 8, None)}
    return out


def analyse(data: dict, launchers: Sequence[str]) -> dict:
    """Fit, checks, micro-batching, projection and targets from the measurements in `data`."""
    coefs = fit_model(data["cases"])
    data["fit"] = summarize_fit(coefs, data["cases"])
    if data.get("tp2", {}).get("cases"):
        data["tp2"]["check"] = tp_check(coefs, data["cases"], data["tp2"]["cases"])
    data["micro_batching"] = {"skewed mix (generic)": generic_micro_batching()}
    table = StateBytes.measured(data)
    data["model_state_table"] = asdict(table)
    data["projection"] = project_launchers(coefs, table, launchers) if launchers else {}
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
            if (a.get("attention"), a["batch"], a["prompt"]) == (b.get("attention"), b["batch"], b["prompt"]) \
                    and b["new_tokens"] > a["new_tokens"]:
                out.append(dict(attention=a.get("attention", "local"), batch=a["batch"], prompt=a["prompt"],
                                new_tokens=(a["new_tokens"], b["new_tokens"]), peak_rise=b["peak"] - a["peak"],
                                kv_cache_rise=b["kv_cache"] - a["kv_cache"]))
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
    p.add_argument("--remeasure", metavar="REGEX", help="measure again the cases of --reuse whose name matches")
    p.add_argument("--attentions", nargs="+", choices=("sdpa", "local"), default=["sdpa", "local"],
                   help="the core attentions measured (the first also runs the RSS check and every TP2 mode)")
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
    attentions = list(opts.attentions)
    data = dict(meta=dict(format=JSON_FORMAT, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          command=" ".join(sys.argv), device=opts.device, threads=opts.threads, versions=versions(),
                          machine=machine(), shape=asdict(shape), lengths=lengths, attentions=attentions,
                          shape_text=f"hidden {shape.hidden}, FFN {shape.ffn}, {shape.heads} heads / {shape.kv_heads} "
                                     f"KV x {shape.head_dim}, {shape.layers} layers, vocabulary {shape.vocab}, bf16"))
    max_bytes = opts.max_case_gb * GB
    old = {}
    if opts.reuse:
        with open(opts.reuse) as f:
            old = json.load(f)
        data["meta"]["reused_from"] = dict(path=opts.reuse, date=old["meta"]["date"], format=old["meta"].get("format"),
                                           earlier=old["meta"].get("reused_from"))
    # an earlier format's rollout, model-state, TP2 and RSS results were measured otherwise: only its cases are
    # taken (by name: the same shape, levers and attention)
    old_extras = old if old.get("meta", {}).get("format") == JSON_FORMAT else {}

    def save(cases=None):
        if opts.json:
            if cases is not None:
                data["cases"] = cases
            os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
            with open(opts.json, "w") as f:
                json.dump(data, f, indent=1)

    data["peak_check"] = dict(scripted=check_peak_method(opts.device))
    log(f"peak method on a scripted sequence: {data['peak_check']['scripted']}")
    for key in ("generate", "model_state", "model_state_distributed_optimizer_dp1", "tp2"):
        if key in old_extras:
            data[key] = old_extras[key]
    for key, threshold in (("rss", None), ("rss_fixed_mmap_threshold", 128 << 10)):
        if key in old_extras.get("peak_check", {}):
            data["peak_check"][key] = old_extras["peak_check"][key]
        elif opts.device == "cpu" and not opts.no_rss_check:
            data["peak_check"][key] = check_peak_rss(Case(shape, lengths[0], attentions[0]), threshold)
            log(f"RSS check ({key}): {data['peak_check'][key]}")
    if "generate" not in data and not opts.no_generate:
        p1, p2 = (lengths[0] // 4, lengths[0] // 2)
        data["generate"] = [measure_generate(shape, b, p, n, attention, opts.device) for attention in attentions
                            for b, p, n in ((2, p1, 2), (2, p2, 2), (4, p2, 2), (4, p2, 2 + p2 // 4))]
        log(f"generate: {[(g['attention'], g['peak'], g['kv_cache']) for g in data['generate']]}")
    if "model_state" not in data:
        data["model_state"] = measure_model_state(grid["dense"][0])
        data["model_state_distributed_optimizer_dp1"] = measure_model_state(grid["dense"][0], True, offload=False)
        log(f"model state: {data['model_state']['bytes_per_param']}")
    if "tp2" not in data and not opts.no_tp2 and opts.device == "cpu":
        tp_cases = [Case(shape, lengths[0], attention, recompute=mode) for attention in attentions
                    for mode in (RECOMPUTE if attention == attentions[0] else ["none"])]
        data["tp2"] = run_tp2(tp_cases, grid["dense"][0])
        log(f"TP2: {'error' if 'error' in data['tp2'] else 'done'}")
    save()
    cases = main_cases(shape, lengths, attentions) + ([] if opts.no_fit_grid else grid_cases(grid, attentions))
    reuse = {c["case"]["name"]: dict(c, measured_on=c.get("measured_on") or f"before {old['meta']['date']}")
             for c in old.get("cases", []) if "saved" in c}
    reuse = {name: c for name, c in reuse.items() if not (opts.remeasure and re.search(opts.remeasure, name))}
    data["cases"] = run_cases(cases, opts.device, max_bytes, log, reuse=reuse, only=opts.only, save=save,
                              date=data["meta"]["date"])
    data["meta"]["reused_cases"] = sorted(name for name in reuse if name in {c.name for c in cases})
    data["meta"]["wall_s"] = time.time() - started
    data["meta"]["machine"]["load_average_end"] = os.getloadavg()
    save()
    analyse(data, opts.launchers)
    print(report(data))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
