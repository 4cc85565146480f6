"""Checks of the peak method: a scripted allocation sequence of known peak (`check_peak_method`) and the rise of a fresh
process's ru_maxrss over one step (`check_peak_rss`)."""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from typing import Optional

from benchmarks.step_memory.measure import (
    build, case_dict, free_port, init_process, micro_batch_of, profile_memory, synthetic_experience,
)
from benchmarks.step_memory.shapes import KL_COEF, LOSS_ARGS, ROOT, Case, Shape


def check_peak_method(device_type: str = "cpu") -> dict:
    """The profiler running-sum method on a scripted sequence whose peak is known: a, b live (3 MiB + 5 MiB), a freed,
    c (7 MiB) allocated -> peak 12 MiB; and a view adds nothing."""
    import torch

    from mindspeed_llm import device

    dev = device.current_device()

    def script():
        a = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
        b = torch.empty(5 << 20, dtype=torch.uint8, device=dev)
        del a
        c = torch.empty(7 << 20, dtype=torch.uint8, device=dev)
        view = c[: 1 << 20]
        del b, c, view

    _, timeline = profile_memory(script, device_type)
    return dict(expected=12 << 20, measured=timeline["peak"], end=timeline["end"])


def _rss_child(case_json: str, out_path: str) -> None:
    """In a fresh process: one cold training step of the case under the profiler (the peak method), and the rise of
    ru_maxrss over the resident size just before it."""
    import psutil
    import torch

    from mindspeed_llm.rl.update import engine
    from mindspeed_llm.rl.update.loss_closures import clipped_policy_loss
    from mindspeed_llm.rl.settings import LossSettings

    torch.set_num_threads(1)
    init_process(1)
    d = json.loads(case_json)
    case = Case(shape=Shape(**d.pop("shape")), **{k: v for k, v in d.items() if k != "name"})
    rows, seq, prompt, response = case.rows_and_lengths()
    tm = build(case, trainable=True)
    exp = synthetic_experience(case.samples, prompt, response, case.shape.vocab)
    _, mb = micro_batch_of(case, exp)
    args = LossSettings(**LOSS_ARGS, max_new_tokens=response)
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step():
        tm.ddp.zero_grad_buffer()
        engine.run_schedule(tm.chunks, [mb], lambda o, m: (clipped_policy_loss(args, o, m, KL_COEF)[0], {}), False)

    _, timeline = profile_memory(step, "cpu")
    max_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out_path, "w") as f:
        json.dump(dict(profiler_peak=timeline["peak"], rss_before=rss_before, maxrss_before=max_before,
                       maxrss_after=max_after, rss_rise=max_after - rss_before,
                       rise_visible=max_after > max_before), f)


def check_peak_rss(case: Case, mmap_threshold: Optional[int] = None) -> dict:
    """ru_maxrss of a fresh process over one step against the profiler's peak of the same case (its own process).
    The maximum RSS before the step (model building) must stay below the step's level for the rise to be seen; it
    is reported. `mmap_threshold`: glibc's MALLOC_MMAP_THRESHOLD_ for the child (a fixed threshold: every block
    above it is mmap'ed and returned when freed; glibc's default raises the threshold to the largest block freed,
    up to 32 MiB, and keeps freed blocks below it in the heap, which RSS then counts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rss.json")
        code = ("import sys; sys.path.insert(0, %r); from benchmarks.step_memory import peak_checks; "
                "peak_checks._rss_child(%r, %r)"
                % (ROOT, json.dumps(case_dict(case)), out))
        env = dict(os.environ, MINDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
        if mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        with open(out) as f:
            result = json.load(f)
    result.update(case=case.name, mmap_threshold=mmap_threshold)
    return result
