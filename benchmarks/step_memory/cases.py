"""The measured cases (`main_cases`, `grid_cases`) and their run (`run_cases`), with the versions and machine they ran
on."""

from __future__ import annotations

import os
import platform
import re
import time
from typing import Dict, List, Optional, Sequence

from benchmarks.step_memory.measure import case_dict, measure
from benchmarks.step_memory.shapes import GB, RECOMPUTE, Case, rough_case_bytes, Shape


# ---------------------------------------------------------------------------------------------- cases and driver
def main_cases(shape: Shape, lengths: Sequence[int], attentions: Sequence[str]) -> List[Case]:
    cases = []
    for attention in attentions:
        for seq in lengths:
            for mode in RECOMPUTE:
                cases.append(Case(shape, seq, attention, recompute=mode))
            cases.append(Case(shape, seq, attention, kind="forward"))
    # the same 4 samples of one prompt as 4 rows and as one packed row [prompt | r1 .. r4] of `seq` tokens
    for attention in attentions:
        for seq in lengths[:2]:
            cases.append(Case(shape, seq, attention, layout="packed", group=4, tag="packed"))
            cases.append(Case(shape, seq, attention, layout="row", group=4, tag="packed"))
    return cases


def grid_cases(grid: dict, attentions: Sequence[str]) -> List[Case]:
    cases = []
    for attention in attentions:
        for tag in ("dense", "held_out", "qk_norm", "moe", "moe_held_out"):
            for shape in grid[tag]:
                for seq in grid["lengths"]:
                    name = "fit" if tag == "dense" else tag
                    for mode in RECOMPUTE:
                        cases.append(Case(shape, seq, attention, recompute=mode, tag=name))
                    cases.append(Case(shape, seq, attention, kind="forward", tag=name))
    return cases


def run_cases(cases: Sequence[Case], device_type: str, max_bytes: float, log, timing_tags=("main", "packed"),
              reuse: Optional[Dict[str, dict]] = None, only: Optional[str] = None, save=None, date: str = ""):
    """Measures `cases` (those in `reuse` taken from it, those `only` does not match skipped), calling `save`
    with the results so far after each measured case (a long run keeps what it measured); each measured case
    records its run's `date` (`measured_on`), which reuse keeps."""
    results = []
    for i, case in enumerate(cases):
        if reuse and case.name in reuse:
            results.append(reuse[case.name])
            continue
        if only and not re.search(only, case.name):
            results.append(dict(case=case_dict(case), skipped=f"not selected (--only {only})"))
            continue
        guess = rough_case_bytes(case)
        if guess > max_bytes:
            results.append(dict(case=case_dict(case), skipped=f"needs about {guess / GB:.1f} GB by a rough estimate "
                                f"(--max-case-gb {max_bytes / GB:g})"))
            log(f"[{i + 1}/{len(cases)}] skip {case.name}: ~{guess / GB:.1f} GB")
            continue
        start = time.perf_counter()
        try:
            r = measure(case, device_type, timing=case.tag in timing_tags)
        except Exception as exc:  # a lever that does not run is a result, not the end of the benchmark
            results.append(dict(case=case_dict(case), error=f"{type(exc).__name__}: {exc}"[:500]))
            log(f"[{i + 1}/{len(cases)}] error {case.name}: {exc}")
            continue
        r["measured_on"] = date
        results.append(r)
        log(f"[{i + 1}/{len(cases)}] {case.name}: saved/layer/token {r['per_layer']['layer_total']:.0f} B, "
            f"peak {r['peak'] / 2**20:.1f} MiB ({time.perf_counter() - start:.1f} s)")
        if save is not None:
            save(results + [dict(case=case_dict(c), skipped="not reached yet") for c in cases[len(results):]])
    return results


def versions() -> dict:
    import megatron.core
    import torch

    return dict(python=platform.python_version(), torch=torch.__version__,
                megatron_core=getattr(megatron.core, "__version__", "?"))


def machine() -> dict:
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), load_average=os.getloadavg())
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            info["memory_gb"] = int(f.readline().split()[1]) / 1e6
    except OSError:
        pass
    return info
