"""A Hugging Face model folder on disk: its tensors read lazily (`HFWeights`: safetensors or .bin, sharded or
not, transformers 5's fused experts read as the Hub's per-expert names), its config.json read, and weights,
JSON files and tokenizer files written atomically. Also the Hugging Face tensor names the reader itself needs:
the top-level ones and the MoE blocks' (`moe_hf_names`); the rest of the name mapping is `hf_mapping.py`.
It needs torch and safetensors, not megatron.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Dict, Iterable, List, Optional

import torch

from mindspeed_llm.checkpoint.errors import ConversionError
from mindspeed_llm.files import write_atomically

HF_EMBED = "embed_tokens.weight"
HF_FINAL_NORM = "norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_SCORE = "score.weight"

# HF files that carry the tokenizer (and generation defaults): copied next to converted weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)

# Tensors older exports carry that hold no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def moe_hf_names(spec):
    """(prefix of the MoE block, (gate, up, down) expert projection names) of `spec`'s family."""
    if spec.family == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------------- readers

class HFWeights:
    """Lazy reader of a Hugging Face model folder's tensors.

    Handles `model.safetensors`, sharded `model.safetensors.index.json`, `pytorch_model.bin` and sharded
    `pytorch_model.bin.index.json`. Key names are returned without the decoder prefix ("model." for
    *ForCausalLM / *ForSequenceClassification exports, "" for bare *Model exports); `lm_head.weight`
    and `score.weight` keep theirs.
    """

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"Hugging Face model directory {self.path} does not exist")
        self._files: Dict[str, str] = {}  # raw key -> file
        self._handles: Dict[str, object] = {}
        self._bins: Dict[str, Dict[str, torch.Tensor]] = {}
        # Per-expert names read out of transformers' fused expert tensors: name -> (fused name, expert, part).
        self._views: Dict[str, tuple] = {}
        self._fused: Dict[str, str] = {}  # fused name -> raw key
        self._cached: tuple = (None, None)  # (fused name, tensor): one fused tensor is read once for its experts
        self._discover()
        raw = list(self._files)
        self.prefix = "model." if any(k.startswith("model.") for k in raw) else ""
        self._by_name = {}
        for key in raw:
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            if self.prefix and key.startswith(self.prefix):
                self._by_name[key[len(self.prefix):]] = key
            else:
                self._by_name[key] = key

    def _discover(self) -> None:
        candidates = [
            ("model.safetensors.index.json", True), ("model.safetensors", False),
            ("pytorch_model.bin.index.json", True), ("pytorch_model.bin", False),
        ]
        for name, is_index in candidates:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                continue
            if is_index:
                weight_map = read_json(full).get("weight_map") or {}
                if not weight_map:
                    raise ConversionError(f"{full} has no weight_map")
                for key, shard in weight_map.items():
                    shard_path = os.path.join(self.path, shard)
                    if not os.path.isfile(shard_path):
                        raise FileNotFoundError(f"{full} lists {shard} (for {key}) but {shard_path} is missing")
                    self._files[key] = shard_path
            else:
                for key in self._keys_of(full):
                    self._files[key] = full
            return
        raise FileNotFoundError(
            f"no Hugging Face weights in {self.path}: expected model.safetensors, model.safetensors.index.json, "
            f"pytorch_model.bin or pytorch_model.bin.index.json"
        )

    def _keys_of(self, file: str) -> List[str]:
        if file.endswith(".safetensors"):
            return list(self._handle(file).keys())
        return list(self._bin(file).keys())

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            except Exception as err:  # SafetensorError: truncated or not a safetensors file
                raise _unreadable(file, err) from None
        return self._handles[file]

    def _bin(self, file: str) -> Dict[str, torch.Tensor]:
        if file not in self._bins:
            try:
                try:
                    self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
                    self._bins[file] = torch.load(file, map_location="cpu", weights_only=True)
            except (RuntimeError, EOFError, OSError, ValueError) as err:
                raise _unreadable(file, err) from None
        return self._bins[file]

    def expose_fused_experts(self, spec) -> None:
        """Let transformers' fused expert tensors (`layers.i.mlp.experts.gate_up_proj` [E, 2F, hidden] and
        `down_proj` [E, hidden, F]) read as the per-expert Hub names of `spec`'s family; Mixtral's fused
        router `layers.i.mlp.gate.weight` reads as `block_sparse_moe.gate.weight`. No-op for a dense model
        or the Hub format."""
        if not spec.is_moe:
            return
        moe, (gate, up, down) = moe_hf_names(spec)
        fused = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
        for name in list(self._by_name):
            match = fused.match(name)
            if not match:
                continue
            layer, kind = match.group(1), match.group(2)
            shape = self._raw_shape(name)
            rows = spec.num_experts
            if len(shape) != 3 or shape[0] != rows or (kind == "gate_up_proj" and shape[1] % 2):
                raise ConversionError(
                    f"fused expert tensor {self.prefix}{name} in {self.path} has shape {tuple(shape)}; "
                    f"{'[num_experts, 2 x expert width, hidden]' if kind == 'gate_up_proj' else '[num_experts, hidden, expert width]'} "
                    f"with num_experts={rows} was expected: use the config.json these weights were saved with")
            base = f"layers.{layer}.{moe}experts."
            for j in range(rows):
                if kind == "gate_up_proj":
                    self._views[f"{base}{j}.{gate}.weight"] = (name, j, 0)
                    self._views[f"{base}{j}.{up}.weight"] = (name, j, 1)
                else:
                    self._views[f"{base}{j}.{down}.weight"] = (name, j, None)
            self._fused[name] = self._by_name.pop(name)  # read only through the per-expert views
            if moe != "mlp.":
                router = f"layers.{layer}.mlp.gate.weight"
                if router in self._by_name:
                    self._by_name[f"layers.{layer}.{moe}gate.weight"] = self._by_name.pop(router)

    def _view(self, name: str) -> torch.Tensor:
        source, j, part = self._views[name]
        if self._cached[0] != source:
            self._cached = (source, self._raw_get(source))
        tensor = self._cached[1][j]
        if part is not None:
            tensor = torch.chunk(tensor, 2, dim=0)[part]
        return tensor.clone()

    def names(self) -> List[str]:
        return list(self._by_name) + list(self._views)

    def has(self, name: str) -> bool:
        return name in self._by_name or name in self._views

    def get(self, name: str) -> torch.Tensor:
        if name in self._views:
            return self._view(name)
        return self._raw_get(name)

    def _raw_get(self, name: str) -> torch.Tensor:
        if name not in self._by_name and name not in self._fused:
            raise ConversionError(f"Hugging Face checkpoint {self.path} has no tensor {self.prefix}{name}")
        key = self._by_name.get(name) or self._fused[name]
        file = self._files[key]
        if file.endswith(".safetensors"):
            try:
                return self._handle(file).get_tensor(key)
            except ConversionError:
                raise
            except Exception as err:
                raise _unreadable(file, err, key) from None
        return self._bin(file)[key]

    def shape(self, name: str) -> tuple:
        """The shape of tensor `name`, without reading its data (safetensors)."""
        if name in self._views:
            source, _, part = self._views[name]
            fused = self._raw_shape(source)
            return (fused[1] // 2 if part is not None else fused[1], fused[2])
        return self._raw_shape(name)

    def _raw_shape(self, name: str) -> tuple:
        key = self._by_name.get(name) or self._fused[name]
        file = self._files[key]
        if file.endswith(".safetensors"):
            try:
                return tuple(self._handle(file).get_slice(key).get_shape())
            except ConversionError:
                raise
            except Exception as err:
                raise _unreadable(file, err, key) from None
        return tuple(self._bin(file)[key].shape)

    def dtype(self) -> torch.dtype:
        """The dtype of the weights (that of the embedding)."""
        return self.get(HF_EMBED).dtype


def _unreadable(file: str, err: Exception, key: Optional[str] = None) -> "ConversionError":
    what = f" (reading {key})" if key else ""
    detail = " ".join(str(err).split())[:200]
    return ConversionError(
        f"{file} cannot be read{what}: it is truncated or not a valid weights file ({detail}); download or copy "
        f"it again (compare its size with the source)")


def read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"{file} is not valid JSON ({err}); download or copy it again") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(path: str) -> dict:
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isdir(os.fspath(path)):
        raise FileNotFoundError(f"Hugging Face model directory {path} does not exist")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}: pass a Hugging Face model directory as --load-dir")
    return read_json(file)

# ------------------------------------------------------------------------------------------- writers

def _independent(tensors: Iterable[torch.Tensor]):
    """Contiguous tensors that share no storage (safetensors refuses shared or partial storages)."""
    seen = set()
    for t in tensors:
        t = t.detach().contiguous()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        yield t


def save_hf_weights(state: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = 5 * 1024 ** 3) -> List[str]:
    """Write `state` as model.safetensors (or shards + model.safetensors.index.json) atomically per file.

    Each file is written under a temporary name and renamed into place; the index (when sharded) last.
    Returns the file names written.
    """
    from safetensors.torch import save_file

    names = list(state)
    tensors = dict(zip(names, _independent(state[n] for n in names)))
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    try:
        for file, shard in zip(files, shards):
            write_atomically(os.path.join(out_dir, file), lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
            written.append(file)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": {name: file for file, shard in zip(files, shards) for name in shard},
            }
            write_json_atomic(os.path.join(out_dir, "model.safetensors.index.json"), index)
            written.append("model.safetensors.index.json")
    except OSError:  # a WriteError naming the file: the shards written before it go too (nothing partial stays)
        for file in written:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, file))
        raise
    return written


_WEIGHT_FILE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$"
)


def remove_hf_weights(out_dir: str) -> List[str]:
    """Delete weight files a previous export left in `out_dir` (a different sharding would shadow ours)."""
    removed = []
    if not os.path.isdir(out_dir):
        return removed
    for name in os.listdir(out_dir):
        if _WEIGHT_FILE.match(name):
            os.remove(os.path.join(out_dir, name))
            removed.append(name)
    return removed


def write_json_atomic(path: str, data) -> None:
    """`data` as JSON in `path` (`files.write_atomically`: a failed write names the file, leaves no temp file)."""
    from mindspeed_llm.files import write_text_atomically

    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def copy_tokenizer_files(src: str, dst: str) -> List[str]:
    """Copy the tokenizer (and generation_config) files found in `src` to `dst`; returns their names."""
    import shutil

    copied = []
    if not src or not os.path.isdir(src):
        return copied
    for name in sorted(os.listdir(src)):
        if name in TOKENIZER_FILES or name.endswith(".tiktoken"):
            source = os.path.join(src, name)
            write_atomically(os.path.join(dst, name), lambda tmp, source=source: shutil.copyfile(source, tmp))
            copied.append(name)
    return copied
