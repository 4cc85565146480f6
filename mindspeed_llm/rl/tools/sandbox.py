"""The python tool's sandbox, caller side: its config values, the isolation this kernel offers (probed once), the
refusal where it offers too little, and one sandboxed run (`sandbox_child.py` does the work in the child).

A call is confined by the kernel, not by checks in Python: user, PID, network and mount namespaces (a fresh
``/proc`` showing only the call's processes; no network device; a ``tmpfs`` of ``max_file_mb`` on the scratch
directory), Landlock (reads: the interpreter's prefixes and the system's program and library folders; writes: the
scratch directory; no TCP from ABI 4; no signal or abstract socket outside the call from ABI 6), a seccomp filter
(no unix socket, no io_uring), resource limits
(``RLIMIT_NPROC`` under an unprivileged uid, ``RLIMIT_AS`` / ``CPU`` / ``FSIZE`` per process) and a keeper process
(PID 1 of the call's namespace) that stops the call when all its processes together exceed ``memory_mb`` or
``timeout`` CPU seconds, and whose exit makes the kernel kill and reap every process the call started. Which of
these are active is said at start-up (`isolation_note`); without the namespaces or Landlock the tool is refused
unless its config says ``unconfined: true``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Tuple

from mindspeed_llm.errors import UserError

DEFAULTS: Dict[str, Any] = {"timeout": 5.0, "memory_mb": 512, "max_output_chars": 4000, "max_file_mb": 16,
                            "max_processes": 16, "unconfined": False}

# key: (kind, low, high, the allowed values in words)
_RANGES = {
    "timeout": (float, 0.0, 3600.0, "a number of seconds, 0 < timeout <= 3600"),
    "memory_mb": (int, 32, 1 << 20, "an integer number of MiB, 32 <= memory_mb <= 1048576"),
    "max_output_chars": (int, 1, 10 ** 8, "an integer, 1 <= max_output_chars <= 100000000"),
    "max_file_mb": (int, 1, 1 << 20, "an integer number of MiB, 1 <= max_file_mb <= 1048576"),
    "max_processes": (int, 1, 4096, "an integer, 1 <= max_processes <= 4096"),
}

_PYTHON_TOOL_NAMES = ("python", "mindspeed_llm.rl.tools.PythonTool", "mindspeed_llm.rl.tools.python_exec.PythonTool")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_NAMESPACES = "user, PID, network and mount namespaces"
_DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
_SYSTEM_READS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/ld.so.conf",
                 "/etc/ld.so.conf.d", "/etc/localtime"]

# argv: [-c, code, fd]; the limits, namespaces and Landlock are in place before this runs; a byte on fd tells the
# keeper that the code starts (its timeout counts from here, not from the interpreter's start-up)
PREAMBLE = r"""
import os, sys, traceback
os.write(int(sys.argv[2]), b"1")
os.close(int(sys.argv[2]))
import socket, _socket
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the python tool")
socket.socket = socket.create_connection = socket.socketpair = _socket.socket = _no_network
_code = compile(sys.argv[1], "<tool>", "exec")
del sys.argv[1:], _no_network, socket, _socket, os
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException:
    _type, _value, _tb = sys.exc_info()
    traceback.print_exception(_type, _value, _tb.tb_next)
    sys.exit(1)
"""


class PythonToolConfigError(UserError, ValueError):
    """A python tool config value out of range, or a kernel without the sandbox and no ``unconfined: true``."""


def check_config(config: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The tool's config with defaults, every value checked: PythonToolConfigError naming the key and its range."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(DEFAULTS) - {"type"})  # `type: native` is verl's marker
    if unknown:
        raise PythonToolConfigError(f"python tool: unknown config key(s) {', '.join(unknown)}; known: "
                                    f"{', '.join(DEFAULTS)}")
    checked = dict(DEFAULTS)
    for key, value in config.items():
        if key == "type":
            continue
        if key == "unconfined":
            if not isinstance(value, bool):
                raise PythonToolConfigError(f"python tool config unconfined: {value!r} must be true or false")
            checked[key] = value
            continue
        kind, low, high, words = _RANGES[key]
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if kind is int and isinstance(number, float) and number.is_integer():
            number = int(number)
        if number is None or (kind is int and not isinstance(number, int)) or not math.isfinite(number) \
                or not low <= number <= high or (key == "timeout" and number <= 0):
            raise PythonToolConfigError(f"python tool config {key}: {value!r} is out of range; give {words}")
        checked[key] = kind(number)
    return checked


def _read_paths() -> List[str]:
    """What the code may read and execute: the interpreter's prefixes (a venv and the python it came from) and the
    system's program and library folders; never ``/`` (an interpreter installed there gets the system folders)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(p for p in prefixes if os.path.realpath(p) != "/") + _SYSTEM_READS


def run_sandboxed(code: str, timeout: float, memory_mb: int, max_file_mb: int, max_processes: int,
                  read_limit: int, confine: bool = True,
                  call_cpu_seconds: Optional[float] = None) -> Tuple[str, Dict[str, Any], List[str]]:
    """Runs ``code`` in the sandbox: (its output, at most ``read_limit`` bytes decoded; the outcome record from
    the keeper; the layers the runner reported). The call's processes together get ``call_cpu_seconds`` of CPU
    (default: ``timeout`` + 1, each process the same by ``RLIMIT_CPU``). ``confine=False`` (tests) skips the
    namespaces and Landlock, as on a kernel without them."""
    with tempfile.TemporaryDirectory(prefix="mindspeed_python_tool_") as scratch, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as status, tempfile.TemporaryFile() as spec:
        cpu = max(1, math.ceil(timeout) + 1)
        record = {
            "code": code, "preamble": PREAMBLE, "scratch": scratch, "timeout": float(timeout),
            "caller": os.getpid(), "as_root": os.geteuid() == 0, "namespaces": confine, "landlock": confine,
            "status_fd": status.fileno(), "read_paths": _read_paths(), "device_paths": _DEVICES,
            "limits": {"memory": int(memory_mb) << 20, "cpu": cpu, "file": int(max_file_mb) << 20,
                       "call_cpu": cpu if call_cpu_seconds is None else call_cpu_seconds,
                       "disk": int(max_file_mb) << 20, "processes": int(max_processes)},
        }
        spec.write(json.dumps(record).encode())
        spec.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _CHILD, str(spec.fileno())], cwd=scratch, env=_minimal_env(scratch),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            pass_fds=(spec.fileno(), status.fileno()))
        try:  # the keeper ends the call at its deadline; this only guards against a launcher that hangs
            proc.wait(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
        out.seek(0)
        text = out.read(read_limit).decode("utf-8", errors="replace")
        status.seek(0)
        records = [json.loads(line) for line in status.read().decode().splitlines() if line.strip()]
    layers = next((r["layers"] for r in records if "layers" in r), [])
    error = next((r["error"] for r in records if "error" in r), None)
    outcome = next((r for r in records if "result" in r), None)
    if outcome is None:
        outcome = {"result": "error", "error": error or f"the sandbox's launcher ended with status {proc.returncode}"}
    return text, outcome, layers


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)  # the launcher, the holder and the keeper: the keeper's exit takes the rest
    except (ProcessLookupError, PermissionError):
        pass


def _minimal_env(scratch: str) -> Dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=None)
def isolation_layers() -> Tuple[str, ...]:
    """The layers a sandboxed call gets on this machine (one probe run, about 0.1 s, once per process)."""
    _, outcome, layers = run_sandboxed("pass", timeout=10.0, memory_mb=256, max_file_mb=1, max_processes=4,
                                       read_limit=4096)
    if outcome.get("result") != "exit" or outcome.get("code") != 0:
        return ()
    return tuple(layers)


def missing_layers(layers) -> List[str]:
    """What a confined call needs and this machine lacks: the namespaces and Landlock's file rules."""
    missing = [] if _NAMESPACES in layers else [_NAMESPACES + " (unprivileged user namespaces)"]
    if not any(layer.startswith("landlock ABI") for layer in layers):
        missing.append("Landlock (Linux >= 5.13 with landlock in the LSM list)")
    return missing


def isolation_note(config: Mapping[str, Any]) -> str:
    """The start-up line naming each active layer and the call's limits (``config``: `check_config`'s);
    PythonToolConfigError where a layer the sandbox needs is missing and the config does not say
    ``unconfined: true``."""
    unconfined = config["unconfined"]
    layers = isolation_layers()
    missing = missing_layers(layers)
    if missing and not unconfined:
        raise PythonToolConfigError(
            f"python tool: this kernel does not offer {' or '.join(missing)}, so model-written code would run "
            "unconfined (able to read and write the user's files, signal the trainer, reach the network); set "
            "`unconfined: true` in the python tool's config to run it anyway, or use a kernel with them "
            "(docs/multi_turn.md#sandbox)")
    active = "; ".join(layers) or "none"
    limits = (f"per call: {config['timeout']:g} s, {config['memory_mb']} MB, {config['max_processes']} processes, "
              f"{config['max_file_mb']} MB of files")
    if missing:
        return (f"python tool: UNCONFINED (unconfined: true; missing {', '.join(missing)}); active: {active}; "
                f"{limits}")
    return f"python tool sandbox: {active}; {limits}"


def python_tool_notes(path: str) -> List[str]:
    """Argument validation's look at a tool config's python tool entries (before any model is built): each entry's
    config values checked and the sandbox probed; the start-up line per entry. PythonToolConfigError naming the
    file and the entry otherwise. Other mistakes in the file are left to the tool config's own checks."""
    from mindspeed_llm.files import YamlFileError, read_yaml

    try:
        data = read_yaml(path, f"--tool-config {path}", allow_null=lambda keys: True)
    except (YamlFileError, OSError):
        return []
    entries = data.get("tools") if isinstance(data, Mapping) else None
    notes = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        name = str(entry.get("class_name") or "").strip() if isinstance(entry, Mapping) else ""
        config = entry.get("config") or {} if name else {}
        if name not in _PYTHON_TOOL_NAMES or not isinstance(config, Mapping):
            continue
        try:
            notes.append(isolation_note(check_config(config)))
        except PythonToolConfigError as exc:
            raise PythonToolConfigError(f"--tool-config {path}, tools[{index}]: {exc}") from None
    return notes
