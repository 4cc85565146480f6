"""Activation memory of the core attention: the fused `SDPAttention` (the default) against megatron's local
`DotProductAttention`, per transformer layer, in the row layout and the packed prompt-group layout.

For each sequence length s, a random llama-shaped model (hidden `--hidden`, `--heads` heads, `--kv-heads` key/value
heads, ffn 2.7x hidden) takes one row of s tokens through a training forward in `--dtype`:

* rows: one causal sequence;
* packed: one prompt group `[prompt | r1 | .. | rn]`, the prompt s/4, `--group` responses sharing the rest (the
  fused attention gets `PackedGroups` as `packed_seq_params`; the local one the dense mask
  `PackedGroups.dense_mask()`, as `rl/update/engine.py` does).

Measured per layer: the bytes of the distinct storages saved for backward (`torch.autograd.graph.saved_tensors_hooks`,
the weights the linear layers save left out) of a 2-layer model minus those of a 1-layer model (embedding, output
layer and loss cancel), and the largest saved activation (elements); on CUDA also the peak of
`torch.cuda.max_memory_allocated` over forward + backward, per layer the same way. `--check` also compares the two attentions on the device in fp32 (logits and every parameter gradient of
the 2-layer model, both layouts) and exits 1 when they differ by more than 1e-4 (logits) / 1e-3 of each gradient's
largest entry: on CUDA this is the check that torch's own SDPA kernels give megatron's results (scripts/gpu_check.py
runs it).

Usage::

    python benchmarks/attention.py                                  # s = 512 1024 2048, hidden 512, bf16, CPU
    python benchmarks/attention.py --device cuda --check --json runs/attention.json

Exit status 1 when `--check` fails or the requested device is not there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _init(device: str):
    os.environ["MINDSPEED_DEVICE"] = device
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, seed=0)


def _spec(opts, layers: int):
    from mindspeed_llm.models import ArchitectureSpec

    return ArchitectureSpec.from_hf_config(dict(
        model_type="llama", vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=int(2.7 * opts.hidden),
        num_hidden_layers=layers, num_attention_heads=opts.heads, num_key_value_heads=opts.kv_heads,
        max_position_embeddings=max(opts.seq) * 2, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=False))


def _model(opts, layers, attention, dtype):
    from mindspeed_llm import device
    from mindspeed_llm.models import build_model

    import torch

    torch.manual_seed(0)
    model = build_model(_spec(opts, layers), params_dtype=dtype, attention=attention, init_method_std=0.05)
    return model.to(device.current_device()).train()


def _inputs(opts, s, layout):
    """(tokens [1, s], position ids [1, s], PackedGroups or None) on the device."""
    import torch

    from mindspeed_llm import device
    from mindspeed_llm.models.attention import PackedGroups

    dev = device.current_device()
    tokens = torch.randint(3, opts.vocab, (1, s), generator=torch.Generator().manual_seed(s)).to(dev)
    if layout == "rows":
        return tokens, torch.arange(s, device=dev)[None], None
    prompt, n = s // 4, opts.group
    width = (s - prompt) // n
    groups = PackedGroups(n, (prompt,), (width,), s)
    positions = torch.arange(s)
    slot = torch.arange(s - prompt)
    positions[prompt:] = torch.where(slot < n * width, prompt + slot % width, prompt + slot)
    return tokens, positions[None].to(dev), groups


def _forward(model, attention, tokens, positions, groups):
    from mindspeed_llm.models import forward_layout

    kwargs, mask = {}, None
    if groups is not None:
        if attention == "sdpa":
            kwargs["packed_seq_params"] = groups.seq_params()
        else:
            mask = groups.dense_mask(tokens.device)
    with forward_layout(model, positions):
        return model(tokens, positions, mask, **kwargs)


def _saved(fn, model):
    """(fn's output, bytes of the distinct storages saved for backward, the largest saved tensor's numel); the
    model's parameters (saved by its linear layers, but no activation memory) are not counted."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total, largest = set(), [0], [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[0] in params:
            return t
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0], largest[0]


def _measure(opts, s, layout, attention):
    """Per-layer saved bytes (2 layers - 1 layer), the largest saved tensor, and the CUDA peak per layer."""
    import torch

    from mindspeed_llm import device

    cuda = device.accelerator().kind == "cuda"
    figures = {}
    for layers in (1, 2):
        model = _model(opts, layers, attention, opts.dtype)
        tokens, positions, groups = _inputs(opts, s, layout)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out, saved, largest = _saved(lambda: _forward(model, attention, tokens, positions, groups), model)
        out.float().square().mean().backward()
        figures[layers] = dict(saved=saved, largest=largest,
                               peak=(torch.cuda.max_memory_allocated() - base) if cuda else None)
        del model, out
    per_layer = figures[2]["saved"] - figures[1]["saved"]
    peak = figures[2]["peak"] - figures[1]["peak"] if cuda else None
    return dict(s=s, layout=layout, attention=attention, saved_per_layer=per_layer, largest_saved=figures[2]["largest"],
                peak_per_layer=peak)


def _check(opts):
    """fp32 on the device: logits and parameter gradients of the two attentions, both layouts."""
    import torch

    failures, rows = [], []
    s = min(opts.seq)
    for layout in ("rows", "packed"):
        results = {}
        for attention in ("sdpa", "local"):
            model = _model(opts, 2, attention, "fp32")
            tokens, positions, groups = _inputs(opts, s, layout)
            out = _forward(model, attention, tokens, positions, groups)
            read = slice(None) if groups is None else slice(0, groups.prompt_lengths[0] + groups.group_size
                                                               * groups.widths[0])
            out[:, read].float().square().mean().backward()
            results[attention] = (out[:, read].detach().float(),
                                  {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None})
        logits = (results["sdpa"][0] - results["local"][0]).abs().max().item()
        grads = max((g - results["local"][1][k]).abs().max().item() / max(results["local"][1][k].abs().max().item(),
                                                                          1e-30)
                    for k, g in results["sdpa"][1].items())
        rows.append(dict(layout=layout, s=s, logits_max_diff=logits, grad_max_rel_diff=grads))
        if not (logits <= 1e-4 and grads <= 1e-3):
            failures.append(f"{layout}: logits differ by {logits:.3g}, gradients by {grads:.3g} of their scale")
    return rows, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--group", type=int, default=4, help="responses per prompt group (packed layout)")
    p.add_argument("--layouts", nargs="+", choices=("rows", "packed"), default=["rows", "packed"])
    p.add_argument("--check", action="store_true", help="also compare the two attentions in fp32 (exit 1 if not equal)")
    p.add_argument("--json")
    opts = p.parse_args(argv)
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/attention.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 1
    _init(opts.device)
    results = [_measure(opts, s, layout, attention) for layout in opts.layouts for s in opts.seq
               for attention in ("local", "sdpa")]
    heads = f"{opts.heads} heads ({opts.kv_heads} kv), hidden {opts.hidden}, {opts.dtype}, {opts.device}"
    print(f"saved for backward per layer ({heads}); MiB")
    print(f"{'layout':8} {'s':>6} {'local':>10} {'sdpa':>10} {'sdpa/local':>10} {'largest saved (local / sdpa)':>30}"
          + ("  peak per layer local / sdpa" if opts.device == "cuda" else ""))
    by_key = {(r["layout"], r["s"], r["attention"]): r for r in results}
    for layout in opts.layouts:
        for s in opts.seq:
            loc, sd = by_key[(layout, s, "local")], by_key[(layout, s, "sdpa")]
            line = (f"{layout:8} {s:>6} {loc['saved_per_layer'] / 2**20:>10.2f} {sd['saved_per_layer'] / 2**20:>10.2f} "
                    f"{sd['saved_per_layer'] / loc['saved_per_layer']:>10.3f} "
                    f"{loc['largest_saved']:>14,} / {sd['largest_saved']:<,}")
            if opts.device == "cuda":
                line += f"  {loc['peak_per_layer'] / 2**20:.1f} / {sd['peak_per_layer'] / 2**20:.1f} MiB"
            print(line)
    report = {"settings": {k: v for k, v in vars(opts).items() if k != "json"}, "results": results}
    status = 0
    if opts.check:
        rows, failures = _check(opts)
        report["check"] = rows
        for row in rows:
            print(f"check fp32 {row['layout']} s={row['s']}: max |logits diff| {row['logits_max_diff']:.3g}, "
                  f"max gradient diff {row['grad_max_rel_diff']:.3g} of its scale")
        if failures:
            print("check FAILED: " + "; ".join(failures), file=sys.stderr)
            status = 1
        report["check_ok"] = not failures
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
