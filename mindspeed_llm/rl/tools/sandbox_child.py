"""The python tool's sandbox, child side: ``python -I -S sandbox_child.py SPEC_FD`` (stdlib only; started by
`sandbox.run_sandboxed`). Four processes, each single-threaded when it changes its own credentials or namespaces:

- the launcher (this script's process, in the caller's namespaces) forks
- the holder, which enters new user, PID, network and mount namespaces; the launcher writes its uid / gid maps
  (as root: inside uid 0 is root, inside uid 1 is ``nobody``, so ``RLIMIT_NPROC`` is enforced; otherwise inside
  uid 0 is the caller's own uid). The holder forks
- the keeper, PID 1 of the new PID namespace: it mounts a fresh ``/proc`` (only the call's processes) and a
  ``tmpfs`` of the call's disk budget on the scratch directory, forks the runner, reaps every orphan, watches the
  deadline and the memory and CPU time of all the call's processes together, and exits, which makes the kernel kill
  and reap everything left in the namespace;
- the runner sets the resource limits (``RLIMIT_NPROC``, ``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, no core),
  drops to inside uid 1 (as root; keeping only ``CAP_DAC_READ_SEARCH`` inside the namespace, so root-only folders on
  the way to the interpreter stay readable), enters a Landlock domain (read and execute: the interpreter's prefixes
  and the system's library and program folders; everything: the scratch directory; no TCP; with ABI 6 no signal or
  abstract socket outside the domain), installs a seccomp filter (no ``socket(AF_UNIX)``, no ``io_uring``) and
  execs ``python -I -c PREAMBLE CODE``.

Each layer that cannot be set up is left out and named in the report the runner writes (one JSON line on the
status fd) before it execs; the keeper writes the outcome (another JSON line) before it exits. The caller decides
whether the layers present are enough (`sandbox.py`).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 4, 8, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH = 47, 2, 2
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 22, 2, 0x7FFF0000, 0x00050000
# audit arch -> (socket, io_uring_setup) syscall numbers
_SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # on every arch
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _call(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    return max(int(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))), 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: execute .. make_sym
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def enter_landlock(abi: int, read_paths, write_paths, device_paths) -> list:
    """Restricts this process (and what it execs and forks) to the given paths, no TCP (ABI >= 4) and, with ABI
    >= 6, no signal or abstract unix socket outside its domain. The layers applied, as words."""
    handled = _fs_rights(abi)
    attr = _RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _call(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    file_only = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
    grants = [(p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in read_paths]
    grants += [(p, handled) for p in write_paths]
    grants += [(p, FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV) for p in device_paths]
    for path, rights in grants:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a folder this system does not have
        try:
            if not os.path.isdir(path):
                rights &= file_only
            rule = _PathBeneathAttr(rights & handled, fd)
            _call(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock_add_rule {path}")
        finally:
            os.close(fd)
    _call(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _call(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict")
    os.close(ruleset)
    layers = [f"landlock ABI {abi} (files)"]
    if abi >= 4:
        layers.append("landlock TCP")
    if abi >= 6:
        layers.append("landlock signal and abstract socket scope")
    return layers


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_unix_sockets() -> bool:
    """A seccomp filter: ``socket(AF_UNIX, ...)`` fails with EACCES (Landlock does not govern connecting to a unix
    socket by path; the network namespace and Landlock's scope cover the abstract ones), and so does
    ``io_uring_setup`` (its requests bypass this filter); a foreign syscall ABI (x32, i386) fails entirely.
    ``socketpair`` stays (a connected pair reaches nothing). False on an architecture this does not know."""
    known = _SECCOMP_ARCHES.get(os.uname().machine)
    if known is None:
        return False
    arch, nr_socket, nr_uring = known
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    deny = SECCOMP_RET_ERRNO | 13  # EACCES
    program = [  # (code, jump if true, jump if false, k): jumps skip that many instructions
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),         # 0-2: seccomp_data.arch, else deny
        (ld, 0, 0, 0), (0x35, 0, 1, 0x40000000), (ret, 0, 0, deny),  # 3-5: seccomp_data.nr; x32 (>= 2**30): deny
        (jeq, 0, 2, nr_socket), (ld, 0, 0, 16), (jeq, 2, 1, 1),      # 6-8: socket: args[0] (low word) == AF_UNIX
        (jeq, 1, 0, nr_uring),                                       # 9: io_uring_setup
        (ret, 0, 0, SECCOMP_RET_ALLOW), (ret, 0, 0, deny),           # 10-11
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*op) for op in program])
    prog = _SockFprog(len(program), filters)
    _call(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _call(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")
    return True


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _map_ids(pid: int, as_root: bool) -> None:
    """The holder's uid / gid maps, written from outside its user namespace."""
    if as_root:  # root may map any id: inside 1 is nobody, so the process limit holds (it never does for uid 0)
        _write(f"/proc/{pid}/uid_map", f"0 0 1\n1 {NOBODY} 1\n")
        _write(f"/proc/{pid}/gid_map", f"0 0 1\n1 {NOBODY} 1\n")
    else:  # an unprivileged user maps only itself
        _write(f"/proc/{pid}/setgroups", "deny")
        _write(f"/proc/{pid}/uid_map", f"0 {os.geteuid()} 1\n")
        _write(f"/proc/{pid}/gid_map", f"0 {os.getegid()} 1\n")


def _report(spec, record) -> None:
    os.write(spec["status_fd"], (json.dumps(record) + "\n").encode())


def _die_with_parent(parent: int) -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(125)


def _keep_read_search() -> None:
    """Inside uid 1 with only CAP_DAC_READ_SEARCH (effective, and ambient so exec'd programs keep it): reads
    through root-only folders stay possible where Landlock allows them; nothing else of root's is kept."""
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    bit = 1 << CAP_DAC_READ_SEARCH
    data[0].effective = data[0].permitted = data[0].inheritable = bit
    _call(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _call(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0), "ambient capability")


def _run_code(spec, layers, started: int) -> None:
    """The runner: limits, credentials, Landlock, then exec of the tool's interpreter (never returns)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        limits = spec["limits"]
        if spec["namespaces"]:
            os.chdir(spec["scratch"])  # the tmpfs mounted over it, not the folder below
            if spec["as_root"]:
                resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
                _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
                os.setgroups([])
                os.setresgid(1, 1, 1)
                os.setresuid(1, 1, 1)
                _keep_read_search()
                layers.append("process limit (RLIMIT_NPROC as uid nobody)")
            else:  # the holder, keeper and runner share the inside uid's count
                n = limits["processes"] + 2
                resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
                layers.append("process limit (RLIMIT_NPROC in the user namespace)")
        for kind, value in ((resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, limits["cpu"]),
                            (resource.RLIMIT_FSIZE, limits["file"]), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(kind, (value, value))
        layers.append("rlimits (memory, CPU, file size per process)")
        if "fresh /proc" in layers:
            layers.append("memory and CPU of all processes together")
        abi = landlock_abi() if spec["landlock"] else 0
        if abi:
            read = list(spec["read_paths"]) + (["/proc"] if "fresh /proc" in layers else [])
            layers += enter_landlock(abi, read, [spec["scratch"]], spec["device_paths"])
        if spec["landlock"] and deny_unix_sockets():
            layers.append("seccomp (no unix socket, no io_uring)")
        _report(spec, {"layers": layers})
        os.set_inheritable(spec["status_fd"], False)  # the code cannot write the outcome
        os.set_inheritable(started, True)  # the preamble writes a byte on it when the code starts
        os.execv(sys.executable, [sys.executable, "-I", "-c", spec["preamble"], spec["code"], str(started)])
    except BaseException as exc:  # noqa: BLE001 - report and leave; the keeper sees the exit status
        _report(spec, {"error": f"sandbox setup failed: {type(exc).__name__}: {exc}"})
        os._exit(126)


def _process_totals(self_pid: int):
    """(resident bytes, CPU seconds) of every process this /proc shows but the keeper, with what each has reaped."""
    rss = cpu = 0
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == self_pid:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/statm", "rb") as f:
                rss += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        cpu += sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
    own = os.times()
    return rss, cpu + own.children_user + own.children_system


def _descendants(root: int) -> list:
    """Every process whose parent chain reaches ``root`` (without a PID namespace: the keeper is a subreaper)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parents[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier and p not in found}
        found |= frontier
    return sorted(found)


def _keep(spec, layers) -> None:
    """The keeper: starts the runner, watches the call, reports its outcome and exits (never returns)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    in_namespace = os.getpid() == 1  # PID 1 of its own namespace (even where the uid map failed)
    if spec["namespaces"]:
        try:
            _call(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
            layers.append("fresh /proc")
        except OSError:
            pass  # e.g. a container that masks parts of /proc: Landlock then hides /proc entirely
        size = f"size={spec['limits']['disk']},mode=0777".encode()
        if _libc.mount(b"tmpfs", spec["scratch"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size) == 0:
            layers.append("scratch tmpfs (disk per call)")
    else:
        _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here, to be killed at the end
    started_r, started_w = os.pipe()
    runner = os.fork()
    if runner == 0:
        os.close(started_r)
        _run_code(spec, layers, started_w)
    os.close(started_w)
    os.set_blocking(started_r, False)
    watched = in_namespace and "fresh /proc" in layers
    deadline = time.monotonic() + spec["timeout"] + 60  # until the code starts: the interpreter's start-up
    outcome, poll, running = None, 0.002, False
    while outcome is None:
        if not running:
            try:
                if os.read(started_r, 1):
                    running, deadline = True, time.monotonic() + spec["timeout"]  # the code's own time from here
            except BlockingIOError:
                pass
        try:
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == runner:
                    outcome = ({"result": "signal", "signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                               else {"result": "exit", "code": os.WEXITSTATUS(status)})
        except ChildProcessError:
            pass
        if outcome is not None:
            break
        if time.monotonic() > deadline:
            outcome = {"result": "timeout"}
        elif watched:
            rss, cpu = _process_totals(1)
            if rss > spec["limits"]["memory"]:
                outcome = {"result": "memory", "bytes": rss}
            elif cpu > spec["limits"]["call_cpu"]:
                outcome = {"result": "cpu", "seconds": cpu}
        time.sleep(poll)
        poll = min(poll * 2, 0.01)
    if not in_namespace:  # no PID namespace to take them all: kill what descends from here, until none is left
        for _ in range(50):
            rest = _descendants(os.getpid())
            if not rest:
                break
            for pid in rest:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            time.sleep(0.005)
    _report(spec, outcome)
    os._exit(0)  # as PID 1: the kernel kills and reaps every process left in the namespace


def _guarded(spec, body, *args) -> None:
    """Runs a sandbox process's body, which ends its process; a failure is reported instead of a traceback."""
    try:
        body(*args)
    except BaseException as exc:  # noqa: BLE001 - the caller turns the record into the tool's answer
        _report(spec, {"error": f"sandbox setup failed: {type(exc).__name__}: {exc}"})
    os._exit(126)


def _hold(spec, layers, launcher: int, pipes) -> None:
    """The holder: enters the namespaces, waits for its id maps, forks the keeper and waits for it (never returns)."""
    ready_r, ready_w, mapped_r, mapped_w = pipes
    _die_with_parent(launcher)
    os.close(ready_r)
    os.close(mapped_w)
    namespaces = spec["namespaces"]
    if namespaces:
        try:
            _call(_libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS), "unshare")
        except OSError:
            namespaces = False
    os.write(ready_w, b"1" if namespaces else b"0")
    ok = os.read(mapped_r, 1) == b"1"
    spec["namespaces"] = namespaces and ok
    if spec["namespaces"]:
        _call(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
        layers.append("user, PID, network and mount namespaces")
    keeper = os.fork()
    if keeper == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the holder waits for it: no race
        _guarded(spec, _keep, spec, layers)
    os.waitpid(keeper, 0)
    os._exit(0)


def main() -> None:
    with os.fdopen(int(sys.argv[1]), "rb") as f:  # the spec (with the code) from a file: no argv size limit
        spec = json.loads(f.read())
    _die_with_parent(spec["caller"])
    launcher = os.getpid()
    layers = []
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        _guarded(spec, _hold, spec, layers, launcher, (ready_r, ready_w, mapped_r, mapped_w))
    os.close(ready_w)
    os.close(mapped_r)
    unshared = os.read(ready_r, 1) == b"1"
    mapped = False
    if unshared:
        try:
            _map_ids(holder, spec["as_root"])
            mapped = True
        except OSError:
            pass
    os.write(mapped_w, b"1" if mapped else b"0")
    os.waitpid(holder, 0)


if __name__ == "__main__":
    main()
