"""The launch grids and tiles of the Triton scan and loss kernels (mindspeed_llm/kernels/launch.py) against
Triton-Ascend's porting rules, for the vector-core counts of Atlas A2 / A3 (`launch.ASCEND_VECTOR_CORES`): a 1-D grid of
at most the core count and never more than coreDim 65535 programs, whose strided loops visit every task exactly once;
tiles that are whole 32-byte units for every element size the kernels read and whose live float32 tiles fit half the
192 KB unified buffer. On CUDA the grid stays one program per task. (Whether Triton-Ascend compiles and runs the
kernels is unverified until they run on an NPU; the loops themselves run under TRITON_INTERPRET=1 in
tests/dist/test_triton_rl_math.py.)"""

from __future__ import annotations

import types

import pytest

from mindspeed_llm.kernels import launch as L

# (tasks, row length): rows of the scans / (row, block) tasks of the losses, from one row to more than coreDim allows
SHAPES = [(1, 1), (3, 37), (47, 1030), (48, 4096), (49, 8192), (512, 16384), (70000, 300), (200000, 64)]
ELEMENT_SIZES = (1, 2, 4)  # bool masks read as bytes, bf16 / fp16, fp32


def _kernels_live_tiles():
    pytest.importorskip("triton")
    from mindspeed_llm.kernels import triton_rl_losses, triton_scans

    return {"scans": triton_scans.LIVE_TILES, "policy loss": triton_rl_losses.POLICY_LIVE_TILES,
            "value loss": triton_rl_losses.VALUE_LIVE_TILES}


def test_the_core_counts_are_written_once_with_their_devices():
    assert set(L.ASCEND_VECTOR_CORES.values()) == {40, 48}
    assert any("A2" in name for name in L.ASCEND_VECTOR_CORES) and any("A3" in name for name in L.ASCEND_VECTOR_CORES)
    assert L.MAX_CORE_DIM == 2 ** 16 - 1 and L.VECTOR_ALIGN_BYTES == 32 and L.UB_BYTES == 192 * 1024


@pytest.mark.parametrize("device", sorted(L.ASCEND_VECTOR_CORES))
def test_npu_launches_follow_triton_ascends_rules(device):
    cores = L.ASCEND_VECTOR_CORES[device]
    for kernel, live in _kernels_live_tiles().items():
        for tasks, length in SHAPES:
            plan = L.launch(tasks, length, 1024, live, "npu", cores)
            case = (device, kernel, tasks, length, plan)
            assert 1 <= plan.programs <= min(tasks, cores, L.MAX_CORE_DIM), case
            # the programs' strided loops (range(pid, tasks, programs)) visit each task once
            visits = [0] * tasks
            for pid in range(plan.programs):
                for task in range(pid, tasks, plan.programs):
                    visits[task] += 1
            assert set(visits) == {1}, case
            assert plan.block & (plan.block - 1) == 0, case  # a power of two (tl.arange)
            assert all(plan.block * size % L.VECTOR_ALIGN_BYTES == 0 for size in ELEMENT_SIZES), case
            assert live * plan.block * 4 <= L.UB_BYTES // 2, case  # double-buffered unified buffer


def test_cuda_keeps_one_program_per_task_and_its_tiles():
    for tasks, length in SHAPES:
        plan = L.launch(tasks, length, 1024, 32, "cuda")
        assert plan.programs == tasks
        assert plan.block == max(16, min(1024, 1 << max(0, length - 1).bit_length()))  # as before the NPU rules


def test_the_kernels_launch_through_the_plan_on_an_npu(monkeypatch):
    """The scan and loss wrappers size their grid from the device's vector cores (Triton-Ascend's driver, stubbed)."""
    _kernels_live_tiles()
    from mindspeed_llm.kernels import triton_rl_losses, triton_scans

    npu = types.SimpleNamespace(type="npu", index=0)
    for module in (triton_scans, triton_rl_losses):
        monkeypatch.setattr(module, "vector_cores", lambda device: 48)
    assert triton_scans._launch_for(npu, 512, 8192, None, None) == (48, 1024)
    assert triton_scans._launch_for(npu, 5, 8192, None, None) == (5, 1024)
    programs, block, n_blocks, tasks = triton_rl_losses._launch_for(npu, 64, 8192, triton_rl_losses.POLICY_LIVE_TILES,
                                                                    None)
    assert (programs, tasks) == (48, 64 * n_blocks) and n_blocks * block >= 8192 > (n_blocks - 1) * block
    assert triton_rl_losses.POLICY_LIVE_TILES * block * 4 <= L.UB_BYTES // 2
    cpu = types.SimpleNamespace(type="cpu", index=None)
    assert triton_scans._launch_for(cpu, 512, 8192, None, None) == (512, 1024)  # one program per row off the NPU
    with pytest.raises(ValueError, match="vector-core count"):
        L.launch(4, 16, 1024, 16, "npu", 0)
