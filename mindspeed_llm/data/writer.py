"""Writing a preprocessed dataset: Megatron indexed datasets plus a manifest, all or nothing.

Files under ``--output-prefix PREFIX`` (see :func:`output_files`):

``PREFIX_packed_{key}_document.bin/.idx``  token ids per sample, int32 (``input_ids``; also
                                           ``labels`` with -100 on the prompt for SFT data)
``PREFIX_extra_{key}_document.bin/.idx``   one UTF-8 JSON value per sample, uint8 bytes
                                           (string ``labels``, ``--dataset-additional-keys``)
``PREFIX_meta.json``                       the manifest: handler, template, tokenizer, keys,
                                           sample count, dropped-row counts; written last

A dataset exists only when its manifest does (:class:`~mindspeed_llm.data.prompt_dataset.PromptDataset`
requires it). Writing goes through two hidden folders next to the prefix, named after the
prefix's stem, the host and the process id of the run that made them:

``.STEM.partial-HOST-PID-*``  the new dataset while it is written (staging)
``.STEM.old-HOST-PID-*``      the previous dataset while ``--overwrite-cache`` swaps it out

Publishing (:meth:`DatasetWriter.commit`) is crash-safe:

1. the new files are complete in the staging folder, manifest included;
2. the previous dataset (if any) is hard-linked into the ``.old-`` folder, its manifest last
   (renamed instead where the filesystem has no hard links), so a complete copy exists;
3. the previous manifest, then its data files, leave the prefix;
4. the new files move in by rename, the manifest last;
5. the ``.old-`` and staging folders are deleted.

A process killed at any point leaves either the previous or the new complete dataset at the prefix,
or (between 3 and 4) no manifest at the prefix and a complete copy of the previous dataset in the
``.old-`` folder: ``PromptDataset`` then reads that copy (with a warning), and the next run of
``preprocess_data.py`` on the prefix puts it back (:func:`recover_interrupted`) and deletes stale
staging folders, before it does anything else.

Test hook (not for users): with ``MINDSPEED_LLM_FAULT_AT=<point>`` in the environment the process
SIGKILLs itself when the commit reaches ``<point>``: ``staged`` (after 1), ``aside`` (after 2),
``swap`` (during 4: the previous manifest is gone, one new file is in place), ``published``
(after 4); or when a later run restoring an interrupted swap has put back one file (``restoring``).
``tests/unit/test_faults_data.py`` uses it.
"""
from __future__ import annotations

import errno
import glob
import json
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from mindspeed_llm.data.errors import OutputExistsError, OutputWriteError
from mindspeed_llm.files import fsync_dir

logger = logging.getLogger("mindspeed_llm.data.preprocess")

FORMAT_VERSION = 1
META_SUFFIX = "_meta.json"
FAULT_ENV = "MINDSPEED_LLM_FAULT_AT"
PARTIAL_TAG = "partial"
ASIDE_TAG = "old"


def packed_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_packed_{key}_document"


def extra_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_extra_{key}_document"


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def output_files(prefix: str, packed_keys: Sequence[str], extra_keys: Sequence[str]) -> List[str]:
    """All paths a dataset at ``prefix`` consists of; the manifest is last."""
    files = []
    for p in [packed_prefix(prefix, k) for k in packed_keys] + [extra_prefix(prefix, k) for k in extra_keys]:
        files += [p + ".bin", p + ".idx"]
    return files + [meta_path(prefix)]


def existing_outputs(prefix: str) -> List[str]:
    """Files of any dataset already written at ``prefix`` (by this scheme)."""
    esc = glob.escape(prefix)
    found = set(glob.glob(esc + "_packed_*_document.bin") + glob.glob(esc + "_packed_*_document.idx")
                + glob.glob(esc + "_extra_*_document.bin") + glob.glob(esc + "_extra_*_document.idx"))
    if os.path.exists(meta_path(prefix)):
        found.add(meta_path(prefix))
    return sorted(found)


def check_can_write(prefix: str, overwrite: bool) -> None:
    existing = existing_outputs(prefix)
    if existing and not overwrite:
        shown = ", ".join(existing[:4]) + (" ..." if len(existing) > 4 else "")
        raise OutputExistsError(
            f"output prefix {prefix!r} already holds a dataset ({shown}); "
            f"pass --overwrite-cache to replace it, or choose another --output-prefix")


# ---- output location ---------------------------------------------------------------------------

def check_prefix(prefix: str) -> None:
    """``--output-prefix`` is a folder plus a file-name stem (``dataset/train``), not a folder."""
    text = str(prefix)
    stem = os.path.basename(text)
    if text.endswith(("/", os.sep)) or stem in ("", ".", ".."):
        example = os.path.join(text.rstrip("/" + os.sep) or ".", "train")
        raise OutputWriteError(
            f"--output-prefix {text!r} names a folder, not a prefix: a prefix is a path plus a file-name stem "
            f"that every output file starts with (e.g. dataset/train -> dataset/train_meta.json); "
            f"use e.g. --output-prefix {example}")


def _strerror(err: OSError) -> str:
    name = errno.errorcode.get(err.errno, "") if err.errno else ""
    text = err.strerror or str(err)
    return f"{text} ({name})" if name else text


def check_output_dir(prefix: str) -> str:
    """Create the prefix's folder if needed and prove it is writable (a probe file); returns it.

    Runs before any tokenizing, so a read-only or impossible location fails in a second."""
    out_dir = os.path.dirname(os.path.abspath(str(prefix)))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        where = e.filename or out_dir
        raise OutputWriteError(
            f"--output-prefix {prefix}: cannot create the folder {out_dir} ({where}: {_strerror(e)}); "
            f"choose a --output-prefix in a folder you can write") from None
    if not os.path.isdir(out_dir):
        raise OutputWriteError(f"--output-prefix {prefix}: {out_dir} is not a folder; choose another --output-prefix")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(str(prefix))}.probe-", dir=out_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OutputWriteError(
            f"--output-prefix {prefix}: the folder {out_dir} is not writable ({_strerror(e)}); choose a "
            f"--output-prefix in a writable folder or fix its permissions") from None
    return out_dir


def write_error(err: OSError, path: str) -> OutputWriteError:
    """The one-line error for a failed write of ``path`` (after the partial output was removed)."""
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        fix = "free space there or choose a --output-prefix on another disk"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "choose a --output-prefix in a writable folder"
    else:
        fix = "check the output location"
    return OutputWriteError(f"cannot write {path}: {_strerror(err)}; {fix}; the partial output was removed, "
                            f"nothing was written")


# ---- leftovers of interrupted runs -------------------------------------------------------------

_HOST = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname() or "host")[:64] or "host"


def _owner_tag() -> str:
    return f"{_HOST}-{os.getpid()}"


def _work_dirs(prefix: str, tag: str) -> List[str]:
    """The ``.STEM.<tag>-*`` folders next to ``prefix``."""
    out_dir = os.path.dirname(os.path.abspath(str(prefix)))
    stem = os.path.basename(str(prefix))
    pattern = os.path.join(glob.escape(out_dir), glob.escape(f".{stem}.{tag}-") + "*")
    return sorted(p for p in glob.glob(pattern) if os.path.isdir(p))


def _owner(path: str, tag: str) -> Tuple[Optional[str], Optional[int]]:
    """(host, pid) encoded in a work folder's name; (None, None) for a name without them."""
    rest = os.path.basename(path).split(f".{tag}-", 1)[-1]
    parts = rest.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None, None
    return parts[0], int(parts[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _status(path: str, tag: str) -> str:
    """'stale' (its run is gone), 'live' (its run is still going) or 'foreign' (made on another host)."""
    host, pid = _owner(path, tag)
    if host is None:
        return "stale"  # made by an older version of this code: no owner recorded
    if host != _HOST:
        return "foreign"
    return "live" if _pid_alive(pid) else "stale"


def aside_copy(prefix: str) -> Optional[str]:
    """The prefix of the complete copy of the previous dataset that an interrupted (or running)
    ``--overwrite-cache`` swap keeps in ``.STEM.old-*``; None when there is none."""
    stem = os.path.basename(str(prefix))
    found = [d for d in _work_dirs(prefix, ASIDE_TAG) if os.path.isfile(os.path.join(d, stem + META_SUFFIX))]
    if not found:
        return None
    return os.path.join(max(found, key=os.path.getmtime), stem)


def _put_back(aside: str, name: str, dst: str) -> None:
    """Make ``dst`` the file ``aside/name`` while ``aside`` stays complete (a hard link renamed over
    ``dst``), so a process killed while restoring leaves the copy intact; moved where the
    filesystem has no hard links."""
    src = os.path.join(aside, name)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        return
    tmp = os.path.join(aside, f".{name}.link")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.link(src, tmp)
    except OSError:
        os.replace(src, dst)
        return
    os.replace(tmp, dst)


def _restore_aside(aside: str, prefix: str) -> str:
    """Undo or finish an interrupted swap whose previous dataset is in ``aside``; says what it did."""
    out_dir = os.path.dirname(os.path.abspath(str(prefix)))
    stem = os.path.basename(str(prefix))
    meta_name = stem + META_SUFFIX
    names = sorted((n for n in os.listdir(aside) if not n.startswith(".")),
                   key=lambda n: n == meta_name)  # the manifest last
    if meta_name in names and os.path.exists(meta_path(prefix)):
        shutil.rmtree(aside, ignore_errors=True)
        return f"removed {aside}, the previous dataset's copy left by an interrupted --overwrite-cache run " \
               f"(the new dataset at {prefix} is complete)"
    if meta_name in names:
        # killed after the previous manifest left the prefix: put the previous dataset back
        try:
            with open(os.path.join(aside, meta_name), encoding="utf-8") as f:
                keep = {os.path.basename(p) for p in all_files_of(json.load(f), prefix)}
        except (OSError, ValueError):
            keep = set()
        keep |= set(names)
        for path in existing_outputs(prefix):
            if os.path.basename(path) not in keep:
                os.remove(path)  # a file of the unfinished new dataset
        for i, name in enumerate(names):
            _put_back(aside, name, os.path.join(out_dir, name))
            if i == 0:
                _fault_point("restoring")
        fsync_dir(out_dir)
        shutil.rmtree(aside, ignore_errors=True)
        return f"restored the previous dataset at {prefix} from {aside} (an --overwrite-cache run was " \
               f"interrupted before the new dataset was complete)"
    # killed while the copy was being made: the prefix still holds the previous dataset
    for name in names:
        dst = os.path.join(out_dir, name)
        if not os.path.exists(dst):
            os.replace(os.path.join(aside, name), dst)
    shutil.rmtree(aside, ignore_errors=True)
    return f"removed {aside}, left by an --overwrite-cache run interrupted before it changed {prefix}"


def recover_interrupted(prefix: str) -> List[str]:
    """Clean up after runs on ``prefix`` that were killed: restore the previous dataset from a
    stale ``.old-`` folder (or drop that folder when the new dataset is complete) and delete
    stale staging folders. Folders of a run that is still alive are left alone; those made on
    another host are reported, not touched. Each action is logged as it is done (a warning) and
    returned as one line."""
    notes = _Notes()
    for aside in _work_dirs(prefix, ASIDE_TAG):
        status = _status(aside, ASIDE_TAG)
        host, pid = _owner(aside, ASIDE_TAG)
        if status == "stale":
            notes.append(_restore_aside(aside, prefix))
        elif status == "live":
            notes.append(f"left {aside} alone: its --overwrite-cache run (pid {pid}) is still running")
        elif os.path.exists(meta_path(prefix)):
            notes.append(f"left {aside} alone: a run on host {host} (pid {pid}) made it; delete it if that "
                         f"run is over")
        else:
            raise OutputExistsError(
                f"--output-prefix {prefix} is being replaced by a run on host {host} (pid {pid}), which keeps the "
                f"previous dataset in {aside}; wait for that run, or if it is dead, move {aside}'s files back "
                f"next to the prefix and delete the folder")
    for partial in _work_dirs(prefix, PARTIAL_TAG):
        status = _status(partial, PARTIAL_TAG)
        if status == "stale":
            shutil.rmtree(partial, ignore_errors=True)
            notes.append(f"removed {partial}, the staging folder of an interrupted run")
        elif status == "foreign":
            host, pid = _owner(partial, PARTIAL_TAG)
            notes.append(f"left {partial} alone: a run on host {host} (pid {pid}) made it; delete it if that "
                         f"run is over")
    return notes


class _Notes(list):
    """A list of notes that logs each one as it is added."""

    def append(self, note: str) -> None:
        logger.warning("%s", note)
        super().append(note)


def prepare_output(prefix: str, overwrite: bool) -> List[str]:
    """Everything about ``--output-prefix`` that can fail before any work: its form, a writable
    folder, leftovers of interrupted runs (cleaned and logged, see :func:`recover_interrupted`) and
    an existing dataset without ``--overwrite-cache``. Returns the recovery notes."""
    check_prefix(prefix)
    check_output_dir(prefix)
    notes = recover_interrupted(prefix)
    check_can_write(prefix, overwrite)
    return notes


def _fault_point(name: str) -> None:
    """Test hook: SIGKILL this process at commit point ``name`` (see the module doc)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the writer --------------------------------------------------------------------------------

class DatasetWriter:
    """Collects samples into temporary indexed datasets; :meth:`commit` moves them into place.

    Use as a context manager: leaving the block with an exception calls :meth:`abort`. A failed
    write (disk full, I/O error) removes the partial files and raises :class:`OutputWriteError`.
    """

    def __init__(self, prefix: str, packed_keys: Sequence[str], extra_keys: Sequence[str],
                 overwrite: bool = False):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = str(prefix)
        self.packed_keys = tuple(packed_keys)
        self.extra_keys = tuple(extra_keys)
        self.overwrite = overwrite
        self._done = False
        self._builders: Dict[Tuple[str, str], object] = {}
        self.tmp_dir = None
        prepare_output(self.prefix, overwrite)
        out_dir = os.path.dirname(os.path.abspath(self.prefix))
        stem = os.path.basename(self.prefix)
        try:
            self.tmp_dir = tempfile.mkdtemp(prefix=f".{stem}.{PARTIAL_TAG}-{_owner_tag()}-", dir=out_dir)
        except OSError as e:
            raise write_error(e, out_dir) from None
        self.tmp_prefix = os.path.join(self.tmp_dir, stem)
        try:
            for k in self.packed_keys:
                self._builders["packed", k] = IndexedDatasetBuilder(
                    packed_prefix(self.tmp_prefix, k) + ".bin", dtype=np.int32)
            for k in self.extra_keys:
                self._builders["extra", k] = IndexedDatasetBuilder(
                    extra_prefix(self.tmp_prefix, k) + ".bin", dtype=np.uint8)
        except OSError as e:
            self.abort()
            raise write_error(e, e.filename or self.tmp_dir) from None
        except BaseException:
            self.abort()
            raise
        self.count = 0

    def _final_path(self, kind: str, key: str, suffix: str) -> str:
        pre = packed_prefix(self.prefix, key) if kind == "packed" else extra_prefix(self.prefix, key)
        return pre + suffix

    def add(self, packed: Dict[str, List[int]], extras: Dict[str, bytes]) -> None:
        import torch

        kind = key = None
        try:
            for key in self.packed_keys:
                kind = "packed"
                b = self._builders["packed", key]
                b.add_item(torch.from_numpy(np.asarray(packed[key], dtype=np.int32)))
                b.end_document()
            for key in self.extra_keys:
                kind = "extra"
                b = self._builders["extra", key]
                b.add_item(torch.from_numpy(np.frombuffer(extras[key], dtype=np.uint8).copy()))
                b.end_document()
        except OSError as e:
            self.abort()
            raise write_error(e, self._final_path(kind, key, ".bin")) from None
        self.count += 1

    def commit(self, meta: dict) -> List[str]:
        """Finalize, write the manifest and publish (see the module doc). Returns the paths."""
        path = self.prefix
        try:
            for (kind, k), b in self._builders.items():
                pre = packed_prefix(self.tmp_prefix, k) if kind == "packed" else extra_prefix(self.tmp_prefix, k)
                path = self._final_path(kind, k, ".bin")
                b.data_file.flush()
                os.fsync(b.data_file.fileno())
                path = self._final_path(kind, k, ".idx")
                b.finalize(pre + ".idx")
            meta = dict(meta)
            meta.update(format_version=FORMAT_VERSION, num_samples=self.count,
                        packed_keys=list(self.packed_keys), extra_keys=list(self.extra_keys))
            self.meta = meta
            path = meta_path(self.prefix)
            with open(meta_path(self.tmp_prefix), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2, ensure_ascii=False, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self.abort()
            raise write_error(e, path) from None
        # re-check now: another run may have written the prefix meanwhile
        try:
            check_can_write(self.prefix, self.overwrite)
        except BaseException:
            self.abort()
            raise
        _fault_point("staged")
        tmp_files = output_files(self.tmp_prefix, self.packed_keys, self.extra_keys)
        final_files = output_files(self.prefix, self.packed_keys, self.extra_keys)
        self._publish(tmp_files, final_files)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True
        return final_files

    def _publish(self, tmp_files: List[str], final_files: List[str]) -> None:
        out_dir = os.path.dirname(os.path.abspath(self.prefix))
        stem = os.path.basename(self.prefix)
        old = sorted(existing_outputs(self.prefix), key=lambda p: p.endswith(META_SUFFIX))  # manifest last
        aside = None
        try:
            if old:
                aside = tempfile.mkdtemp(prefix=f".{stem}.{ASIDE_TAG}-{_owner_tag()}-", dir=out_dir)
                link = True
                for path in old:  # a complete copy of the previous dataset, its manifest last
                    dst = os.path.join(aside, os.path.basename(path))
                    if link:
                        try:
                            os.link(path, dst)
                            continue
                        except OSError as e:
                            if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
                                raise
                            link = False  # no hard links here (some network / FUSE filesystems): move
                    os.replace(path, dst)
                fsync_dir(aside)
                _fault_point("aside")
                for path in reversed(old):  # the manifest first: the prefix stops claiming a dataset
                    if os.path.lexists(path):
                        os.remove(path)
                fsync_dir(out_dir)
            for i, (src, dst) in enumerate(zip(tmp_files, final_files)):  # the manifest last
                os.replace(src, dst)
                if i == 0:
                    _fault_point("swap")
            fsync_dir(out_dir)
        except BaseException as err:
            self._rollback(aside, final_files)
            if isinstance(err, OSError):
                raise write_error(err, err.filename or self.prefix) from None
            raise
        _fault_point("published")
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _rollback(self, aside: Optional[str], final_files: List[str]) -> None:
        """A publish that failed in this process: the previous dataset back, the new files gone."""
        try:
            if aside is not None:
                _restore_aside(aside, self.prefix)
            else:
                for path in final_files:
                    if os.path.exists(path):
                        os.remove(path)
        except OSError as e:
            logger.error("could not roll back the dataset at %s (%s); the previous one is in %s",
                         self.prefix, _strerror(e), aside)
        self.abort()

    def abort(self) -> None:
        for b in getattr(self, "_builders", {}).values():
            try:
                b.data_file.close()
            except Exception:
                pass
        if self.tmp_dir:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not self._done:
            self.abort()
        return None

def all_files_of(meta: dict, prefix: str) -> Iterable[str]:
    return output_files(prefix, meta.get("packed_keys", ()), meta.get("extra_keys", ()))
