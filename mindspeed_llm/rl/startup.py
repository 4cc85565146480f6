"""What rank 0 prints once before training (`trainer.run`), composed here from the layers below the trainer:
the parser's lines (`compat_flags.startup_lines`: ignored flags, an overridden --distributed-backend, the notes
`validate_args` left), the MoE notes (`rl.update.moe.startup_notes`: --moe-grouped-gemm without a kernel), what the
profiling flags do on this device (`rl.profiling.startup_notes`) and the environment switches with their values.

The switches stay environment variables, not flags: each picks an implementation, never the math (the Triton
kernels of `mindspeed_llm.kernels`, the decode step's CUDA graph of `inference/cuda_graph.py`), and each is read
where that implementation is chosen, deep below the stages; printing them here makes them as visible as a flag.
"""

from __future__ import annotations

import os
from typing import List

from mindspeed_llm import compat_flags
from mindspeed_llm.inference.cuda_graph import DECODE_CUDA_GRAPH_ENV
from mindspeed_llm.kernels import KERNEL_ENVS
from mindspeed_llm.rl import profiling
from mindspeed_llm.rl.update import moe

# environment variable -> the value it has when unset
# the collectives backend -> the device kind it runs on
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
ENVIRONMENT_SWITCHES = {**{env: "auto" for env in KERNEL_ENVS.values()}, DECODE_CUDA_GRAPH_ENV: "0"}


def environment_line() -> str:
    """`environment switches: NAME=value, ...` as this process sees them; `(default)` marks an unset one."""
    values = [f"{name}={os.environ[name]}" if name in os.environ else f"{name}={default} (default)"
              for name, default in ENVIRONMENT_SWITCHES.items()]
    return "environment switches: " + ", ".join(values)


def startup_lines(settings, backend: str) -> List[str]:
    """The lines rank 0 prints once before training, in order, from the run's settings (`rl.settings.Settings`);
    `backend` is the device's collectives backend."""
    notes = profiling.startup_notes(settings.profile, BACKEND_DEVICE.get(backend, backend))
    return (compat_flags.startup_lines(settings.startup, backend) + moe.startup_notes(settings.moe) + notes
            + [environment_line()])
