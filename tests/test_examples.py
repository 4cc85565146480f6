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
LAUNCHERS = ["examples/mcore/llama32/trl_ppo_llama32_1b.sh", "examples/mcore/qwen25/grpo_qwen25_7b.sh"]

STUB = """import json, sys
with open(sys.argv[1], "w") as f:
    json.dump(sys.argv[2:], f)
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _launch(tmp_path, script, **env):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    record = tmp_path / "argv.json"
    full_env = dict(os.environ, PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=str(tmp_path / "run.log"),
                    **env)
    result = subprocess.run(["bash", str(ROOT / script)], cwd=tmp_path, env=full_env, capture_output=True, text=True)
    return result, record


@pytest.mark.parametrize("script", LAUNCHERS)
def test_launcher_flags_parse(tmp_path, script):
    result, record = _launch(tmp_path, script, NPUS_PER_NODE="8", NNODES="2", MASTER_ADDR="10.0.0.1",
                             CURRENT_IP="10.0.0.1")
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert argv[:3] == ["-m", "torch.distributed.run", "--nproc_per_node"]
    assert "--nnodes" in argv and argv[argv.index("--node_rank") + 1] == "0"
    posttrain = argv[argv.index("posttrain_gpt.py") + 1:]
    args = parse_args(posttrain, world_size=16)
    assert args.stage in script


def test_multinode_with_localhost_master_is_refused(tmp_path):
    result, record = _launch(tmp_path, LAUNCHERS[1], NNODES="2", MASTER_ADDR="localhost")
    assert result.returncode == 2 and not record.exists()
    assert "MASTER_ADDR=localhost" in result.stderr and "every node can reach" in result.stderr


def test_other_nodes_need_a_node_rank(tmp_path):
    result, _ = _launch(tmp_path, LAUNCHERS[1], NNODES="2", MASTER_ADDR="10.0.0.1", CURRENT_IP="10.0.0.2")
    assert result.returncode == 2 and "NODE_RANK" in result.stderr
