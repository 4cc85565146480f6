"""The built-in ``python`` tool: runs the model's code in a separate interpreter and returns what it printed.

Each call runs ``python -I -c <preamble> <code>``:

- in a fresh scratch directory (the working directory, ``HOME`` and ``TMPDIR``), deleted afterwards;
- with an environment stripped to ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and ``OMP_NUM_THREADS`` (``-I``: no
  user site-packages, no ``PYTHON*`` variables, the current folder not on ``sys.path``);
- under a wall-clock timeout: the child's whole process group is killed when it runs over, so a timed-out call
  ends here even though the executor's thread that waits for it cannot be killed;
- under limits set by the preamble with ``resource.setrlimit`` before the code runs: address space
  (``RLIMIT_AS``, the memory limit), CPU seconds, size of written files, no core files. They are set in the child
  itself and not in ``preexec_fn``, which Python documents as unsafe in a threaded parent (the executor's pool);
- without network, best effort: the preamble replaces ``socket.socket``, ``socket.create_connection`` and
  ``_socket.socket`` with functions that raise. Code that reaches the OS another way (``ctypes``, ``os.system``
  of a network tool) is not stopped: this is not a kernel sandbox; use a container for untrusted code at scale.

stdout and stderr go, interleaved, to an anonymous file (bounded by the written-file limit, never to memory) and
come back truncated to ``max_output_chars``. A traceback shows the model's code as ``<tool>``, without the
preamble's frame.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Mapping, Optional

from mindspeed_llm.rl.tools.base import ToolTimeout

PYTHON_SCHEMA: Dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a fresh interpreter and return what it prints (stdout and stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run; print the results."}},
            "required": ["code"],
        },
    },
}

DEFAULTS = {"timeout": 5.0, "memory_mb": 512, "max_output_chars": 4000, "max_file_mb": 16}

# argv: [-c, code, memory bytes, cpu seconds, file bytes]
_PREAMBLE = r"""
import resource, sys, traceback
def _limit(kind, value):
    resource.setrlimit(kind, (value, value))
_limit(resource.RLIMIT_AS, int(sys.argv[2]))
_limit(resource.RLIMIT_CPU, int(sys.argv[3]))
_limit(resource.RLIMIT_FSIZE, int(sys.argv[4]))
_limit(resource.RLIMIT_CORE, 0)
import socket, _socket
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the python tool")
socket.socket = socket.create_connection = socket.socketpair = _socket.socket = _no_network
_code = compile(sys.argv[1], "<tool>", "exec")
del sys.argv[1:], _limit, _no_network, resource, socket, _socket
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException:
    _type, _value, _tb = sys.exc_info()
    traceback.print_exception(_type, _value, _tb.tb_next)
    sys.exit(1)
"""


def _minimal_env(scratch: str) -> Dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... [output truncated to {max_chars} characters]"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: this takes its children too
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               max_file_mb: int = 16) -> str:
    """What ``code`` printed (stdout and stderr), with a note on a non-zero exit; ToolTimeout, whose message holds
    the output so far, when it runs over ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="mindspeed_python_tool_") as scratch, tempfile.TemporaryFile() as out:
        limits = [str(int(memory_mb) * 2 ** 20), str(int(timeout) + 1), str(int(max_file_mb) * 2 ** 20)]
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _PREAMBLE, code, *limits], cwd=scratch, env=_minimal_env(scratch),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        started = time.monotonic()
        try:
            returncode = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode, timed_out = proc.returncode, True
        out.seek(0)
        text = _truncate(out.read(4 * max_output_chars + 1024).decode("utf-8", errors="replace"), max_output_chars)
    if timed_out:
        raise ToolTimeout(f"{text}\nerror: the code ran longer than {timeout:g} s and was stopped".lstrip("\n"))
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        text += f"\nerror: the process was killed by signal {name} after {time.monotonic() - started:.1f} s"
    elif returncode != 0 and not text.strip():
        text = f"error: exit status {returncode}"
    return text if text.strip() else "(no output)"


class PythonTool:
    """``python(code)``: the code's printed output. Config keys (tool config ``config:``): ``timeout`` (seconds),
    ``memory_mb``, ``max_output_chars``, ``max_file_mb``. Stateless: shared by all trajectories."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Optional[Dict[str, Any]] = None):
        unknown = sorted(set(config or {}) - set(DEFAULTS) - {"type"})  # `type: native` is verl's marker
        if unknown:
            raise ValueError(f"python tool: unknown config key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
        self.config = {**DEFAULTS, **{k: v for k, v in (config or {}).items() if k in DEFAULTS}}
        self.tool_schema = tool_schema or PYTHON_SCHEMA
        self.name = self.tool_schema["function"]["name"]

    def execute(self, parameters: Mapping[str, Any], row: Mapping[str, Any]) -> str:
        code = parameters.get("code")
        if not isinstance(code, str):
            return 'error: give the code as a string argument: {"code": "print(1 + 1)"}'
        return run_python(code, **self.config)
