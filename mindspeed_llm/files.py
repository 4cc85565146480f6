"""Small filesystem helpers: crash-safe publishing (datasets and checkpoints alike), writes whose failure names the
file and leaves nothing partial (`write_atomically`, `append_line`), and YAML files read strictly (`read_yaml`)."""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Callable

from mindspeed_llm.errors import UserError


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


# ------------------------------------------------------------------------------------------- named writes
class WriteError(UserError, OSError):
    """A file could not be written; the message names the file and the cause (a full disk by name). What was
    being written is gone (a temp file removed, a half line cut off); what was there before stays. `errno` is the
    cause's (ENOSPC for a full disk), `filename` the file; `str` is the one-line message."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def write_error_message(path: str, exc: BaseException) -> str:
    """One line for a failed write of `path`: a full disk is named as such (torch's zip writer reports it as an
    'unexpected pos' RuntimeError, safetensors as a SafetensorError), as is a permission problem."""
    text = str(exc)
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text or "unexpected pos" in text:
        return f"No space left on device writing {path}"
    if isinstance(exc, PermissionError) or "Permission denied" in text:
        return f"permission denied writing {path}"
    return f"cannot write {path} ({' '.join(text.split())[:200]})"


def write_atomically(path: str, write: Callable[[str], None], error=WriteError) -> None:
    """`write(tmp)` to a temp name beside `path`, then renamed into place. Any failure of the writer (an OSError,
    torch's RuntimeError, safetensors' SafetensorError: none of them names the file) removes the temp file and
    raises `error` (a `WriteError`) naming `path`; the previous file, if any, stays. Every writer of a file a user
    keeps goes through here (checkpoints, Hugging Face and PEFT folders, JSON, copied tokenizers, samples)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 (the writers' own error types differ; each becomes one named line)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, WriteError):
            raise
        raise _named(error, path, exc) from exc


def _named(error, path: str, exc: BaseException) -> "WriteError":
    named = error(write_error_message(path, exc))  # str() is the message alone
    named.errno = getattr(exc, "errno", None) or (errno.ENOSPC if "No space left" in str(named) else errno.EIO)
    named.filename = path
    return named


def write_text_atomically(path: str, text: str, error=WriteError) -> None:
    """`text` as the whole of `path`, flushed to disk, through `write_atomically` (a failure raises `error`)."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, write, error=error)


def open_for_append(path: str):
    """`path` opened to append text (created when missing); a failure (a directory there, no permission, a full
    disk) raises `WriteError` naming the file."""
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as exc:
        if isinstance(exc, IsADirectoryError):
            raise _named(WriteError, path, OSError(exc.errno, "it is a directory; move it away")) from exc
        raise _named(WriteError, path, exc) from exc


def append_line(handle, line: str) -> None:
    """Append `line` (ending in a newline) to the open text file `handle` and flush it; a failed write is cut off
    again (no half line for a reader) and raises `WriteError` naming the file."""
    start = handle.tell()
    try:
        handle.write(line)
        handle.flush()
    except Exception as exc:  # noqa: BLE001
        with contextlib.suppress(OSError, ValueError):
            handle.seek(start)
            handle.truncate(start)
        raise _named(WriteError, handle.name, exc) from exc


# ------------------------------------------------------------------------------------------- YAML
class YamlFileError(UserError, ValueError):
    """A YAML file that cannot be read as asked; the message names the file, the line and the fix."""


def read_yaml(path: str, what: str = "", allow_null=lambda keys: False):
    """The YAML document in `path`, read strictly: not UTF-8, not YAML, a key given twice in one mapping (YAML keeps
    the last silently) or a key whose value is null or left empty (`key: ~`, `key:`; a default would take its
    place silently) is a `YamlFileError` naming `what` (e.g. "--config x.yaml"), the line(s) and the key.
    `allow_null(keys)` (the key's path, a tuple) says where a null means something documented. A missing or empty
    file is the caller's to judge (FileNotFoundError / None)."""
    import yaml

    label = what or path
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise YamlFileError(f"{label}: line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text; save the file "
                            "as UTF-8") from None

    class StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, keys=()):
        # every key of the mapping checked first, then the values (each key constructed once)
        seen, pairs = {}, []
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            where = "".join(k if str(k).startswith("[") else f".{k}" for k in (*keys, str(key)))[1:]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise YamlFileError(f"{label}: '{where}' is given twice (lines {seen[key]} and {line}); YAML would "
                                    "keep the last silently: keep one")
            seen[key] = line
            if value_node.tag == "tag:yaml.org,2002:null" and not allow_null((*keys, key)):
                raise YamlFileError(f"{label}: line {line}: '{where}' has no value (null or left empty), which "
                                    "would leave the default in its place silently; give a value or delete the key")
            pairs.append((key, value_node))
        return {key: _construct(loader, value_node, (*keys, key)) for key, value_node in pairs}

    def _construct(loader, node, keys):
        if isinstance(node, yaml.MappingNode):
            return construct_mapping(loader, node, keys)
        if isinstance(node, yaml.SequenceNode):
            return [_construct(loader, item, (*keys, f"[{i}]")) for i, item in enumerate(node.value)]
        return loader.construct_object(node, deep=True)

    try:
        loader = StrictLoader(text)
        try:
            node = loader.get_single_node()
            return None if node is None else _construct(loader, node, ())
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or exc).split())
        raise YamlFileError(f"{label}: {where}not valid YAML ({problem})") from None
    except yaml.YAMLError as exc:
        raise YamlFileError(f"{label}: not valid YAML ({' '.join(str(exc).split())})") from None
