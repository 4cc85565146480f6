"""Peak memory and time: fused ``vocab_parallel_logprobs`` vs naive full-vocab log-softmax.

Variants: "fused" is the chunked torch path of ``vocab_parallel_logprobs`` (``MINDSPEED_LOGPROBS_KERNEL=torch``),
"triton" the Triton kernel behind the same call (``MINDSPEED_LOGPROBS_KERNEL=triton``; CUDA only: on CPU its
row is skipped with a note, its CPU check being tests/dist/test_triton_logprobs.py under ``TRITON_INTERPRET=1``),
"naive" ``reference_logprobs``. All variants compute the target log-prob *and* the entropy of every token (``--no-entropy`` drops
the entropy). "naive" is ``reference_logprobs``: fp32 upcast of the whole ``[tokens, vocab]`` logits,
``log_softmax``, gather, ``-(exp(lsm) * lsm).sum(-1)``. Modes:

* ``fwd``: forward only, under ``torch.no_grad()`` (how old / reference log-probs are computed);
* ``fwd+bwd``: forward, then backward of ``sum(logp) + sum(entropy)`` to the logits.

Every (device, dtype, mode, variant) runs in a fresh subprocess so measurements do not interfere:

* CPU peak memory = peak RSS during the measured call minus RSS just before it (``ru_maxrss`` after
  minus RSS before; the logits are created row-block by row-block first, so creating them leaves no
  higher earlier peak). It counts everything the call allocates, including the logits gradient in
  ``fwd+bwd`` (same size as the logits, needed by both variants).
* CUDA peak memory = ``torch.cuda.max_memory_allocated()`` minus allocated memory before the call.
* Time: the median of ``--repeats`` further calls (the first call, which is the memory measurement,
  also serves as warm-up).

Usage::

    python benchmarks/logprobs.py                       # 4096 tokens x 152064 vocab, CPU (+ CUDA if present)
    python benchmarks/logprobs.py --tokens 1024 --json runs/logprobs.json
    python3 benchmarks/logprobs.py --device cuda --tokens 8192   # GPU only (one line and exit 1 without a GPU)

Exit status 1 when a measurement failed (its row says why) or a requested device is not there.
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

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child(opts) -> dict:
    """Runs one measurement; returns a dict (printed as JSON by the caller)."""
    import torch

    sys.path.insert(0, ROOT)
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    dtype = getattr(torch, DTYPES[opts.dtype])
    with_entropy = not opts.no_entropy
    gen = torch.Generator(device="cpu").manual_seed(0)

    # Build the logits block by block so no fp32 full-size temporary raises the peak before we measure.
    logits = torch.empty(opts.tokens, opts.vocab, dtype=dtype, device=device)
    block = max(1, (1 << 18) // opts.vocab)
    for start in range(0, opts.tokens, block):
        end = min(start + block, opts.tokens)
        logits[start:end] = (torch.randn(end - start, opts.vocab, generator=gen) * 2).to(device, dtype)
    targets = torch.randint(0, opts.vocab, (opts.tokens,), generator=gen).to(device)

    if opts.variant in ("fused", "triton"):  # which kernel: MINDSPEED_LOGPROBS_KERNEL, set by the parent
        def compute(x):
            return vocab_parallel_logprobs(
                x, targets, with_entropy=with_entropy, chunk_size=opts.chunk_size or None
            )
    else:
        def compute(x):
            return reference_logprobs(x, targets, with_entropy=with_entropy)

    backward = opts.mode == "fwd+bwd"
    if backward:
        logits.requires_grad_()

    def run_once():
        if backward:
            logits.grad = None
            out = compute(logits)
            out = out if with_entropy else (out,)
            sum(o.sum() for o in out).backward()
        else:
            with torch.no_grad():
                out = compute(logits)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    # Warm up kernels / allocator on a small problem so one-off costs are not attributed to the call (16 rows:
    # Triton specializes integer arguments on divisibility by 16, so the measured call reuses this compilation).
    warm = min(16, opts.tokens)
    small = logits.detach()[:warm].clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        o = (vocab_parallel_logprobs if opts.variant in ("fused", "triton") else reference_logprobs)(
            small, targets[:warm], with_entropy=with_entropy
        )
        if backward:
            sum(t.sum() for t in (o if with_entropy else (o,))).backward()
    del small, o

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    start = time.perf_counter()
    out = run_once()
    first = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_rss_bytes() - before
    del out

    times = []
    for _ in range(opts.repeats):
        start = time.perf_counter()
        out = run_once()
        times.append(time.perf_counter() - start)
        del out
    return {
        "device": opts.device,
        "dtype": opts.dtype,
        "mode": opts.mode,
        "variant": opts.variant,
        "tokens": opts.tokens,
        "vocab": opts.vocab,
        "entropy": with_entropy,
        "threads": opts.threads,
        "chunk_size": opts.chunk_size or None,
        "logits_bytes": logits.numel() * logits.element_size(),
        "peak_bytes": int(peak),
        "first_call_s": first,
        "time_s": statistics.median(times) if times else first,
        "times_s": times,
    }


def _triton_skip_reason(device):
    """Why the "triton" variant cannot run on `device` (None when it can)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # Triton's interpreter: checks this script's triton path without a GPU (times meaningless)
    if device != "cuda":
        return ("skipped: the Triton kernel runs on CUDA only (on CPU it is checked under TRITON_INTERPRET=1 by "
                "tests/dist/test_triton_logprobs.py, not timed)")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "skipped: triton is not importable here"
    return None


def _run_child(opts, device, dtype, mode, variant) -> dict:
    if variant == "triton":
        reason = _triton_skip_reason(device)
        if reason:
            return {"device": device, "dtype": dtype, "mode": mode, "variant": variant, "skipped": reason}
    cmd = [
        sys.executable, os.path.abspath(__file__), "--_child",
        "--device", device, "--dtypes", dtype, "--modes", mode, "--variants", variant,
        "--tokens", str(opts.tokens), "--vocab", str(opts.vocab), "--threads", str(opts.threads),
        "--repeats", str(opts.repeats), "--chunk-size", str(opts.chunk_size or 0),
    ]
    if opts.no_entropy:
        cmd.append("--no-entropy")
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads),
               MINDSPEED_LOGPROBS_KERNEL="triton" if variant == "triton" else "torch")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"device": device, "dtype": dtype, "mode": mode, "variant": variant,
                "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_mib(b):
    return f"{b / 2**20:9.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--json", metavar="PATH", help="write all results to this JSON file")
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto (cpu, plus cuda when available)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--variants", default="fused,naive,triton", help="fused, naive, triton (triton: CUDA only)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the first (median reported)")
    ap.add_argument("--chunk-size", type=int, default=0, help="fused rows per chunk (0: the default)")
    ap.add_argument("--no-entropy", action="store_true")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)

    if opts._child:
        opts.dtype, opts.mode, opts.variant = opts.dtypes, opts.modes, opts.variants
        print(json.dumps(_child(opts)))
        return 0

    unknown = [v for v in opts.variants.split(",") if v not in ("fused", "naive", "triton")]
    if unknown:
        raise SystemExit(f"logprobs.py: --variants {opts.variants}: unknown variant {unknown[0]!r} (fused, naive, triton)")
    if opts.device == "auto":
        import torch

        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = opts.device.split(",")
        unknown = [d for d in devices if d not in ("cpu", "cuda")]
        if unknown:
            raise SystemExit(f"logprobs.py: --device {opts.device}: unknown device {unknown[0]!r} (cpu, cuda or auto)")
        if "cuda" in devices:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(f"logprobs.py: --device cuda, but torch {torch.__version__} sees no CUDA device "
                                 "(run it on a GPU machine, or use --device cpu)")
    results = []
    for device in devices:
        for dtype in opts.dtypes.split(","):
            for mode in opts.modes.split(","):
                for variant in opts.variants.split(","):
                    r = _run_child(opts, device, dtype, mode, variant)
                    results.append(r)
                    print(f"  done {device} {dtype} {mode} {variant}: "
                          + (f"error {r['error']}" if "error" in r else r["skipped"] if "skipped" in r else
                             f"peak {r['peak_bytes'] / 2**20:.1f} MiB, {r['time_s']:.3f} s"),
                          file=sys.stderr, flush=True)

    print(f"\nlogprobs benchmark: tokens={opts.tokens} vocab={opts.vocab} entropy={not opts.no_entropy} "
          f"threads={opts.threads} (peak = extra memory of the call; fwd under no_grad)")
    show_triton = "triton" in opts.variants.split(",")
    header = (f"{'device':6} {'dtype':5} {'mode':8} | {'naive MiB':>9} {'fused MiB':>9} {'mem x':>6} | "
              f"{'naive s':>8} {'fused s':>8} {'time x':>6}")
    if show_triton:  # triton's memory and time, and both as a multiple of naive's
        header += f" | {'triton MiB':>10} {'mem x':>6} {'triton s':>8} {'time x':>6}"
    print(header)
    print("-" * len(header))
    by_key = {(r["device"], r["dtype"], r["mode"], r["variant"]): r for r in results}
    summary = []
    for device in devices:
        for dtype in opts.dtypes.split(","):
            for mode in opts.modes.split(","):
                naive, fused = by_key.get((device, dtype, mode, "naive")), by_key.get((device, dtype, mode, "fused"))
                if not naive or not fused or "error" in naive or "error" in fused:
                    print(f"{device:6} {dtype:5} {mode:8} | error: {(naive or {}).get('error')} {(fused or {}).get('error')}")
                    continue
                mem_x = fused["peak_bytes"] / max(1, naive["peak_bytes"])
                time_x = fused["time_s"] / naive["time_s"]
                row = {"device": device, "dtype": dtype, "mode": mode, "mem_ratio": mem_x, "time_ratio": time_x}
                line = (f"{device:6} {dtype:5} {mode:8} | {_fmt_mib(naive['peak_bytes'])} {_fmt_mib(fused['peak_bytes'])} "
                        f"{mem_x:6.3f} | {naive['time_s']:8.3f} {fused['time_s']:8.3f} {time_x:6.3f}")
                tri = by_key.get((device, dtype, mode, "triton"))
                if show_triton and tri and "peak_bytes" in tri:
                    row["triton_mem_ratio"] = tri["peak_bytes"] / max(1, naive["peak_bytes"])
                    row["triton_time_ratio"] = tri["time_s"] / naive["time_s"]
                    line += (f" | {tri['peak_bytes'] / 2**20:10.1f} {row['triton_mem_ratio']:6.3f} "
                             f"{tri['time_s']:8.3f} {row['triton_time_ratio']:6.3f}")
                elif show_triton and tri:
                    line += " | " + ("error" if "error" in tri else "skipped (CUDA only)" if device != "cuda" else "skipped")
                summary.append(row)
                print(line)
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as fh:
            json.dump({"config": {k: v for k, v in vars(opts).items() if not k.startswith("_")},
                       "results": results, "summary": summary}, fh, indent=2)
        print(f"wrote {opts.json}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
