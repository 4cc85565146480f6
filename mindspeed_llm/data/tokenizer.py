"""Loading the Hugging Face tokenizer named by ``--tokenizer-type`` / ``--tokenizer-name-or-path``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Tuple

from mindspeed_llm.data.errors import DataError, UnknownNameError

# MindSpeed-LLM scripts say PretrainedFromHF, MindSpeed-RL configs say HuggingFaceTokenizer: same thing.
TOKENIZER_TYPES = ("PretrainedFromHF", "HuggingFaceTokenizer")

_CACHE: Dict[Tuple, object] = {}


def _stamp(path: Path) -> float:
    if path.is_dir():
        return max((f.stat().st_mtime for f in path.iterdir() if f.is_file()), default=0.0)
    return path.stat().st_mtime if path.exists() else 0.0


def load_tokenizer(tokenizer_type: str, name_or_path: str, use_fast: bool = True):
    """A ``transformers`` tokenizer. Loaded once per process for the same files (cached)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise UnknownNameError(
            f"unknown --tokenizer-type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPES)}")
    if not name_or_path:
        raise DataError("--tokenizer-name-or-path is required (a local Hugging Face tokenizer folder)")
    path = Path(name_or_path)
    key = (str(path.resolve()) if path.exists() else name_or_path, bool(use_fast), _stamp(path))
    if key in _CACHE:
        return _CACHE[key]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, use_fast=use_fast, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        hint = "" if path.exists() else " (the path does not exist; no network is used, give a local folder)"
        raise DataError(f"cannot load tokenizer from {name_or_path!r}{hint}: {e}") from None
    _CACHE[key] = tok
    return tok


def tokenizer_info(tok, name_or_path: str) -> dict:
    """What a preprocessed dataset records about the tokenizer that made it."""
    return {
        "name_or_path": str(name_or_path),
        "class": type(tok).__name__,
        "vocab_size": len(tok),
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
    }
