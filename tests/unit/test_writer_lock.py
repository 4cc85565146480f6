"""The --save writer lock (`checkpoint/writer_lock.py::WriterLock`): exactly one of any number of runs that take over a
dead run's lock at the same instant wins, over many trials, with flock and with the O_EXCL fallback for filesystems
without it; a live holder is refused by name; a released lock is gone. (Before: when two runs took over a dead
process's lock at once, both held it in 1 of 6 trials, and the loser otherwise hit a FileNotFoundError.)"""

import json
import multiprocessing as mp
import os
import socket

import pytest

from mindspeed_llm.checkpoint.errors import CheckpointError
from mindspeed_llm.checkpoint.writer_lock import WriterLock

TAKERS, TRIALS = 4, 15


def _dead_pid() -> int:
    process = mp.get_context("fork").Process(target=lambda: None)
    process.start()
    process.join()
    return process.pid


def _take(save, barrier, results, no_flock):
    import fcntl

    if no_flock:
        def flock(*_args):
            raise OSError(95, "Operation not supported")
        fcntl.flock = flock
    lock = WriterLock(save)
    barrier.wait()
    try:
        lock.acquire(log=lambda message: None)
        results.put(("won", os.getpid()))
    except CheckpointError as exc:
        results.put(("refused", str(exc)))
    except Exception as exc:  # anything else is a bug: reported, not raised in the child
        results.put(("crashed", repr(exc)))
    barrier.wait()  # the winner holds it until every taker has tried
    lock.release()


@pytest.mark.parametrize("no_flock", [False, True], ids=["flock", "o_excl"])
def test_simultaneous_takeovers_of_a_stale_lock_have_one_winner(tmp_path, no_flock):
    ctx = mp.get_context("fork")
    dead = _dead_pid()
    for trial in range(TRIALS):
        save = tmp_path / f"trial{trial}"
        save.mkdir()
        (save / WriterLock.NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
        barrier, results = ctx.Barrier(TAKERS), ctx.Queue()
        takers = [ctx.Process(target=_take, args=(str(save), barrier, results, no_flock)) for _ in range(TAKERS)]
        for taker in takers:
            taker.start()
        outcomes = [results.get(timeout=60) for _ in takers]
        winners = [o for o in outcomes if o[0] == "won"]
        for taker in takers:
            taker.join(timeout=60)
        assert not [o for o in outcomes if o[0] == "crashed"], outcomes
        assert len(winners) == 1, f"trial {trial}: {outcomes}"
        assert all("is being written by another run" in o[1] or "another run is taking over" in o[1]
                   for o in outcomes if o[0] == "refused"), outcomes
        assert not (save / WriterLock.NAME).exists()  # the winner released it


def test_a_live_holder_is_refused_by_name_and_a_release_frees_it(tmp_path):
    first = WriterLock(str(tmp_path))
    first.acquire()
    with pytest.raises(CheckpointError, match=rf"pid {os.getpid()} on {socket.gethostname()}"):
        WriterLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / WriterLock.NAME).exists()
    again = WriterLock(str(tmp_path))
    again.acquire()
    again.release()
