"""rl/tools/python_exec.py: the python tool's output, scratch directory, environment, time and memory limits, and
its best-effort network block. Each test starts `python -I -c` children (about 50 ms each)."""

import os
import time

import pytest

from mindspeed_llm.rl.tools import PythonTool, ToolTimeout, run_python


def test_output_stdout_and_stderr_interleaved():
    assert run_python("print(6 * 7)") == "42\n"
    out = run_python("import sys\nprint('a')\nsys.stdout.flush()\nprint('b', file=sys.stderr)")
    assert out == "a\nb\n"
    assert run_python("x = 1") == "(no output)"


def test_traceback_shows_the_code_not_the_preamble():
    out = run_python("def f():\n    return 1 / 0\nf()")
    assert 'File "<tool>", line 2, in f' in out and "ZeroDivisionError: division by zero" in out
    assert "exec(_code" not in out and '"<string>"' not in out


def test_exit_status_without_output():
    assert run_python("raise SystemExit(3)") == "error: exit status 3"


def test_runs_in_a_fresh_scratch_directory_that_is_deleted():
    out = run_python("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.environ['HOME'])")
    cwd, home = out.split()
    assert cwd == home and os.path.basename(cwd).startswith("mindspeed_python_tool_")
    assert not os.path.exists(cwd)
    assert run_python("import os\nprint(os.path.exists('f.txt'))") == "False\n"


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    out = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
    assert "SECRET_TOKEN" not in out and "'PATH'" in out and out.strip().endswith("1")


def test_timeout_stops_the_code_and_raises_tool_timeout_with_the_output_so_far():
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match=r"(?s)before.*ran longer than 0.5 s") as caught:
        run_python("import sys, time\nprint('before')\nsys.stdout.flush()\ntime.sleep(30)", timeout=0.5)
    assert time.monotonic() - started < 5
    assert "before" in str(caught.value)


def test_timeout_also_kills_the_codes_children():
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(p.pid, flush=True)\n"
            "p.wait()")
    with pytest.raises(ToolTimeout) as caught:  # 3 s: the child and its child start in time on a loaded machine
        run_python(code, timeout=3.0)
    pid = int(str(caught.value).split()[0])
    deadline = time.monotonic() + 5.0  # the kill is sent; the process leaves once it is scheduled
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper, as under a container's init that does not reap, is dead)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_memory_limit():
    out = run_python("x = bytearray(400 * 2 ** 20)\nprint('allocated')", memory_mb=128)
    assert "MemoryError" in out and "allocated" not in out
    assert run_python("x = bytearray(20 * 2 ** 20)\nprint('allocated')", memory_mb=256) == "allocated\n"


def test_socket_is_blocked():
    for code in ("import socket\nsocket.socket()",
                 "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)",
                 "import _socket\n_socket.socket()"):
        out = run_python(code)
        assert "PermissionError: network access is disabled in the python tool" in out, code


def test_output_is_truncated():
    out = run_python("print('x' * 10000)", max_output_chars=100)
    assert out == "x" * 100 + "\n... [output truncated to 100 characters]"


def test_tool_wrapper_config_and_arguments():
    tool = PythonTool(config={"timeout": 3, "type": "native"})
    assert tool.name == "python" and tool.config["timeout"] == 3
    assert tool.execute({"code": "print('hi')"}, {}) == "hi\n"
    assert tool.execute({}, {}).startswith("error: give the code")
    with pytest.raises(ValueError, match="unknown config key"):
        PythonTool(config={"mem": 1})
