"""Count the suite: collected test ids (pytest --collect-only) and static checks (AST) per test file and in total.

A check is an `assert` statement, a `pytest.raises` / `pytest.warns` use (call or `with`), or a call whose name
starts with `assert` (`torch.testing.assert_close`, `np.testing.assert_array_equal`, `self.assertEqual`, a
helper named `assert_*`). Counted in every .py file under tests/ (helper modules and conftest included), so
moving tests or helpers between files keeps the totals. Used to show that a reorganisation of the tree kept
every test and every check:

    python scripts/count_tests.py                 # table
    python scripts/count_tests.py --json out.json # and the numbers as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _call_name(node: ast.AST) -> str:
    """The last part of a call's dotted name (`torch.testing.assert_close` -> `assert_close`)."""
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def count_checks(source: str) -> int:
    checks = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            checks += 1
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name.startswith("assert") or name in ("raises", "warns"):
                checks += 1
    return checks


def collected_ids(tests: Path) -> Counter:
    """{test file path relative to the repo root: number of collected ids}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(tests.relative_to(ROOT))], cwd=ROOT, env=env, capture_output=True, text=True)
    ids = Counter()
    for line in out.stdout.splitlines():
        if "::" in line and not line.startswith(" "):
            ids[line.split("::", 1)[0]] += 1
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"pytest --collect-only exited {out.returncode}")
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", default=str(ROOT / "tests"), help="the test folder (default: tests/)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    tests = Path(args.tests).resolve()
    ids = collected_ids(tests)
    checks = {str(p.relative_to(ROOT)): count_checks(p.read_text()) for p in sorted(tests.rglob("*.py"))}
    files = sorted(set(ids) | set(checks))
    width = max(len(f) for f in files)
    print(f"{'file':<{width}}  {'ids':>5}  {'checks':>6}")
    for f in files:
        print(f"{f:<{width}}  {ids.get(f, 0):>5}  {checks.get(f, 0):>6}")
    total = {"ids": sum(ids.values()), "checks": sum(checks.values()), "files": len(files),
             "test_files": sum(1 for f in files if Path(f).name.startswith("test_"))}
    print(f"{'total':<{width}}  {total['ids']:>5}  {total['checks']:>6}   ({total['test_files']} test files, "
          f"{total['files'] - total['test_files']} other modules)")
    if args.json:
        Path(args.json).write_text(json.dumps({"total": total, "ids": dict(ids), "checks": checks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
