"""A registry of classes by name whose entries may be given as "module:attribute" strings, imported on first read:
the stages (`rl/stages`) and the rollout strategies (`rl/rollout_strategies.py`) register this way, so naming a
choice (a parser's `--stage` list) does not import megatron-core."""

import importlib
from collections.abc import MutableMapping
from typing import Dict, Iterator


class LazyRegistry(MutableMapping):
    """name -> class; a value given as "module:attribute" is imported when first read, then kept."""

    def __init__(self, entries: Dict[str, object]):
        self._entries = dict(entries)

    def __getitem__(self, name: str):
        value = self._entries[name]
        if isinstance(value, str):
            module, attribute = value.split(":")
            value = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return value

    def __setitem__(self, name: str, value) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
