"""Bytes one transformer layer keeps for its backward, without and with activation recompute.

One megatron-core TransformerBlock of a single layer, built as the trained models are (`models.builder`'s
TransformerConfig of a Qwen2-style `ArchitectureSpec`: RMSNorm, SwiGLU, rotary, local attention), in train mode,
runs one forward of `[s, 1, H]` hidden states (micro-batch 1, causal attention). Every tensor autograd saves for the
backward is caught with `torch.autograd.graph.saved_tensors_hooks`; the bytes of their distinct storages, the
parameters left out, are counted after the forward (a storage megatron frees before the backward counts 0). The
layer's input is included: full recompute keeps exactly that.

Settings: none; selective (`--recompute-activations`: megatron's core_attn module); full
(`--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`). The MLP width is 4 H,
heads of 64 (H / 64 of them), no grouped-query attention, no dropout. The count is exact and device-independent
(the same tensors are saved on CPU and on an accelerator), so it runs on CPU.

Usage::

    python benchmarks/recompute_memory.py                          # H 256 512 1024 x s 512 1024 2048, bf16
    python benchmarks/recompute_memory.py --hidden 256 --seq 512 --dtype fp32 --json runs/recompute_memory.json
    python benchmarks/recompute_memory.py --fused      # no recompute, without / with the fused RMSNorm and SwiGLU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
MIB = 2 ** 20


def saved_bytes(hidden: int, seq: int, dtype: str, setting: str, fused_ops=()) -> int:
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mindspeed_llm.models.builder import _layer_spec, parse_dtype, transformer_config
    from mindspeed_llm.models.architecture import ArchitectureSpec
    from mindspeed_llm.models.fused_ops import use_fused_norms

    heads = max(1, hidden // 64)
    spec = ArchitectureSpec(family="qwen2", num_layers=1, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                            num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads,
                            vocab_size=256)
    config = transformer_config(spec, dtype, fused_ops=fused_ops, **SETTINGS[setting])
    block = TransformerBlock(config, _layer_spec(spec, config), post_layer_norm=False).to(parse_dtype(dtype))
    if "rmsnorm" in fused_ops:
        use_fused_norms(block)
    block.train()
    rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)(seq)
    x = torch.randn(seq, 1, hidden, dtype=parse_dtype(dtype), requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, attention_mask=None, rotary_pos_emb=rotary)
    total = sum(s.nbytes() for s in kept.values())
    out.float().sum().backward()  # the graph is complete (and the recompute runs)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--fused", action="store_true",
                   help="instead: no recompute, without and with --use-fused-rmsnorm / --use-fused-swiglu")
    p.add_argument("--json", help="also write the rows here")
    opts = p.parse_args(argv)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("MINDSPEED_DEVICE", "cpu")
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, seed=1, rank=0, world_size=1)
    if opts.fused:
        return _fused_table(opts)
    rows = []
    print(f"{'H':>6} {'F':>6} {'s':>6}  " + "  ".join(f"{name + ' MiB':>14}" for name in SETTINGS) +
          "  selective/none  full/none")
    for hidden in opts.hidden:
        for seq in opts.seq:
            row = {"hidden": hidden, "ffn": 4 * hidden, "seq": seq, "heads": max(1, hidden // 64),
                   "dtype": opts.dtype}
            row.update({name: saved_bytes(hidden, seq, opts.dtype, name) for name in SETTINGS})
            rows.append(row)
            print(f"{hidden:>6} {4 * hidden:>6} {seq:>6}  " +
                  "  ".join(f"{row[name] / MIB:>14.2f}" for name in SETTINGS) +
                  f"  {row['selective'] / row['none']:>14.3f}  {row['full'] / row['none']:>9.4f}", flush=True)
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


FUSED = {"unfused": (), "rmsnorm": ("rmsnorm",), "swiglu": ("swiglu",), "both": ("rmsnorm", "swiglu")}


def _fused_table(opts) -> int:
    """Saved bytes per layer without recompute, for each set of fused ops (`device.FUSED_OPS` on this device)."""
    rows = []
    print(f"{'H':>6} {'F':>6} {'s':>6}  " + "  ".join(f"{name + ' MiB':>12}" for name in FUSED) +
          "  " + "  ".join(f"{name + '/unfused':>16}" for name in FUSED if name != "unfused"))
    for hidden in opts.hidden:
        for seq in opts.seq:
            row = {"hidden": hidden, "ffn": 4 * hidden, "seq": seq, "heads": max(1, hidden // 64),
                   "dtype": opts.dtype}
            row.update({name: saved_bytes(hidden, seq, opts.dtype, "none", ops) for name, ops in FUSED.items()})
            rows.append(row)
            print(f"{hidden:>6} {4 * hidden:>6} {seq:>6}  " +
                  "  ".join(f"{row[name] / MIB:>12.2f}" for name in FUSED) + "  " +
                  "  ".join(f"{row[name] / row['unfused']:>16.3f}" for name in FUSED if name != "unfused"),
                  flush=True)
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
