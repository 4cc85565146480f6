"""preprocess_data.py's example script (its own process): it reads its YAML config, and refuses an unknown one.
The preprocessing itself: tests/unit/test_data_preprocess.py.
"""

import json
import os
import subprocess


from tests.helpers.fixtures_data import DEEPSCALER, ROOT, load_json_rows, qwen_tok_dir  # noqa: F401 (a fixture)

from mindspeed_llm.data import PromptDataset


def test_example_script_reads_yaml_config(qwen_tok_dir, tmp_path):
    """bash examples/data/preprocess_data.sh deepscaler, with the yaml's paths overridden by env vars."""
    env = dict(os.environ, INPUT=str(DEEPSCALER), TOKENIZER=str(qwen_tok_dir), OUTPUT_PREFIX=str(tmp_path / "ds"),
               WORKERS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", str(ROOT / "examples" / "data" / "preprocess_data.sh"), "deepscaler"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "kept 43 of 43 rows" in proc.stderr and "rows/s" in proc.stderr
    ds = PromptDataset(str(tmp_path / "ds"))
    assert [ds[i]["labels"] for i in range(len(ds))] == [r["answer"] for r in load_json_rows(DEEPSCALER)]
    assert ds.meta["prompt_type"] == "qwen_r1" and ds.meta["handler"] == "R1AlpacaStyleInstructionHandler"


def test_example_script_rejects_unknown_config(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "examples" / "data" / "preprocess_data.sh"), "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "deepscaler" in proc.stderr
