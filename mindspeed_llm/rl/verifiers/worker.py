"""The helper interpreter ``math_acc`` runs its comparisons (`equality.math_verify_equal`) in when it is called
off the main thread, where ``math_verify``'s signal-based timeouts cannot work (see `verifiers/math.py`)."""

from __future__ import annotations

import atexit
import os
import threading
from typing import Optional

from mindspeed_llm.rl.verifiers.equality import load_math_verify, math_verify_equal
from mindspeed_llm.rl.verifiers.registry import VerifierTimeout

# the folder holding the mindspeed_llm package: the worker imports it from there
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

class _WorkerProcess:
    """A helper interpreter that runs comparisons requested off the main thread.

    It is a plain ``python -c`` subprocess (not ``multiprocessing``, whose ``spawn`` start method
    re-imports the caller's ``__main__``), speaking one JSON object per line over stdin/stdout. In its
    own main thread ``math_verify``'s signal timeouts work; on top of that the parent waits at most
    ``budget`` seconds for an answer and kills and replaces a worker that overruns it.
    """

    _BOOT = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        "from mindspeed_llm.rl.verifiers.worker import _worker_main; _worker_main()"
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._replies = None

    def _start_locked(self, startup_timeout: float) -> None:
        import json
        import queue
        import subprocess
        import sys

        paths = [p for p in sys.path if p] + [_REPO_ROOT]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(
            [sys.executable, "-c", self._BOOT, json.dumps(paths)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )
        replies: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump(stream=proc.stdout, out=replies):
            for line in stream:
                out.put(line)
            out.put(None)  # EOF: the worker died

        threading.Thread(target=pump, name="math-acc-worker-reader", daemon=True).start()
        self._proc, self._replies = proc, replies
        if self._get_locked(startup_timeout) != {"ready": True}:
            self._kill_locked()
            raise RuntimeError("math_acc worker process failed to start")

    def _get_locked(self, timeout: float):
        import json
        import queue

        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            raise RuntimeError("math_acc worker process exited unexpectedly")
        return json.loads(line)

    def run(self, call: tuple, budget: float) -> bool:
        import json

        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill_locked()
                self._start_locked(startup_timeout=120.0)
            try:
                self._proc.stdin.write(json.dumps(list(call)) + "\n")
                self._proc.stdin.flush()
                reply = self._get_locked(budget)
            except (OSError, RuntimeError):
                self._kill_locked()
                raise
            if reply is None:
                self._kill_locked()
                raise VerifierTimeout(f"math_acc worker exceeded {budget:.0f}s and was restarted")
        if "timeout" in reply:
            raise VerifierTimeout(reply["timeout"])
        if "error" in reply:
            raise RuntimeError(f"math_acc worker: {reply['error']}")
        return bool(reply["ok"])

    def _kill_locked(self) -> None:
        proc, self._proc, self._replies = self._proc, None, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        with self._lock:
            self._kill_locked()


def _worker_main() -> None:
    """Entry point of the worker interpreter (see :class:`_WorkerProcess`)."""
    import json
    import sys

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    load_math_verify()
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            pred_text, unanchored, gold_text, timeout, rounding = json.loads(line)
            reply = {"ok": math_verify_equal(pred_text, unanchored, gold_text, timeout, rounding)}
        except VerifierTimeout as exc:
            reply = {"timeout": str(exc)}
        except Exception as exc:  # noqa: BLE001
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        proto.write(json.dumps(reply) + "\n")


WORKER = _WorkerProcess()
atexit.register(WORKER.close)


def _forget_worker_in_child() -> None:
    # a forked child (e.g. a DataLoader worker) must not share the parent's pipes or a held lock
    WORKER._lock = threading.Lock()
    WORKER._proc = None
    WORKER._replies = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_in_child)


