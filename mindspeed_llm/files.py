"""Small filesystem helpers that crash-safe publishing needs (datasets and checkpoints alike)."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename into it) to disk; best effort where the filesystem refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
