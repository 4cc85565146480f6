"""Launch grids and tile sizes of the Triton kernels (scans, losses), and Triton-Ascend's porting rules they follow on
an NPU.

Every kernel here is written as programs that loop over tasks (`for task in range(pid, tasks, programs)`: a task
is a row of the scans, a (row, block of positions) of the losses), so the number of programs is a launch choice:

* CUDA (and the CPU interpreter): one program per task, as a GPU schedules a large grid itself.
* NPU (Triton-Ascend): a 1-D grid of at most the device's vector-core count (the kernels have no `tl.dot`: vector
  operators), each program looping over its tasks; never more than `MAX_CORE_DIM` programs. The tiles are powers of
  two of at least `NPU_MIN_BLOCK` elements, so every tile of every input dtype (bool masks read as bytes included)
  is a multiple of `VECTOR_ALIGN_BYTES`, and small enough that the float32 tiles a kernel keeps live fit half the
  unified buffer (`UB_BYTES`; the compiler double-buffers by default).

The porting rules, from Triton-Ascend's documentation (gitcode.com/Ascend/triton-ascend, docs/en/migration_guide/
migrate_from_gpu.md and docs/en/programming_guide/index.md, read 2026-12-02):
  - grid: prefer 1-D (a 2-D grid is merged into 1-D); programs beyond the physical core count are dispatched in
    further rounds, at a cost: fix the grid to the vector-core count for vector-only operators and loop inside;
  - `coreDim` (the number of programs) cannot exceed UINT16_MAX = 65535 ("coreDim=... can't be greater than
    UINT16_MAX");
  - vector operators: 32-byte aligned memory access (the UB pads a tail axis to 32 bytes);
  - the unified buffer of Atlas A2 is 192 KB (1572864 bits, the figure of the "ub overflow" error), halved by the
    default double buffering.
The core counts are read at run time from Triton-Ascend's driver (`vector_cores`); `ASCEND_VECTOR_CORES` holds the
counts of the devices this was sized for, for the unit test and as the documented fallback. None of this has run on
an NPU: the grids and tiles satisfy the documented rules (tests/unit/test_kernel_launch.py), but whether the
compiler accepts the kernels (UB use of the scan's `associative_scan`, int64 offsets) is unverified until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

MAX_CORE_DIM = 65535  # Triton-Ascend: coreDim <= UINT16_MAX
VECTOR_ALIGN_BYTES = 32  # Triton-Ascend: vector operators access memory in 32-byte units
UB_BYTES = 192 * 1024  # unified buffer per core, Atlas A2 / A3 (Triton-Ascend's programming guide)
NPU_MIN_BLOCK = 32  # a tile of 1-byte elements (bool masks) is then 32 bytes

# Vector cores per device (an AI Core is one cube core and two vector cores). Sources: Triton-Ascend's programming
# guide (the 1:2 pairing; `driver.active.utils.get_device_properties(device)["num_vectorcore"]`), CANN's ATC
# documentation (`--aicore_num`: a platform_config ini of 24 cube and 48 vector cores), vllm-ascend's Triton
# kernels ("40 on 910B3"). Atlas A3's Ascend910_93 is seen as two devices, 24 AI Cores each.
ASCEND_VECTOR_CORES: Dict[str, int] = {
    "Atlas A2 (Ascend910B1 / 910B2, 24 AI Cores)": 48,
    "Atlas A2 (Ascend910B3 / 910B4, 20 AI Cores)": 40,
    "Atlas A3 (Ascend910_93, per device, 24 AI Cores)": 48,
}


@dataclass(frozen=True)
class Launch:
    programs: int  # the 1-D grid
    block: int  # BLOCK_T, positions per tile
    tasks: int  # what the programs loop over


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_block(length: int, cap: int, live_tiles: int, npu: bool) -> int:
    """Positions per tile: a power of two, at most `cap` and the row length rounded up, at least 16 (32 on NPU:
    `NPU_MIN_BLOCK`); on NPU also at most what lets `live_tiles` float32 tiles fit half the unified buffer."""
    floor = NPU_MIN_BLOCK if npu else 16
    block = max(floor, min(int(cap), _pow2_at_least(max(1, int(length)))))
    if npu:
        while block > floor and live_tiles * block * 4 > UB_BYTES // 2:
            block //= 2
    return block


def launch(tasks: int, length: int, cap: int, live_tiles: int, device_type: str, vector_cores: int = 0) -> Launch:
    """The grid and tile of a kernel over `tasks` tasks of rows `length` long (module docstring). `vector_cores`:
    the NPU's count (`vector_cores(device)`), unused elsewhere."""
    npu = device_type == "npu"
    block = tile_block(length, cap, live_tiles, npu)
    if npu:
        if vector_cores < 1:
            raise ValueError(f"launch on an NPU needs its vector-core count; got {vector_cores}")
        programs = min(tasks, vector_cores, MAX_CORE_DIM)
    else:
        programs = tasks
    return Launch(programs=max(programs, 0), block=block, tasks=tasks)


def vector_cores(device) -> int:
    """The vector-core count of an NPU `device`, from Triton-Ascend's driver (0 for any other device)."""
    if getattr(device, "type", str(device)) != "npu":
        return 0
    import triton

    index = device.index if getattr(device, "index", None) is not None else 0
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["num_vectorcore"])
