#!/usr/bin/env python
"""Bytes and seconds of one weight sync (`rl/async_rl/streaming.py`) from TP2 trainer ranks to generator ranks at a
few bucket sizes, over gloo processes on this machine.

    .venv/bin/python benchmarks/weight_sync.py                                  # tiny and small, 3 and 4 processes
    .venv/bin/python benchmarks/weight_sync.py --models small --buckets-mb 4 64 --json runs/weight_sync.json

Layouts: 3 processes (2 trainers at TP2 -> 1 generator at TP1) and 4 processes (2 trainers at TP2 -> 2 generators
at TP2, one actor). Models (bf16, the shapes of megatron's local-spec GPTModel, held as the checkpoint code's TP
shards of them, values zero: the stream's cost does not depend on them): `tiny`, the stage tests' tiny Qwen2 policy
(2 layers of hidden 64 and Qwen2.5's 151,936-token vocabulary, tied); `small`, 4 layers of Qwen2.5-0.5B (hidden 896,
FFN 4864, 14 heads, 2 key/value heads) with its vocabulary, tied. Each (layout, bucket size) syncs `--repeats` times
after one warm-up; the median is reported: bytes each generator receives, the slowest rank's seconds (headers, the
go flag, the buckets, the generators' reslicing and copies), and bytes / seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from spawned import spawn_ranks, write_results  # noqa: E402 - benchmarks/ on the path first

MODELS = {
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 kv_channels=16),
    "small": dict(num_layers=4, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
                  kv_channels=64),
}
LAYOUTS = {3: (2, 1), 4: (2, 2)}  # world size -> (trainer TP, generator TP); the trainers are 2 ranks at TP2


def spec_of(model: str):
    from mindspeed_llm.models.architecture import ArchitectureSpec

    return ArchitectureSpec(family="qwen2", vocab_size=151936, add_qkv_bias=True, tie_word_embeddings=True,
                            **MODELS[model])


def shard(spec, tp: int, rank: int):
    """{global name: zeros} of TP rank `rank` of `tp` (PP 1), in bf16."""
    import torch

    from mindspeed_llm.checkpoint import sharding
    from mindspeed_llm.rl.async_rl import weights

    h, f, v, kv = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * kv
    shapes = {"word_embeddings.weight": (v, h), "linear_qkv.weight": (qkv, h), "linear_qkv.bias": (qkv,),
              "linear_proj.weight": (h, spec.num_attention_heads * kv), "linear_fc1.weight": (2 * f, h),
              "linear_fc2.weight": (h, f)}
    out = {}
    for name in sharding.expected_local_names(spec, 1, 0, False):
        full = next((s for suffix, s in shapes.items() if name.endswith(suffix)), (h,))
        out[name] = torch.zeros(weights.local_shape(weights.split_name(name), full, tp), dtype=torch.bfloat16)
    return out


def _rank(rank: int, world: int, port: int, model: str, buckets_mb, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mindspeed_llm.rl.async_rl import placement as placing
    from mindspeed_llm.rl.async_rl import streaming

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trainer_tp, generator_tp = LAYOUTS[world]
    placement = placing.plan_placement(world, world - trainer_tp, generator_tp, trainer_tp)
    groups = placing.create_sync_groups(placement, placing.trainer_sources(trainer_tp, 1), backend="gloo")
    spec = spec_of(model)
    generator = placement.is_generator(rank)
    if generator:
        tensors = shard(spec, generator_tp, placement.generator_tp_rank(rank))
        receiver = streaming.WeightReceiver(groups.sources, generator_tp, placement.generator_tp_rank(rank))
    else:
        tensors = shard(spec, trainer_tp, rank)
        sender = streaming.WeightSender(groups.own, trainer_tp, 1, rank, 0)
    rows = []
    for mb in buckets_mb:
        runs = []
        for _ in range(repeats + 1):
            dist.barrier()
            if generator:
                stats = receiver.receive(tensors)
            else:
                sender.bucket_bytes = int(mb * 1024 * 1024)
                stats = sender.send(tensors)
            runs.append(stats)
        runs = runs[1:]  # the first is the warm-up
        rows.append(dict(bucket_mb=mb, generator=generator, bytes=runs[0].bytes, buckets=runs[0].buckets,
                         seconds=statistics.median(s.seconds for s in runs)))
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_world(world: int, model: str, buckets_mb, repeats: int):
    ranks = spawn_ranks(_rank, world, (model, buckets_mb, repeats), "bench-weight-sync-")
    trainer_tp, generator_tp = LAYOUTS[world]
    results = []
    for i, mb in enumerate(buckets_mb):
        generators = [r[i] for r in ranks if r[i]["generator"]]
        seconds = max(r[i]["seconds"] for r in ranks)
        results.append(dict(model=model, processes=world, layout=f"TP{trainer_tp} -> {world - 2} x TP{generator_tp}"
                            if generator_tp == 1 else f"TP{trainer_tp} -> TP{generator_tp}",
                            bucket_mb=mb, bytes_per_generator=generators[0]["bytes"],
                            buckets_per_source=max(r[i]["buckets"] for r in ranks if not r[i]["generator"]),
                            seconds=seconds, gb_per_s=generators[0]["bytes"] / seconds / 1e9))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    ap.add_argument("--worlds", type=int, nargs="+", choices=sorted(LAYOUTS), default=[3, 4],
                    help="processes: 3 (TP2 -> TP1) or 4 (TP2 -> TP2)")
    ap.add_argument("--buckets-mb", type=float, nargs="+", default=[1, 16, 256], help="bucket sizes in MiB")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per bucket size after a warm-up (median)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    results = []
    for model in args.models:
        for world in args.worlds:
            results += run_world(world, model, args.buckets_mb, args.repeats)
    print(f"weight sync over gloo, bf16, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"median of {args.repeats}")
    print(f"{'model':>6} {'procs':>5} {'layout':>16} {'bucket MiB':>10} {'MB / generator':>15} {'buckets':>8} "
          f"{'seconds':>8} {'GB/s':>6}")
    for r in results:
        print(f"{r['model']:>6} {r['processes']:>5} {r['layout']:>16} {r['bucket_mb']:>10g} "
              f"{r['bytes_per_generator'] / 1e6:>15.1f} {r['buckets_per_source']:>8} {r['seconds']:>8.3f} "
              f"{r['gb_per_s']:>6.2f}")
    if args.json:
        write_results(args.json, "weight_sync", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
