"""The trl_ppo update, ours against TRL 1.12's PPOTrainer, side by side in ONE process (issue 31 item 3).

    .venv/bin/python benchmarks/update_profile.py                  # 2 timed + 1 profiled rounds, 2 threads
    .venv/bin/python benchmarks/update_profile.py --timed 3 --profiled 2 --json out.json

The settings are `vs_trl.py --model smollm2 --only trl_ppo`'s defaults (SmolLM2-135M fp32, 8 prompts, 24 new
tokens, one micro-batch of 8, one PPO epoch, one mini-batch; the models and data of its `--workdir`), built by
vs_trl.py's own functions, so the two sides do what the benchmark's two processes do:

* ours: `mindspeed_llm.rl.trainer.run` for 2 iterations (gloo, world size 1). At iteration 2 the arguments of the
  actor's and critic's `ppo_update` are kept; the update is then replayed, actor then critic, once per round
  (each replay is a real optimizer step on the same experience: the arithmetic does not depend on the values).
* TRL: vs_trl.py's TRL worker (`_trl_ppo`: `PPOTrainer.train()` with vs_trl's wrappers of TRL's own functions)
  runs inside the last `ppo_update` call of our iteration 2; each TRL iteration starts with one round of ours, and
  TRL's update is what vs_trl.py times: from its first grad-enabled `forward` to its `log` call (the joint policy
  + value forward, ONE backward of the summed loss, the optimizer step, its statistics).

So the two sides alternate (ours, TRL, ours, TRL, ...) in one process at the same thread count
(`torch.set_num_threads`, OMP_NUM_THREADS). The first TRL iteration and the round before it are warm-up. Then
`--timed` rounds only timed, and `--profiled` rounds under `torch.profiler` (CPU, shapes, FLOPs), whose
self CPU time is summed by op group (matmuls with their GFLOP, attention, softmax / log-softmax path,
elementwise, copies, reductions, optimizer, host syncs). Prints the timed table and the side-by-side profile,
with the load average at each figure; writes JSON (`--json`, default WORKDIR/update_profile.json).

update tokens/s is vs_trl.py's: the iteration's prompt + response tokens (responses up to and including EOS) /
update seconds (ours: actor + critic). The padded positions (rows x width) each side's update computes are shown
beside it: TRL always generates `response_length` tokens (`min_new_tokens`), so its width is prompt + 24.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Op groups of the profile, by self CPU time. First match wins; the rest is "other".
OP_GROUPS = (
    ("matmul (mm/addmm/bmm)", r"^aten::(mm|addmm|bmm|baddbmm|addmv|mv|dot)$"),
    ("attention (SDPA)", r"scaled_dot_product|flash_attention|_efficient_attention"),
    ("softmax / log-softmax / logsumexp", r"softmax|logsumexp|nll_loss|cross_entropy"),
    ("gather / scatter / index", r"gather|scatter|index|masked_fill|where|take_along"),
    ("copies / layout", r"^aten::(copy_|clone|contiguous|_to_copy|to|t|transpose|permute|view|reshape|expand|"
                        r"as_strided|cat|stack|split|chunk|slice|select|narrow|unsqueeze|squeeze|"
                        r"_unsafe_view|empty_like|empty|empty_strided|zeros|zeros_like|zero_|fill_|resize_|"
                        r"detach|alias|embedding_dense_backward|embedding|pad|constant_pad_nd)$"),
    ("norms / reductions", r"^aten::(sum|mean|norm|linalg_vector_norm|_foreach_norm|max|min|amax|amin|var|std|"
                           r"all|any|isfinite|argmax|cumsum|prod)$"),
    ("optimizer (_foreach / _fused_adam)", r"^aten::(_foreach_|_fused_adam)"),
    ("elementwise", r"^aten::(mul|add|sub|div|neg|exp|log|pow|rsqrt|sqrt|silu|sigmoid|tanh|abs|clamp|clamp_min|"
                    r"clamp_max|square|reciprocal|maximum|minimum|lt|gt|le|ge|eq|ne|logical_not|bitwise_not|"
                    r"mul_|add_|sub_|div_|addcmul_|addcdiv_|lerp_|threshold_backward|silu_backward|"
                    r"sigmoid_backward|_softmax_backward_data|rsub|sgn|sign|cos|sin|masked_scatter|"
                    r"_log_softmax_backward_data|fmod|remainder|floor|ceil|round|trunc|type_as|float|"
                    r"native_dropout|dropout|bernoulli_|erf|gelu|gelu_backward|relu|_unsafe_index)$"),
    ("host syncs (item / _local_scalar_dense)", r"^aten::(item|_local_scalar_dense|is_nonzero|tolist)$"),
    ("communication (gloo)", r"^(c10d|gloo|record_param_comms)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timed", type=int, default=2, help="timed rounds (ours then TRL) after the warm-up")
    p.add_argument("--profiled", type=int, default=1, help="rounds under torch.profiler after the timed ones")
    p.add_argument("--threads", type=int, default=2, help="torch / OMP threads (vs_trl.py's default: 2)")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench_vs_trl"),
                   help="vs_trl.py's workdir (models, conversions, data; built there when missing)")
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", type=int, default=8, help="matmul shapes shown per side")
    p.add_argument("--top", type=int, default=0, help="also print the top N ops of each side's last profile")
    return p


def _loadavg():
    return [round(x, 2) for x in os.getloadavg()]


# ================================================================================================ profiles
def summarize_profile(prof) -> dict:
    """Self CPU seconds, calls and GFLOP by op group; the backward's and optimizer's inclusive seconds."""
    groups = {name: {"calls": 0, "s": 0.0, "gflop": 0.0} for name, _ in OP_GROUPS}
    groups["other"] = {"calls": 0, "s": 0.0, "gflop": 0.0}
    patterns = [(name, re.compile(rx)) for name, rx in OP_GROUPS]
    ops = {}
    backward_s = optimizer_s = 0.0
    for e in prof.key_averages():
        key = e.key
        if key.startswith("autograd::engine::evaluate_function"):
            backward_s += e.cpu_time_total / 1e6  # the engine's node evaluations do not nest
            continue
        if key.startswith("Optimizer.step#"):
            optimizer_s += e.cpu_time_total / 1e6
            continue
        if not key.startswith("aten::") and not key.startswith(("c10d", "gloo", "record_param_comms")):
            continue  # record_function labels and autograd nodes: their self time is tiny, their ops are counted
        name = next((n for n, rx in patterns if rx.search(key)), "other")
        g = groups[name]
        g["calls"] += e.count
        g["s"] += e.self_cpu_time_total / 1e6
        g["gflop"] += (e.flops or 0) / 1e9
        ops[key] = {"calls": e.count, "self_s": e.self_cpu_time_total / 1e6, "gflop": (e.flops or 0) / 1e9}
    mm = {k: v for k, v in ops.items() if re.match(OP_GROUPS[0][1], k)}
    return {"groups": groups, "backward_s": backward_s, "optimizer_s": optimizer_s, "matmul_ops": mm,
            "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["self_s"])[:40])}


def matmul_shapes(prof, limit=12) -> list:
    out = []
    for e in prof.key_averages(group_by_input_shape=True):
        if re.match(OP_GROUPS[0][1], e.key):
            out.append({"op": e.key, "shapes": str(e.input_shapes), "calls": e.count,
                        "self_s": e.self_cpu_time_total / 1e6, "gflop": (e.flops or 0) / 1e9})
    return sorted(out, key=lambda r: -r["self_s"])[:limit]


class Session:
    """Timing / profiling of one side's update, one record per round."""

    def __init__(self):
        self.profiled = False
        self._prof = None
        self._t0 = None
        self.records = []  # {"round", "seconds", "load", "profile"?, ...}

    def start(self):
        if self.profiled:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True)
            self._prof.__enter__()
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()

    def stop(self, **extra):
        seconds, cpu = time.perf_counter() - self._t0, time.process_time() - self._cpu0
        rec = {"seconds": seconds, "cpu_s": cpu, "load": _loadavg(), "profiled": self.profiled, **extra}
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            rec["profile"] = summarize_profile(self._prof)
            rec["matmul_shapes"] = matmul_shapes(self._prof)
            self._prof = None
        self.records.append(rec)
        return rec


# ================================================================================================ main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    threads = str(args.threads)
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", MINDSPEED_DEVICE="cpu")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    import vs_trl

    bench = vs_trl.build_parser().parse_args(["--model", "smollm2", "--only", "trl_ppo", "--iterations",
                                              str(args.timed + args.profiled), "--warmup", "1",
                                              "--threads", threads, "--workdir", args.workdir])
    work = Path(args.workdir).resolve()
    model = vs_trl.prepare_model("smollm2", work, bench)
    data = vs_trl.prepare_data(work, Path(model["tokenizer"]), bench.seed, bench.system_prompt)
    schedule = vs_trl.prompt_schedule(data, bench.prompts, bench.warmup + bench.iterations, bench.seed)
    run_dir = work / "runs" / "update_profile"
    run_dir.mkdir(parents=True, exist_ok=True)
    argv_ours = vs_trl.our_argv("trl_ppo", model, data, run_dir / "metrics.jsonl", bench)
    argv_ours = [str(a) for a in argv_ours[argv_ours.index("posttrain_gpt.py") + 1:]]
    i = argv_ours.index("--train-iters")
    argv_ours[i + 1] = "2"  # iteration 1 warms up, iteration 2's experience is replayed
    spec = vs_trl.trl_spec("trl_ppo", model, schedule, run_dir, bench)

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.stages import trl_ppo as our_stage

    actor, critic, trl = Session(), Session(), Session()
    kept = []  # iteration 2's (args, kwargs) of the actor's and critic's ppo_update
    real_update = our_stage.ppo_update
    state = {"round": 0, "tokens_ours": None}

    def our_round():
        for session in (actor, critic, trl):
            session.profiled = state["round"] > args.timed
        exp = kept[0][0][1]
        for session, (a, k) in zip((actor, critic), kept):
            session.start()
            real_update(*a, **k)
            session.stop(round=state["round"], tokens=state["tokens_ours"],
                         positions=int(exp.tokens.shape[0] * exp.tokens.shape[1]))

    class Recorder(vs_trl._Recorder):
        def begin(self):
            if len(self.iterations) < spec["iterations"]:  # TRL's loop draws one more batch than it trains on
                state["round"] += bool(self.iterations)
                our_round()  # one round of ours before each TRL iteration
            super().begin()

        def update_started(self):
            trl.start()

        def update_ended(self):
            cur = self.cur
            trl.stop(round=state["round"], tokens=cur.get("prompt_tokens", 0) + cur.get("response_tokens", 0),
                     positions=cur.get("_positions"))

    rec = Recorder()

    def run_trl():
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # else accelerate wraps TRL's model for MULTI_CPU
            os.environ.pop(name, None)
        from trl.experimental.ppo import ppo_trainer as trl_ppo

        forward = trl_ppo.forward

        def width_forward(model_, query_responses, *a, **k):  # the update's padded positions
            if torch.is_grad_enabled() and rec.iterations:
                rec.cur["_positions"] = int(query_responses.numel())
            return forward(model_, query_responses, *a, **k)

        trl_ppo.forward = width_forward
        try:
            vs_trl._trl_ppo(spec, rec)
        finally:
            trl_ppo.forward = forward

    def capture(model_, *a, **k):
        out = real_update(model_, *a, **k)
        iteration = a[4] if len(a) > 4 else k["iteration"]
        if iteration == 2:
            kept.append(((model_, *a), k))
            if len(kept) == 2:  # the critic's: iteration 2's update is complete, TRL runs from here
                exp = a[0]
                state["tokens_ours"] = int(exp.prompt_lengths.sum() + exp.response_mask.sum())
                print(f"update_profile: ours captured (iteration 2, {state['tokens_ours']} tokens); "
                      f"TRL starts, load {_loadavg()}", flush=True)
                run_trl()
        return out

    our_stage.ppo_update = capture
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(vs_trl._free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    load_start = _loadavg()
    trainer.run(parse_args(argv_ours, 1))
    report = make_report(actor.records, critic.records, trl.records, args, load_start)
    print(report["text"])
    out = Path(args.json) if args.json else work / "update_profile.json"
    out.write_text(json.dumps({"settings": vars(args), "actor": actor.records, "critic": critic.records,
                               "trl": trl.records,
                               "load_start": load_start, "load_end": _loadavg(), "table": report["text"]}, indent=1))
    print(f"JSON: {out}")
    return 0


def make_report(actor: list, critic: list, trl: list, args, load_start) -> dict:
    lines = [f"update_profile: {args.threads} threads, load average at start {load_start}", "",
             "rounds (ours = actor + critic ppo_update; TRL = its joint update, forward .. log); wall s and the "
             "process's CPU s:",
             f"{'round':>5} {'actor':>6} {'critic':>6} {'ours':>6} {'TRL':>6} {'ratio':>6} | {'CPU actor':>9} "
             f"{'critic':>6} {'ours':>6} {'TRL':>6} {'ratio':>6} | {'pos ours/TRL':>12} load (ours | TRL)"]
    by_round = {r["round"]: r for r in trl}
    sums = defaultdict(float)
    for a, c in zip(actor, critic):
        t = by_round.get(a["round"])
        if t is None or a["round"] == 0:
            continue
        ours_s, ours_cpu = a["seconds"] + c["seconds"], a["cpu_s"] + c["cpu_s"]
        # tokens/s ratio: ours' tokens over ours' seconds against TRL's tokens over TRL's seconds
        rate = (a["tokens"] / ours_s) / (t["tokens"] / t["seconds"])
        rate_cpu = (a["tokens"] / ours_cpu) / (t["tokens"] / t["cpu_s"])
        tag = " (profiled)" if a["profiled"] else ""
        lines.append(f"{a['round']:>5} {a['seconds']:>6.2f} {c['seconds']:>6.2f} {ours_s:>6.2f} {t['seconds']:>6.2f} "
                     f"{rate:>5.2f}x | {a['cpu_s']:>9.2f} {c['cpu_s']:>6.2f} {ours_cpu:>6.2f} {t['cpu_s']:>6.2f} "
                     f"{rate_cpu:>5.2f}x | {a['positions']:>5}/{t['positions'] or 0:<6} {a['load'][0]} | "
                     f"{t['load'][0]}{tag}")
        if not a["profiled"]:
            for key, value in (("ours_s", ours_s), ("ours_cpu", ours_cpu), ("trl_s", t["seconds"]),
                               ("trl_cpu", t["cpu_s"]), ("ours_tok", a["tokens"]), ("trl_tok", t["tokens"])):
                sums[key] += value
    if sums["ours_s"] and sums["trl_s"]:
        wall = (sums["ours_tok"] / sums["ours_s"]) / (sums["trl_tok"] / sums["trl_s"])
        cpu = (sums["ours_tok"] / sums["ours_cpu"]) / (sums["trl_tok"] / sums["trl_cpu"])
        lines.append(f"timed rounds: update tokens/s ours/TRL = {wall:.2f}x by wall time, {cpu:.2f}x by CPU time "
                     f"(ours {sums['ours_tok'] / sums['ours_s']:.1f} tok/s, TRL {sums['trl_tok'] / sums['trl_s']:.1f})")
    profiled = [(a, c, by_round.get(a["round"])) for a, c in zip(actor, critic)
                if a.get("profile") and by_round.get(a["round"])]
    if profiled:
        a, c, t = profiled[-1]
        sides = (("ours actor", a), ("ours critic", c), ("TRL joint", t))
        lines += ["", f"profile of round {a['round']} (self CPU s by op group; load {a['load'][0]} | {c['load'][0]} | "
                      f"{t['load'][0]}):",
                  f"{'op group':<40}" + "".join(f" | {name + ' calls':>16} {'GFLOP':>6} {'s':>6}" for name, _ in sides)]
        for group in a["profile"]["groups"]:
            row = f"{group:<40}"
            for _, rec in sides:
                g = rec["profile"]["groups"][group]
                row += f" | {g['calls']:>16} {g['gflop']:>6.1f} {g['s']:>6.2f}"
            lines.append(row)
        for label, fn in (("sum of self times", lambda r: sum(g["s"] for g in r["profile"]["groups"].values())),
                          ("wall (under the profiler)", lambda r: r["seconds"]),
                          ("backward (inclusive)", lambda r: r["profile"]["backward_s"]),
                          ("optimizer step (inclusive)", lambda r: r["profile"]["optimizer_s"])):
            lines.append(f"{label:<40}" + "".join(f" | {'':>16} {'':>6} {fn(rec):>6.2f}" for _, rec in sides))
        for side, rec in sides:
            g = rec["profile"]["groups"]["matmul (mm/addmm/bmm)"]
            lines.append(f"{side} matmuls: {g['gflop']:.1f} GFLOP in {g['s']:.2f} s = "
                         f"{g['gflop'] / max(g['s'], 1e-9):.0f} GFLOP/s; by op: " + ", ".join(
                             f"{k} {v['calls']}x {v['gflop']:.1f} GFLOP {v['self_s']:.2f} s"
                             for k, v in rec["profile"]["matmul_ops"].items()))
            for sh in rec["matmul_shapes"][:args.shapes]:
                lines.append(f"    {sh['op']} {sh['shapes']} x{sh['calls']}: {sh['gflop']:.1f} GFLOP "
                             f"{sh['self_s']:.2f} s ({sh['gflop'] / max(sh['self_s'], 1e-9):.0f} GFLOP/s)")
        if args.top:
            for side, rec in sides:
                lines.append(f"top ops, {side}:")
                for k, v in list(rec["profile"]["top_ops"].items())[:args.top]:
                    lines.append(f"    {k:<58} {v['calls']:>6} {v['self_s']:>6.2f} s {v['gflop']:>6.1f} GFLOP")
    return {"text": "\n".join(lines)}


if __name__ == "__main__":
    sys.exit(main())
