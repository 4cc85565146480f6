"""The prompt data the RL stages read: :class:`PromptDataset`, :class:`PromptSampler` and
:class:`PromptDataLoader`.

Typical use in a stage (``trl_ppo`` / ``grpo``)::

    ds = PromptDataset(args.data_path)                 # the --output-prefix of preprocess_data.py
    loader = PromptDataLoader(ds, global_batch_size=gbs, dp_rank=dp_rank, dp_size=dp_size, seed=args.seed)
    if checkpoint: loader.load_state_dict(checkpoint["prompt_loader"])
    for it in range(train_iters):
        prompts = loader.next_batch()                  # this rank's gbs // dp_size prompts
        # each: {"input_ids": [...], "labels": "42" or None, **additional keys}
        ...
        checkpoint["prompt_loader"] = loader.state_dict()

Order: every epoch is a permutation of all prompts drawn from ``(seed, epoch)``; a global batch
is the next ``global_batch_size`` prompts of it (the incomplete tail of an epoch is skipped, so
every iteration has a full global batch); DP rank ``r`` takes the ``r``-th contiguous slice of
``global_batch_size // dp_size`` prompts, so ranks never overlap. The state is the position
``(epoch, batch in epoch)`` and does not depend on the DP rank, so a resumed run, even with
another DP size, continues with exactly the prompts an uninterrupted run would have seen.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, Iterator, List, Optional

import numpy as np

from mindspeed_llm.data.errors import DataError, DatasetNotFoundError, NotEnoughPromptsError
from mindspeed_llm.data.writer import (FORMAT_VERSION, all_files_of, aside_copy, extra_prefix, meta_path,
                                       packed_prefix)

logger = logging.getLogger(__name__)

PREPROCESS_HINT = (
    "python preprocess_data.py --input <data file> --tokenizer-type PretrainedFromHF "
    "--tokenizer-name-or-path <tokenizer folder> --handler-name R1AlpacaStyleInstructionHandler "
    "--prompt-type <template> --output-prefix {prefix}  "
    "(or: OUTPUT_PREFIX={prefix} bash examples/data/preprocess_data.sh <deepscaler|math_17k|alpaca>)"
)


def _open_indexed(prefix: str, mmap: bool, hint: str):
    """Megatron's IndexedDataset at `prefix`, or a DataError naming the damaged file: an .idx that megatron cannot
    parse, or a .bin shorter than the index says (a truncated copy would fail at the first prompt past its end)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if os.path.isfile(f"{prefix}.bin") and os.path.getsize(f"{prefix}.bin") == 0:  # megatron cannot mmap it
        raise DataError(f"{prefix}.bin is empty: the dataset holds no prompts (written from an input with no rows, "
                        f"or emptied since); preprocess an input that has prompts: {hint}")
    dataset = IndexedDataset.__new__(IndexedDataset)
    try:
        dataset.__init__(prefix, mmap=mmap)
        index = dataset.index
        expected = 0 if len(index) == 0 else int(index.sequence_pointers[-1]) + \
            int(index.sequence_lengths[-1]) * int(index.dtype_size)
    except Exception as exc:  # struct / numpy / assertion errors of a truncated or foreign index
        # megatron's __del__ deletes both readers: give the half-built object them, so it goes quietly
        dataset.bin_reader = dataset.index = None
        raise DataError(f"{prefix}.idx cannot be read ({type(exc).__name__}: {str(exc)[:120]}): the dataset is "
                        f"damaged; recreate it with: {hint}") from None
    size = os.path.getsize(f"{prefix}.bin")
    if size < expected:
        raise DataError(f"{prefix}.bin holds {size} bytes, its index needs {expected}: the file is truncated; "
                        f"recreate the dataset with: {hint}")
    return dataset


class PromptDataset:
    """Random access to a preprocessed dataset at ``prefix``.

    ``ds[i]`` is ``{"input_ids": list[int], "labels": str | None, **extras}``: the prompt's token
    ids, the reference answer string when the dataset has one (for SFT data made by
    ``AlpacaStyleInstructionHandler``, the token-level ``labels`` list instead) and every
    ``--dataset-additional-keys`` column with its original JSON type.
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix = str(prefix)
        hint = PREPROCESS_HINT.format(prefix=self.prefix)
        mpath = meta_path(self.prefix)
        #: where the files are read from: the prefix, or the previous dataset's copy kept by an
        #: interrupted --overwrite-cache swap (see mindspeed_llm.data.writer)
        self.files_prefix = self.prefix
        copy = None if os.path.isfile(mpath) else aside_copy(self.prefix)
        if copy is not None:
            logger.warning(
                "the dataset at %s is being replaced, or its --overwrite-cache run was killed: reading the previous "
                "dataset from %s; rerun preprocess_data.py on this prefix to restore or replace it", self.prefix, copy)
            self.files_prefix = copy
            mpath = meta_path(copy)
        if not os.path.isfile(mpath):
            partial = [p for p in (packed_prefix(self.prefix, "input_ids") + ".bin",) if os.path.exists(p)]
            what = "is incomplete (its manifest is missing)" if partial else "does not exist"
            raise DatasetNotFoundError(
                f"the prompt dataset at prefix {self.prefix!r} {what}: {mpath} not found. Create it with: {hint}")
        try:
            with open(mpath, encoding="utf-8") as f:
                self.meta: dict = json.load(f)
        except json.JSONDecodeError as e:
            raise DatasetNotFoundError(f"{mpath} is corrupt ({e.msg}); recreate it with: {hint}") from None
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{mpath} has format version {self.meta.get('format_version')!r}, this code reads "
                            f"{FORMAT_VERSION}; recreate it with: {hint}")
        missing = [p for p in all_files_of(self.meta, self.files_prefix) if not os.path.isfile(p)]
        if missing:
            raise DatasetNotFoundError(
                f"the prompt dataset at prefix {self.prefix!r} is incomplete, missing: {', '.join(missing)}. "
                f"Recreate it with: {hint}")
        self.packed_keys: List[str] = list(self.meta["packed_keys"])
        self.extra_keys: List[str] = list(self.meta["extra_keys"])
        if "input_ids" not in self.packed_keys:
            raise DataError(f"{mpath} lists no input_ids dataset")
        self._packed = {k: _open_indexed(packed_prefix(self.files_prefix, k), mmap, hint) for k in self.packed_keys}
        self._extras = {k: _open_indexed(extra_prefix(self.files_prefix, k), mmap, hint) for k in self.extra_keys}
        self._len = int(self.meta["num_samples"])
        for k, d in list(self._packed.items()) + list(self._extras.items()):
            if len(d) != self._len:
                raise DataError(f"{self.prefix}: dataset {k!r} has {len(d)} samples, the manifest says "
                                f"{self._len}; recreate it with: {hint}")

    def __len__(self) -> int:
        return self._len

    def check_prompts(self, flag: str) -> None:
        """RL generates the response itself: a dataset made for SFT (its input_ids hold prompt + response, its
        token-level labels mark the response: `AlpacaStyleInstructionHandler`) would put the reference answers
        inside the prompts. Refused naming `flag`, the handler that made it and the ones to use."""
        if "labels" not in self.packed_keys:
            return
        handler = self.meta.get("handler") or "an SFT handler"
        raise DataError(
            f"{flag} {self.prefix}: this dataset was made by {handler} for SFT: its input_ids hold each prompt with "
            "its response, so RL would train on prompts that contain their reference answers. Preprocess the data "
            "again with --handler-name R1AlpacaStyleInstructionHandler (the answer kept as a label for the "
            "verifiers: --map-keys '{\"labels\": ...}') or PPOAlpacaStyleInstructionHandler (prompts for a reward "
            "model)")

    def __getitem__(self, index: int) -> Dict:
        i = int(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for {self._len} prompts")
        item = {k: d[i].tolist() for k, d in self._packed.items()}
        for k, d in self._extras.items():
            item[k] = json.loads(d[i].tobytes().decode("utf-8"))
        item.setdefault("labels", None)
        return item

    def get_batch(self, indices) -> List[Dict]:
        return [self[i] for i in indices]

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Token count of every sample's ``input_ids``."""
        return np.array(self._packed["input_ids"].sequence_lengths, dtype=np.int64)  # a copy: the index is mmapped

    @property
    def tokenizer_info(self) -> dict:
        return dict(self.meta.get("tokenizer", {}))

    @property
    def stop_words(self) -> List[str]:
        """Stop strings of the chat template the prompts were made with."""
        return list(self.meta.get("template", {}).get("stop_words", []))


def split_indices(dataset_len: int, weights, seed: int) -> List[np.ndarray]:
    """Megatron-LM's ``--split``: the prompt indices of the train, valid and test parts (sorted, disjoint, together
    all of ``range(dataset_len)``). ``weights`` are the parts' shares (summing to 1); part sizes are rounded as
    Megatron-LM rounds them, and which prompts go where is a permutation drawn from ``seed`` alone, so every
    rank and every resumed run gets the same parts."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(float(w) * dataset_len)))
    diff = bounds[-1] - dataset_len
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0x5EED5])))
    order = rng.permutation(dataset_len)
    return [np.sort(order[max(0, a):max(0, b)]) for a, b in zip(bounds[:-1], bounds[1:])]


class PromptDatasetView:
    """A dataset made from another (``dataset``): its files, keys, manifest, tokenizer and stop words are the other's;
    a view gives ``__len__``, ``__getitem__`` and ``prompt_lengths``."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.prefix = dataset.prefix
        self.extra_keys = dataset.extra_keys
        self.meta = dataset.meta

    def get_batch(self, indices) -> List[Dict]:
        return [self[i] for i in indices]

    @property
    def tokenizer_info(self) -> dict:
        return self.dataset.tokenizer_info

    @property
    def stop_words(self) -> List[str]:
        return self.dataset.stop_words


class PromptSubset(PromptDatasetView):
    """The prompts ``indices`` of a :class:`PromptDataset`, as a dataset of their own (a ``--split`` part)."""

    def __init__(self, dataset: PromptDataset, indices, part: str = "train"):
        super().__init__(dataset)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.part = part

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Dict:
        return self.dataset[int(self.indices[index])]

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self.dataset.prompt_lengths[self.indices]


class PromptSampler:
    """Deterministic, DP-sharded, resumable order of prompt indices (see the module doc)."""

    def __init__(self, dataset_len: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 1234, shuffle: bool = True):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be positive, got {global_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch_size % dp_size:
            raise DataError(f"global_batch_size {global_batch_size} is not divisible by the data-parallel "
                            f"size {dp_size}")
        if dataset_len < global_batch_size:
            raise NotEnoughPromptsError(
                f"the dataset has {dataset_len} prompts, fewer than one global batch of {global_batch_size}; "
                f"lower the global batch size or use more data (dropped rows are listed in the dataset's "
                f"_meta.json)")
        if seed < 0:
            raise DataError(f"seed must be non-negative, got {seed}")
        self.dataset_len = int(dataset_len)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.batch_in_epoch = 0
        self.iteration = 0
        self._order_epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def consumed_samples(self) -> int:
        return self.iteration * self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all prompt indices used in ``epoch``."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(epoch)])))
                self._order = rng.permutation(self.dataset_len)
            else:
                self._order = np.arange(self.dataset_len)
            self._order_epoch = epoch
        return self._order

    def global_batch_indices(self, epoch: int, batch: int) -> List[int]:
        """All ``global_batch_size`` indices of batch ``batch`` of ``epoch`` (every rank's)."""
        start = batch * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size].tolist()

    def next_batch_indices(self) -> List[int]:
        """This rank's share of the next global batch; advances the position."""
        g = self.global_batch_indices(self.epoch, self.batch_in_epoch)
        self.batch_in_epoch += 1
        self.iteration += 1
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        n = self.local_batch_size
        return g[self.dp_rank * n:(self.dp_rank + 1) * n]

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch_indices()

    def state_dict(self) -> dict:
        """The position, as plain ints (store it in the training checkpoint)."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "iteration": self.iteration,
                "consumed_samples": self.consumed_samples, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "dataset_len": self.dataset_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "shuffle", "global_batch_size", "dataset_len"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the prompt order: the checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; the resumed prompts would differ from the original run")
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        if not 0 <= batch < self.batches_per_epoch or epoch < 0:
            raise DataError(f"invalid prompt sampler state: epoch={epoch}, batch_in_epoch={batch}")
        self.epoch, self.batch_in_epoch = epoch, batch
        self.iteration = int(state.get("iteration", epoch * self.batches_per_epoch + batch))


class PromptDataLoader:
    """:class:`PromptDataset` + :class:`PromptSampler`: ``next_batch()`` gives this rank's prompts."""

    def __init__(self, dataset: PromptDataset, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 1234, shuffle: bool = True):
        self.dataset = dataset
        self.sampler = PromptSampler(len(dataset), global_batch_size, dp_rank, dp_size, seed, shuffle)

    def next_batch(self) -> List[Dict]:
        return self.dataset.get_batch(self.sampler.next_batch_indices())

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
