"""The grouped-GEMM MoE patch in a spawned process (megatron's parallel state): --moe-grouped-gemm falls back to
the sequential MLP where no kernel is available. The specs, flags and router semantics: tests/unit/test_moe_spec.py.
"""

import pytest

from mindspeed_llm.models.architecture import ArchitectureSpec

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.01,
                 decoder_sparse_step=1, mlp_only_layers=[0, 2], rms_norm_eps=1e-6, rope_theta=1e6)


def _grouped_gemm_fallback(rank, world_size):
    from mindspeed_llm import distributed
    from mindspeed_llm.models import builder

    distributed.initialize(1, 1)
    spec = ArchitectureSpec.from_hf_config(QWEN3_MOE)
    model = builder.build_model(spec, moe_grouped_gemm=True)
    return {"kernel": builder.grouped_gemm_kernel(),
            "grouped": builder.transformer_config(spec, moe_grouped_gemm=True).moe_grouped_gemm,
            "names": [n for n, _ in model.named_parameters() if ".mlp.experts." in n]}


def test_grouped_gemm_falls_back_to_sequential_mlp_where_no_kernel():
    from tests.helpers.multiproc import run_distributed

    result = run_distributed(_grouped_gemm_fallback, 1)[0]  # its own process: the CPU patches stay there
    if result["kernel"] is not None:
        pytest.skip(f"a grouped GEMM kernel ({result['kernel']}) is installed here")
    assert result["grouped"] is False
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight" in result["names"], result["names"][:4]
