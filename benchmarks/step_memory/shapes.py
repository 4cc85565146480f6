"""The benchmark's data: the real models' shapes (`MODELS`), the launchers it projects (`LAUNCHERS`), the devices and
targets, the scaled-down `Shape` measured and the fit grids, and one measured `Case` (its levers)."""

from __future__ import annotations

import os
from dataclasses import dataclass


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JSON_FORMAT = 2  # 2: cases choose their attention; model state by part (rl/update/model_state), offload, DP2 dist-opt
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
