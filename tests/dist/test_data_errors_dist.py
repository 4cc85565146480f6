"""preprocess_data.py as a process of its own on bad input: its exit status and one-line message, no traceback.
The errors in this process: tests/unit/test_data_errors.py.
"""

import subprocess
import sys


from tests.helpers.fixtures_data import DEEPSCALER, ROOT



R1 = "R1AlpacaStyleInstructionHandler"


def test_cli_subprocess_exit_status_and_message(tmp_path):
    """A real process: non-zero exit, one clear line naming the valid handlers, no traceback."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "preprocess_data.py"), "--input", str(DEEPSCALER), "--tokenizer-name-or-path",
         str(tmp_path), "--output-prefix", str(tmp_path / "d"), "--handler-name", "Nope"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown --handler-name 'Nope'" in proc.stderr and R1 in proc.stderr
