"""The NPU check: the NPU counterpart of `scripts/gpu_check.py`, for a machine with an Ascend NPU and torch_npu.

    bash scripts/npu_check.sh                          # on the NPU machine ("no NPU: nothing to check" elsewhere)
    python scripts/npu_check.py run --dry-run          # the steps and their command lines, nothing run
    python scripts/npu_check.py ops --json ops.json    # one step alone: the fused ops against their references

Steps of `run` (each in its own process with its own timeout, logged to WORKDIR/logs/STEP.log; the runner,
the JSON and the exit status are gpu_check.py's):

  env            torch, torch_npu, the NPU and package versions
  ops            the project's NPU attention (`device.attention` -> torch_npu.npu_fusion_attention, BNSD: causal,
                 right-down causal, explicit masks, grouped key heads; fp32 and bf16) against plain-torch
                 attention on the CPU (`attention_reference` here), and torch_npu's npu_rms_norm (y and rstd),
                 npu_swiglu, npu_rotary_position_embedding (both modes, three layouts) against
                 mindspeed_llm/kernels/npu_reference.py; fails above the tolerances. No test module is imported.
  kernels        the Triton kernels of the RL math on the NPU (Triton-Ascend: GAE and discounted-return scans)
                 against their torch references; says "skipped" where Triton-Ascend is not installed
  qwen_prepare   a random 2 x 64 Qwen2 (the Qwen2.5 vocabulary) and its value copy, bf16 conversions, prompts
  qwen_grpo / qwen_trl_ppo   torchrun posttrain_gpt.py --stage ... --bf16, 3 iterations, on the NPU
  memory         benchmarks/memory.py --device npu --toy: one step's memory with torch_npu's allocator statistics

Results: $OUT/npu_check.json (else runs/npu_check.json), the logs in $OUT/npu_check_logs.tar.gz. Exit status: 0 when
no step failed or timed out, 1 otherwise (npu_check.sh: 3 when there is no NPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402  (the runner, steps and JSON this check shares)

ORDER = ["env", "ops", "kernels", "qwen_prepare", "qwen_grpo", "qwen_trl_ppo", "memory"]
TIMES = {"env": (15, 90), "ops": (30, 300), "kernels": (30, 300), "qwen_prepare": (60, 300),
         "qwen_grpo": (60, 300), "qwen_trl_ppo": (60, 300), "memory": (120, 600)}
# fp32: torch_npu's kernels may accumulate in another order (and the cube unit in reduced precision for matmuls);
# bf16: one bf16 rounding of O(1) outputs. A wrong mask, head mapping or split order moves outputs by O(0.1).
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}

ENV_SNIPPET = r"""
import json, platform, importlib.metadata as md, torch
d = {"python": platform.python_version(), "torch": torch.__version__}
try:
    import torch_npu
    d.update(torch_npu=torch_npu.__version__, npu_available=torch.npu.is_available(), npus=torch.npu.device_count())
    if torch.npu.is_available():
        d.update(npu=torch.npu.get_device_name(0))
except Exception as exc:
    d.update(torch_npu=None, error=f"{type(exc).__name__}: {exc}")
for pkg in ("megatron-core", "transformers", "triton", "triton-ascend", "numpy"):
    try:
        d[pkg] = md.version(pkg)
    except Exception:
        d[pkg] = None
print(json.dumps(d))
"""


class NpuCheck(gpu_check.Check):
    """gpu_check's runner with the NPU's steps."""

    def _times(self, name):
        return TIMES[name]

    def _steps(self):
        py, o = self.py, self.o
        steps = []

        def add(name, what, commands, figures=None, brief=None):
            expected, timeout = self._times(name)
            steps.append(gpu_check.Step(name, what, commands, expected, timeout, None, figures, brief))

        me = Path(__file__).resolve()
        add("env", "torch, torch_npu, the NPU and package versions", [[py, "-c", ENV_SNIPPET]],
            figures=lambda: gpu_check._last_json_line(self.logs / "env.log"), brief=lambda f: json.dumps(f)[:200])
        ops = self.work / "ops.json"
        add("ops", "npu_fusion_attention (via device.attention) and the fused norm / SwiGLU / RoPE vs references",
            [[py, me, "ops", "--json", ops]], figures=lambda: _read(ops), brief=_brief_ops)
        kernels = self.work / "kernels.json"
        add("kernels", "Triton-Ascend kernels of the RL math vs their torch references",
            [[py, me, "kernels", "--json", kernels]], figures=lambda: _read(kernels),
            brief=lambda f: f.get("skipped") or f"max error {f.get('max_error')}")
        shape, q = gpu_check.QWEN_SHAPES["tiny"], self.work / "qwen"
        add("qwen_prepare", "random {layers}x{hidden} Qwen2 (vocab {vocab}), value copy, bf16 conversions, prompts"
            .format(**shape), gpu_check.qwen_prepare_commands(py, q, self.assets, shape, "cpu"),
            figures=lambda: gpu_check._qwen_prepare_figures(q), brief=gpu_check._brief_qwen_prepare)
        for stage in ("grpo", "trl_ppo"):
            metrics = q / f"{stage}_metrics.jsonl"
            add(f"qwen_{stage}", f"posttrain_gpt.py --stage {stage} --bf16 on the small model, on the NPU",
                [self._qwen_stage_argv(stage, q, metrics)],
                figures=lambda metrics=metrics: gpu_check._stage_figures(metrics), brief=gpu_check._brief_stage)
        memory = self.work / "memory.json"
        add("memory", "benchmarks/memory.py --device npu --toy (torch_npu's allocator statistics)",
            [[py, "benchmarks/memory.py", "--device", o.device, "--toy", "--no-tp2", "--no-rss-check",
              "--json", memory]], figures=lambda: {"written": memory.is_file()}, brief=lambda f: "")

        by_name = {s.name: s for s in steps}
        assert list(by_name) == ORDER, list(by_name)
        chosen = o.steps.split(",") if o.steps else ORDER
        skip = set(o.skip.split(",")) if o.skip else set()
        unknown = [n for n in chosen + sorted(skip) if n not in by_name]
        if unknown:
            raise SystemExit(f"npu_check: unknown step(s) {unknown}; steps: {', '.join(ORDER)}")
        return [by_name[n] for n in ORDER if n in chosen and n not in skip]

    def _bundle(self, path: Path):
        super()._bundle(path.with_name("npu_check_logs.tar.gz"))


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _brief_ops(f: dict) -> str:
    worst = max(f.get("cases", {}).items(), key=lambda kv: kv[1]["error"] / kv[1]["tolerance"], default=None)
    return f"{len(f.get('cases', {}))} cases; worst {worst[0]}: {worst[1]['error']:.2e}" if worst else ""


# ================================================================================================ ops
def attention_reference(query, key, value, scale, causal=None, masked=None):
    """`device.attention`'s contract written out in plain torch (float32 on the CPU): `query` [b, h, sq, d], `key` /
    `value` [b, g, sk, d], query head i reading key head i // (h // g); `causal` "upper_left" (query i sees keys
    <= i) or "lower_right" (keys <= i + sk - sq); `masked` bool, True = not attended, a row masked everywhere
    attending to every key."""
    import torch

    heads, groups = query.size(1), key.size(1)
    key, value = (t.repeat_interleave(heads // groups, dim=1) for t in (key, value))
    sq, sk = query.size(2), key.size(2)
    later = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]  # key index - query index
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if causal == "upper_left":
        hidden = later > 0
    elif causal == "lower_right":
        hidden = later > sk - sq
    if masked is not None:
        hidden = masked & ~masked.all(dim=-1, keepdim=True)
    scores = (query @ key.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ value


def check_ops(json_path: str) -> int:
    """The NPU's fused ops against the references; every case's error in `json_path`; 1 above a tolerance."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch_npu

    from mindspeed_llm import device
    from mindspeed_llm.kernels import npu_reference as ref

    if device.accelerator().kind != "npu":
        raise SystemExit("npu_check ops: no NPU here (torch_npu missing or it sees no device)")
    npu = device.current_device()
    g = torch.Generator().manual_seed(0)
    cases = {}

    def record(name, got, expected, dtype):
        error = float((got.float().cpu() - expected.float()).abs().max())
        cases[name] = {"error": error, "tolerance": TOLERANCE[dtype], "ok": error <= TOLERANCE[dtype]}

    b, heads, groups, d = 2, 8, 2, 64
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        for case, (sq, sk) in {"causal": (128, 128), "lower_right": (32, 128), "mask": (128, 128),
                               "decode": (1, 96)}.items():
            q = torch.randn(b, heads, sq, d, generator=g).to(dt)
            k, v = (torch.randn(b, groups, sk, d, generator=g).to(dt) for _ in range(2))
            kwargs = {}
            if case == "causal":
                kwargs["causal"] = "upper_left"
            elif case == "lower_right":
                kwargs["causal"] = "lower_right"
            else:
                masked = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
                masked[1, ..., :5] = True  # key padding of row 1
                if case == "mask":
                    masked |= torch.ones(sq, sk, dtype=torch.bool).triu(1)
                kwargs["masked"] = masked
            reference = attention_reference(q.float(), k.float(), v.float(), d ** -0.5, **kwargs)
            on_npu = {k2: (t.to(npu) if isinstance(t, torch.Tensor) else t) for k2, t in kwargs.items()}
            got = device.attention(q.to(npu), k.to(npu), v.to(npu), scale=d ** -0.5, **on_npu)
            record(f"attention_{case}_{dtype}", got, reference, dtype)
        x = torch.randn(4, 16, 256, generator=g).to(dt)
        gamma = (1 + 0.1 * torch.randn(256, generator=g)).to(dt)
        y, rstd = torch_npu.npu_rms_norm(x.to(npu), gamma.to(npu), epsilon=1e-6)
        ry, rrstd = ref.npu_rms_norm(x, gamma, 1e-6)
        record(f"rms_norm_y_{dtype}", y, ry, dtype)
        record(f"rms_norm_rstd_{dtype}", rstd, rrstd, "float32")
        z = torch.randn(4, 16, 512, generator=g).to(dt)
        record(f"swiglu_{dtype}", torch_npu.npu_swiglu(z.to(npu), dim=-1), ref.npu_swiglu(z, -1), dtype)
        s, n, dh = 16, 4, 64
        angles = torch.randn(s, dh // 2, generator=g)
        for mode in (0, 1):
            freqs = torch.cat([angles, angles], -1) if mode == 0 else angles.repeat_interleave(2, -1)
            for layout, shape, rshape in (("BNSD", (2, n, s, dh), (1, 1, s, dh)),
                                          ("BSND", (2, s, n, dh), (1, s, 1, dh)),
                                          ("SBND", (s, 2, n, dh), (s, 1, 1, dh))):
                t = torch.randn(*shape, generator=g).to(dt)
                cos, sin = freqs.cos().reshape(rshape).to(dt), freqs.sin().reshape(rshape).to(dt)
                got = torch_npu.npu_rotary_position_embedding(t.to(npu), cos.to(npu), sin.to(npu), mode)
                record(f"rope_mode{mode}_{layout}_{dtype}", got, ref.npu_rotary_position_embedding(t, cos, sin, mode),
                       dtype)
    bad = sorted(name for name, c in cases.items() if not c["ok"])
    Path(json_path).write_text(json.dumps({"cases": cases, "failed": bad}, indent=1))
    for name, c in cases.items():
        print(f"{name:40s} {c['error']:.3e} (tolerance {c['tolerance']:.0e}){'' if c['ok'] else '  FAILED'}")
    return 1 if bad else 0


# ================================================================================================ kernels
def check_kernels(json_path: str) -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from mindspeed_llm import device, kernels
    from mindspeed_llm.rl.core_algos import scans

    if device.accelerator().kind != "npu":
        raise SystemExit("npu_check kernels: no NPU here (torch_npu missing or it sees no device)")
    if not kernels.triton_ascend_available():
        out = {"skipped": "Triton-Ascend is not installed: the RL math runs its torch path on this NPU"}
        Path(json_path).write_text(json.dumps(out))
        print(out["skipped"])
        return 0
    npu = device.current_device()
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(8, 300, generator=g), torch.randn(8, 300, generator=g)
    mask = (torch.arange(300)[None, :] < torch.randint(1, 301, (8, 1), generator=g)).float()
    errors = {}
    adv, ret = scans.gae_scan(rewards.to(npu), values.to(npu), mask.to(npu), 0.99, 0.95, kernel="triton")
    ref_adv, ref_ret = scans.gae_scan_loop(rewards, values, mask, 0.99, 0.95)
    errors["gae_advantages"] = float((adv.cpu() - ref_adv).abs().max())
    errors["gae_returns"] = float((ret.cpu() - ref_ret).abs().max())
    disc = scans.discounted_returns(rewards.to(npu), mask.to(npu), 0.99, kernel="triton")
    errors["discounted_returns"] = float((disc.cpu() - scans.discounted_returns_loop(rewards, mask, 0.99)).abs().max())
    out = {"errors": errors, "max_error": max(errors.values()), "tolerance": 1e-4}
    Path(json_path).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if out["max_error"] <= out["tolerance"] else 1


# ================================================================================================ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the check")
    r.add_argument("--device", choices=("npu",), default="npu")
    r.add_argument("--budget", type=float, default=900.0, help="seconds for all steps")
    r.add_argument("--steps", default=None, help=f"comma-separated subset of: {','.join(ORDER)}")
    r.add_argument("--skip", default=None, help="comma-separated steps to leave out")
    r.add_argument("--workdir", default=str(ROOT / "runs" / "npu_check"))
    r.add_argument("--assets", default=str(gpu_check.DEFAULT_ASSETS), help="tokenizer folders (gpu_check.py "
                                                                           "prepare-assets)")
    r.add_argument("--json", default=None, help="default: $OUT/npu_check.json, else runs/npu_check.json")
    r.add_argument("--python", default=sys.executable, help="the interpreter of every step")
    r.add_argument("--dry-run", action="store_true", help="print the steps and command lines, run nothing")
    for name in ("ops", "kernels"):
        s = sub.add_parser(name, help=f"the {name} step alone")
        s.add_argument("--json", required=True)
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    if opts.command == "ops":
        return check_ops(opts.json)
    if opts.command == "kernels":
        return check_kernels(opts.json)
    opts.size = "tiny"  # gpu_check's toy run sizes (QWEN_RUN["tiny"]), in bf16 on the NPU
    if opts.json is None:
        opts.json = str(Path(os.environ["OUT"]) / "npu_check.json" if os.environ.get("OUT")
                        else ROOT / "runs" / "npu_check.json")
    return NpuCheck(opts).run()


if __name__ == "__main__":
    sys.exit(main())
