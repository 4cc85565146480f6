"""Activation and model-state memory of one RL training step, measured on CPU at a scaled-down shape, fitted per
layer, and projected to every shipped launcher's devices.

What is measured (``--device cpu``; ``--device cuda`` / ``npu`` runs the same code with the device allocator's
statistics, ``npu`` through torch_npu and unverified until run on an NPU), for
each core attention (``--attentions``: every case names its own, `build_model(..., attention=...)`):

* one training forward + backward of the policy on the real path: `MicroBatchPlan` rows or packed prompt groups ->
  the actor's `TrainableModel` (megatron DDP with its fp32 grad buffer, bf16 weights) through megatron's schedule
  (`rl.update.engine.run_schedule`, what `train_step` runs before the optimizer step) -> `rl.update.loss_closures.clipped_policy_loss`
  (`passes.response_logprobs` -> `rl.logprobs.vocab_parallel_logprobs` with entropy, the clipped surrogate, the
  low_var_kl loss), with grpo's settings;
* **saved for backward**: every tensor autograd packs during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters left out, attributed to
  the module that was running (forward pre/post hooks on the embedding, each layer and its norms, attention,
  core attention and MLP, the final norm, the output layer; the log-prob + loss closure; the decoder itself for
  full recompute's checkpointed layer inputs). A storage saved in more than one layer (the rotary table, the
  causal or packed mask) is counted once, as "shared". Which saved storages the step does not allocate before
  its backward is measured too (``saved_outside_step``, weak references to the storages): those from before the
  step (the micro-batch's token ids, megatron's cached causal mask) and those freed before the backward (a graph
  branch the loss does not reach);
* **peak**: on CPU, ``torch.profiler`` with ``profile_memory=True``: the running sum of every allocation and free
  event (``alloc_size`` of the profiler's allocation events, in time order) from the step's start; its maximum is
  the step's peak above what was live before it. Megatron's global memory buffer (the local attention's score
  matmul target, ``[b * heads, s, s]``, allocated once and kept) is added: it is steady-state memory. Checked
  (JSON ``peak_check``): the method gives the exact bytes of a scripted allocation sequence, and a fresh process
  whose only work is one step rises in ``ru_maxrss`` by about the profiler's peak when glibc's mmap threshold is
  fixed (by default glibc raises it and keeps freed blocks in its heap, which RSS counts on top). On CUDA:
  ``torch.cuda.max_memory_allocated`` minus the allocation before the step (the profiler's timeline is still used
  for the phase split);
* the phase split of the peak (markers in the profiler's timeline from the same module hooks and from gradient
  hooks on each layer's output, `summarize_phases`): one layer's forward and backward, the head's forward and
  backward, each as the most memory live above the live bytes when it starts;
* the time of one plain step (no hooks, no profiler) after a warm-up step;
* the forward-only log-prob pass (`passes.policy_logprobs`, no grad) and the rollout (`inference.generate` on
  megatron's static KV cache), by the same peak method;
* model-state bytes per parameter by part of a real `TrainableModel` after one optimizer step
  (`rl/update/model_state.bytes_per_parameter`: weights, DDP grad buffer, fp32 main weights, Adam moments), at DP1 and at
  DP2 (two gloo processes) with megatron's optimizer and the distributed optimizer, what `TrainableModel.offload()`
  leaves on the device for each --offload-train-* flag (actor and critic, `roles.offload_parts`), and a frozen
  model's;
* the same saved-bytes measurement at TP2 on two gloo processes;
* the token-budget micro-batches on the real `MicroBatchPlan` (`plan_micro_batch_tokens`) at a skewed length mix.

Levers, one parameter each (`Case`): ``recompute`` none / selective (megatron's core_attn) / full (uniform, one
layer per checkpoint); ``attention`` sdpa (the fused core attention, the default) / local (megatron's unfused
attention, which keeps ``[b, heads, s, s]`` scores); ``layout`` row / packed (`[prompt | r1 .. rn]`); micro-batching
by count or by a token budget (`batch_plan.token_budget_groups`, the rule `MicroBatchPlan` runs).

What is computed: coefficients fitted to the measurements of each attention (`fit_model`: least squares with
non-negative coefficients) -- saved bytes per token per layer by part as linear functions of hidden, FFN, q and
kv widths, heads and, for the local attention's ``s^2`` part, heads x s (MoE: experts, top-k x hidden, top-k x
expert FFN); one layer's working set without recompute (a recomputed layer's backward adds what recompute did not
keep, checked against the measured selective / full cases) and the head's; held-out shapes check them
(`check_fit`: saved bytes and the composed peak); their division under tensor parallelism (hidden-sized tensors
stay replicated without sequence parallelism, the rest divides; checked against the TP2 measurement); the padding
of micro-batches at a skewed length mix; the model-state table (`StateBytes.measured`: which parts the distributed
optimizer divides, what offload leaves); and the per-device projection of each launcher (`examples/mcore/*/*.sh`,
read through its own command line and `arguments.parse_args`) for the rollout (its rows in flight
``--rollout-max-num-seqs``, its prefill ``--rollout-max-num-batched-tokens``), the forward-only passes and the
update at its worst pipeline stage, as launched and with each lever flipped (`Levers`, `lever_rows`; sequence
parallelism and context parallelism among them, computed from the TP1 fit, not measured: the hidden-sized terms
divided by TP, a CP rank's 1/CP of the tokens plus each layer's all-gathered keys and values), against 64 GB and
80 GB, the 7B and 32B launchers also at a 16k response (`long_response_rows`: as launched, + SP, + SP + CP 2, and
what then fits 56 GB), and the cheapest levers and layout that fit 56 GB in every phase (`recommend`; it does not
flip SP or CP). DeepSeek-V3 (multi-latent attention, not measured) gets its
model state only. Every assumption is printed and in the JSON (``assumptions``). Cases a shared 24 GB machine
cannot hold are skipped by a rough estimate (``--max-case-gb``) and say so; ``--reuse`` / ``--only`` /
``--remeasure`` add cases to an earlier JSON without measuring the rest again (an earlier JSON format gives its
cases only).

Code: this file is the command line (`parse`, `main`); the benchmark is the package `benchmarks/step_memory/`:
`shapes` (the data), `measure` / `measure_state` / `peak_checks` (measurement), `micro_batching`, `fit`, `launch` /
`projection`, `cases` / `analyse` (the run and its analyses), `report`.

Usage::

    python benchmarks/memory.py --json runs/memory.json              # default shape, 2k/4k/8k, ~1 h on 2 cores
    python benchmarks/memory.py --reuse runs/memory.json --only "s=4096 none" --max-case-gb 14 --json runs/m2.json
    python benchmarks/memory.py --toy --no-tp2 --json /tmp/m.json  # a minute (tests/dist/test_benchmark_memory_dist.py)
    python benchmarks/memory.py --project-only runs/memory.json      # redo fit + projection from a JSON"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.step_memory.analyse import analyse  # noqa: E402
from benchmarks.step_memory.cases import grid_cases, machine, main_cases, run_cases, versions  # noqa: E402
from benchmarks.step_memory.measure import init_process, measure_generate  # noqa: E402
from benchmarks.step_memory.measure_state import measure_model_state, run_tp2  # noqa: E402
from benchmarks.step_memory.peak_checks import check_peak_method, check_peak_rss  # noqa: E402
from benchmarks.step_memory.report import report  # noqa: E402
from benchmarks.step_memory.shapes import (  # noqa: E402
    DEFAULT_SHAPE, FIT_GRIDS, GB, JSON_FORMAT, LAUNCHERS, RECOMPUTE, TOY_SHAPE, Case, Shape,
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="model row lengths (tokens)")
    p.add_argument("--hidden", type=int, default=DEFAULT_SHAPE.hidden)
    p.add_argument("--ffn", type=int, default=DEFAULT_SHAPE.ffn)
    p.add_argument("--heads", type=int, default=DEFAULT_SHAPE.heads)
    p.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE.kv_heads)
    p.add_argument("--head-dim", type=int, default=DEFAULT_SHAPE.head_dim)
    p.add_argument("--layers", type=int, default=DEFAULT_SHAPE.layers)
    p.add_argument("--vocab", type=int, default=DEFAULT_SHAPE.vocab)
    p.add_argument("--toy", action="store_true", help="toy shape, lengths 64 / 128 and the toy fit grid (seconds)")
    p.add_argument("--max-case-gb", type=float, default=8.0,
                   help="skip a case whose rough estimate exceeds this (the machine is shared)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-tp2", action="store_true", help="skip the two-process TP2 measurement")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--no-fit-grid", action="store_true",
                   help="fit on the main shape's cases only (no other shapes, no held-out check)")
    p.add_argument("--no-rss-check", action="store_true")
    p.add_argument("--launchers", nargs="*", default=list(LAUNCHERS))
    p.add_argument("--project-only", metavar="JSON", help="redo fit and projection from an earlier --json")
    p.add_argument("--reuse", metavar="JSON",
                   help="take the cases an earlier --json measured (same name), the rollout, model-state, TP2 and "
                        "peak-check results from it, and measure only the rest")
    p.add_argument("--only", metavar="REGEX", help="measure only the cases whose name matches (with --reuse)")
    p.add_argument("--remeasure", metavar="REGEX", help="measure again the cases of --reuse whose name matches")
    p.add_argument("--attentions", nargs="+", choices=("sdpa", "local"), default=["sdpa", "local"],
                   help="the core attentions measured (the first also runs the RSS check and every TP2 mode)")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.project_only:
        with open(opts.project_only) as f:
            data = json.load(f)
        analyse(data, opts.launchers)
        print(report(data))
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(data, f, indent=1)
        return 0
    os.environ["MINDSPEED_DEVICE"] = opts.device
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    import torch

    torch.set_num_threads(opts.threads)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 1
    if opts.device == "npu":
        from mindspeed_llm import device

        if not device._npu_available():
            print("--device npu: no NPU here (torch_npu missing or it sees no device)", file=sys.stderr)
            return 1
    if opts.toy:
        shape, lengths, grid = TOY_SHAPE, [64, 128], FIT_GRIDS["toy"]
    else:
        shape = Shape(hidden=opts.hidden, ffn=opts.ffn, heads=opts.heads, kv_heads=opts.kv_heads,
                      head_dim=opts.head_dim, layers=opts.layers, vocab=opts.vocab)
        lengths, grid = opts.lengths, FIT_GRIDS["default"]
    started = time.time()
    log = lambda msg: print(f"[{time.time() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    init_process(1)
    attentions = list(opts.attentions)
    data = dict(meta=dict(format=JSON_FORMAT, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          command=" ".join(sys.argv), device=opts.device, threads=opts.threads, versions=versions(),
                          machine=machine(), shape=asdict(shape), lengths=lengths, attentions=attentions,
                          shape_text=f"hidden {shape.hidden}, FFN {shape.ffn}, {shape.heads} heads / {shape.kv_heads} "
                                     f"KV x {shape.head_dim}, {shape.layers} layers, vocabulary {shape.vocab}, bf16"))
    max_bytes = opts.max_case_gb * GB
    old = {}
    if opts.reuse:
        with open(opts.reuse) as f:
            old = json.load(f)
        data["meta"]["reused_from"] = dict(path=opts.reuse, date=old["meta"]["date"], format=old["meta"].get("format"),
                                           earlier=old["meta"].get("reused_from"))
    # an earlier format's rollout, model-state, TP2 and RSS results were measured otherwise: only its cases are
    # taken (by name: the same shape, levers and attention)
    old_extras = old if old.get("meta", {}).get("format") == JSON_FORMAT else {}

    def save(cases=None):
        if opts.json:
            if cases is not None:
                data["cases"] = cases
            os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
            with open(opts.json, "w") as f:
                json.dump(data, f, indent=1)

    data["peak_check"] = dict(scripted=check_peak_method(opts.device))
    log(f"peak method on a scripted sequence: {data['peak_check']['scripted']}")
    for key in ("generate", "model_state", "model_state_distributed_optimizer_dp1", "tp2"):
        if key in old_extras:
            data[key] = old_extras[key]
    for key, threshold in (("rss", None), ("rss_fixed_mmap_threshold", 128 << 10)):
        if key in old_extras.get("peak_check", {}):
            data["peak_check"][key] = old_extras["peak_check"][key]
        elif opts.device == "cpu" and not opts.no_rss_check:
            data["peak_check"][key] = check_peak_rss(Case(shape, lengths[0], attentions[0]), threshold)
            log(f"RSS check ({key}): {data['peak_check'][key]}")
    if "generate" not in data and not opts.no_generate:
        p1, p2 = (lengths[0] // 4, lengths[0] // 2)
        data["generate"] = [measure_generate(shape, b, p, n, attention, opts.device) for attention in attentions
                            for b, p, n in ((2, p1, 2), (2, p2, 2), (4, p2, 2), (4, p2, 2 + p2 // 4))]
        log(f"generate: {[(g['attention'], g['peak'], g['kv_cache']) for g in data['generate']]}")
    if "model_state" not in data:
        data["model_state"] = measure_model_state(grid["dense"][0])
        data["model_state_distributed_optimizer_dp1"] = measure_model_state(grid["dense"][0], True, offload=False)
        log(f"model state: {data['model_state']['bytes_per_param']}")
    if "tp2" not in data and not opts.no_tp2 and opts.device == "cpu":
        tp_cases = [Case(shape, lengths[0], attention, recompute=mode) for attention in attentions
                    for mode in (RECOMPUTE if attention == attentions[0] else ["none"])]
        data["tp2"] = run_tp2(tp_cases, grid["dense"][0])
        log(f"TP2: {'error' if 'error' in data['tp2'] else 'done'}")
    save()
    cases = main_cases(shape, lengths, attentions) + ([] if opts.no_fit_grid else grid_cases(grid, attentions))
    reuse = {c["case"]["name"]: dict(c, measured_on=c.get("measured_on") or f"before {old['meta']['date']}")
             for c in old.get("cases", []) if "saved" in c}
    reuse = {name: c for name, c in reuse.items() if not (opts.remeasure and re.search(opts.remeasure, name))}
    data["cases"] = run_cases(cases, opts.device, max_bytes, log, reuse=reuse, only=opts.only, save=save,
                              date=data["meta"]["date"])
    data["meta"]["reused_cases"] = sorted(name for name in reuse if name in {c.name for c in cases})
    data["meta"]["wall_s"] = time.time() - started
    data["meta"]["machine"]["load_average_end"] = os.getloadavg()
    save()
    analyse(data, opts.launchers)
    print(report(data))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
