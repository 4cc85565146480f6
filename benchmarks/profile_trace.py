"""How large one profiled iteration's trace is at the demo's shape (issue 45): the demo's SmolLM2-135M-Instruct,
its task and its stage flags (`mindspeed_llm.demo.run`: `--tools` for the multi-turn demo), one iteration under
`--profile --use-pytorch-profiler --profile-step-start 0 --profile-step-end 1`, once per setting of what the trace
records:

* `lean`: the defaults (the ops' times);
* `shapes+stacks`: `--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack` (what every trace
  recorded before issue 45);
* further `--record` settings by name (`memory`: `--profile-with-memory`).

The model, data and Megatron checkpoint are the demo's (prepared as `scripts/demo.sh` does, in `--out`, reused).
Reported: the trace file's size and the iteration's wall time (the profiler's own cost included).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_trace.py [--tools] [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {
    "lean": [],
    "shapes+stacks": ["--pytorch-profiler-collect-shapes", "--pytorch-profiler-collect-callstack"],
    "memory": ["--profile-with-memory"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", action="store_true", help="the multi-turn demo (calculator tool)")
    p.add_argument("--record", nargs="+", default=["lean", "shapes+stacks"], choices=sorted(SETTINGS))
    p.add_argument("--out", default=None, help="working folder (default runs/profile_trace[_tools])")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mindspeed_llm.demo import model, run, task, tool_demo

    demo = run.build_parser().parse_args(["--iterations", "1"] + (["--tools"] if args.tools else []))
    for name, (real, _) in (tool_demo.DEFAULTS if demo.tools else {}).items():
        if getattr(demo, name) is None:
            setattr(demo, name, real)
    for name, (real, _) in run.DEFAULTS.items():
        if getattr(demo, name) is None:
            setattr(demo, name, real)
    out = Path(args.out or run.ROOT / "runs" / f"profile_trace{'_tools' if args.tools else ''}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    hf_model = model.prepare_smollm2()
    tool_config = tool_demo.write_tool_config(out / "tools.yaml") if args.tools else None
    if args.tools:
        splits = tool_demo.write_tool_splits(out / "task", tool_demo.DEFAULT_TOOL_VARIANT, n_test=4, seed=demo.seed)
    else:
        splits = task.write_splits(out / "task", task.DEFAULT_VARIANT, n_test=4, seed=demo.seed)
    data = run.preprocess_splits(out, splits, hf_model, log, tool_config)
    mg_model = out / "mg_model"
    if not (mg_model / "latest_checkpointed_iteration.txt").is_file():
        run.run_step("convert the model to Megatron", [
            run._python(), "convert_ckpt.py", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
            hf_model, "--save-dir", mg_model, "--target-tensor-parallel-size", "1",
            "--target-pipeline-parallel-size", "1", "--no-progress"], log)
    results = {}
    for name in args.record:
        folder = out / name.replace("+", "_")
        shutil.rmtree(folder, ignore_errors=True)
        extra = ["--n-samples-per-prompt", demo.samples_per_prompt, "--kl-penalty", "low_var_kl",
                 "--profile", "--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "1",
                 "--tensorboard-dir", folder / "tb", *SETTINGS[name]]
        command = run.stage_command(demo, data["train"], mg_model, hf_model, folder / "metrics.jsonl",
                                    folder / "ckpt", extra, tool_config)
        command = [a for a in command]
        save_at = command.index("--save")
        del command[save_at:save_at + 4]  # no checkpoint: the trace alone (--save DIR --save-interval N)
        started = time.time()
        run.run_step(f"one profiled iteration ({name})", command, log, echo=False,
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        wall = time.time() - started
        traces = glob.glob(str(folder / "tb" / "profile" / "*.pt.trace.json"))
        with open(folder / "metrics.jsonl") as f:
            row = json.loads(f.readline())
        results[name] = {"trace_bytes": sum(os.path.getsize(t) for t in traces), "traces": len(traces),
                         "run_seconds": round(wall, 1), "iteration_seconds": round(row.get("timing/all", 0.0), 1),
                         "flags": [str(a) for a in SETTINGS[name]]}
        print(f"{name:>14}: trace {results[name]['trace_bytes'] / 1e6:8.1f} MB ({len(traces)} file), iteration "
              f"{results[name]['iteration_seconds']} s, run {wall:.0f} s", flush=True)
        shutil.rmtree(folder / "tb" / "profile", ignore_errors=True)  # the figure is kept, not the file
    if args.json:
        Path(args.json).write_text(json.dumps({"tools": args.tools, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
