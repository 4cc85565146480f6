"""verl's published tool classes, imported from the installed ``verl`` wheel (``verl==0.7.1``, installed without its
dependencies by scripts/setup_venv.sh) as they are, without what verl's package ``__init__`` files pull in (ray,
tensordict, omegaconf: a training stack this test does not need).

`published_verl_tools` runs the files verl ships for a tool (`verl/tools/gsm8k_tool.py`, `base_tool.py`,
`schemas.py`, `verl/utils/rollout_trace.py`, `verl/utils/reward_score/gsm8k.py`) unchanged. Two things are not
verl's: the package ``__init__`` files of ``verl``, ``verl.utils``, ``verl.utils.reward_score`` are not run (empty
packages over verl's own folders stand in), and ``verl.utils.ray_utils`` (ray) is replaced by its one function
that `rollout_trace` imports, ``get_event_loop``, written here. Everything is taken out of ``sys.modules`` after.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import os
import sys
import types

VERL_PIN = "verl==0.7.1"
_EMPTY_PACKAGES = ("verl", "verl.utils", "verl.utils.reward_score", "verl.tools")


def verl_root() -> str:
    spec = importlib.util.find_spec("verl")  # finds the folder without running verl/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"verl is not installed: scripts/setup_venv.sh installs {VERL_PIN} (--no-deps)")
    return list(spec.submodule_search_locations)[0]


def _get_event_loop():
    """What verl's ``ray_utils.get_event_loop`` returns: the thread's loop, a new one set when there is none."""
    try:
        return asyncio.get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


@contextlib.contextmanager
def published_verl_tools():
    """Inside: ``import verl.tools.gsm8k_tool`` etc. run verl's own files (module docstring)."""
    root = verl_root()
    saved = {name: module for name, module in sys.modules.items() if name == "verl" or name.startswith("verl.")}
    for name in saved:
        del sys.modules[name]
    try:
        for name in _EMPTY_PACKAGES:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = package
        ray_utils = types.ModuleType("verl.utils.ray_utils")
        ray_utils.get_event_loop = _get_event_loop
        sys.modules["verl.utils.ray_utils"] = ray_utils
        importlib.invalidate_caches()
        yield root
    finally:
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]
        sys.modules.update(saved)
