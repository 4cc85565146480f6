"""Time and peak memory of the RL math at long responses: GAE and the REINFORCE++ returns (the per-position loop vs
the torch scan vs the Triton kernel) and the clipped policy / value losses, forward + backward (torch vs the fused
Triton kernel), at B = 256 and T = 512, 4k, 16k by default.

Variants:

* ``gae`` / ``rpp_returns``: ``loop`` is ``core_algos.gae_scan_loop`` / ``discounted_returns_loop`` (what
  ``compute_gae`` and REINFORCE++ ran before: one step per position), ``scan`` the torch scan
  (``gae_scan`` / ``discounted_returns`` with ``kernel="torch"``), ``triton`` the kernel (``kernel="triton"``).
  GAE: ``gamma = 1``, ``lam = 0.95``, TRL's value mask; the returns: ``gamma = 1``. Inputs fp32, a right-padded
  response mask with interior holes.
* ``policy_loss``: ``core_algos.policy_loss`` as grpo calls it (vanilla clipped surrogate, ``token-mean``, the k3
  KL to the reference with coefficient 0.04, the entropy given (metric), batch totals as device tensors), forward
  and backward to the log-probs and the entropy; ``value_loss``: ``core_algos.value_loss`` (clip 0.2), forward and
  backward. ``torch`` / ``triton`` through ``MINDSPEED_LOSS_KERNEL``.

``triton`` runs on CUDA only here (on CPU its rows are skipped with a note: the kernels' CPU check is
tests/dist/test_triton_rl_math.py under ``TRITON_INTERPRET=1``, which says nothing about speed; with
``TRITON_INTERPRET=1`` set, small CPU runs take the triton rows through the interpreter, to check this script).

Every (device, op, T, variant) runs in a fresh subprocess so measurements do not interfere:

* CPU peak memory = peak RSS during the first call minus RSS just before it (the inputs exist by then); CUDA peak
  memory = ``torch.cuda.max_memory_allocated()`` minus the allocated memory before the call. It counts what the
  call allocates: outputs, intermediates, gradients.
* Time: the median of ``--repeats`` further calls (the first call, the memory measurement, is the warm-up), the
  device synchronised around each; ``cpu s``, the process's CPU time of the same calls (less sensitive to other
  processes on a shared machine than the wall time, not to their use of memory bandwidth). With ``--rounds N``
  the whole sweep runs N times, one variant after the other in each round (so a load change hits every variant),
  and each row reports the median over the rounds (the rounds' values are in the JSON).
* ``max_abs_diff``: the largest difference of a ``scan`` / ``triton`` result from the ``loop`` (scans), or of the
  ``triton`` loss, metrics and gradient from ``torch`` (losses), computed in the same subprocess.

Usage::

    python benchmarks/rl_math.py                                  # B 256, T 512 4096 16384, CPU (+ CUDA if present)
    python benchmarks/rl_math.py --rounds 3 --json runs/rl_math.json      # what benchmarks/README.md records
    python benchmarks/rl_math.py --lengths 512 4096
    python benchmarks/rl_math.py --device cuda --ops gae policy_loss

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

OPS = ("gae", "rpp_returns", "policy_loss", "value_loss")
VARIANTS = {"gae": ("loop", "scan", "triton"), "rpp_returns": ("loop", "scan", "triton"),
            "policy_loss": ("torch", "triton"), "value_loss": ("torch", "triton")}
BASELINE = {"gae": "loop", "rpp_returns": "loop", "policy_loss": "torch", "value_loss": "torch"}


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _inputs(opts, device):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    b, t = opts.batch, opts.length
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # right padded, responses of T/2..T tokens
    mask &= torch.rand(b, t, generator=gen) > 0.01  # and interior holes
    x = {"mask": mask, "rewards": torch.randn(b, t, generator=gen) * 0.1, "values": torch.randn(b, t, generator=gen)}
    x["logp"] = -torch.rand(b, t, generator=gen) * 3
    x["old_logp"] = x["logp"] + torch.randn(b, t, generator=gen) * 0.1
    x["ref_logp"] = x["logp"] + torch.randn(b, t, generator=gen) * 0.2
    x["entropy"] = torch.rand(b, t, generator=gen) * 2
    x["advantages"] = torch.randn(b, t, generator=gen)
    x["old_values"] = x["values"] + torch.randn(b, t, generator=gen) * 0.1
    x["returns"] = torch.randn(b, t, generator=gen)
    return {k: v.to(device) for k, v in x.items()}


def _compute(opts, x):
    """The call to measure, for this child's op and variant; returns the tensors it produced (for max_abs_diff)."""
    import torch

    from mindspeed_llm.rl import core_algos as ca
    from mindspeed_llm.rl.core_algos import scans

    op, variant = opts.op, opts.variant
    if op == "gae":
        value_mask = ca.response_mask_p1(x["mask"])
        if variant == "loop":
            return lambda: scans.gae_scan_loop(x["rewards"], x["values"], value_mask, 1.0, 0.95)
        return lambda: scans.gae_scan(x["rewards"], x["values"], value_mask, 1.0, 0.95,
                                      kernel="torch" if variant == "scan" else "triton")
    if op == "rpp_returns":
        if variant == "loop":
            return lambda: (scans.discounted_returns_loop(x["rewards"], x["mask"], 1.0),)
        return lambda: (scans.discounted_returns(x["rewards"], x["mask"], 1.0,
                                                 kernel="torch" if variant == "scan" else "triton"),)
    tokens = x["mask"].sum().float()
    if op == "policy_loss":
        def run():
            logp = x["logp"].detach().requires_grad_()
            entropy = x["entropy"].detach().requires_grad_()
            loss, metrics = ca.policy_loss(logp, x["old_logp"], x["advantages"], x["mask"], 0.2, 0.28,
                                           ref_logp=x["ref_logp"], kl_coef=0.04, kl_kind="k3", entropy=entropy,
                                           total_tokens=tokens, total_sequences=torch.tensor(float(opts.batch)))
            loss.backward()
            return (loss.detach(), torch.stack(list(metrics.values())), logp.grad)
        return run
    value_mask = ca.response_mask_p1(x["mask"])

    def run():
        values = x["values"].detach().requires_grad_()
        loss, metrics = ca.value_loss(values, x["old_values"], x["returns"], value_mask, 0.2, total_tokens=tokens)
        loss.backward()
        return (loss.detach(), torch.stack(list(metrics.values())), values.grad)
    return run


def _child(opts) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from mindspeed_llm import device as dev

    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    x = _inputs(opts, device)
    call = _compute(opts, x)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    first = call()
    sync()
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()) - before
    times, cpu_times = [], []
    for _ in range(opts.repeats):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        call()
        sync()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    result = {"peak_bytes": int(peak), "time_s": statistics.median(times), "times_s": times,
              "cpu_s": statistics.median(cpu_times)}
    baseline = BASELINE[opts.op]
    if opts.variant != baseline and not opts.no_check:
        opts.variant = baseline
        if opts.op in ("policy_loss", "value_loss"):
            os.environ["MINDSPEED_LOSS_KERNEL"] = "torch"
        reference = _compute(opts, x)()
        result["max_abs_diff"] = max(float((a.double() - b.double()).abs().max()) for a, b in zip(first, reference))
    del dev
    return result


def _triton_skip_reason(device):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter: exercises this script's triton rows on CPU; its times mean nothing
    if device != "cuda":
        return ("the Triton kernels run on CUDA here (their CPU check is tests/dist/test_triton_rl_math.py under "
                "TRITON_INTERPRET=1, not timed)")
    import importlib.util

    return None if importlib.util.find_spec("triton") else "triton is not installed"


def _run_child(opts, device, op, length, variant) -> dict:
    args = [sys.executable, os.path.abspath(__file__), "--_child", "--device", device, "--op", op,
            "--length", str(length), "--variant", variant, "--batch", str(opts.batch), "--repeats", str(opts.repeats),
            "--threads", str(opts.threads)] + (["--no-check"] if opts.no_check else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads), PYTHONPATH=ROOT)
    if op in ("policy_loss", "value_loss"):
        env["MINDSPEED_LOSS_KERNEL"] = "triton" if variant == "triton" else "torch"
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), action="append",
                    help="device(s) to run on (default: cpu, and cuda when available)")
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 4096, 16384], help="response lengths T")
    ap.add_argument("--batch", type=int, default=256, help="rows B")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls after the first (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (shared 2-core machine: 1)")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps; each row reports the median over them")
    ap.add_argument("--no-check", action="store_true", help="skip the max_abs_diff computation")
    ap.add_argument("--json", metavar="PATH", help="write all results to this JSON file")
    # one measurement, in a child process
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", choices=OPS, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts._child:
        opts.device = opts.device[0]
        print(json.dumps(_child(opts)))
        return 0

    import torch

    devices = opts.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if "cuda" in devices and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 1
    failed = False
    cases = [(device, op, length) for device in devices for op in opts.ops for length in opts.lengths]
    measured = {}  # (device, op, length, variant) -> one result per round
    for _ in range(opts.rounds):
        for device, op, length in cases:
            skip = _triton_skip_reason(device)
            for variant in VARIANTS[op]:
                r = {"skipped": skip} if variant == "triton" and skip else _run_child(opts, device, op, length, variant)
                measured.setdefault((device, op, length, variant), []).append(r)
    rows = []
    print(f"B={opts.batch}, median of {opts.repeats} calls (of {opts.rounds} rounds), threads={opts.threads}; "
          f"peak = extra memory of the call (losses: forward + backward)")
    header = (f"{'device':6} {'op':12} {'T':>6} | {'variant':7} {'time s':>9} {'cpu s':>9} {'x base':>7} "
              f"{'peak MiB':>9} {'max|diff|':>10}")
    print(header)
    print("-" * len(header))
    for device, op, length in cases:
        base = None
        for variant in VARIANTS[op]:
            runs = measured[(device, op, length, variant)]
            row = {"device": device, "op": op, "batch": opts.batch, "length": length, "variant": variant}
            rows.append(row)
            errors = [r["error"] for r in runs if "error" in r]
            if errors:
                failed = True
                row["error"] = errors[0]
                print(f"{device:6} {op:12} {length:6} | {variant:7} FAILED: {errors[0]}")
                continue
            if "skipped" in runs[0]:
                row["skipped"] = runs[0]["skipped"]
                print(f"{device:6} {op:12} {length:6} | {variant:7} skipped: {row['skipped']}")
                continue
            for key in ("time_s", "cpu_s", "peak_bytes"):
                row[key] = statistics.median(r[key] for r in runs)
            if any("max_abs_diff" in r for r in runs):
                row["max_abs_diff"] = max(r["max_abs_diff"] for r in runs)
            row["rounds"] = runs
            if variant == BASELINE[op]:
                base = row
            row["speedup"] = base["time_s"] / row["time_s"] if base else None
            diff = f"{row['max_abs_diff']:10.2e}" if "max_abs_diff" in row else f"{'-':>10}"
            speed = f"{row['speedup']:6.1f}x" if row["speedup"] else f"{'-':>7}"
            print(f"{device:6} {op:12} {length:6} | {variant:7} {row['time_s']:9.4f} {row['cpu_s']:9.4f} {speed} "
                  f"{row['peak_bytes'] / 2**20:9.1f} {diff}")
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as fh:
            json.dump({"config": {k: v for k, v in vars(opts).items() if not k.startswith("_") and k not in
                                  ("op", "length", "variant")},
                       "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]},
                       "results": rows}, fh, indent=1)
        print(f"wrote {opts.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
