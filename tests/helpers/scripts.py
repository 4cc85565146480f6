"""The repository's scripts (scripts/, benchmarks/) imported as modules by file path, for the tests that read them."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, path: Path):
    """The file at `path` imported as module `name` (registered in sys.modules: dataclasses look their module up
    while the class is made)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
