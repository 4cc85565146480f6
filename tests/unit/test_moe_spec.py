"""Mixture-of-experts model specs from Hugging Face configs, the expert-parallel flags, and the MoE patches
(the grouped-GEMM fallback, in a spawned process: tests/dist/test_moe_spec_dist.py).

The router semantics are checked against transformers' own MoE blocks: megatron's `moe_router_pre_softmax`
must give HF's `norm_topk_prob` behaviour for the same router logits.
"""

import pytest
import torch

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.models.architecture import ArchitectureSpec, UnsupportedModelError

QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.01,
                 decoder_sparse_step=1, mlp_only_layers=[0, 2], rms_norm_eps=1e-6, rope_theta=1e6)
QWEN2_MOE = dict(model_type="qwen2_moe", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=256, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                 decoder_sparse_step=2, rope_theta=1e6)
MIXTRAL = dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, intermediate_size=112,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_local_experts=4,
               num_experts_per_tok=2, router_aux_loss_coef=0.02, sliding_window=None, bos_token_id=1, eos_token_id=2)


def test_families_read_from_config_json():
    q3 = ArchitectureSpec.from_hf_config(QWEN3_MOE)
    assert (q3.num_experts, q3.moe_ffn_hidden_size, q3.moe_router_topk, q3.ffn_hidden_size) == (8, 32, 2, 96)
    assert q3.moe_layers() == [0, 1, 0, 1] and q3.qk_layernorm and not q3.add_qkv_bias
    assert q3.moe_router_pre_softmax is False and q3.moe_aux_loss_coeff == 0.01
    q2 = ArchitectureSpec.from_hf_config(QWEN2_MOE)
    assert q2.moe_layers() == [0, 1]  # decoder_sparse_step 2: layers 2, 4, ... (1-based) are sparse
    assert q2.moe_shared_expert_intermediate_size == 48 and q2.moe_shared_expert_gate and q2.add_qkv_bias
    assert q2.moe_router_pre_softmax is True  # norm_topk_prob false: softmax over all experts, no renormalising
    mx = ArchitectureSpec.from_hf_config(MIXTRAL)
    assert (mx.num_experts, mx.moe_ffn_hidden_size, mx.moe_layer_pattern) == (4, 112, None)
    assert mx.moe_layers() == [1, 1] and mx.moe_aux_loss_coeff == 0.02


@pytest.mark.parametrize("config", [QWEN3_MOE, QWEN2_MOE, MIXTRAL], ids=lambda c: c["model_type"])
def test_written_config_reads_back_and_loads_in_transformers(config):
    from transformers import AutoConfig

    spec = ArchitectureSpec.from_hf_config(config)
    written = spec.to_hf_config()
    assert ArchitectureSpec.from_hf_config(written) == spec
    hf = AutoConfig.for_model(**written)
    assert ArchitectureSpec.from_hf_config(hf.to_dict()) == spec


def test_unsupported_moe_settings_are_named():
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise"):
        ArchitectureSpec.from_hf_config(dict(MIXTRAL, router_jitter_noise=0.1))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        ArchitectureSpec.from_hf_config(dict(MIXTRAL, sliding_window=4096))
    spec = ArchitectureSpec.from_hf_config(QWEN3_MOE)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 .* num_experts=8"):
        spec.check_parallel(1, 1, ep=3)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 3 does not divide moe_ffn_hidden_size=32"):
        spec.check_parallel(1, 1, ep=1, etp=3)
    dense = ArchitectureSpec.from_hf_config(dict(QWEN3_MOE, model_type="qwen3"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        dense.check_parallel(1, 1, ep=2)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_semantics_match_transformers(norm_topk_prob):
    """Same router weight, same hidden states: megatron's top-k probabilities equal HF Qwen3-MoE's."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(**{k: v for k, v in dict(QWEN3_MOE, norm_topk_prob=norm_topk_prob).items()
                               if k != "model_type"})
    spec = ArchitectureSpec.from_hf_config(config.to_dict())
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        param.data.normal_()
    hidden = torch.randn(10, config.hidden_size)
    router_logits = hidden @ block.gate.weight.t()
    probs, routing_map = topk_routing_with_score_function(
        router_logits, spec.moe_router_topk, use_pre_softmax=spec.moe_router_pre_softmax)
    full = torch.softmax(router_logits, dim=-1)
    top, idx = torch.topk(full, config.num_experts_per_tok, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    expected = torch.zeros_like(full).scatter(1, idx, top)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, expected > 0)


BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
        "--global-batch-size", "4", "--ref-model", "r"]


def _parse(*extra, world):
    return parse_args(BASE + list(extra), world_size=world)


def test_expert_parallel_flags_resolve():
    args = _parse("--expert-model-parallel-size", "2", world=2)
    assert (args.settings.parallel.expert_parallel_size, args.settings.parallel.expert_tensor_parallel_size) == (2, 1)
    assert args.settings.moe.moe_token_dispatcher_type == "alltoall"  # all-gather needs equal token counts per EP rank
    assert _parse(world=1).settings.moe.moe_token_dispatcher_type == "allgather"
    args = _parse("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", world=4)
    assert (args.settings.parallel.expert_parallel_size, args.settings.parallel.expert_tensor_parallel_size) == (2, 2)
    # MindSpeed's --moe-tp-extend-ep: the TP ranks split the experts too, experts are not tensor-split.
    args = _parse("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--moe-tp-extend-ep",
                  world=4)
    assert (args.settings.parallel.expert_parallel_size, args.settings.parallel.expert_tensor_parallel_size) == (4, 1)
    args = _parse("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                  "--expert-tensor-parallel-size", "1", world=2)
    assert (args.settings.parallel.expert_parallel_size, args.settings.parallel.expert_tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("extra, world, message", [
    (["--expert-model-parallel-size", "4"], 2, "not divisible by expert tensor parallel 1 x expert parallel 4"),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--moe-tp-extend-ep"], 2,
     r"expert parallel 4 \(--expert-model-parallel-size x TP, --moe-tp-extend-ep\)"),
    (["--tensor-model-parallel-size", "2", "--moe-tp-extend-ep", "--expert-tensor-parallel-size", "2"], 2,
     "cannot be combined with --expert-tensor-parallel-size 2"),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"], 8,
     "--expert-tensor-parallel-size 4 must be 1 or --tensor-model-parallel-size 2"),
    (["--expert-model-parallel-size", "0"], 1, "must be >= 1"),
    (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"], 2,
     "allgather cannot run expert parallel 2: .* use --moe-token-dispatcher-type alltoall"),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], 2,
     "needs an expert-parallel size that is a multiple of 2 .* not 1; use --moe-tp-extend-ep"),
    (["--moe-aux-loss-coeff", "-1"], 1, "--moe-aux-loss-coeff -1.0 must be >= 0"),
])
def test_inconsistent_expert_flags_are_named(extra, world, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(*extra, world=world)


def test_router_runs_without_transformer_engine():
    """megatron 0.16.1's router reads `te_general_gemm`, bound only when TE imports: patches/moe.py binds it."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from mindspeed_llm import patches

    had = hasattr(moe_utils, "te_general_gemm")
    saved = getattr(moe_utils, "te_general_gemm", None)
    try:
        if had:
            delattr(moe_utils, "te_general_gemm")
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
        if saved is None:  # no TE here: unpatched, the router fails
            with pytest.raises(NameError, match="te_general_gemm"):
                moe_utils.router_gating_linear(x, w, None, torch.float32)
        patch = next(p for p in patches.registry() if p.target.endswith("moe_utils.te_general_gemm"))
        moe_utils.te_general_gemm = patch.make(saved)
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
        out.sum().backward()
        torch.testing.assert_close(out, x @ w.t())
        torch.testing.assert_close(x.grad, torch.ones(3, 2) @ w)
    finally:
        if had:
            moe_utils.te_general_gemm = saved
        elif hasattr(moe_utils, "te_general_gemm"):
            delattr(moe_utils, "te_general_gemm")
