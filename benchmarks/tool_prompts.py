#!/usr/bin/env python
"""What a rank spends at startup offering the run's tools in its prompts (`rl/tools/prompts.offer_run_tools`, then
`trainer.check_prompt_lengths`), at 1 and more ranks (gloo processes on this machine).

    .venv/bin/python benchmarks/tool_prompts.py                             # 4000 DeepScaleR prompts, 1 and 2 ranks
    .venv/bin/python benchmarks/tool_prompts.py --rows 8000 --worlds 1 2 4 --json runs/tool_prompts.json

The prompts are tests/fixtures/data's DeepScaleR rows, replicated and preprocessed with Qwen2.5's template and the
offline Qwen2.5 tokenizer (its chat template has a tools section: the prompts get Qwen2.5's own `# Tools` block, of
the demo's calculator tool). Timed on every rank, after a barrier: `offer_run_tools` and `check_prompt_lengths`
(tokenizer loading, the dataset's opening and imports excluded), then the reading of 64 prompts as a rank draws
them, and the rendering of the same 64 one at a time (what rendering each at its first access would cost instead).
`ids sha256` is a digest of every offered prompt's token ids and of the prompt lengths: equal before and
after a change of how the prompts are rendered, the prompts are the same.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from spawned import spawn_ranks, write_results  # noqa: E402 - benchmarks/ on the path first
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
FIXTURES = ROOT / "tests" / "fixtures"
DRAWN = 64  # prompts read after startup, as a rank draws them


def make_dataset(rows: int, folder: Path, tok_dir: Path) -> str:
    """`rows` DeepScaleR prompts preprocessed with Qwen2.5's template (no tools: the run offers them)."""
    import logging

    logging.getLogger("mindspeed_llm.data.preprocess").setLevel(logging.WARNING)
    from mindspeed_llm.data.preprocess import preprocess

    base = json.loads((FIXTURES / "data" / "deepscaler_sample.json").read_text(encoding="utf-8"))
    src = folder / "rows.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps(base[i % len(base)], ensure_ascii=False) + "\n")
    prefix = folder / "prompts"
    preprocess(["--input", str(src), "--tokenizer-name-or-path", str(tok_dir), "--output-prefix", str(prefix),
                "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "qwen",
                "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}), "--log-interval", "0"])
    return str(prefix)


def _rank(rank: int, world: int, port: int, prefix: str, tok_dir: str, tool_config: str, out: str) -> None:
    import numpy as np
    import torch.distributed as dist

    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.data.tokenizer import load_tokenizer
    from mindspeed_llm.distributed import world_share
    from mindspeed_llm.rl.tools.prompts import offer_run_tools
    from mindspeed_llm.rl.trainer import check_prompt_lengths

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokenizer = load_tokenizer("PretrainedFromHF", tok_dir)
    dataset = PromptDataset(prefix)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    # as trainer.run does (an implementation from before the shared rendering takes no `ranks`: every rank renders all)
    shared = "ranks" in inspect.signature(offer_run_tools).parameters
    offered, _ = offer_run_tools(tool_config, tokenizer, dataset, None, **(dict(ranks=world_share()) if shared else {}))
    check_prompt_lengths(offered, 4096, "--data-path")
    startup, startup_cpu = time.perf_counter() - start, time.process_time() - cpu
    drawn = np.random.default_rng(rank).choice(len(offered), size=min(DRAWN, len(offered)), replace=False)
    start = time.perf_counter()
    rows = [offered[int(i)]["input_ids"] for i in drawn]
    read = time.perf_counter() - start
    # what rendering a prompt at its first access would cost instead (one prompt at a time)
    start = time.perf_counter()
    for i in drawn:
        offered.offered.render([dataset[int(i)]["input_ids"]], tokenizer)
    lazy = time.perf_counter() - start
    result = dict(rank=rank, startup_s=startup, startup_cpu_s=startup_cpu, read_ms_per_prompt=1e3 * read / len(rows),
                  render_ms_per_prompt=1e3 * lazy / len(rows),
                  offered_tokens=int(offered.prompt_lengths.sum()), stored_tokens=int(dataset.prompt_lengths.sum()))
    if rank == 0:
        digest = hashlib.sha256()
        for i in range(len(offered)):
            digest.update(np.asarray(offered[i]["input_ids"], dtype=np.int64).tobytes())
        digest.update(np.asarray(offered.prompt_lengths, dtype=np.int64).tobytes())
        result["ids_sha256"] = digest.hexdigest()[:16]
        result["rows_checked"] = all(offered[int(i)]["input_ids"] == r for i, r in zip(drawn, rows))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_world(world: int, prefix: str, tok_dir: str, tool_config: str) -> dict:
    ranks = spawn_ranks(_rank, world, (prefix, tok_dir, tool_config), "bench-tool-prompts-")
    first = ranks[0]
    return dict(world=world, startup_s_max=max(r["startup_s"] for r in ranks),
                startup_s_mean=sum(r["startup_s"] for r in ranks) / world,
                startup_cpu_s_max=max(r["startup_cpu_s"] for r in ranks),
                read_ms_per_prompt=max(r["read_ms_per_prompt"] for r in ranks),
                render_ms_per_prompt=max(r["render_ms_per_prompt"] for r in ranks),
                offered_tokens=first["offered_tokens"], stored_tokens=first["stored_tokens"],
                ids_sha256=first["ids_sha256"], rows_checked=first["rows_checked"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000, help="prompts in the dataset")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="ranks (gloo processes) per measurement")
    ap.add_argument("--repeats", type=int, default=1, help="runs per world size; the fastest is reported")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    from mindspeed_llm.data.offline_tokenizer import cached_qwen2_5_tokenizer
    from mindspeed_llm.demo.tool_task import write_tool_config

    template = (FIXTURES / "tokenizers" / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")
    tok_dir = str(cached_qwen2_5_tokenizer(chat_template=template))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-tool-prompts-data-") as tmp:
        prefix = make_dataset(args.rows, Path(tmp), Path(tok_dir))
        tool_config = str(write_tool_config(Path(tmp) / "tools.yaml"))
        for world in args.worlds:
            runs = [run_world(world, prefix, tok_dir, tool_config) for _ in range(args.repeats)]
            results.append(min(runs, key=lambda r: r["startup_s_max"]))

    print(f"offering the tools in {args.rows} prompts at startup: DeepScaleR rows, Qwen2.5's template and tools "
          f"section, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'ranks':>5} {'startup s (max rank)':>21} {'(mean)':>7} {'CPU s (max)':>12} {'read ms/prompt':>15} "
          f"{'render ms/prompt':>17} {'tokens stored':>14} {'offered':>9} {'ids sha256':>17}")
    for r in results:
        print(f"{r['world']:>5} {r['startup_s_max']:>21.2f} {r['startup_s_mean']:>7.2f} "
              f"{r['startup_cpu_s_max']:>12.2f} "
              f"{r['read_ms_per_prompt']:>15.3f} {r['render_ms_per_prompt']:>17.2f} {r['stored_tokens']:>14} "
              f"{r['offered_tokens']:>9} {r['ids_sha256']:>17}")
    if len({r["ids_sha256"] for r in results}) != 1 or not all(r["rows_checked"] for r in results):
        print("the offered prompts differ between the world sizes", file=sys.stderr)
        return 1
    if args.json:
        write_results(args.json, "tool_prompts", results, rows=args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
