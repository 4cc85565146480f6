"""The shell examples: valid bash, launch variables checked, and every posttrain flag they pass accepted by
the real parser (the launcher is replaced by a stub that records its command line)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_llm.arguments import parse_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "examples").rglob("*.sh"))
# launcher -> (its stage, the nodes it is checked on: a multiple of its TP x PP devices at 8 per node)
LAUNCHERS = {
    "examples/mcore/llama32/trl_ppo_llama32_1b.sh": ("trl_ppo", 2),
    "examples/mcore/qwen25/grpo_qwen25_7b.sh": ("grpo", 2),
    "examples/mcore/qwen25/ppo_qwen25_32b.sh": ("trl_ppo", 4),
}
GRPO_7B = "examples/mcore/qwen25/grpo_qwen25_7b.sh"
LAUNCH_VARIABLES = ("NNODES", "NPUS_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CURRENT_IP", "TP", "PP")

STUB = """import json, sys
with open(sys.argv[1], "w") as f:
    json.dump(sys.argv[2:], f)
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _launch(tmp_path, script, **env):
    """Runs `script` with the launch variables of `env` only (none inherited from this shell)."""
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    record = tmp_path / "argv.json"
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    full_env = dict(base, PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=str(tmp_path / "run.log"), **env)
    result = subprocess.run(["bash", str(ROOT / script)], cwd=tmp_path, env=full_env, capture_output=True, text=True)
    return result, record


@pytest.mark.parametrize("script", LAUNCHERS)
def test_launcher_flags_parse(tmp_path, script):
    stage, nodes = LAUNCHERS[script]
    result, record = _launch(tmp_path, script, NPUS_PER_NODE="8", NNODES=str(nodes), NODE_RANK="0",
                             MASTER_ADDR="10.0.0.1", CURRENT_IP="10.0.0.1")
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert argv[:3] == ["-m", "torch.distributed.run", "--nproc_per_node"]
    assert argv[argv.index("--nnodes") + 1] == str(nodes) and argv[argv.index("--node_rank") + 1] == "0"
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.1"
    posttrain = argv[argv.index("posttrain_gpt.py") + 1:]
    args = parse_args(posttrain, world_size=8 * nodes)
    assert args.stage == stage


def test_other_nodes_launch_with_their_node_rank(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                             CURRENT_IP="10.0.0.2")
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("--node_rank") + 1] == "1"


def test_multinode_with_localhost_master_is_refused(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="0", MASTER_ADDR="localhost")
    assert result.returncode == 2 and not record.exists()
    assert "MASTER_ADDR=localhost" in result.stderr and "every node can reach" in result.stderr


def test_multinode_needs_a_master_addr(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="0")
    assert result.returncode == 2 and not record.exists()
    assert "MASTER_ADDR is not set" in result.stderr and "NODE_RANK=1" in result.stderr


@pytest.mark.parametrize("extra", [{}, {"CURRENT_IP": "10.0.0.1"}, {"CURRENT_IP": "10.0.0.2"}])
def test_every_node_needs_a_node_rank(tmp_path, extra):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", MASTER_ADDR="10.0.0.1", **extra)
    assert result.returncode == 2 and not record.exists()
    assert "NODE_RANK is not set" in result.stderr and "0 on the master node" in result.stderr


def test_the_32b_launcher_is_multinode_by_default(tmp_path):
    result, record = _launch(tmp_path, "examples/mcore/qwen25/ppo_qwen25_32b.sh", MASTER_ADDR="10.0.0.1")
    assert result.returncode == 2 and not record.exists()
    assert "NNODES=4 but NODE_RANK is not set" in result.stderr


@pytest.mark.parametrize("node_rank, current_ip, message", [
    ("2", None, "NODE_RANK=2 is out of range for NNODES=2"),
    ("one", None, "NODE_RANK=one must be a whole number"),
    ("1", "10.0.0.1", "it needs NODE_RANK=0"),
    ("0", "10.0.0.2", "NODE_RANK=0 belongs to the master node"),
])
def test_wrong_node_ranks_are_refused(tmp_path, node_rank, current_ip, message):
    extra = {"CURRENT_IP": current_ip} if current_ip else {}
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK=node_rank, MASTER_ADDR="10.0.0.1", **extra)
    assert result.returncode == 2 and not record.exists()
    assert message in result.stderr
