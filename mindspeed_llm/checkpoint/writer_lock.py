"""One writer per --save directory (`WriterLock`): `<save>/.writer.lock`, taken by rank 0 at the start of a stage and
released at its exit (`rl/trainer.py`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Optional

from mindspeed_llm.checkpoint.errors import CheckpointError


class WriterLock:
    """One writer per --save directory: `<save>/.writer.lock`, held with an exclusive `flock` for the run's
    lifetime and holding the host and pid of the run writing there (for messages).

    Taken by rank 0 at start, released at exit. A live holder is refused with its host and pid named. A lock left by
    a run that died is free again (the kernel, or the NFS server, drops a dead process's flock): it is taken over,
    with a message; when several runs take it over at the same instant, exactly one wins (the kernel's lock decides,
    and a taker checks that the file it locked is still the one at the path, since a releasing run unlinks it).
    Where the filesystem has no flock, an O_EXCL create of the file is the lock, and a dead holder's file is taken
    over by renaming it away (one taker's rename wins).
    """

    NAME = ".writer.lock"

    def __init__(self, save: str):
        self.path = os.path.join(save, self.NAME)
        self.held = False
        self._fd: Optional[int] = None

    def acquire(self, log=print) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(20):  # a few rounds for a takeover racing with a release
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = self._holder()
                raise CheckpointError(self._busy_message(holder)) from None
            except OSError:  # no flock on this filesystem
                os.close(fd)
                return self._acquire_exclusive(me, log)
            if not self._same_file(fd):  # a releasing run unlinked the file we locked: lock the new one
                os.close(fd)
                continue
            previous = self._holder()
            if previous and previous.get("pid") is not None and not (
                    previous.get("host") == me["host"] and previous.get("pid") == me["pid"]):
                log(f"taking over {self.path} from pid {previous.get('pid')} on {previous.get('host')}, which is "
                    "no longer running")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
            self._fd, self.held = fd, True
            return
        raise CheckpointError(f"cannot take {self.path}: other runs keep taking and releasing it")

    def release(self) -> None:
        if not self.held:
            return
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if self._same_file(self._fd):
                    os.remove(self.path)  # while still locked: a taker that locked this file sees it gone
            os.close(self._fd)  # drops the flock
            self._fd = None
        else:
            holder = self._holder()
            if holder and holder.get("pid") == os.getpid():
                os.remove(self.path)
        self.held = False

    def _same_file(self, fd: int) -> bool:
        try:
            mine, there = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def _busy_message(self, holder: Optional[dict]) -> str:
        who = (f"pid {holder['pid']} on {holder['host']}, since {holder.get('since', '?')}" if holder
               else "a run that has not written its name yet")
        return (f"--save {os.path.dirname(self.path)} is being written by another run ({who}); two writers would "
                "corrupt it: stop that run or pass another --save")

    def _acquire_exclusive(self, me: dict, log) -> None:
        """The lock without flock: the file's O_EXCL creation. A dead holder's file (or one left empty by a run
        killed while writing it, after a grace period) is taken over under a takeover mutex (`mkdir` of
        `<lock>.takeover`, atomic): of simultaneous takers, the one that made it replaces the file, the others are
        refused as if the lock were live (it is, a moment later)."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if (holder is None and self._age() < self.EMPTY_GRACE_S) or (holder and self._alive(holder)):
                    raise CheckpointError(self._busy_message(holder)) from None
                mutex = f"{self.path}.takeover"
                try:
                    os.mkdir(mutex)
                except FileExistsError:
                    raise CheckpointError(f"another run is taking over {self.path} at this moment (if none is, "
                                          f"delete {mutex})") from None
                try:
                    if self._holder() != holder:  # replaced since we read it: look again
                        continue
                    log(f"taking over {self.path} from pid {holder.get('pid') if holder else '?'} on "
                        f"{holder.get('host') if holder else '?'}, which is no longer running")
                    # replaced in one rename, never removed first: a taker that arrives now finds a file (ours,
                    # or the dead one) and is refused, instead of creating its own in the gap
                    staged = f"{self.path}.{os.getpid()}.staging"
                    with open(staged, "w") as f:
                        json.dump(me, f)
                    os.replace(staged, self.path)
                    self.held = True
                    return
                finally:
                    os.rmdir(mutex)
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise CheckpointError(f"cannot take {self.path}: another run took it at the same moment")

    EMPTY_GRACE_S = 10.0  # an empty lock file younger than this is a run writing its name, not a dead one

    def _age(self) -> float:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return 0.0

    def _holder(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # empty, half-written, or gone

    @staticmethod
    def _alive(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # cannot tell from here: assume it runs
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
