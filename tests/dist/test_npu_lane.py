"""The NPU lane: both stages with `MINDSPEED_DEVICE=npu` on the `torch_npu` stand-in (`tests/helpers/npu_stand_in.py`),
on gloo, checked branch by branch and against the CPU run of the same command line.

One 2-process body runs each case twice in the same processes: first as on an NPU (the stand-in installed, tensors
marked by the virtual-device guard, `device.setup()` taking its NPU branch), then on the CPU (the stand-in removed, the
NPU patches taken back, the CPU ones applied). Cases: grpo at TP2 with LoRA, activation recompute and the fused-op
flags; trl_ppo at PP2 with every part of the trained models' state offloaded to host memory and the torch_npu
profiler; grpo and trl_ppo at TP1 (DP2). Each is one iteration of the continuous engine's rollout and an update.

What the NPU run must show, from the stand-in's records:
* the device chosen as NPU with the hccl backend (`distributed.initialize` asks for "hccl"; only this test swaps the
  process group for the gloo one the harness made), `transfer_to_npu` imported, `torch.npu.set_device(LOCAL_RANK)`,
  the seeds and RNG states through `torch.npu`, `torch.npu.synchronize` for the timers;
* every core attention through `npu_fusion_attention` in BNSD with `head_num` = the local query heads (TP2: half),
  causal prefills as `sparse_mode` 2 with the compressed 2048 x 2048 mask, decode / continued blocks as 3, explicit
  masks as 0, and query / key lengths that agree with those modes (a lower-right block has fewer queries than keys);
* the offload path's host buffers pinned (`pin_memory=True`, noted by the guard), the torch_npu profiler used;
* the fused norm / SwiGLU / RoPE called when their flags are set, once the flags are wired (see FUSED_OP_FLAGS);
* the Triton kernels' eligibility decided as on an NPU: `auto` keeps the torch path (no Triton-Ascend here).
The metrics row equals the CPU run's within `TOLERANCE` (the attention reference adds in another order than SDPA).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TOLERANCE = dict(rel=2e-4, abs=2e-5)
# MindSpeed's fused-op switches -> the torch_npu op each should reach on an NPU. Checked once the switch is wired
# (no longer in compat_flags.IGNORED_SWITCHES); while it is listed as ignored, the lane only checks it is not called.
FUSED_OP_FLAGS = {"--use-fused-rmsnorm": "npu_rms_norm", "--use-fused-swiglu": "npu_swiglu",
                  "--use-fused-rotary-pos-emb": "npu_rotary_position_embedding"}
SKIPPED = ("timing/", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps")


def _argv(task, stage, tp, pp, out, extra=()):
    models = f"tp{tp}pp{pp}"
    argv = ["--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--ref-model", task[f"mg_actor_{models}"], "--reward-model", task[f"mg_reward_{models}"],
            "--tokenizer-name-or-path", task["tokenizer"], "--data-path", task["data"],
            "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", "1", "--max-length", "24",
            "--max-new-tokens", "4", "--do-sample", "--seed", "5", "--lr", "1e-3",
            "--metrics-jsonl", str(out / "metrics.jsonl"), *extra]
    if stage == "grpo":
        argv += ["--n-samples-per-prompt", "2", "--kl-coef", "0.01"]
    return argv


def _cases(task, root):
    fused = list(FUSED_OP_FLAGS)
    return {
        "grpo_tp2_lora_recompute": ("grpo", 2, 1, ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1",
                                                   "linear_fc2", "--lora-r", "4", "--lora-alpha", "8",
                                                   "--recompute-granularity", "full", "--recompute-method", "uniform",
                                                   "--recompute-num-layers", "1", *fused]),
        "trl_ppo_pp2_offload_profile": ("trl_ppo", 1, 2, ["--offload-ref-reward", "--offload-train-optimizer",
                                                          "--offload-train-grad", "--offload-train-param",
                                                          "--profile", "--use-pytorch-profiler",
                                                          "--profile-step-start", "0", "--profile-step-end", "1",
                                                          "--tensorboard-dir", "{out}/tb"]),
        "grpo_tp1": ("grpo", 1, 1, []),
        "trl_ppo_tp1": ("trl_ppo", 1, 1, ["--micro-batch-size", "1"]),
    }


class _BackendProbe:
    """`torch.distributed` as `mindspeed_llm.distributed` sees it in the NPU runs: the backend it asks for is
    recorded and the harness's gloo group stands in for it (the one place the test swaps hccl for gloo)."""

    def __init__(self, real):
        self._real = real
        self.backends = []

    def is_initialized(self):
        return bool(self.backends) and self._real.is_initialized()

    def init_process_group(self, backend, *args, **kwargs):
        self.backends.append(backend)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _reset_device(kind):
    """This process as new for `kind`: the device choice, the setup flag and every patch taken back."""
    os.environ["MINDSPEED_DEVICE"] = kind
    from megatron.core import parallel_state

    from mindspeed_llm import device, patches

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    patches.remove_patches()
    device._SETUP_DONE = False
    device.accelerator.cache_clear()
    device._NPU_CAUSAL_MASKS.clear()  # made under the previous run's guard


def _metrics(path):
    if not os.path.exists(path):  # the run failed: its exit code says so
        return None
    (row,) = [json.loads(line) for line in open(path).read().splitlines()]
    return {k: v for k, v in row.items() if not k.startswith(SKIPPED)}


def _npu_run(argv, patch):
    """One NPU run: (exit code, the stand-in's records, the guard's pinned count, the backends asked for)."""
    import torch
    import torch.distributed

    import posttrain_gpt
    from mindspeed_llm import distributed
    from tests.helpers.device_guard import virtual_device
    from tests.helpers.npu_stand_in import installed

    _reset_device("npu")
    from mindspeed_llm import kernels

    probe = _BackendProbe(torch.distributed)
    patch.setattr(distributed, "dist", probe)
    asked = []  # the device types the kernels' `auto` choice asked Triton about
    runs_on = kernels._triton_runs_on
    patch.setattr(kernels, "_triton_runs_on", lambda device_type: asked.append(device_type) or runs_on(device_type))
    try:
        with installed() as npu, virtual_device(marker=torch.device("npu", int(os.environ["LOCAL_RANK"]))) as vd:
            code = posttrain_gpt.main(argv)
            selected = {family: kernels.select_kernel(family, torch.device("npu", 0))
                        for family in ("logprobs", "scans", "losses")}
    finally:
        patch.undo()
        _reset_device("cpu")
    attention = [dict(info) for name, info in npu.calls if name == "npu_fusion_attention"]
    return dict(code=code, counts=dict(npu.counts()), attention=attention, pinned=vd.pinned,
                set_device=[c["args"] for c in npu.of("set_device")], backends=probe.backends, kernels=selected,
                triton_asked=sorted(set(asked)),
                fused={op: npu.count(op) for op in FUSED_OP_FLAGS.values()},
                fused_args={"rms_norm_epsilon": sorted({c["options"].get("epsilon") for c in npu.of("npu_rms_norm")}),
                            "swiglu_dim": sorted({c["options"].get("dim") for c in npu.of("npu_swiglu")}),
                            "rope_mode": sorted({tuple(c["positional"]) for c in
                                                 npu.of("npu_rotary_position_embedding")})},
                profiler=[name for name, _ in npu.calls if name.startswith("profiler.")])


def _lane(rank, world_size, cases):
    import posttrain_gpt

    out = {}
    for name, (npu_argv, cpu_argv, npu_metrics, cpu_metrics) in cases.items():
        with pytest.MonkeyPatch.context() as patch:
            npu = _npu_run(npu_argv, patch)
        _reset_device("cpu")
        cpu_code = posttrain_gpt.main(cpu_argv)
        _reset_device("cpu")
        npu.update(cpu_code=cpu_code, npu_row=_metrics(npu_metrics) if rank == 0 else None,
                   cpu_row=_metrics(cpu_metrics) if rank == 0 else None)
        out[name] = npu
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("npu_lane_task"), layouts=((1, 1), (2, 1), (1, 2)), reward=True)


@pytest.fixture(scope="module")
def lane(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("npu_lane")
    cases, specs = {}, {}
    for name, (stage, tp, pp, extra) in _cases(task, root).items():
        argvs = []
        for kind in ("npu", "cpu"):
            out = root / name / kind
            out.mkdir(parents=True)
            argvs.append(_argv(task, stage, tp, pp, out, [e.replace("{out}", str(out)) for e in extra]))
        cases[name] = (*argvs, str(root / name / "npu" / "metrics.jsonl"), str(root / name / "cpu" / "metrics.jsonl"))
        specs[name] = (stage, tp, pp, extra)
    return run_distributed(_lane, 2, cases), specs


def _wired(flag):
    from mindspeed_llm import compat_flags

    return flag not in compat_flags.IGNORED_SWITCHES


def test_npu_branches_reached_and_results_equal_the_cpu_run(lane, task):
    results, specs = lane
    config = json.loads((Path(task["tokenizer"]).parent / "hf_actor" / "config.json").read_text())
    for rank, by_case in enumerate(results):
        for name, r in by_case.items():
            stage, tp, pp, extra = specs[name]
            where = f"{name} rank {rank}"
            assert r["code"] == 0 and r["cpu_code"] == 0, where
            # device selection, backend, transfer_to_npu, device pinning, RNG, timers
            assert r["backends"] == ["hccl"], (where, r["backends"])
            assert r["counts"].get("transfer_to_npu") == 1, where
            assert r["set_device"] and r["set_device"][0] == (rank,), (where, r["set_device"])
            for call in ("manual_seed_all", "get_rng_state", "synchronize"):
                assert r["counts"].get(call, 0) > 0, (where, call, r["counts"])
            # the fused attention: layout, heads, modes and lengths
            heads = 4 // tp  # the tiny Qwen2: 4 query heads, 2 key/value groups
            attention = r["attention"]
            assert attention, where
            modes = set()
            for call in attention:
                b, n, sq, d = call["q_shape"]
                sk = call["k_shape"][2]
                assert call["layout"] == "BNSD" and call["head_num"] == heads == n, (where, call)
                assert call["k_shape"][1] == max(2 // tp, 1) and call["contiguous"], (where, call)
                assert call["keep_prob"] == 1.0 and call["actual_seq_qlen"] is None, (where, call)
                mode = call["sparse_mode"]
                modes.add(mode)
                if mode == 2:
                    assert sq == sk and call["mask_shape"] == (2048, 2048), (where, call)
                elif mode == 3:
                    assert sq < sk and call["mask_shape"] == (2048, 2048), (where, call)
                else:
                    assert mode == 0 and call["mask_shape"][-2:] == (sq, sk), (where, call)
            assert 2 in modes, (where, modes)  # prefills and training forwards
            # the fused ops of MindSpeed's switches
            for flag, op in FUSED_OP_FLAGS.items():
                if flag in extra and _wired(flag):
                    assert r["fused"][op] > 0, (where, flag, r["fused"])
                elif flag not in extra:
                    assert r["fused"][op] == 0, (where, flag, r["fused"])
            if "--use-fused-rmsnorm" in extra and _wired("--use-fused-rmsnorm"):  # the model's epsilon, as documented
                assert r["fused_args"]["rms_norm_epsilon"] == [config["rms_norm_eps"]], (where, r["fused_args"])
            if "--use-fused-swiglu" in extra and _wired("--use-fused-swiglu"):  # halves along the last dimension
                assert r["fused_args"]["swiglu_dim"] == [-1], (where, r["fused_args"])
            if "--use-fused-rotary-pos-emb" in extra and _wired("--use-fused-rotary-pos-emb"):  # Qwen2: rotate_half
                assert r["fused_args"]["rope_mode"] == [(0,)], (where, r["fused_args"])
            # Triton: auto keeps the torch path on an NPU without Triton-Ascend
            assert r["kernels"] == {"logprobs": "torch", "scans": "torch", "losses": "torch"}, (where, r["kernels"])
            assert r["triton_asked"] == ["npu"], (where, r["triton_asked"])  # the run's own choices, for "npu"
            if "--offload-train-param" in extra:
                assert r["pinned"] > 0, (where, r["pinned"])
            if "--use-pytorch-profiler" in extra and rank == 0:
                assert "profiler.profile" in r["profiler"], (where, r["profiler"])
            if rank == 0:
                npu_row, cpu_row = r["npu_row"], r["cpu_row"]
                assert npu_row.keys() == cpu_row.keys(), where
                for key, value in cpu_row.items():
                    if isinstance(value, float):
                        assert npu_row[key] == pytest.approx(value, **TOLERANCE), (where, key, npu_row[key], value)
                    else:
                        assert npu_row[key] == value, (where, key)
