"""The built-in ``python`` tool: runs the model's code in a sandboxed interpreter and returns what it printed.

Each call runs ``python -I -c <preamble> <code>`` inside the sandbox of `sandbox.py` / `sandbox_child.py`, built
from the kernel's own mechanisms (the guarantees, and what is not stopped: docs/multi_turn.md, "Sandbox"):

- user, PID, network and mount namespaces: the call sees only its own processes (a fresh ``/proc``), has no
  network device, and its scratch directory is a ``tmpfs`` of ``max_file_mb`` (the working directory, ``HOME``
  and ``TMPDIR``), gone with the call;
- Landlock: reads and executes only the interpreter's prefixes and the system's program and library folders,
  writes only the scratch directory, no TCP (ABI >= 4), no signal or abstract unix socket outside the call
  (ABI >= 6); a seccomp filter refuses unix sockets (``socket(AF_UNIX)``) and ``io_uring``;
- resource limits: at most ``max_processes`` processes (``RLIMIT_NPROC``; as root the code runs as ``nobody``,
  which the limit binds), and per process ``memory_mb`` of address space, CPU seconds and file size;
- a keeper, PID 1 of the call's namespace, that stops the call at ``timeout`` seconds, or when its processes
  together hold more than ``memory_mb`` or use more than ``timeout`` + 1 CPU seconds, and whose exit makes the
  kernel kill and reap every process the call started (background, new-session and double-forked ones too);
- an environment stripped to ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and ``OMP_NUM_THREADS`` (``-I``: no user
  site-packages, no ``PYTHON*`` variables); ``socket.socket`` raises a friendly error (the kernel blocks the rest).

Which layers are active is probed once and said at start-up; without the namespaces or Landlock the tool is
refused unless its config says ``unconfined: true``.

stdout and stderr go, interleaved, to an anonymous file (bounded by the file-size limit, never to memory) and
come back truncated to ``max_output_chars``. A traceback shows the model's code as ``<tool>``, without the
preamble's frame.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Dict, Mapping, Optional

from mindspeed_llm.rl.tools.base import ToolTimeout
from mindspeed_llm.rl.tools.sandbox import DEFAULTS, PythonToolConfigError, check_config, isolation_note, run_sandboxed

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

__all__ = ["DEFAULTS", "PYTHON_SCHEMA", "PythonTool", "PythonToolConfigError", "run_python"]


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... [output truncated to {max_chars} characters]"


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               max_file_mb: int = 16, max_processes: int = 16, unconfined: bool = False) -> str:
    """What ``code`` printed (stdout and stderr), with a note on a non-zero exit or a call-wide limit; ToolTimeout,
    whose message holds the output so far, when it runs over ``timeout`` seconds. PythonToolConfigError where this
    kernel cannot confine it and ``unconfined`` is not set."""
    isolation_note(check_config({"timeout": timeout, "memory_mb": memory_mb, "max_output_chars": max_output_chars,
                                 "max_file_mb": max_file_mb, "max_processes": max_processes,
                                 "unconfined": unconfined}))
    started = time.monotonic()
    text, outcome, _ = run_sandboxed(code, timeout, memory_mb, max_file_mb, max_processes,
                                     read_limit=4 * max_output_chars + 1024)
    text = _truncate(text, max_output_chars)
    result = outcome["result"]
    if result == "timeout":
        raise ToolTimeout(f"{text}\nerror: the code ran longer than {timeout:g} s and was stopped".lstrip("\n"))
    if result == "signal":
        number = outcome["signal"]
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        text += f"\nerror: the process was killed by signal {name} after {time.monotonic() - started:.1f} s"
    elif result == "memory":
        text += (f"\nerror: the code's processes together held {outcome['bytes'] / 2 ** 20:.0f} MB, over the "
                 f"tool's memory_mb {memory_mb}, and were stopped")
    elif result == "cpu":
        text += f"\nerror: the code's processes together used {outcome['seconds']:.1f} CPU seconds and were stopped"
    elif result == "error":
        text += f"\nerror: {outcome['error']}"
    elif outcome["code"] != 0 and not text.strip():
        text = f"error: exit status {outcome['code']}"
    return text if text.strip() else "(no output)"


class PythonTool:
    """``python(code)``: the code's printed output. Config keys (tool config ``config:``, each checked here):
    ``timeout`` (seconds), ``memory_mb``, ``max_output_chars``, ``max_file_mb``, ``max_processes``,
    ``unconfined``. ``startup_note`` names the sandbox's active layers. Stateless: shared by all trajectories."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, tool_schema: Optional[Dict[str, Any]] = None):
        self.config = check_config(config)
        self.startup_note = isolation_note(self.config)
        self.tool_schema = tool_schema or PYTHON_SCHEMA
        self.name = self.tool_schema["function"]["name"]

    def execute(self, parameters: Mapping[str, Any], row: Mapping[str, Any]) -> str:
        code = parameters.get("code")
        if not isinstance(code, str):
            return 'error: give the code as a string argument: {"code": "print(1 + 1)"}'
        return run_python(code, **self.config)
