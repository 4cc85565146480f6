"""The project's one registry idiom: a `Registry` maps a name to what is registered under it (a class, a function, a
spec). Every registry is one (the stages, the sample generators and rollout schedules, the tools and their call
parsers, the data handlers, the advantage estimators, the policy losses, the verifiers), and a new entry is one
`@REGISTRY.register(name)` (a decorator) or one `REGISTRY[name] = value` (what a user's module does to add a tool parser).

An entry may be given as a "module:attribute" string, imported on first read: the stages, generators and schedules
register this way, so naming a choice (a parser's `--stage` list) does not import megatron-core."""

import importlib
from collections.abc import MutableMapping
from typing import Callable, Dict, Iterator, Optional


class Registry(MutableMapping):
    """name -> entry, in the order registered; a value given as "module:attribute" is imported when first read, then
    kept."""

    def __init__(self, entries: Optional[Dict[str, object]] = None):
        self._entries = dict(entries or {})

    def register(self, name: Optional[str] = None) -> Callable:
        """Decorator: register the decorated class or function under `name` (default: its `__name__`)."""
        def decorator(value):
            self[value.__name__ if name is None else name] = value
            return value
        return decorator

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

    def __repr__(self) -> str:
        return f"Registry({sorted(self._entries)})"


# The name the stages and rollout registries first used (lazy "module:attribute" entries are a Registry's own).
LazyRegistry = Registry
