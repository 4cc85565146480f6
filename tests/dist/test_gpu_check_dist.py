"""scripts/gpu_check.sh and gpu_check.py as processes of their own on a machine without a GPU: the shell script's
refusal, the dry run's list of every step. Their parsing in this process: tests/unit/test_gpu_check.py.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.scripts import ROOT, has_cuda, load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check_script", ROOT / "scripts" / "gpu_check.py")


def test_gpu_check_sh_without_gpu(tmp_path):
    if shutil.which("nvidia-smi") and has_cuda():
        pytest.skip("a GPU is here: the script would run the whole check")
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("GPU_CHECK_ALLOW_CPU", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no GPU: nothing to check"), proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written to $OUT


def test_dry_run_lists_every_step(gpu_check):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "run", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in gpu_check.ORDER:
        assert f"[{name}]" in out, name
    commands = "\n".join(line for line in out.splitlines() if line.startswith("    $ "))
    assert "mindspeed_llm.demo.run --tiny --stage grpo" in commands
    assert "mindspeed_llm.demo.run --tiny --stage trl_ppo" in commands
    assert "--layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936" in commands
    assert commands.count("posttrain_gpt.py --stage") == 2 and commands.count(" --bf16 ") == 2
    assert commands.count("benchmarks/vs_trl.py --device cuda") == 5  # prepare + 2 stages x 2 dtypes
    assert "benchmarks/logprobs.py --device cuda --tokens 8192" in commands
    assert "benchmarks/attention.py --device cuda --seq 1024 2048 4096" in commands and " --check " in commands
    assert "expected in all" in out


def test_npu_check_sh_without_npu(tmp_path):
    """The NPU counterpart: the same refusal, exit status 3 and nothing written, where no Ascend NPU is."""
    if shutil.which("npu-smi"):
        pytest.skip("npu-smi is here: the script would run the NPU check")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "npu_check.sh")], cwd=ROOT,
                          env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no NPU: nothing to check"), proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_npu_check_dry_run_lists_every_step():
    npu_check = load_script("npu_check_script", ROOT / "scripts" / "npu_check.py")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "npu_check.py"), "run", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in npu_check.ORDER:
        assert f"[{name}]" in out, name
    commands = "\n".join(line for line in out.splitlines() if line.startswith("    $ "))
    assert "npu_check.py ops --json" in commands and "npu_check.py kernels --json" in commands
    assert commands.count("posttrain_gpt.py --stage") == 2 and commands.count(" --bf16 ") == 2
    assert "benchmarks/memory.py --device npu" in commands
