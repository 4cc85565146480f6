"""Build Megatron-core `GPTModel`s (policy) and value-head models (critic, reward) from a `ArchitectureSpec`.

Only the local (non-Transformer-Engine) layer spec is used so that every device, the CPU included, runs
the same modules; its core attention is `mindspeed_llm.models.attention.SDPAttention` (the device's fused
attention kernel, the default) or megatron's own `DotProductAttention` (`attention="local"`, the reference).
`attention_backend=local` tells megatron that no Transformer Engine attention is in play either way (its
inference wrapper then builds the explicit causal mask of the stepwise prefill).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.enums import AttnBackend

from mindspeed_llm.device import fused_ops_here
from mindspeed_llm.models.attention import ATTENTIONS, use_core_attention
from mindspeed_llm.models.fused_ops import use_fused_norms
from mindspeed_llm.models.forward_layout import install_layout_hooks
from mindspeed_llm.models.architecture import ArchitectureSpec

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def grouped_gemm_kernel() -> Optional[str]:
    """The grouped-GEMM kernel the MoE experts use here: None, always, in this build.

    Megatron's local-spec grouped experts (`GroupedMLP`) need the CUDA-only `grouped_gemm` package and hold each
    layer's experts fused (`experts.weight1` / `weight2`), which the per-expert checkpoints (`local_experts.j`)
    do not map yet; `--moe-grouped-gemm` therefore runs megatron's `SequentialMLP`: the same math, one matmul
    per expert. (Transformer Engine's grouped experts belong to the TE spec, which these models do not use.)
    """
    return None


def moe_config(spec: ArchitectureSpec) -> dict:
    """TransformerConfig fields of `spec`'s mixture of experts (empty for a dense model).

    Run options (token dispatcher, load-balancing type, aux-loss coefficient, routing replay) are
    passed by the caller as overrides; the model's own router semantics come from the checkpoint.
    """
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_router_pre_softmax=spec.moe_router_pre_softmax,
        moe_router_score_function=spec.moe_router_score_function,
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=spec.moe_shared_expert_gate,
        moe_layer_freq=list(spec.moe_layers()) if spec.moe_layer_pattern is not None else 1,
        moe_grouped_gemm=False,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        moe_router_num_groups=spec.moe_router_num_groups,
        moe_router_group_topk=spec.moe_router_group_topk,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        # transformers' DeepSeek-V3 router computes its logits in fp32 whatever the model's dtype
        **(dict(moe_router_dtype="fp32") if spec.moe_router_enable_expert_bias else {}),
    )


def mla_config(spec: ArchitectureSpec) -> dict:
    """MLATransformerConfig fields of `spec`'s multi-latent attention (empty without MLA).

    Megatron's q/kv RMSNorms on the compressed projections come with `qk_layernorm`; `kv_channels` is the
    value head dim (the attention output width per head); YaRN acts on the rope part of each head."""
    if not spec.is_mla:
        return {}
    fields = dict(
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim, qk_pos_emb_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim, kv_channels=spec.v_head_dim, rotary_base=spec.rotary_base,
    )
    if spec.yarn_factor is not None:
        fields.update(rope_type="yarn", rotary_scaling_factor=spec.yarn_factor,
                      original_max_position_embeddings=spec.yarn_original_max_position_embeddings,
                      beta_fast=spec.yarn_beta_fast, beta_slow=spec.yarn_beta_slow, mscale=spec.yarn_mscale,
                      mscale_all_dim=spec.yarn_mscale_all_dim)
    else:  # plain RoPE; a scaling factor of 1 keeps megatron's softmax scale at 1/sqrt(q head dim)
        fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return fields


def check_fused_ops(fused_ops) -> frozenset:
    """`fused_ops` as a set of `device.FUSED_OPS` names this device runs (`device.fused_ops_here`); another name is an
    error naming the choices."""
    fused_ops = frozenset(fused_ops)
    unknown = sorted(fused_ops - set(fused_ops_here()))
    if unknown:
        raise ValueError(f"fused_ops: {unknown} not among this device's fused ops {sorted(fused_ops_here())} "
                         f"(--use-fused-rotary-pos-emb acts on NPU only)")
    return fused_ops


def fused_config(spec: ArchitectureSpec, fused_ops) -> dict:
    """TransformerConfig switches of the fused ops `fused_ops` (`device.FUSED_OPS` names) that megatron routes:
    SwiGLU through `bias_activation_fusion`, RoPE through `apply_rope_fusion` (their kernels:
    `patches/fused_ops.py`). Multi-latent attention keeps megatron's unfused RoPE (its fused path is Transformer
    Engine's training-only MLA RoPE; said at startup). The norm is not a config switch (`use_fused_norms`)."""
    fused_ops = check_fused_ops(fused_ops)
    return dict(bias_activation_fusion="swiglu" in fused_ops,
                apply_rope_fusion="rope" in fused_ops and not spec.is_mla)


def transformer_config(spec: ArchitectureSpec, params_dtype=torch.float32, fused_ops=(), groups=None, **overrides
                       ) -> TransformerConfig:
    """The TransformerConfig of `spec` under the current parallel state (`fused_ops`: `fused_config`), or at the
    sizes of explicit `groups` (`build_model`'s)."""
    params_dtype = parse_dtype(params_dtype)
    tp, pp = _parallel_sizes(groups)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_backend=AttnBackend.local,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        # Megatron's fused bias/activation kernels need CUDA/TE; the torch paths are exact.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    kwargs.update(fused_config(spec, fused_ops))
    kwargs.update(moe_config(spec))
    kwargs.update(mla_config(spec))
    kwargs.update(overrides)
    if kwargs["pipeline_model_parallel_size"] > 1:
        # Micro-batches are cut to their own length (`rl/update/batch_plan.py`): the pipeline stages exchange each one's
        # shape before its activations (megatron's variable_seq_lengths), which megatron allows with the
        # all-to-all token dispatcher only (a check megatron makes on dense models too): all-gather's default
        # gives way to it (the same dropless routing; --moe-token-dispatcher-type allgather is refused with PP).
        kwargs["variable_seq_lengths"] = True
        if kwargs.get("moe_token_dispatcher_type", "allgather") == "allgather":
            kwargs["moe_token_dispatcher_type"] = "alltoall"
    if kwargs.get("moe_grouped_gemm") and grouped_gemm_kernel() is None:
        kwargs["moe_grouped_gemm"] = False  # SequentialMLP: same math, one matmul per expert (see grouped_gemm_kernel)
    return (MLATransformerConfig if spec.is_mla else TransformerConfig)(**kwargs)


def _layer_spec(spec: ArchitectureSpec, config: TransformerConfig, attention: str = "sdpa"):
    """Megatron-core's local (non-TE) spec: one layer spec for a dense model, a per-layer block spec
    (dense and MoE layers as `moe_layer_freq` says) for a mixture of experts; `attention`'s core attention."""
    if not spec.is_moe:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return use_core_attention(layer_spec, attention)


class ValueHead(torch.nn.Module):
    """Scalar head in fp32, replicated on every TP rank: value = h @ w^T (no bias).

    It plays `GPTModel.output_layer`'s role (same call signature), so the model returns `[b, s, 1]`
    instead of logits. The layout equals `transformers`' `*ForSequenceClassification.score` with
    num_labels=1, which is how reward checkpoints are exchanged.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **_kwargs):
        return F.linear(hidden_states.float(), self.weight), None


def _parallel_sizes(groups) -> tuple:
    """(TP, PP) of megatron's parallel state, or of explicit `groups` (a ProcessGroupCollection)."""
    if groups is None:
        return (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
    return groups.tp.size(), groups.pp.size()


def build_model(
    spec: ArchitectureSpec,
    params_dtype=torch.float32,
    value_head: bool = False,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    attention: str = "sdpa",
    fused_ops=(),
    groups=None,
    **config_overrides,
) -> GPTModel:
    """A GPTModel for this rank's pipeline stage. `value_head=True` gives the critic/reward model. `attention`:
    "sdpa" (the device's fused kernel, `models/attention.py`) or "local" (megatron's DotProductAttention).
    `fused_ops`: names of `device.FUSED_OPS` (MindSpeed-LLM's --use-fused-* flags) run on the device's fused ops
    (`fused_config`, `models/fused_ops.py`); none by default (megatron's unfused torch path). `groups`: megatron's
    `ProcessGroupCollection` for a model outside megatron's parallel_state (a generator rank of asynchronous RL,
    `rl/async_rl/placement.py`): a dense model at PP 1 on its TP group."""
    if attention not in ATTENTIONS:
        raise ValueError(f"build_model: attention={attention!r}; use one of {ATTENTIONS}")
    tp, pp = _parallel_sizes(groups)
    if groups is not None:
        if spec.is_moe or pp != 1:
            raise ValueError("build_model: explicit groups build a dense model at PP 1 only")
        pre_process = post_process = True
    if spec.is_moe:
        spec.check_parallel(tp, pp, parallel_state.get_expert_model_parallel_world_size(),
                            parallel_state.get_expert_tensor_parallel_world_size())
    else:  # a dense model (e.g. the critic next to an MoE actor) ignores the expert groups
        spec.check_parallel(tp, pp)
    fused_ops = check_fused_ops(fused_ops)
    config = transformer_config(spec, params_dtype, fused_ops=fused_ops, groups=groups, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(spec, config, attention),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=int(spec.rotary_base),
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        pg_collection=groups,
    )
    model.model_spec = spec
    model.is_value_model = value_head
    model.attention_kind = attention  # read by models.attention.model_attention (packed layout, batched prefill)
    dtype = parse_dtype(params_dtype)
    if dtype != torch.float32:
        # Megatron-LM runs the whole model in half precision (its Float16Module); the local spec's torch
        # norms are built in fp32 whatever params_dtype says, so they follow here. Megatron's optimizer keeps
        # fp32 main copies of every half-precision parameter. The value head below stays fp32.
        for param in model.parameters():
            param.data = param.data.to(dtype)
    if value_head and post_process:
        model.output_layer = ValueHead(spec.hidden_size)
    if "rmsnorm" in fused_ops:
        use_fused_norms(model)
    model.fused_ops = fused_ops
    install_layout_hooks(model)  # RoPE by position ids and an output window (models/forward_layout.py)
    return model
