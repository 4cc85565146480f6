"""Writing a preprocessed dataset: Megatron indexed datasets plus a manifest, all or nothing.

Files under ``--output-prefix PREFIX`` (see :func:`output_files`):

``PREFIX_packed_{key}_document.bin/.idx``  token ids per sample, int32 (``input_ids``; also
                                           ``labels`` with -100 on the prompt for SFT data)
``PREFIX_extra_{key}_document.bin/.idx``   one UTF-8 JSON value per sample, uint8 bytes
                                           (string ``labels``, ``--dataset-additional-keys``)
``PREFIX_meta.json``                       the manifest: handler, template, tokenizer, keys,
                                           sample count, dropped-row counts; written last

Every file is first written into a hidden temporary folder next to the prefix and only moved
into place once all of them are complete, the manifest last. A run that fails part way removes
its temporary folder and leaves no manifest, so a half-written dataset never looks complete
(:class:`~mindspeed_llm.data.prompt_dataset.PromptDataset` requires the manifest).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

import numpy as np

from mindspeed_llm.data.errors import OutputExistsError

FORMAT_VERSION = 1
META_SUFFIX = "_meta.json"


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


class DatasetWriter:
    """Collects samples into temporary indexed datasets; :meth:`commit` moves them into place.

    Use as a context manager: leaving the block with an exception calls :meth:`abort`.
    """

    def __init__(self, prefix: str, packed_keys: Sequence[str], extra_keys: Sequence[str],
                 overwrite: bool = False):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = str(prefix)
        self.packed_keys = tuple(packed_keys)
        self.extra_keys = tuple(extra_keys)
        self.overwrite = overwrite
        check_can_write(self.prefix, overwrite)
        out_dir = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(out_dir, exist_ok=True)
        base = os.path.basename(self.prefix) or "dataset"
        self.tmp_dir = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=out_dir)
        self.tmp_prefix = os.path.join(self.tmp_dir, base)
        self._builders: Dict[str, object] = {}
        try:
            for k in self.packed_keys:
                self._builders["packed", k] = IndexedDatasetBuilder(
                    packed_prefix(self.tmp_prefix, k) + ".bin", dtype=np.int32)
            for k in self.extra_keys:
                self._builders["extra", k] = IndexedDatasetBuilder(
                    extra_prefix(self.tmp_prefix, k) + ".bin", dtype=np.uint8)
        except BaseException:
            self.abort()
            raise
        self.count = 0
        self._done = False

    def add(self, packed: Dict[str, List[int]], extras: Dict[str, bytes]) -> None:
        import torch

        for k in self.packed_keys:
            b = self._builders["packed", k]
            b.add_item(torch.from_numpy(np.asarray(packed[k], dtype=np.int32)))
            b.end_document()
        for k in self.extra_keys:
            b = self._builders["extra", k]
            b.add_item(torch.from_numpy(np.frombuffer(extras[k], dtype=np.uint8).copy()))
            b.end_document()
        self.count += 1

    def commit(self, meta: dict) -> List[str]:
        """Finalize, write the manifest and move everything into place. Returns the paths."""
        for (kind, k), b in self._builders.items():
            pre = packed_prefix(self.tmp_prefix, k) if kind == "packed" else extra_prefix(self.tmp_prefix, k)
            b.finalize(pre + ".idx")
        meta = dict(meta)
        meta.update(format_version=FORMAT_VERSION, num_samples=self.count,
                    packed_keys=list(self.packed_keys), extra_keys=list(self.extra_keys))
        self.meta = meta
        with open(meta_path(self.tmp_prefix), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, ensure_ascii=False, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        # re-check now: another run may have written the prefix meanwhile
        check_can_write(self.prefix, self.overwrite)
        if self.overwrite:
            # the old manifest goes first, so a crash below never leaves an old manifest
            # describing a mix of old and new files
            old = existing_outputs(self.prefix)
            for path in sorted(old, key=lambda p: not p.endswith(META_SUFFIX)):
                os.remove(path)
        tmp_files = output_files(self.tmp_prefix, self.packed_keys, self.extra_keys)
        final_files = output_files(self.prefix, self.packed_keys, self.extra_keys)
        for src, dst in zip(tmp_files, final_files):  # manifest last
            os.replace(src, dst)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True
        return final_files

    def abort(self) -> None:
        for b in getattr(self, "_builders", {}).values():
            try:
                b.data_file.close()
            except Exception:
                pass
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not self._done:
            self.abort()
        return None


def read_meta(prefix: str) -> dict:
    with open(meta_path(prefix), encoding="utf-8") as f:
        return json.load(f)


def all_files_of(meta: dict, prefix: str) -> Iterable[str]:
    return output_files(prefix, meta.get("packed_keys", ()), meta.get("extra_keys", ()))
