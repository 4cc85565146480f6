"""This project's `--stage grpo` / `--stage trl_ppo` against Hugging Face TRL 1.12 (`GRPOTrainer`,
`trl.experimental.ppo.PPOTrainer`): the same model, prompts, batch, samples per prompt, response length and
sampling settings and precision, on the same device, one after the other in one run.

    .venv/bin/python benchmarks/vs_trl.py                       # tiny random Llama and SmolLM2-135M, both stages
    .venv/bin/python benchmarks/vs_trl.py --model tiny --only grpo --iterations 2 --json out.json
    python3 benchmarks/vs_trl.py --device cuda --dtype bf16 ... # both sides on the GPU, both in bf16

Device and precision (`--device`, `--dtype`) are set for both sides together:

* `--device cpu` (default): TRL `use_cpu=True`; ours `MINDSPEED_DEVICE=cpu` (gloo), even where a GPU is present.
  `--device cuda`: TRL `use_cpu=False`; ours `MINDSPEED_DEVICE=cuda` (nccl, `mindspeed_llm.device` puts everything
  on the GPU); refused with one line when torch sees no CUDA device.
* `--dtype fp32` (default): fp32 everywhere (TRL `bf16=False`). `--dtype bf16`: ours `posttrain_gpt.py --bf16`
  (Megatron: bf16 weights and compute, fp32 main weights in the optimizer); TRL `bf16=True` on fp32-loaded weights
  (accelerate's bf16 autocast: bf16 compute, fp32 weights in the optimizer), the closest Trainer setting.
* On CUDA each run's peak GPU memory (nvidia-smi's used memory of the device, above what was used before the run)
  is recorded beside its peak RSS.

Each measured run is a fresh process, polled with psutil for its peak RSS:

* ours: `torchrun --nproc_per_node 1 posttrain_gpt.py --stage ...` (gloo on CPU, OMP_NUM_THREADS = --threads) on
  Megatron conversions of the Hugging Face folders (`convert_hf_to_mg`) and prompts preprocessed by the code of
  `preprocess_data.py` (R1 handler, chatml, labels kept), `--metrics-jsonl`: per iteration `timing/*` and the token
  counts of `throughput_metrics`;
* TRL: this script in worker mode (`--trl-worker SPEC`, same thread count) drives `GRPOTrainer.train()` /
  `PPOTrainer.train()` on the same Hugging Face folders and the same prompt token ids in the same order (our
  `PromptSampler` with our seed), timing each optimizer step and its phases by wrapping TRL's own functions.

Throughput is the seed's formula for both sides: tokens = prompt + response tokens of every sample of the
iteration (a prompt counts once per sample; responses up to and including EOS), tokens/s = tokens / world size (1) /
seconds, with seconds = the iteration (`e2e`), its rollout (generation only) or its update phase. Over the measured
iterations (the first `--warmup` are dropped) the table shows sum(tokens) / sum(seconds). Process start, imports and
model loading are outside the iteration on both sides (their wall time is in the JSON as `process_wall_s`).
"""

from __future__ import annotations

import argparse
from typing import Optional
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("grpo", "trl_ppo")
MODELS = ("tiny", "smollm2")
DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")
VERIFIER = "first_line_answer"
TASK_VARIANT = "add20"
# Our timers, in iteration order; `update_critic` only for trl_ppo.
PHASES = ("rollout", "old_log_p", "reference_model", "critic_model", "reward_model", "rule_reward", "adv", "update",
          "update_critic")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=(*MODELS, "both"), default="both")
    p.add_argument("--only", choices=STAGES, default=None, help="one stage (default: both)")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations per run (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and left out of the figures")
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration (both stages)")
    p.add_argument("--samples", type=int, default=4, help="grpo: samples per prompt (trl_ppo: always 1)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward / backward micro-batch")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (top-k / top-p off)")
    p.add_argument("--grpo-kl-coef", type=float, default=0.001,
                   help="grpo KL loss coefficient (TRL beta); > 0 loads a reference model on both sides")
    p.add_argument("--ppo-kl-coef", type=float, default=0.05, help="trl_ppo KL reward coefficient (TRL kl_coef)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--system-prompt", default=None,
                   help="a system turn before every prompt (e.g. SmolLM2's default one: longer, shared prompts)")
    p.add_argument("--threads", type=int, default=2, help="OMP / torch threads of every measured process")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where both sides run (default: cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="both sides' precision: fp32, or bf16 (ours --bf16, TRL bf16=True)")
    p.add_argument("--tiny-layers", type=int, default=4)
    p.add_argument("--tiny-hidden", type=int, default=256)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench_vs_trl"),
                   help="models, data, logs (reused between runs)")
    p.add_argument("--json", default=None, help="write the results here (default: WORKDIR/results.json)")
    p.add_argument("--prepare-only", action="store_true",
                   help="only build the models, conversions and data in WORKDIR (reused by later runs), then exit")
    p.add_argument("--wait-load", type=float, default=None, metavar="L",
                   help="before starting, wait (up to 30 min) until the 1-minute load average is below L")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    return p


# ================================================================================================ helpers
def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int, device: str = "cpu") -> dict:
    # MINDSPEED_DEVICE: our side's device choice (mindspeed_llm.device), so that --device cpu stays on the CPU
    # where a GPU is present too; the TRL worker reads its device from the spec (use_cpu).
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                PYTHONWARNINGS="ignore", DISABLE_TQDM="1", MINDSPEED_DEVICE=device)


def check_device(device: str) -> None:
    """Refuse --device cuda, in one line, where torch sees no CUDA device."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"vs_trl.py: --device cuda, but torch {torch.__version__} sees no CUDA device "
                             "(run it on a GPU machine, or use --device cpu)")


def _gpu_memory_used_mb() -> Optional[float]:
    """Memory in use on GPU 0, from nvidia-smi (None without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class GPUPoller:
    """Peak memory in use on the GPU while a run lasts (nvidia-smi every `interval` seconds), above the memory in
    use before it started: the run's CUDA contexts, weights, activations and caching allocators."""

    def __init__(self, interval: float = 0.5):
        self.baseline = _gpu_memory_used_mb()
        self.peak = self.baseline
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.baseline is not None:
            self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            used = _gpu_memory_used_mb()
            if used is not None:
                self.peak = max(self.peak, used)
            self._stop.wait(self._interval)

    def stop(self) -> Optional[float]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return None if self.baseline is None else self.peak - self.baseline


def _busy_cpu_seconds(psutil) -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


class RSSPoller:
    """Peak resident memory of a process and all its descendants, polled every `interval` seconds; also the CPU
    time the tree used and what the whole machine used meanwhile (the rest is other people's load)."""

    def __init__(self, pid: int, interval: float = 0.1):
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(pid)
        self._interval = interval
        self.peak_tree = 0  # max over polls of the summed RSS of the tree
        self.peak_process = 0  # max over polls of the largest single process's RSS
        self._cpu = {}  # pid -> last seen user + system seconds
        self._busy0, self._t0 = _busy_cpu_seconds(psutil), time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self):
        try:
            procs = [self._root] + self._root.children(recursive=True)
        except self._psutil.Error:
            return
        sizes = []
        for proc in procs:
            try:
                sizes.append(proc.memory_info().rss)
                t = proc.cpu_times()
                self._cpu[proc.pid] = t.user + t.system
            except self._psutil.Error:
                pass
        if sizes:
            self.peak_tree = max(self.peak_tree, sum(sizes))
            self.peak_process = max(self.peak_process, max(sizes))

    def _run(self):
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self._interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._t0
        busy = _busy_cpu_seconds(self._psutil) - self._busy0
        ours = sum(self._cpu.values())
        cpus = self._psutil.cpu_count() or 1
        return {"tree_cpu_s": ours, "machine_busy_cpu_s": busy,
                "other_cpu_share": max(0.0, busy - ours) / (wall * cpus) if wall > 0 else None}


def _run_measured(argv, log_path: Path, threads: int, title: str, device: str = "cpu") -> dict:
    """Run `argv` (from the repository root), polling its process tree's RSS (and on CUDA the GPU's memory); raise
    with the log's tail on failure."""
    print(f"\n--> {title}\n    $ {' '.join(str(a) for a in argv)}", flush=True)
    load_before = _loadavg()
    started = time.perf_counter()
    gpu = GPUPoller() if device == "cuda" else None
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=_env(threads, device))
        poller = RSSPoller(proc.pid)
        code = proc.wait()
        cpu = poller.stop()
    peak_gpu = gpu.stop() if gpu is not None else None
    wall = time.perf_counter() - started
    if code:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise SystemExit(f"{title} failed (exit {code}); the end of {log_path}:\n{tail}")
    print(f"    done in {wall:.0f} s, peak RSS {poller.peak_process / 2**20:.0f} MB "
          f"(process tree {poller.peak_tree / 2**20:.0f} MB), load {load_before} -> {_loadavg()}, "
          f"other processes used {cpu['other_cpu_share']:.0%} of the CPUs meanwhile"
          + (f", peak GPU memory {peak_gpu:,.0f} MB" if peak_gpu is not None else ""), flush=True)
    out = {"process_wall_s": wall, "peak_rss_mb": poller.peak_process / 2**20,
           "peak_rss_tree_mb": poller.peak_tree / 2**20, "load_before": load_before, "load_after": _loadavg(), **cpu}
    if device == "cuda":
        out["peak_gpu_mb"] = peak_gpu
    return out


# ================================================================================================ assets
def _value_model(policy_dir: Path, out_dir: Path, seed: int) -> Path:
    """A *ForSequenceClassification of the policy's trunk with a small random scalar head (critic and reward)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.copy_(0.02 * torch.randn(model.score.weight.shape,
                                                    generator=torch.Generator().manual_seed(seed)))
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def _converted(hf_dir: Path, mg_dir: Path, value_head: bool) -> Path:
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    if not (mg_dir / "latest_checkpointed_iteration.txt").is_file():
        convert_hf_to_mg(str(hf_dir), str(mg_dir), 1, 1, value_head=value_head, progress=False)
    return mg_dir


def prepare_data(work: Path, tokenizer_dir: Path, seed: int, system: Optional[str] = None) -> Path:
    """The demo task's training split, preprocessed like `preprocess_data.py` does (chatml, labels kept), with
    `system` as every prompt's system turn when given."""
    import hashlib

    from mindspeed_llm.data.preprocess import preprocess
    from mindspeed_llm.demo.task import make_splits

    name = "train" if system is None else "train_sys_" + hashlib.sha1(system.encode()).hexdigest()[:8]
    prefix = work / "data" / name
    if not Path(f"{prefix}_meta.json").is_file():
        train, _ = make_splits(TASK_VARIANT, n_test=100, seed=seed)
        map_keys = {"prompt": "problem", "labels": "answer"}
        if system is not None:
            train = [dict(row, system=system) for row in train]
            map_keys["system"] = "system"
        raw = work / "data" / f"{name}.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(train))
        preprocess(["--input", str(raw), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                    str(tokenizer_dir), "--output-prefix", str(prefix), "--handler-name",
                    "R1AlpacaStyleInstructionHandler", "--prompt-type", "chatml", "--map-keys",
                    json.dumps(map_keys), "--log-interval", "0"])
    return prefix


def prepare_model(name: str, work: Path, args) -> dict:
    from mindspeed_llm.demo import model as demo_model

    tok_dir = demo_model.prepare_smollm2_tokenizer()
    if name == "tiny":
        hf = work / f"tiny_l{args.tiny_layers}_h{args.tiny_hidden}" / "hf"
        if not (hf / "mindspeed_demo.json").is_file():
            demo_model.tiny_random_llama(hf, tok_dir, num_layers=args.tiny_layers, hidden_size=args.tiny_hidden,
                                         seed=0)
        label = f"tiny random Llama ({args.tiny_layers}x{args.tiny_hidden})"
    else:
        hf = Path(demo_model.prepare_smollm2())
        label = "SmolLM2-135M-Instruct"
    root = hf.parent if name == "tiny" else work / "smollm2"
    root.mkdir(parents=True, exist_ok=True)
    hf_value = _value_model(hf, root / "hf_value", args.seed)
    return {
        "name": name, "label": label, "hf": str(hf), "hf_value": str(hf_value),
        "mg": str(_converted(hf, root / "mg", False)), "mg_value": str(_converted(hf_value, root / "mg_value", True)),
        "tokenizer": str(tok_dir),
    }


def prompt_schedule(prefix: Path, prompts: int, iterations: int, seed: int) -> list:
    """[(input_ids, label)] in the order our trainer draws them (PromptSampler, DP size 1, --seed)."""
    from mindspeed_llm.data import PromptDataset, PromptSampler

    ds = PromptDataset(str(prefix))
    sampler = PromptSampler(len(ds), prompts, 0, 1, seed)
    out = []
    for _ in range(iterations):
        for i in sampler.next_batch_indices():
            row = ds[i]
            out.append((list(row["input_ids"]), row["labels"]))
    return out


# ================================================================================================ our side
def our_argv(stage: str, model: dict, data: Path, metrics: Path, args) -> list:
    n = args.samples if stage == "grpo" else 1
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "posttrain_gpt.py", "--stage", stage,
        "--ref-model", model["mg"], "--data-path", data, "--tokenizer-name-or-path", model["hf"],
        "--micro-batch-size", args.micro_batch, "--global-batch-size", args.prompts,
        "--train-iters", args.warmup + args.iterations, "--lr", args.lr, "--lr-decay-style", "constant",
        "--weight-decay", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
        "--seed", args.seed, "--do-sample", "--temperature", args.temperature, "--top-k", "0", "--top-p", "1.0",
        "--max-new-tokens", args.max_new_tokens, "--max-length", 192, "--clip-ratio", "0.2",
        "--ppo-epochs", "1", "--ppo-mini-batch-size", args.prompts * n,
        "--log-interval", "1", "--metrics-jsonl", metrics,
    ]
    if args.dtype == "bf16":
        argv.append("--bf16")
    if stage == "grpo":
        argv += ["--n-samples-per-prompt", n, "--verifier-function", VERIFIER, "--kl-coef", args.grpo_kl_coef,
                 "--kl-penalty", "low_var_kl", "--loss-agg-mode", "token-mean", "--clip-grad", "1.0"]
    else:
        # Reward = the value-head model's score (TRL's placement), critic initialised from the same checkpoint.
        # TRL's PPO loop never clips gradients, so clipping is off here too.
        argv += ["--reward-model", model["mg_value"], "--critic-lr", args.lr, "--kl-coef", args.ppo_kl_coef,
                 "--kl-penalty", "k1", "--cliprange-value", "0.2", "--vf-coef", "0.1", "--gamma", "1.0",
                 "--lam", "0.95", "--clip-grad", "0"]
    return argv


def read_ours(metrics_path: Path, stage: str, args) -> list:
    n_seqs = args.prompts * (args.samples if stage == "grpo" else 1)
    out = []
    for line in metrics_path.read_text().splitlines():
        m = json.loads(line)
        it = {"iteration": m["iteration"], "n_sequences": n_seqs,
              "prompt_tokens": m["prompt_length/mean"] * n_seqs, "response_tokens": m["response_length/mean"] * n_seqs,
              "all": m["timing/all"], "logged_e2e_tps": m.get("e2e_tps"), "logged_rollout_tps": m.get("rollout_tps"),
              "logged_update_tps": m.get("update_tps"), "world_size": m.get("world_size", 1)}
        it["tokens"] = it["prompt_tokens"] + it["response_tokens"]
        for phase in PHASES:
            if f"timing/{phase}" in m:
                it[phase] = m[f"timing/{phase}"]
        out.append(it)
    return out


# ================================================================================================ TRL side (worker)
class _Recorder:
    """Per-iteration wall times of TRL's phases (filled by the wrappers below)."""

    def __init__(self):
        self.iterations = []
        self.logs = []

    @property
    def cur(self):
        return self.iterations[-1]

    def begin(self):
        self.iterations.append({"start": time.perf_counter()})

    def end(self):
        if self.iterations and "end" not in self.cur:
            self.cur["end"] = time.perf_counter()
            self.cur["all"] = self.cur["end"] - self.cur["start"]

    def update_started(self):
        """Called once per iteration, at the first forward of TRL's PPO update (a hook for update_profile.py)."""

    def update_ended(self):
        """Called where TRL's PPO update ends (its log call; a hook for update_profile.py)."""

    def add(self, name, seconds):
        if self.iterations and "end" not in self.cur:
            self.cur[name] = self.cur.get(name, 0.0) + seconds

    def timed(self, fn, name):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(name(*a, **k) if callable(name) else name, time.perf_counter() - t0)
        return wrapper


def _trl_tokenizer(hf_dir, pad_token):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, padding_side="left")
    if pad_token is not None and tok.pad_token_id == tok.eos_token_id:
        # SmolLM2's pad is its EOS (<|im_end|>), which the chatml prompts contain; TRL's PPO derives attention
        # masks from `!= pad_token_id`, so give it a pad that never occurs in a prompt (<|endoftext|>).
        tok.pad_token = pad_token
    return tok


def trl_precision_kwargs(device: str, dtype: str) -> dict:
    """TRL's (transformers' TrainingArguments') device and precision settings for --device / --dtype. bf16 is
    accelerate's bf16 autocast over the fp32-loaded weights (the optimizer keeps fp32 weights, as Megatron's
    --bf16 keeps fp32 main weights)."""
    if device not in DEVICES or dtype not in DTYPES:
        raise ValueError(f"device {device!r} / dtype {dtype!r}: expected one of {DEVICES} / {DTYPES}")
    return dict(use_cpu=device == "cpu", bf16=dtype == "bf16", fp16=False)


def _trl_common_config(spec):
    return dict(output_dir=spec["out_dir"], report_to="none",
                **trl_precision_kwargs(spec.get("device", "cpu"), spec.get("dtype", "fp32")),
                seed=spec["seed"], gradient_checkpointing=False, save_strategy="no", logging_steps=1,
                disable_tqdm=True, learning_rate=spec["lr"], lr_scheduler_type="constant", weight_decay=0.0,
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, dataloader_num_workers=0)


def _trl_grpo(spec, rec):
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    try:
        from mindspeed_llm.rl.verifiers import get_verifier
    except ImportError:  # the tree before rl/verifiers/
        from mindspeed_llm.rl.verifiers import get_verifier

    tok = _trl_tokenizer(spec["hf"], spec["pad_token"])
    rows = []
    for ids, label in spec["prompts"]:
        text = tok.decode(ids)
        if tok(text)["input_ids"] != ids:  # TRL re-tokenizes text prompts: they must give our ids back
            raise SystemExit(f"prompt ids do not survive decode/encode: {ids}")
        rows.append({"prompt": text, "labels": label})
    verifier = get_verifier(spec["verifier"])

    def first_line_answer(prompts, completions, labels, **_):
        return [verifier(c, l) for c, l in zip(completions, labels)]

    n, seqs, mbs = spec["samples"], spec["prompts_per_iteration"] * spec["samples"], spec["micro_batch"]
    config = GRPOConfig(
        **_trl_common_config(spec), per_device_train_batch_size=mbs, gradient_accumulation_steps=seqs // mbs,
        steps_per_generation=seqs // mbs, num_generations=n, max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_k=0, top_p=1.0, beta=spec["kl_coef"], loss_type="bnpo",
        epsilon=0.2, num_iterations=1, scale_rewards="group", max_grad_norm=1.0, shuffle_dataset=False,
        max_steps=spec["iterations"], model_init_kwargs={"dtype": torch.float32}, log_completions=False,
    )
    trainer = GRPOTrainer(model=spec["hf"], reward_funcs=first_line_answer, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tok)

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            rec.begin()

        def on_step_end(self, *a, **k):
            rec.end()

    trainer.add_callback(Steps())
    generate = trainer._generate

    def counted_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        rec.add("rollout", time.perf_counter() - t0)
        prompt_ids, completion_ids = out[0], out[1]
        rec.add("prompt_tokens", sum(len(p) for p in prompt_ids))
        rec.add("response_tokens", sum(len(c) for c in completion_ids))
        rec.add("n_sequences", len(completion_ids))
        return out

    trainer._generate = counted_generate
    trainer._generate_and_score_completions = rec.timed(trainer._generate_and_score_completions, "_experience")
    trainer._calculate_rewards = rec.timed(trainer._calculate_rewards, "rule_reward")
    logps = trainer._get_per_token_logps_and_entropies

    def which_logps(model, *a, **k):
        if torch.is_grad_enabled():
            return "_update_forward"
        return "reference_model" if model is trainer.ref_model else "old_log_p"

    trainer._get_per_token_logps_and_entropies = rec.timed(logps, which_logps)
    log = trainer.log

    def kept_log(logs, *a, **k):
        out = log(logs, *a, **k)  # GRPOTrainer.log adds its metrics (num_tokens, ...) to `logs`
        rec.logs.append(dict(logs))
        return out

    trainer.log = kept_log
    trainer.train()
    for it in rec.iterations:
        # TRL's update: everything of the step after its experience (generation, old/ref log-probs, rewards,
        # advantages): the loss forwards, backwards, gradient clipping and the optimizer step.
        it["update"] = it["all"] - it.get("_experience", 0.0)


def _trl_ppo(spec, rec):
    import torch
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, DataCollatorWithPadding,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    tok = _trl_tokenizer(spec["hf"], spec["pad_token"])
    fp32 = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(spec["hf"], **fp32)
    ref_policy = AutoModelForCausalLM.from_pretrained(spec["hf"], **fp32)
    value_model = AutoModelForSequenceClassification.from_pretrained(spec["hf_value"], num_labels=1, **fp32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(spec["hf_value"], num_labels=1, **fp32)
    dataset = Dataset.from_dict({"input_ids": [ids for ids, _ in spec["prompts"]]})
    batch, mbs = spec["prompts_per_iteration"], spec["micro_batch"]
    config = PPOConfig(
        **_trl_common_config(spec), num_sample_generations=0, per_device_train_batch_size=mbs,
        gradient_accumulation_steps=batch // mbs, num_mini_batches=1, num_ppo_epochs=1,
        local_rollout_forward_batch_size=batch, total_episodes=batch * spec["iterations"],
        kl_coef=spec["kl_coef"], kl_estimator="k1", cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0,
        lam=0.95, whiten_rewards=False, temperature=spec["temperature"], response_length=spec["max_new_tokens"],
        stop_token="eos", missing_eos_penalty=None,
    )
    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         eval_dataset=dataset)

    class Ordered:
        """Our sampler's prompts in order (TRL would shuffle); marks the start of each iteration."""

        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            for item in self.loader:
                rec.begin()
                yield item

        def __len__(self):
            return len(self.loader)

    trainer.dataloader = Ordered(DataLoader(dataset, batch_size=batch, shuffle=False,
                                            collate_fn=DataCollatorWithPadding(tok)))

    class Steps(TrainerCallback):
        def on_step_end(self, *a, **k):
            rec.end()

    trainer.add_callback(Steps())
    eos, pad = tok.eos_token_id, tok.pad_token_id
    saved = {name: getattr(trl_ppo, name) for name in ("batch_generation", "forward", "get_reward")}

    def counted_generation(model, queries, *a, **k):
        t0 = time.perf_counter()
        query_responses, logits = saved["batch_generation"](model, queries, *a, **k)
        rec.add("rollout", time.perf_counter() - t0)
        responses = query_responses[:, queries.shape[1]:]
        is_eos = responses == eos
        full = torch.full((responses.shape[0],), responses.shape[1], dtype=torch.long, device=responses.device)
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, full)  # up to and including EOS
        rec.add("prompt_tokens", int((queries != pad).sum()))
        rec.add("response_tokens", int(lengths.sum()))
        rec.add("n_sequences", int(queries.shape[0]))
        return query_responses, logits

    def timed_forward(model, *a, **k):
        if torch.is_grad_enabled():  # the update's joint policy + value forward: the update starts here
            if "_update_start" not in rec.cur:
                rec.update_started()
                rec.cur["_update_start"] = time.perf_counter()
            return saved["forward"](model, *a, **k)
        t0 = time.perf_counter()
        out = saved["forward"](model, *a, **k)
        rec.add("reference_model", time.perf_counter() - t0)
        return out

    def timed_reward(model, *a, **k):
        t0 = time.perf_counter()
        out = saved["get_reward"](model, *a, **k)
        rec.add("critic_model" if model is value_model else "reward_model", time.perf_counter() - t0)
        return out

    log = trainer.log

    def timed_log(logs, *a, **k):
        if rec.iterations and "_update_start" in rec.cur:
            rec.cur["update"] = time.perf_counter() - rec.cur["_update_start"]
            rec.update_ended()
        rec.logs.append(dict(logs))
        return log(logs, *a, **k)

    trainer.log = timed_log
    trl_ppo.batch_generation, trl_ppo.forward, trl_ppo.get_reward = counted_generation, timed_forward, timed_reward
    try:
        trainer.train()
    finally:
        for name, fn in saved.items():
            setattr(trl_ppo, name, fn)


def trl_worker(spec_path: str) -> int:
    import warnings

    warnings.simplefilter("ignore")
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    rec = _Recorder()
    (_trl_grpo if spec["stage"] == "grpo" else _trl_ppo)(spec, rec)
    iterations = []
    for i, it in enumerate(rec.iterations, start=1):
        clean = {k: v for k, v in it.items() if not k.startswith("_") and k not in ("start", "end")}
        clean["iteration"] = i
        clean["tokens"] = clean.get("prompt_tokens", 0) + clean.get("response_tokens", 0)
        iterations.append(clean)
    result = {"iterations": iterations, "trl_logs": rec.logs}
    logged = [log["num_tokens"] for log in rec.logs if "num_tokens" in log]
    if logged:  # GRPOTrainer's own running count of prompt + completion tokens: must equal ours
        result["token_count_check"] = {"trl_num_tokens": logged[-1], "counted": sum(it["tokens"] for it in iterations)}
    Path(spec["result"]).write_text(json.dumps(result, indent=1))
    return 0


def trl_spec(stage: str, model: dict, schedule: list, out_dir: Path, args) -> dict:
    return {
        "stage": stage, "hf": model["hf"], "hf_value": model["hf_value"], "prompts": schedule,
        "prompts_per_iteration": args.prompts, "samples": args.samples if stage == "grpo" else 1,
        "micro_batch": args.micro_batch, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "kl_coef": args.grpo_kl_coef if stage == "grpo" else args.ppo_kl_coef, "lr": args.lr, "seed": args.seed,
        "iterations": args.warmup + args.iterations, "threads": args.threads, "verifier": VERIFIER,
        "device": args.device, "dtype": args.dtype,
        "pad_token": "<|endoftext|>", "out_dir": str(out_dir / "trl_out"), "result": str(out_dir / "trl_result.json"),
    }


# ================================================================================================ summary
def summarize(iterations: list, warmup: int, stage: str, framework: str) -> dict:
    measured = [it for it in iterations if it["iteration"] > warmup]
    if not measured:
        raise SystemExit(f"{framework} {stage}: no measured iterations (warm-up {warmup} of {len(iterations)})")
    world = measured[0].get("world_size", 1)
    tokens = sum(it["tokens"] for it in measured)
    secs = {k: sum(it.get(k, 0.0) for it in measured) for k in ("all", *PHASES)}

    def tps(seconds):
        return tokens / world / seconds if seconds > 0 else None

    update_s = secs["update"] + secs["update_critic"]  # trl_ppo: actor + critic (TRL updates both in one pass)
    out = {
        "iterations_measured": len(measured), "tokens_per_iteration": tokens / len(measured),
        "prompt_tokens_per_sequence": sum(it["prompt_tokens"] for it in measured) / sum(
            it["n_sequences"] for it in measured),
        "response_tokens_per_sequence": sum(it["response_tokens"] for it in measured) / sum(
            it["n_sequences"] for it in measured),
        "s_per_iteration": secs["all"] / len(measured),
        "e2e_tps": tps(secs["all"]), "rollout_tps": tps(secs["rollout"]), "update_tps": tps(update_s),
        "phase_seconds_per_iteration": {k: v / len(measured) for k, v in secs.items() if v > 0},
        "phase_share": {k: v / secs["all"] for k, v in secs.items() if v > 0 and k != "all"},
    }
    if framework == "ours" and stage == "trl_ppo":
        out["update_tps_actor_only"] = tps(secs["update"])  # the seed's update_tps (timing/update alone)
    if warmup:
        out["warmup_s_per_iteration"] = [it["all"] for it in iterations if it["iteration"] <= warmup]
    return out


def _fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def print_table(results: list) -> str:
    gpu = any("peak_gpu_mb" in r["ours"] for r in results)  # CUDA runs: one more column
    head = (f"{'model':<10} {'stage':<8} {'framework':<10} {'e2e tok/s':>10} {'rollout tok/s':>14} "
            f"{'update tok/s':>13} {'s/iter':>7} {'peak RSS MB':>12} {'others CPU':>10}"
            + (f" {'peak GPU MB':>12}" if gpu else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        for fw in ("ours", "trl"):
            s = r[fw]
            lines.append(f"{r['model']:<10} {r['stage']:<8} {fw:<10} {_fmt(s['e2e_tps']):>10} "
                         f"{_fmt(s['rollout_tps']):>14} {_fmt(s['update_tps']):>13} {s['s_per_iteration']:>7.2f} "
                         f"{s['peak_rss_mb']:>12,.0f} {s.get('other_cpu_share', 0):>10.0%}"
                         + (f" {_fmt(s.get('peak_gpu_mb')):>12}" if gpu else ""))
        q = r["ratio"]
        lines.append(f"{r['model']:<10} {r['stage']:<8} {'ours/TRL':<10} {_fmt(q['e2e_tps'], 2) + 'x':>10} "
                     f"{_fmt(q['rollout_tps'], 2) + 'x':>14} {_fmt(q['update_tps'], 2) + 'x':>13} "
                     f"{_fmt(q['s_per_iteration'], 2) + 'x':>7} {_fmt(q['peak_rss_mb'], 2) + 'x':>12}"
                     + (f" {'':>10} {_fmt(q.get('peak_gpu_mb'), 2) + 'x':>12}" if gpu else ""))
        lines.append("")
    return "\n".join(lines)


def print_profile(results: list) -> str:
    lines = ["where the time of a measured iteration goes (share of e2e; seconds per iteration):"]
    for r in results:
        for fw in ("ours", "trl"):
            s = r[fw]
            parts = [f"{k} {v:.0%} ({s['phase_seconds_per_iteration'][k]:.2f}s)"
                     for k, v in sorted(s["phase_share"].items(), key=lambda kv: -kv[1])]
            other = 1.0 - sum(s["phase_share"].get(k, 0.0) for k in PHASES)
            lines.append(f"  {r['model']:<8} {r['stage']:<8} {fw:<5} {s['s_per_iteration']:.2f}s: " + ", ".join(parts)
                         + f", other {other:.0%}")
    return "\n".join(lines)


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for pkg in ("torch", "transformers", "trl", "megatron-core", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = None
    return out


# ================================================================================================ main
def main(argv=None) -> int:
    import warnings

    # megatron-core's import-time notes about Apex / Transformer Engine (expected on CPU)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|transformer_engine).*")
    args = build_parser().parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.iterations < 1 or args.warmup < 0:
        raise SystemExit("--iterations must be >= 1 and --warmup >= 0")
    check_device(args.device)
    for stage in (args.only,) if args.only else STAGES:
        seqs = args.prompts * (args.samples if stage == "grpo" else 1)
        if seqs % args.micro_batch:
            raise SystemExit(f"--micro-batch {args.micro_batch} must divide the {seqs} sequences of a {stage} "
                             "iteration")
    if args.wait_load is not None:
        deadline = time.time() + 1800
        while (_loadavg() or [0])[0] >= args.wait_load and time.time() < deadline:
            print(f"waiting for the 1-minute load average {_loadavg()} to drop below {args.wait_load}", flush=True)
            time.sleep(20)

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now().astimezone()
    load_start = _loadavg()
    print(f"vs_trl: {started:%Y-%m-%d %H:%M %Z}, load average {load_start}, {os.cpu_count()} CPUs, "
          f"{args.threads} threads per run, device {args.device}, {args.dtype}", flush=True)
    models = MODELS if args.model == "both" else (args.model,)
    stages = (args.only,) if args.only else STAGES

    results = []
    for name in models:
        model = prepare_model(name, work, args)
        data = prepare_data(work, Path(model["tokenizer"]), args.seed, args.system_prompt)
        schedule = prompt_schedule(data, args.prompts, args.warmup + args.iterations, args.seed)
        if args.prepare_only:
            print(f"prepared {model['label']}: {model['mg']}, {model['mg_value']}, {data}", flush=True)
            continue
        for stage in stages:
            suffix = "" if (args.device, args.dtype) == ("cpu", "fp32") else f"_{args.device}_{args.dtype}"
            run_dir = work / "runs" / f"{name}_{stage}{suffix}"
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists():
                metrics.unlink()
            ours_proc = _run_measured(our_argv(stage, model, data, metrics, args), run_dir / "ours.log", args.threads,
                                      f"ours: {model['label']} {stage}", args.device)
            ours_iters = read_ours(metrics, stage, args)

            spec = trl_spec(stage, model, schedule, run_dir, args)
            spec_path = run_dir / "trl_spec.json"
            spec_path.write_text(json.dumps(spec))
            trl_proc = _run_measured([sys.executable, Path(__file__).resolve(), "--trl-worker", spec_path],
                                     run_dir / "trl.log", args.threads, f"TRL: {model['label']} {stage}",
                                     args.device)
            trl_out = json.loads(Path(spec["result"]).read_text())

            ours = {**summarize(ours_iters, args.warmup, stage, "ours"), **ours_proc, "per_iteration": ours_iters}
            trl = {**summarize(trl_out["iterations"], args.warmup, stage, "trl"), **trl_proc,
                   "per_iteration": trl_out["iterations"], "trl_logged": trl_out["trl_logs"]}
            if "token_count_check" in trl_out:
                trl["token_count_check"] = trl_out["token_count_check"]
            ratio = {k: _ratio(ours[k], trl[k]) for k in ("e2e_tps", "rollout_tps", "update_tps")}
            ratio["s_per_iteration"] = _ratio(trl["s_per_iteration"], ours["s_per_iteration"])  # speed-up
            ratio["peak_rss_mb"] = _ratio(ours["peak_rss_mb"], trl["peak_rss_mb"])
            if args.device == "cuda":
                ratio["peak_gpu_mb"] = _ratio(ours.get("peak_gpu_mb"), trl.get("peak_gpu_mb"))
            results.append({"model": name, "model_label": model["label"], "stage": stage, "ours": ours, "trl": trl,
                            "ratio": ratio})
            print(f"    {name} {stage}: e2e {_fmt(ours['e2e_tps'])} vs {_fmt(trl['e2e_tps'])} tok/s "
                  f"= {_fmt(ratio['e2e_tps'], 2)}x", flush=True)

    if args.prepare_only:
        return 0
    table, profile = print_table(results), print_profile(results)
    print("\n" + table + "\n" + profile)
    print("ratios: ours/TRL for tokens/s, TRL/ours for s/iter (both > 1 = we are faster), ours/TRL for RSS; "
          "trl_ppo update = actor + critic (TRL updates policy and value in one pass); others CPU = share of the "
          "machine's CPU time used by other processes during the run")
    out = {
        "date": started.isoformat(timespec="seconds"), "host": platform.node(), "cpus": os.cpu_count(),
        "load_average_start": load_start, "load_average_end": _loadavg(), "versions": _versions(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("trl_worker",)},
        "target": "ours >= 2x TRL e2e tokens/s for both stages",
        "target_met": {f"{r['model']}/{r['stage']}": (r["ratio"]["e2e_tps"] or 0) >= 2.0 for r in results},
        "results": results, "table": table, "profile": profile,
    }
    json_path = Path(args.json) if args.json else work / "results.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1))
    print(f"\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
