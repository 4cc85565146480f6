"""MindSpeed-LLM / MindSpeed-RL's published conversion scripts (tests/fixtures/mindspeed_llm, verbatim) run on tiny
models: `rewrite` substitutes only paths and parallel sizes and drops the Ascend `source ...set_env.sh` line;
`recorded_command` runs the rewritten script with bash and a stub `python` that records its command line (the
conversion then runs in-process through `convert_cli`); `write_peft_adapter` makes the LoRA adapter the merge
scripts load."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mindspeed_llm"
# What a rewrite may substitute: the paths, and the parallel sizes a tiny model cannot take.
PATH_FLAGS = ("--load-dir", "--save-dir", "--tokenizer-model", "--hf-cfg-dir", "--lora-load")
SIZE_FLAGS = ("--target-tensor-parallel-size", "--target-pipeline-parallel-size", "--target-expert-parallel-size")
CONVERTERS = ("convert_ckpt.py", "convert_ckpt_v2.py")

STUB = """import json, sys
with open(sys.argv[1], "w") as f:
    json.dump(sys.argv[2:], f)
"""


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def rewrite(text: str, **values) -> str:
    """`text` with the values of the flags named in `values` (load_dir="...", target_tensor_parallel_size=2)
    replaced, and the `source /usr/local/Ascend/...` line dropped; anything else stays as published."""
    out = [line for line in text.splitlines() if not line.strip().startswith("source /usr/local/Ascend/")]
    text = "\n".join(out) + "\n"
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if flag not in PATH_FLAGS + SIZE_FLAGS:
            raise ValueError(f"{flag}: a rewrite substitutes paths and parallel sizes only")
        text, n = re.subn(rf"(?<!\S){re.escape(flag)}\s+\S+", f"{flag} {shlex.quote(str(value))}", text)
        if n != 1:
            raise ValueError(f"{flag} appears {n} times in the script")
    return text


def recorded_command(text: str, tmp: Path) -> List[str]:
    """Runs `text` with bash, `python` on PATH being a stub that records its arguments; returns the
    converter's arguments (after `convert_ckpt.py` / `convert_ckpt_v2.py`, whichever folder the script names)."""
    tmp.mkdir(parents=True, exist_ok=True)
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp / "stub.py").write_text(STUB)
    record = tmp / "argv.json"
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp / 'stub.py'))} "
                      f"{shlex.quote(str(record))} \"$@\"\n")
    python.chmod(0o755)
    script = tmp / "script.sh"
    script.write_text(text)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert os.path.basename(argv[0]) in CONVERTERS, argv[0]
    return argv[1:]


def write_peft_adapter(hf_dir, out, r: int = 8, alpha: float = 16, seed: int = 0,
                       targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    """A PEFT LoRA folder for the Hugging Face model in `hf_dir` (random A and B on every `targets` linear of every
    layer); returns {HF weight name: (A, B)}."""
    from tests.helpers.convert_checks import hf_tensors

    gen = torch.Generator().manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: Dict[str, torch.Tensor] = {}
    pairs = {}
    for name, weight in sorted(hf_tensors(hf_dir).items()):
        module = name[:-len(".weight")]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        a = torch.randn(r, weight.shape[1], generator=gen) * 0.1
        b = torch.randn(weight.shape[0], r, generator=gen) * 0.1
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        pairs[name] = (a, b)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0,
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(hf_dir)}))
    return pairs
