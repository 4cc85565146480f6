"""An offline wandb run's files read back with wandb's own reader (`wandb leet inspect --json` on the run's .wandb
transaction log), and the comparison of a logged value with the metrics JSONL's (tests/unit/test_wandb.py,
tests/dist/test_stages_wandb.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def inspect(save_dir: Path, *options) -> str:
    """`wandb leet inspect --json [--summary]` of the one offline run under `save_dir` (--wandb-save-dir)."""
    runs = sorted((Path(save_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *options, str(runs[0])],
                          check=True, capture_output=True, text=True, timeout=120).stdout


def records(save_dir: Path) -> list:
    """The records of the run's .wandb log, one JSON object a line (run, history, summary, exit, ...)."""
    return [json.loads(line) for line in inspect(save_dir).splitlines() if line.strip()]


def history(run_records: list) -> dict:
    """{step: the metrics logged at it, without wandb's own `_` keys}."""
    return {r["history"]["step"]["num"]: {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            for r in run_records if r["type"] == "history"}


def state(save_dir: Path):
    """(state, exit code) of the run: ("finished", 0), ("failed", 1), ..."""
    summary = json.loads(inspect(save_dir, "--summary"))
    return summary["state"], summary["exit_code"]


def same(jsonl_value, wandb_value) -> bool:
    """Whether wandb holds the JSONL's value: equal numbers (the reader prints a whole float as 13, the JSONL as
    13.0), bools as bools, and a JSONL null (a non-finite float there) as wandb's NaN / Infinity."""
    if jsonl_value is None:
        return wandb_value in ("NaN", "Infinity", "-Infinity") or (
            isinstance(wandb_value, float) and not math.isfinite(wandb_value))
    if isinstance(jsonl_value, bool) or isinstance(wandb_value, bool):
        return jsonl_value is wandb_value
    return jsonl_value == wandb_value


def differences(jsonl_rows: list, logged: dict) -> dict:
    """{iteration: what differs} between the JSONL's rows and wandb's history (`history`); {} when they agree."""
    found = {}
    for row in jsonl_rows:
        expected = {k: v for k, v in row.items() if k != "iteration"}
        got = logged.get(row["iteration"], {})
        wrong = {k: (expected.get(k), got.get(k)) for k in set(expected) | set(got)
                 if k not in expected or k not in got or not same(expected[k], got[k])}
        if wrong:
            found[row["iteration"]] = wrong
    return found
