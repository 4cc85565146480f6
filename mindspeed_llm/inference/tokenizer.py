"""`HFTokenizerAdapter`: a Hugging Face tokenizer with the interface `megatron.core.inference` expects.

Megatron's inference code (controllers, text-generation server, engines) calls `tokenize(text) -> ids`,
`detokenize(ids[, skip_special_tokens])`, `offsets(ids, text)`, and reads `eod`, `eos_id`, `bos`, `pad`,
`vocab_size`, `additional_special_tokens_ids`, `apply_chat_template`. This adapter provides exactly those
on top of a `transformers` tokenizer (or anything with `encode`/`decode`/`eos_token_id`), plus
`sampling_config(**overrides)` for `generate` with the tokenizer's EOS and pad ids.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from mindspeed_llm.inference.sampling import SamplingConfig


class HFTokenizerAdapter:
    def __init__(self, hf_tokenizer, add_special_tokens: bool = False):
        """`add_special_tokens=False` (default): `tokenize` returns the text's tokens only, as Megatron's
        tokenizers do; Megatron's controller adds BOS itself when asked (`add_BOS`)."""
        self.hf = hf_tokenizer
        self.add_special_tokens = add_special_tokens

    # ------------------------------------------------------------------ text <-> ids
    def tokenize(self, text: str) -> List[int]:
        return list(self.hf.encode(text, add_special_tokens=self.add_special_tokens))

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def offsets(self, ids: Sequence[int], text: str) -> List[int]:
        """Character offset in `text` where each token starts (prefix-decoding, as Megatron's own
        tokenizers do for byte-level vocabularies)."""
        ids = [int(i) for i in ids]
        out, cursor = [], 0
        for n in range(len(ids)):
            out.append(min(cursor, len(text)))
            cursor = len(self.hf.decode(ids[: n + 1]))
        return out

    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = True,
                            **kwargs):
        result = self.hf.apply_chat_template(conversation, tokenize=tokenize,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
        if tokenize and isinstance(result, dict):  # transformers >= 5 may return a BatchEncoding
            result = result["input_ids"]
        return result

    # ------------------------------------------------------------------ vocabulary and special ids
    @property
    def vocab_size(self) -> int:
        """All ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def vocab(self) -> Dict[str, int]:
        return self.hf.get_vocab()

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: t for t, i in self.hf.get_vocab().items()}

    @property
    def eod(self) -> Optional[int]:
        eos = self.hf.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos

    @property
    def eos_id(self) -> Optional[int]:
        return self.eod

    @property
    def eos(self) -> Optional[int]:
        return self.eod

    @property
    def bos(self) -> Optional[int]:
        return self.hf.bos_token_id

    @property
    def bos_id(self) -> Optional[int]:
        return self.bos

    @property
    def pad(self) -> Optional[int]:
        """The pad id, falling back to EOS (common for causal LMs without a pad token)."""
        return self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eod

    @property
    def pad_id(self) -> Optional[int]:
        return self.pad

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        ids = getattr(self.hf, "additional_special_tokens_ids", None)
        if ids is None:
            ids = [i for i in getattr(self.hf, "all_special_ids", []) if i not in (self.eod, self.bos, self.pad)]
        return list(ids)

    # ------------------------------------------------------------------ generate() defaults
    def sampling_config(self, **overrides: Any) -> SamplingConfig:
        """A SamplingConfig with this tokenizer's EOS and pad ids (overridable)."""
        kwargs: Dict[str, Any] = dict(eos_token_id=self.eod, pad_token_id=self.pad)
        kwargs.update(overrides)
        return SamplingConfig(**kwargs)

    def __len__(self) -> int:
        return self.vocab_size


__all__ = ["HFTokenizerAdapter"]
