"""A benchmark's world of spawned ranks on this machine (gloo): each rank writes its figures to `rank<r>.json` in a
folder of the parent's, which reads them back; and the results' JSON file with the machine's facts. Shared by the
benchmarks that measure inside a torch.distributed world (`tool_prompts.py`, `weight_sync.py`)."""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_fn: Callable, world: int, args: tuple, prefix: str) -> List[dict]:
    """Runs `rank_fn(rank, world, port, *args, out)` on `world` spawned processes and returns each rank's
    `out/rank<r>.json`, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        for attempt in range(3):  # a free port can be taken before the ranks listen on it (a shared machine)
            try:
                mp.spawn(rank_fn, args=(world, free_port(), *args, out), nprocs=world, join=True)
                break
            except Exception as exc:  # noqa: BLE001 - the ranks' error, re-raised unless it is the port's
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def write_results(path: str, benchmark: str, results, **facts) -> None:
    """`results` as JSON at `path`, with the benchmark's name, `facts` (its settings) and the machine's CPU count, load
    average, Python version and the time."""
    payload = dict(benchmark=benchmark, **facts, cpu_count=os.cpu_count(), load_average=os.getloadavg()[0],
                   python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), results=results)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
