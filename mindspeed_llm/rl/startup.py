"""What rank 0 prints once before training (`trainer.run`), composed here from the layers below the trainer:
the parser's lines (`compat_flags.startup_lines`: ignored flags, an overridden --distributed-backend, the notes
`validate_args` left) and the MoE notes (`rl.moe.startup_notes`: --moe-grouped-gemm without a kernel)."""

from __future__ import annotations

from typing import List

from mindspeed_llm import compat_flags
from mindspeed_llm.rl import moe


def startup_lines(args, backend: str) -> List[str]:
    """The lines rank 0 prints once before training, in order; `backend` is the device's collectives backend."""
    return compat_flags.startup_lines(args, backend) + moe.startup_notes(args)
