"""Model-state memory a LoRA run saves: the reference (and trl_ppo's reward model) for free, and the trained roles'
gradients and optimizer state shrunk to the adapters'. Beside `memory.py` (whose shapes, launcher reader and
storage accounting this reuses).

What is measured (CPU, bf16 as the launchers train): each stage's models built as the stages build them
(`rl/update/roles.trainable`, frozen reference / reward models, or with LoRA `rl/update/lora.reference` / `rl/update/lora.reward_model`,
the trained models' bases) at SmolLM2-135M's shape with random weights, after one optimizer step of each trained
role (so the DDP grad buffer, the fp32 main weights and Adam's moments exist), in a fresh process per configuration:

* model-state bytes: every distinct storage behind the models' parameters, the DDP grad buffers, the optimizer's
  fp32 main copies and moments, and a LoRA reference's frozen adapter copy (with `--lora-load`) and reward model's
  frozen head -- each storage counted once;
* the process's peak RSS over the build and the step, above its RSS once torch, megatron and the process group are
  up (`ru_maxrss`; glibc maps large tensors with mmap, so it follows them; activations of the one-row step are
  small and the same on both sides).

Configurations: grpo (actor + reference, --kl-coef > 0) and trl_ppo (actor + reference + critic + reward model), each
full and with LoRA (r 16, alpha 32 on linear_qkv, linear_proj, linear_fc1, linear_fc2), and grpo with LoRA from a
loaded adapter (the reference keeps a frozen copy of it).

What is computed: the same accounting per device for every shipped launcher (`memory.read_launcher`: its TP / PP /
EP, distributed optimizer and offload flags): full = trained 2 + 4 + 12 bytes per parameter (12 / DP with the
distributed optimizer) and frozen 2 (0 when offloaded); LoRA = the trained roles' bases 2 bytes per parameter, their
adapters 18 (A replicated and B split for a column-parallel linear, A split and B replicated for a row-parallel
one), the frozen roles 0. Checked against the measurement at TP1 (JSON `check`).

Usage::

    python benchmarks/lora_memory.py --json runs/lora_memory.json          # SmolLM2-135M shape, ~5 min on 2 cores
    python benchmarks/lora_memory.py --shape toy --json /tmp/l.json        # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from benchmarks import step_memory as memory  # noqa: E402  (benchmarks/step_memory/, what benchmarks/memory.py runs)

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
R, ALPHA = 16, 32
SHAPES = {
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the demo's model): tied embeddings, no q/k/v bias
    "smollm2": memory.Shape(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                            qkv_bias=False, tied=True),
    "toy": memory.Shape(hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512, qkv_bias=False),
}
CONFIGS = {  # name -> (stage, LoRA, from a loaded adapter)
    "grpo full": ("grpo", False, False),
    "grpo LoRA": ("grpo", True, False),
    "grpo LoRA --lora-load": ("grpo", True, True),
    "trl_ppo full": ("trl_ppo", False, False),
    "trl_ppo LoRA": ("trl_ppo", True, False),
}
GB = 1e9


# ---------------------------------------------------------------------------------------------- measurement
def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view and its base count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _args(stage: str, lora: bool):
    from mindspeed_llm.arguments import parse_args

    argv = ["--stage", stage, "--ref-model", "unused", "--data-path", "unused", "--global-batch-size", "1",
            "--train-iters", "1", "--bf16", "--lr", "1e-6", "--kl-coef", "0.001",
            "--n-samples-per-prompt", "2" if stage == "grpo" else "1"]  # grpo's group advantage needs n >= 2
    argv += ["--reward-model", "unused"] if stage == "trl_ppo" else ["--verifier-function", "math_acc"]
    if lora:
        argv += ["--lora-target-modules", *TARGETS, "--lora-r", str(R), "--lora-alpha", str(ALPHA)]
    return parse_args(argv)


def _step(trained) -> None:
    import torch

    from mindspeed_llm import device

    tokens = torch.randint(0, 100, (1, 64), device=device.current_device())
    micro_batch = {"tokens": tokens, "position_ids": torch.arange(64, device=tokens.device)[None]}
    trained.train_step([micro_batch], lambda out, mb: (out.float().mean(), {}))


def _optimizer_tensors(trained) -> List:
    import torch

    out = []
    for opt in getattr(trained.optimizer, "chained_optimizers", [trained.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            out.extend(p for p in group["params"] if p.dtype == torch.float32)
        for state in inner.state.values():
            out.extend(v for k, v in state.items() if torch.is_tensor(v) and k != "step" and v.dim() > 0)
    return out


def measure(config: str, shape_name: str) -> dict:
    """One configuration in this (fresh) process."""
    import gc

    import torch

    from mindspeed_llm import device
    from mindspeed_llm.models import build_model
    from mindspeed_llm.models import lora as lora_models
    from mindspeed_llm.rl.update import lora, roles

    memory.init_process()
    gc.collect()
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stage, use_lora, loaded = CONFIGS[config]
    args = _args(stage, use_lora)
    spec = SHAPES[shape_name].spec(max_positions=4096)

    def model(value_head=False):
        return build_model(spec, params_dtype="bf16", value_head=value_head).to(device.current_device())

    actor = roles.trainable(model(), args.settings, "actor", "--ref-model")
    if loaded:  # as --lora-load: the adapters are not zero, and the reference keeps a frozen copy of them
        actor.initial_adapter = "loaded"
        with torch.no_grad():
            for adapter in lora_models.adapters(actor.module).values():
                adapter.B.normal_(0, 0.01)
    trained = {"actor": actor}
    frozen = {"reference": lora.reference(actor) if use_lora else roles.frozen(model())}
    if stage == "trl_ppo":
        trained["critic"] = roles.trainable(model(value_head=True), args.settings, "critic", "--reward-model")
        frozen["reward"] = lora.reward_model(trained["critic"]) if use_lora else roles.frozen(model(value_head=True))
    for role in trained.values():
        _step(role)
    modules = [t.module for t in trained.values()] + [m for m in frozen.values() if not hasattr(m, "active")]
    params = [p for m in modules for p in m.parameters()]
    extra = []  # the LoRA views' own tensors: a frozen adapter copy, a frozen value head
    for view in frozen.values():
        if getattr(view, "frozen_adapters", False):
            extra += [t for a in lora_models.adapters(view.module).values() for t in a.frozen]
        if getattr(view, "head", None) is not None:
            extra += list(view.head.parameters())
    grads = [b.grad_data for t in trained.values() for b in t.ddp.buffers + t.ddp.expert_parallel_buffers]
    optimizer = [x for t in trained.values() for x in _optimizer_tensors(t)]
    parts = {"weights": _storage_bytes(params), "views": _storage_bytes(extra),
             "grad_buffers": _storage_bytes(grads), "optimizer": _storage_bytes(optimizer)}
    parts["total"] = sum(parts.values())
    counts = {"base": sum(p.numel() for p in trained["actor"].module.parameters() if not p.requires_grad),
              "trained": {n: sum(p.numel() for p in t.module.parameters() if p.requires_grad)
                          for n, t in trained.items()},
              "all": sum(p.numel() for p in trained["actor"].module.parameters())}
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(config=config, stage=stage, lora=use_lora, loaded=loaded, bytes=parts, params=counts,
                rss_above_start=rss_peak - rss_start, computed=computed_tp1(SHAPES[shape_name], stage, use_lora,
                                                                          loaded))


def _child(config: str, shape: str, out: str) -> None:
    result = measure(config, shape)
    with open(out, "w") as f:
        json.dump(result, f)


def run_child(config: str, shape: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, MINDSPEED_DEVICE=os.environ.get("MINDSPEED_DEVICE", "cpu"), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(memory.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", config, "--shape", shape,
                               "--out", out], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{config}: {proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------------- computation
def adapter_params(shape: memory.Shape, tp: int = 1, pp: int = 1, r: int = R) -> float:
    """Adapter parameters one rank holds (dense models): per layer, per target, r x (in + out) with the split side
    divided by TP (column: B's out rows; row: A's in columns)."""
    s = shape
    per_layer = (r * s.hidden + r * (s.q + 2 * s.kv) / tp          # linear_qkv (column)
                 + r * s.q / tp + r * s.hidden                       # linear_proj (row)
                 + r * s.hidden + r * 2 * s.ffn / tp                 # linear_fc1 (column)
                 + r * s.ffn / tp + r * s.hidden)                    # linear_fc2 (row)
    return per_layer * s.layers / pp


def role_bytes(shape, trained: bool, value_head: bool, lora: bool, tp=1, pp=1, ep=1, stage=0, dp=1,
               distributed=False, loaded=False) -> float:
    """Model-state bytes of one role on one rank (see the module docstring)."""
    counts = memory.param_counts(shape, tp, pp, ep, stage, value_head)["total"]
    optimizer = 12 / (dp if distributed else 1)
    if not lora:
        return counts * (6 + optimizer) if trained else 2 * counts
    if not trained:
        return 0.0
    adapters = adapter_params(shape, tp, pp) + (shape.hidden if value_head and stage == pp - 1 else 0)
    copy = 2 * adapter_params(shape, tp, pp) if loaded else 0.0  # the reference's frozen copy (actor)
    return 2 * counts + adapters * (6 + optimizer) + copy


def computed_tp1(shape, stage: str, lora: bool, loaded: bool) -> float:
    total = role_bytes(shape, True, False, lora, loaded=loaded) + role_bytes(shape, False, False, lora)
    if stage == "trl_ppo":
        total += role_bytes(shape, True, True, lora) + role_bytes(shape, False, True, lora)
    return total


def project(path: str) -> dict:
    """Model-state GB per device of a launcher at its worst pipeline stage, full and with LoRA."""
    launch = memory.read_launcher(path)
    out = {"launcher": path, "stage": launch.stage, "tp": launch.tp, "pp": launch.pp, "ep": launch.ep,
           "dp": launch.dp, "distributed_optimizer": launch.levers.distributed_optimizer,
           "offload_ref_reward": launch.levers.offload_ref_reward}
    moe = any(role.shape.experts for role in launch.roles)
    for kind in ("full", "lora"):
        worst = 0.0
        for stage in range(launch.pp):
            total = 0.0
            for role in launch.roles:
                if kind == "full" and not role.trainable and launch.levers.offload_ref_reward:
                    continue  # offloaded between uses: counted in its own pass only (memory.py's rule)
                total += role_bytes(role.shape, role.trainable, role.value_head, kind == "lora", launch.tp,
                                    launch.pp, launch.ep, stage, launch.dp, launch.levers.distributed_optimizer)
            worst = max(worst, total)
        out[kind] = worst / GB
    if moe:
        out["note"] = "routed experts' adapters not counted (dense formula); their base counts as frozen"
    return out


# ---------------------------------------------------------------------------------------------- report
def report(data: dict) -> str:
    lines = [f"measured at {data['shape_name']} ({data['params_all'] / 1e6:.1f} M parameters a model), bf16, TP1, "
             "one optimizer step of each trained role", ""]
    head = f"{'configuration':<24}{'weights':>10}{'grads':>9}{'optim':>9}{'views':>8}{'total':>9}" \
           f"{'computed':>10}{'RSS rise':>10}"
    lines += [head, "-" * len(head)]
    mib = 2 ** 20
    for r in data["measured"]:
        b = r["bytes"]
        lines.append(f"{r['config']:<24}{b['weights'] / mib:>9.0f}M{b['grad_buffers'] / mib:>8.0f}M"
                     f"{b['optimizer'] / mib:>8.0f}M{b['views'] / mib:>7.1f}M{b['total'] / mib:>8.0f}M"
                     f"{r['computed'] / mib:>9.0f}M{r['rss_above_start'] / mib:>9.0f}M")
    lines.append("")
    for stage in ("grpo", "trl_ppo"):
        full = next(r for r in data["measured"] if r["config"] == f"{stage} full")
        lora = next(r for r in data["measured"] if r["config"] == f"{stage} LoRA")
        reference = full["bytes"]["weights"] - lora["bytes"]["weights"]
        lines.append(f"{stage}: LoRA saves {(full['bytes']['total'] - lora['bytes']['total']) / mib:.0f} MiB of "
                     f"{full['bytes']['total'] / mib:.0f} MiB model state "
                     f"({1 - lora['bytes']['total'] / full['bytes']['total']:.0%}); the frozen models not loaded: "
                     f"{reference / mib:.0f} MiB; RSS rise {full['rss_above_start'] / mib:.0f} -> "
                     f"{lora['rss_above_start'] / mib:.0f} MiB")
    lines += ["", f"{'launcher (per device, worst stage)':<52}{'full GB':>9}{'LoRA GB':>9}"]
    for p in data["projection"]:
        lines.append(f"{p['launcher']:<52}{p['full']:>9.1f}{p['lora']:>9.1f}" + (f"  ({p['note']})" if "note" in p
                                                                                  else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smollm2")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.shape, args.out)
        return 0
    measured = []
    for config in CONFIGS:
        print(f"measuring {config} ...", flush=True)
        measured.append(run_child(config, args.shape))
    data = {"shape_name": args.shape, "shape": asdict(SHAPES[args.shape]), "lora": dict(r=R, alpha=ALPHA,
                                                                                        targets=list(TARGETS)),
            "params_all": measured[0]["params"]["all"], "measured": measured,
            "check": [dict(config=r["config"], measured=r["bytes"]["total"], computed=r["computed"],
                           ratio=r["bytes"]["total"] / r["computed"]) for r in measured],
            "projection": [project(path) for path in memory.LAUNCHERS]}
    print(report(data))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
