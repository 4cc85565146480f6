"""Start-up: loading a 1B-shaped Megatron checkpoint with and without megatron's random initialisation.

What is timed is `mindspeed_llm.rl.update.roles.load_model`, the function every role of a stage is loaded with, in a fresh
process per measurement (megatron initialised, world size 1, `torch.set_num_threads(--threads)`):

* ``random init`` (before): megatron's default path, as the stages loaded models until now: the model built in host
  memory with `use_cpu_initialization=True` and megatron's random initialisation (an fp32 master of every weight
  drawn from the init method, then cast), the checkpoint loaded over it, the model moved to the device;
* ``from checkpoint`` (after): `roles.from_checkpoint()`: `perform_initialization=False` (the weights are allocated,
  not drawn), built where it lives, then the same strict load.

Columns: the build (`GPTModel` construction), the load (`load_megatron_weights`: read the shard, copy it in), their
sum, the process's peak RSS, and the speed-up of the total. The checkpoint is Llama-3.2-1B's shape (16 layers, hidden
2048, FFN 8192, 32 heads / 8 KV groups, 128,256-token vocabulary, tied embeddings: 1.24 B parameters) with random
bf16 values, written once into ``--cache`` (2.5 GB; reused); its file is read once before the measurements so
that every one reads it from the page cache.

Usage::

    python benchmarks/startup.py                                  # bf16, 2 threads, the cache in runs/startup_1b
    python benchmarks/startup.py --repeats 3 --json runs/startup.json
    python benchmarks/startup.py --layers 2 --vocab 32000           # a smaller shape (a quick check)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("random init", "from checkpoint")


def _spec(opts):
    from mindspeed_llm.models import ArchitectureSpec

    return ArchitectureSpec(family="llama", num_layers=opts.layers, hidden_size=2048, ffn_hidden_size=8192,
                            num_attention_heads=32, num_query_groups=8, kv_channels=64, vocab_size=opts.vocab,
                            max_position_embeddings=131072, norm_epsilon=1e-5, rotary_base=500000.0,
                            rope_scaling_factor=32.0, tie_word_embeddings=True)


def _init_megatron():
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, seed=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_checkpoint(opts) -> dict:
    """The 1B-shaped checkpoint in Megatron-LM's layout (release), random values drawn once."""
    import torch

    from mindspeed_llm.checkpoint import megatron_layout as layout
    from mindspeed_llm.models import build_model

    torch.set_num_threads(opts.threads)
    _init_megatron()
    spec = _spec(opts)
    model = build_model(spec, params_dtype=opts.dtype, perform_initialization=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.empty(param.shape, dtype=torch.float32).uniform_(-0.02, 0.02, generator=gen))
    payload = layout.make_payload(model.state_dict(), spec, 1, 1, 0, 0, model.config.params_dtype, False, "release")
    layout.save_file(payload, layout.shard_path(layout.checkpoint_dir(opts.cache, "release"), 0, 0, 1))
    layout.write_latest(opts.cache, "release")
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _measure(opts) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl.update import roles

    torch.set_num_threads(opts.threads)
    _init_megatron()
    args = parse_args(["--stage", "grpo", "--ref-model", opts.cache, "--data-path", "unused", "--global-batch-size",
                       "1", "--train-iters", "1", "--verifier-function", "math_acc"]
                      + (["--bf16"] if opts.dtype == "bf16" else []))
    if opts.mode == "random init":
        roles.from_checkpoint = lambda on_host=False: {}  # megatron's defaults: CPU initialisation, random init
    load_seconds = []
    load = roles.load_megatron_weights

    def timed_load(*a, **k):
        start = time.perf_counter()
        out = load(*a, **k)
        load_seconds.append(time.perf_counter() - start)
        return out

    roles.load_megatron_weights = timed_load
    start = time.perf_counter()
    model = roles.load_model(opts.cache, "--ref-model", args.settings)
    total = time.perf_counter() - start
    return {"mode": opts.mode, "total_s": total, "load_s": load_seconds[0], "build_s": total - load_seconds[0],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


def _child(opts, **extra) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in dict(vars(opts), **extra).items()
        if k not in ("child", "json", "repeats") and v is not None]
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads), PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise RuntimeError(f"{extra}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=os.path.join(ROOT, "runs", "startup_1b"), help="where the checkpoint is kept")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="measurements per mode (the median is reported)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES + ("write",), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        sys.path.insert(0, ROOT)
        print(json.dumps(_write_checkpoint(opts) if opts.mode == "write" else _measure(opts)), flush=True)
        return 0

    opts.cache = os.path.abspath(os.path.join(opts.cache, f"L{opts.layers}_V{opts.vocab}_{opts.dtype}"))
    if not os.path.isfile(os.path.join(opts.cache, "latest_checkpointed_iteration.txt")):
        print(f"writing the checkpoint to {opts.cache} ...", flush=True)
        _child(opts, mode="write")
    shard = os.path.join(opts.cache, "release", "mp_rank_00", "model_optim_rng.pt")
    with open(shard, "rb") as f:  # into the page cache: every measurement reads the file from memory
        while f.read(1 << 26):
            pass
    runs = {mode: [] for mode in MODES}
    for _ in range(opts.repeats):
        for mode in MODES:
            runs[mode].append(_child(opts, mode=mode))
    rows = {}
    for mode, found in runs.items():
        rows[mode] = {k: statistics.median(r[k] for r in found) if isinstance(found[0][k], float) else found[0][k]
                      for k in found[0]}
    speedup = rows["random init"]["total_s"] / rows["from checkpoint"]["total_s"]
    size = os.path.getsize(shard) / 2**30
    print(f"\nload of a {rows['from checkpoint']['parameters'] / 1e9:.2f} B-parameter {opts.dtype} checkpoint "
          f"({size:.2f} GiB), {opts.threads} threads, median of {opts.repeats}")
    print(f"{'mode':<18}{'build s':>10}{'load s':>10}{'total s':>10}{'peak RSS GiB':>14}")
    for mode, row in rows.items():
        print(f"{mode:<18}{row['build_s']:>10.2f}{row['load_s']:>10.2f}{row['total_s']:>10.2f}"
              f"{row['peak_rss_gb']:>14.2f}")
    print(f"speed-up of the total: {speedup:.1f}x")
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(opts).items() if k not in ("child", "mode", "json")},
                       "checkpoint_gib": size, "results": rows, "runs": runs, "speedup": speedup}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
