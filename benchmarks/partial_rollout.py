"""`timing/rollout` of grpo and trl_ppo iterations at a skewed response-length mix, with and without
`--partial-rollout` (`rl/rollouts/partial.py`).

The skewed mix: the stage's own lengths can only be skewed by what the policy emits (every prompt may answer
--max-new-tokens: `validate_args` keeps --max-prompt-length + --max-new-tokens within --max-length), so the run
gives `--stop-ids` (9) of the 256 word ids as --stop-token-ids to a tiny random Qwen2 (`--layers`, `--hidden`, the
word-task vocabulary: tests/helpers/hf_tiny.py), whose next-token distribution is near uniform: a response ends at each
token with p = 9/256, its length is geometric, (1 - p)^64 = 10% of them run to the 64-token cap and the others
average about a third of it: `generate.py`'s skewed mix (10% at the cap, the rest at 10-50%) by sampling instead
of by budget.
Prompts: 3-5 random words. The measured response lengths (min / mean / max, and the share at the cap) are reported.
Each configuration is one `posttrain_gpt.py` process (1 rank, `OMP_NUM_THREADS=1`) of `--iterations` iterations;
reported per configuration: `timing/rollout` of each iteration (the minimum over `--repeats` runs, round-robin),
its mean over the iterations after the first (the first with --partial-rollout starts with empty buffers and must
cut its own long samples), the ratio of that mean to the run without the flag, `partial_rollout/rounds`, and the
generation engine's counts of the rollout (decode forwards, rows x decode steps, prefilled token slots incl. padding;
a driver around `posttrain_gpt.py` reads them from each `generate` call's `Rollout.stats`), which do not depend on
the machine's load.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/partial_rollout.py [--splits 2 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mindspeed_llm and tests.helpers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--cap", type=int, default=64, help="--max-new-tokens, the long responses' length")
    p.add_argument("--prompts", type=int, default=16, help="--global-batch-size (prompts per iteration)")
    p.add_argument("--grpo-n", type=int, default=4, help="grpo's --n-samples-per-prompt")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--stop-ids", type=int, default=9, help="word ids that stop a response (of 256)")
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4], help="--partial-rollout-max-split values")
    p.add_argument("--stages", nargs="+", default=["grpo", "trl_ppo"])
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="--rollout-max-num-batched-tokens of every run (default: none; a cap also bounds each "
                        "prefill forward's rows x width, beside the engine's padding bound)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, round-robin; the per-iteration "
                                                          "minimum is reported")
    p.add_argument("--wait-load", type=float, metavar="L",
                   help="before starting, wait (up to 30 min) until the 1-minute load average is below L")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def build_task(root: Path, args) -> dict:
    from tests.helpers.hf_tiny import save_tiny, write_tokenizer
    from tests.helpers.word_task import write_prompts

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    tokenizer = root / "tokenizer"
    write_tokenizer(tokenizer, 256)
    sizes = dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                 num_hidden_layers=args.layers,
                 num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128))
    paths = {"tokenizer": str(tokenizer)}
    for role, value_head, seed in (("actor", False, 3), ("reward", True, 4)):
        hf = save_tiny("qwen2", root / f"hf_{role}", seq_cls=value_head, seed=seed, **sizes)
        out = root / f"mg_{role}"
        convert_hf_to_mg(hf, str(out), 1, 1, value_head=value_head, tokenizer_dir=str(tokenizer), progress=False)
        paths[role] = str(out)
    paths["data"] = write_prompts(root, tokenizer, args.prompts * (args.iterations + 4) * 4)  # more than drawn
    return paths


def stage_argv(task, args, stage, out: Path, split) -> list:
    argv = ["--stage", stage, "--ref-model", task["actor"], "--tokenizer-name-or-path", task["tokenizer"],
            "--data-path", task["data"], "--global-batch-size", str(args.prompts), "--micro-batch-size", "4",
            "--train-iters", str(args.iterations), "--max-new-tokens", str(args.cap), "--do-sample",
            "--seed", "5", "--lr", "1e-5", "--stop-token-ids", ",".join(map(str, range(100, 100 + args.stop_ids))),
            "--metrics-jsonl", str(out / "metrics.jsonl"), "--log-interval", "1000"]
    if stage == "grpo":
        argv += ["--n-samples-per-prompt", str(args.grpo_n), "--verifier-function", "first_line_answer"]
    else:
        argv += ["--reward-model", task["reward"]]
    if args.max_num_batched_tokens:
        argv += ["--rollout-max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if split:
        argv += ["--partial-rollout", "--partial-rollout-max-split", str(split), "--max-num-gen-batches", "16"]
    return argv


COUNTING_DRIVER = """
# posttrain_gpt.py whose rollout `generate` calls append the engine's counts (per iteration) to COUNTS_JSONL.
import json, os, sys
import mindspeed_llm.rl.rollouts.plain as rollout
original = rollout.generate
def generate(model, prompts, sampling=None, **kwargs):
    result = original(model, prompts, sampling, **kwargs)
    stats = result.stats or {}
    with open(os.environ["COUNTS_JSONL"], "a") as f:
        f.write(json.dumps(dict(iteration=kwargs.get("iteration"), rows=len(prompts),
                                **{k: stats.get(k, 0) for k in ("decode_forwards", "decode_row_steps",
                                                                 "prefill_tokens")})) + "\\n")
    return result
rollout.generate = generate  # every generator's engine call (rl/rollouts/plain.py)
import posttrain_gpt
sys.exit(posttrain_gpt.main(sys.argv[1:]))
"""


def run_one(argv, driver: Path) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    out = Path(argv[argv.index("--metrics-jsonl") + 1])
    counts = out.parent / "counts.jsonl"
    env["COUNTS_JSONL"] = str(counts)
    done = subprocess.run([sys.executable, str(driver), *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"posttrain_gpt.py {' '.join(argv)} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    calls = [json.loads(line) for line in counts.read_text().splitlines()]
    for row in rows:  # the engine's counts of the iteration's rollout calls (evaluation is off)
        mine = [c for c in calls if c["iteration"] == row["iteration"]]
        for key in ("decode_forwards", "decode_row_steps", "prefill_tokens"):
            row[f"engine/{key}"] = sum(c[key] for c in mine)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.wait_load is not None:
        deadline = time.time() + 1800
        while os.getloadavg()[0] >= args.wait_load and time.time() < deadline:
            print(f"waiting for the 1-minute load average {os.getloadavg()[0]:.1f} to drop below {args.wait_load}",
                  flush=True)
            time.sleep(20)
    load_start = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = build_task(root / "task", args)
        driver = root / "counting_driver.py"
        driver.write_text(COUNTING_DRIVER)
        configs = [(stage, split) for stage in args.stages for split in [None] + list(args.splits)]
        runs = {config: [] for config in configs}
        for repeat in range(args.repeats):  # round-robin: a load change hits every configuration alike
            for stage, split in configs:
                out = root / f"{stage}_{split}_{repeat}"
                runs[(stage, split)].append(run_one(stage_argv(task, args, stage, out, split), driver))
        for stage, split in configs:
            repeats = runs[(stage, split)]
            rows = repeats[0]  # the same tokens and metrics in every repeat; the timings differ
            rollout = [min(rep[i]["timing/rollout"] for rep in repeats) for i in range(len(rows))]
            steady = sum(rollout[1:]) / max(1, len(rollout) - 1)
            base = steady if split is None else base
            results.append(dict(
                stage=stage, split=split, timing_rollout=rollout, steady_mean=steady, ratio=steady / base,
                rounds=[r.get("partial_rollout/rounds") for r in rows],
                max_staleness=[r.get("partial_rollout/max_staleness") for r in rows],
                response_length=[(r["response_length/min"], r["response_length/mean"], r["response_length/max"])
                                 for r in rows], at_cap=[r["response_clip_ratio"] for r in rows],
                timing_all=[min(rep[i]["timing/all"] for rep in repeats) for i in range(len(rows))],
                **{key: [r[f"engine/{key}"] for r in rows]
                   for key in ("decode_forwards", "decode_row_steps", "prefill_tokens")}))
    load_end = os.getloadavg()
    print(f"{args.layers} layers, hidden {args.hidden}, cap {args.cap}, {args.prompts} prompts/iteration (grpo x "
          f"{args.grpo_n}), {args.iterations} iterations, --rollout-max-num-batched-tokens "
          f"{args.max_num_batched_tokens}; load average {load_start[0]:.1f} -> {load_end[0]:.1f}")
    print(f"{'stage':8} {'split':>5} {'timing/rollout per iteration (s)':48} {'mean 2..':>8} {'ratio':>6}  rounds  "
          "at cap  decode steps / row-steps / prefill slots (mean 2..)")
    for r in results:
        per = " ".join(f"{t:.3f}" for t in r["timing_rollout"])
        rounds = " ".join("-" if x is None else f"{x:.0f}" for x in r["rounds"])
        at_cap = sum(r["at_cap"]) / len(r["at_cap"])
        counts = " / ".join(f"{sum(r[k][1:]) / max(1, len(r[k]) - 1):.0f}"
                            for k in ("decode_forwards", "decode_row_steps", "prefill_tokens"))
        print(f"{r['stage']:8} {str(r['split'] or '-'):>5} {per:48} {r['steady_mean']:8.3f} {r['ratio']:6.2f}  "
              f"{rounds}  {at_cap:.0%}  {counts}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), load=[load_start, load_end], results=results),
                                              indent=1))


if __name__ == "__main__":
    main()
