"""rl/tools/python_exec.py and sandbox.py: the python tool's output, scratch directory, environment and limits,
its config values, and the sandbox against the hostile probes of issue 45 (reading the run's checkpoint and
/etc/passwd, the parent's environment, writing into --save, killing the parent or a sibling, a fork bomb, memory and
disk exhaustion across processes, sockets from child processes, processes left behind). Each call starts a
launcher and a `python -I -c` child (about 0.2 s); the probes are bounded to a few seconds."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from mindspeed_llm.rl.tools import PythonTool, ToolConfigError, ToolTimeout, load_tool_config, run_python
from mindspeed_llm.rl.tools import sandbox


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
    marker = _marker()
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)  # {marker}'])\n"
            "print(p.pid, flush=True)\n"
            "p.wait()")
    with pytest.raises(ToolTimeout):  # 3 s: the child and its child start in time on a loaded machine
        run_python(code, timeout=3.0)
    _assert_none_left(marker)  # gone when the call returns, not some time later


def _marker() -> str:
    return f"mindspeed-probe-{uuid.uuid4().hex}"


def _assert_none_left(marker: str) -> None:
    """No process of the call is running; any found is killed (so a failing check leaves none behind either)."""
    left = _marked_processes(marker)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert left == [], f"processes left running after the call: {left}"


def _marked_processes(marker: str) -> list:
    """The running processes (this machine's /proc, every namespace) whose command line holds ``marker`` (a zombie
    waiting for a reaper, as under a container's init that does not reap, is dead)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat", encoding="ascii") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    found.append(int(name))
        except OSError:
            continue
    return found


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


# -- the config values, checked when the tool is made ----------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("timeout", "abc"), ("timeout", -1), ("timeout", 0), ("memory_mb", 0),
                                        ("memory_mb", 1.5), ("max_file_mb", 0), ("max_output_chars", -5),
                                        ("max_processes", 0), ("max_processes", True), ("unconfined", "yes")])
def test_config_values_are_checked_by_key_and_range(key, value):
    with pytest.raises(sandbox.PythonToolConfigError, match=rf"python tool config {key}: .*(give|true or false)"):
        PythonTool(config={key: value})


def test_config_values_are_refused_by_the_tool_config_loader(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: python\n    config: {timeout: abc}\n")
    with pytest.raises(ToolConfigError, match=r"tools\[0\].*timeout: 'abc' is out of range; give a number of sec"):
        load_tool_config(str(path))


# -- the sandbox: which layers, and the refusal without them ---------------------------------------------------------

def test_startup_note_names_each_active_layer():
    note = PythonTool().startup_note
    for layer in ("user, PID, network and mount namespaces", "fresh /proc", "landlock ABI", "landlock TCP",
                  "process limit (RLIMIT_NPROC", "rlimits", "memory and CPU of all processes together",
                  "seccomp (no unix socket", "16 processes"):
        assert layer in note, note


def test_refused_without_isolation_unless_unconfined(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_layers", lambda: ("rlimits (memory, CPU, file size per process)",))
    with pytest.raises(sandbox.PythonToolConfigError, match=r"does not offer user, PID.* or Landlock.*unconfined: t"):
        PythonTool()
    with pytest.raises(sandbox.PythonToolConfigError, match="unconfined: true"):
        run_python("print(1)")
    tool = PythonTool(config={"unconfined": True})
    assert tool.startup_note.startswith("python tool: UNCONFINED (unconfined: true; missing user, PID")
    assert tool.execute({"code": "print(1)"}, {}) == "1\n"


def test_without_namespaces_the_calls_processes_are_still_killed():
    """The unconfined fallback (no namespaces, no Landlock): the keeper, a subreaper, kills what descends from it."""
    marker = _marker()
    text, outcome, layers = sandbox.run_sandboxed(_LEAVE_BEHIND.format(marker=marker), 5.0, 256, 4, 16, 4000,
                                                  confine=False)
    assert outcome == {"result": "exit", "code": 0} and text.count("started") == 3, text
    assert not any("namespaces" in layer or "landlock" in layer for layer in layers)
    _assert_none_left(marker)


# -- hostile probes (issue 45's sweep): each got through before the sandbox ------------------------------------------

def test_reads_outside_the_scratch_directory_are_refused(tmp_path):
    checkpoint = tmp_path / "save" / "iter_0000007" / "model_optim_rng.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("WEIGHTS-OF-THE-RUN")
    source = os.path.abspath(sandbox.__file__)
    for path, secret in (("/etc/passwd", "root:"), (str(checkpoint), "WEIGHTS"), (source, "PythonToolConfigError")):
        out = run_python(f"print(open({path!r}).read())")
        assert secret not in out and "PermissionError" in out, (path, out)
    out = run_python(f"import os\nprint(os.listdir({str(tmp_path)!r}))")
    assert "save" not in out and "PermissionError" in out


def test_writes_outside_the_scratch_directory_are_refused(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    tracker = save / "latest_checkpointed_iteration.txt"
    tracker.write_text("7")
    code = (f"open({str(tracker)!r}, 'w').write('999')\n")
    assert "PermissionError" in run_python(code)
    assert "PermissionError" in run_python(f"open({str(save / 'new.txt')!r}, 'w').write('x')")
    source_dir = os.path.dirname(os.path.abspath(sandbox.__file__))
    assert "PermissionError" in run_python(f"open({os.path.join(source_dir, 'planted.py')!r}, 'w').write('x')")
    assert tracker.read_text() == "7" and sorted(os.listdir(save)) == ["latest_checkpointed_iteration.txt"]
    assert not os.path.exists(os.path.join(source_dir, "planted.py"))


_IN_PARENT = textwrap.dedent("""
    import os, sys
    from mindspeed_llm.rl.tools import run_python
    code = sys.argv[1].replace("PARENT", str(os.getpid()))
    print(run_python(code, timeout=float(os.environ.get("PROBE_TOOL_TIMEOUT", "5"))), flush=True)
    print("PARENT-SURVIVED", flush=True)
""")


def _run_in_dedicated_parent(code: str, **env) -> str:
    """``run_python(code)`` in a parent process of its own (``PARENT`` in the code: its pid), never this pytest."""
    proc = subprocess.run([sys.executable, "-c", _IN_PARENT, code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    return proc.stdout + proc.stderr + f"\n[parent exit {proc.returncode}]"


def test_parent_environment_and_command_line_are_hidden():
    code = ("import os\n"
            "for pid in (os.getppid(), PARENT):\n"
            "    for name in ('environ', 'cmdline'):\n"
            "        try:\n"
            "            print(open(f'/proc/{pid}/{name}', 'rb').read())\n"
            "        except OSError as e:\n"
            "            print(type(e).__name__)\n")
    out = _run_in_dedicated_parent(code, SECRET_TOKEN="hunter2")
    assert "PARENT-SURVIVED" in out, out
    assert "hunter2" not in out and "run_python" not in out, out


def test_the_code_cannot_kill_its_parent_or_a_sibling():
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = ("import os, signal\n"
                f"for pid in (os.getppid(), PARENT, {sibling.pid}):\n"  # never -1: on a failure that is every process
                "    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n"
                "    except OSError as e:\n"
                "        print(pid, type(e).__name__)\n"
                "print('tried')\n")
        out = _run_in_dedicated_parent(code)
        assert "PARENT-SURVIVED" in out and "[parent exit 0]" in out, out
        assert sibling.poll() is None, "the sibling was killed"
    finally:
        sibling.kill()
        sibling.wait()


def test_a_fork_bomb_is_bounded_by_max_processes():
    marker = _marker()
    code = textwrap.dedent(f"""
        import os, time
        started = 0
        for _ in range(40):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:  # {marker} (in the command line of the code's interpreter and its forks)
                time.sleep(30)
                os._exit(0)
            started += 1
        print("started", started)
    """)
    started = time.monotonic()
    out = run_python(code, max_processes=8)
    assert time.monotonic() - started < 10
    count = int(out.split("started")[1].split()[0])
    assert 1 <= count < 8, out  # the code's own interpreter counts as one
    _assert_none_left(marker)


def test_memory_of_all_the_calls_processes_together_is_bounded():
    code = textwrap.dedent("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                block = bytearray(b"x") * (100 * 2 ** 20)  # touched: resident, within the per-process limit
                print("held", flush=True)
                time.sleep(10)
                os._exit(0)
        for _ in range(3):
            os.wait()
        print("all children done")
    """)
    started = time.monotonic()
    out = run_python(code, memory_mb=200, timeout=20)
    assert time.monotonic() - started < 8, out
    assert "all children done" not in out and "together held" in out and "memory_mb 200" in out, out


def test_disk_is_bounded_inside_and_refused_outside_the_scratch_directory(tmp_path):
    outside = [str(tmp_path / "filler"), f"/tmp/{_marker()}", f"/dev/shm/{_marker()}"]
    code = textwrap.dedent(f"""
        written = 0
        for i in range(20):
            try:
                with open(f"fill{{i}}", "wb") as f:
                    f.write(b"x" * (2 * 2 ** 20))
                written += 2
            except OSError as e:
                print(type(e).__name__, e.errno)
                break
        print("scratch MB", written)
        for path in {outside!r}:
            try:
                open(path, "wb").write(b"x" * 2 ** 20)
                print("wrote", path)
            except OSError as e:
                print(type(e).__name__)
    """)
    try:
        out = run_python(code, max_file_mb=8)
        assert int(out.split("scratch MB")[1].split()[0]) <= 8, out
        assert "wrote" not in out, out
        for path in outside:
            assert not os.path.exists(path), path
    finally:
        for path in outside:
            if os.path.exists(path):
                os.remove(path)


_CONNECT = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')"


def test_no_network_from_child_processes():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import subprocess, sys
            for argv in ([sys.executable, "-c", {_CONNECT.format(port=port)!r}],
                         ["bash", "-c", "echo x > /dev/tcp/127.0.0.1/{port}"]):
                print(subprocess.run(argv, capture_output=True, text=True, timeout=5).returncode)
        """)
        out = run_python(code, timeout=15)
        with pytest.raises(socket.timeout):
            listener.accept()
        assert len(out.split()) == 2 and "0" not in out.split(), out  # both failed
    finally:
        listener.close()


_LEAVE_BEHIND = textwrap.dedent("""
    import os, subprocess, sys
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)  # {marker}"]
    subprocess.Popen(sleeper)                               # in the background
    subprocess.Popen(sleeper, start_new_session=True)       # in a new session
    if os.fork() == 0:                                      # double fork: an orphan
        if os.fork() == 0:
            os.execv(sys.executable, sleeper)
        os._exit(0)
    os.wait()
    import time
    time.sleep(0.3)  # the sleepers are running
    print("started\\n" * 3, end="")
""")


def test_no_process_outlives_the_call():
    marker = _marker()
    out = run_python(_LEAVE_BEHIND.format(marker=marker))
    assert out.count("started") == 3, out
    _assert_none_left(marker)


def test_argument_validation_checks_the_python_tool_and_names_its_sandbox(tmp_path, monkeypatch):
    """Before any model is built: a bad value or a kernel without the sandbox is refused naming the file and entry;
    otherwise the start-up notes name the active layers."""
    from mindspeed_llm.arguments import ArgumentError, parse_args

    path = tmp_path / "tools.yaml"
    argv = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", str(tmp_path / "d"),
            "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r", "--tool-config", str(path)]
    path.write_text("tools:\n  - class_name: calculator\n  - class_name: python\n    config: {memory_mb: 0}\n")
    with pytest.raises(ArgumentError, match=r"tools\.yaml, tools\[1\]: python tool config memory_mb: 0 is out of ra"):
        parse_args(argv, 1)
    path.write_text("tools:\n  - class_name: python\n    config: {timeout: 2}\n")
    notes = parse_args(argv, 1).settings.startup.startup_notes
    assert any(n.startswith("python tool sandbox: user, PID, network and mount namespaces") and "per call: 2 s" in n
               for n in notes), notes
    monkeypatch.setattr(sandbox, "isolation_layers", lambda: ())
    with pytest.raises(ArgumentError, match=r"tools\[0\]: python tool: this kernel does not offer .*unconfined: true"):
        parse_args(argv, 1)
    path.write_text("tools:\n  - class_name: python\n    config: {unconfined: true}\n")
    assert any(n.startswith("python tool: UNCONFINED") for n in parse_args(argv, 1).settings.startup.startup_notes)


def test_no_unix_socket_by_path():
    """A unix socket the code's user may write (here world-writable, as X11's and D-Bus's are) is not reachable:
    Landlock does not govern connecting to one, the seccomp filter refuses AF_UNIX sockets."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="mindspeed_unix_probe_")
    path = os.path.join(folder, "s")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(path)
        listener.listen(2)
        listener.settimeout(0.5)
        os.chmod(folder, 0o777)
        os.chmod(path, 0o777)
        connect = f"import _socket; s = _socket.socket(_socket.AF_UNIX); s.connect({path!r}); s.send(b'x')"
        out = run_python(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {connect!r}])")
        with pytest.raises(socket.timeout):
            listener.accept()
        assert "Error" in out, out
    finally:
        listener.close()
        os.remove(path)
        os.rmdir(folder)


def test_a_killed_trainer_takes_the_calls_processes_with_it():
    """The trainer dies mid-call (SIGKILL): each sandbox process dies with its parent, the keeper last, and the
    kernel takes everything in the call's namespace."""
    marker = _marker()
    sleeper = f"import time; time.sleep(60)  # {marker}"
    code = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {sleeper!r}], "
            "start_new_session=True)\ntime.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", _IN_PARENT, code], stdout=subprocess.DEVNULL,
                              env={**os.environ, "PROBE_TOOL_TIMEOUT": "60"})  # the call's own deadline is far
    try:
        deadline = time.monotonic() + 20
        while len(_marked_processes(marker)) < 2 and time.monotonic() < deadline:  # the code and its sleeper
            time.sleep(0.05)
        assert len(_marked_processes(marker)) >= 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5  # the parent-death signals run down the chain
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_none_left(marker)


def test_cpu_time_of_all_the_calls_processes_together_is_bounded():
    """Three spinning processes: the keeper stops the call once their CPU seconds together (live ones, and what the
    reaped ones used) pass the call's budget, long before its wall-clock deadline."""
    code = textwrap.dedent("""
        import os
        for _ in range(3):
            if os.fork() == 0:
                while True:
                    pass
        os.wait()
    """)
    started = time.monotonic()
    text, outcome, _ = sandbox.run_sandboxed(code, 30.0, 256, 4, 8, 4000, call_cpu_seconds=1.0)
    assert outcome["result"] == "cpu" and 1.0 < outcome["seconds"] < 3.0, outcome
    assert time.monotonic() - started < 20


_AS_USER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from mindspeed_llm.rl.tools.sandbox import run_sandboxed
    fork = "import os\\nn = 0\\nfor _ in range(40):\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n" \\
           "        break\\n    if pid == 0:\\n        import time; time.sleep(30); os._exit(0)\\n    n += 1\\nprint(n)"
    results = [run_sandboxed(code, 5.0, 256, 4, 8, 2000)
               for code in ("print(open('/etc/passwd').read())", f"open({sys.argv[2]!r}, 'w')", fork)]
    print(json.dumps(results))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv") or
                    not os.path.exists("/usr/bin/python3"), reason="needs root to become an unprivileged user")
def test_an_unprivileged_user_gets_the_same_sandbox(tmp_path):
    """As a cluster user (no root): the uid maps to itself, the process limit counts in the call's user namespace."""
    import mindspeed_llm

    repo = os.path.dirname(os.path.dirname(os.path.abspath(mindspeed_llm.__file__)))
    os.chmod(tmp_path, 0o777)
    planted = str(tmp_path / "planted")
    argv = ["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-c",
            _AS_USER, repo, planted]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # none of this checkout's PYTHONPATH: argv names it
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", env=env)
    if proc.returncode != 0 and ("Permission denied" in proc.stderr or "No module named" in proc.stderr):
        pytest.skip(f"this checkout is not readable by an unprivileged user: {proc.stderr[-200:]}")
    (passwd, _, layers), (plant, _, _), (fork, _, _) = json.loads(proc.stdout)
    assert "process limit (RLIMIT_NPROC in the user namespace)" in layers and any("landlock" in x for x in layers)
    assert "root:" not in passwd and "PermissionError" in passwd
    assert "PermissionError" in plant and not os.path.exists(planted)
    assert 1 <= int(fork) < 8, fork
