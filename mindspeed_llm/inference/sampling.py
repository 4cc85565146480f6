"""Sampling configuration, logits processing and seeding for rollout generation.

Order of the logits processors is the one `transformers` uses for `generate(do_sample=True)`:
temperature, then top-k, then top-p (both may be set together; top-p acts on the top-k renormalised
distribution). Greedy decoding (`do_sample=False`) is the argmax of the raw logits; temperature/top-k/top-p
do not change it. The draw itself is one uniform number per row against the cumulative distribution of the
kept candidates (float64). Each sample has its own stream of uniforms, keyed by (seed, iteration, sample id)
(`sample_uniforms`): a sample's draws do not depend on which rank generates it, on its row in the batch or on
the other samples, so a sampled rollout is the same at any data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

TokenIds = Union[None, int, Sequence[int]]


def _as_id_tuple(ids: TokenIds) -> Tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (int, np.integer)):
        return (int(ids),)
    return tuple(int(i) for i in ids)


@dataclass
class SamplingConfig:
    """How to generate one batch of responses.

    Length limits (both respected, per row): a row with a prompt of `L` tokens may generate at most
    `min(max_new_tokens, max_length - L)` tokens. `max_length` counts the prompt plus the response of that
    row (not a padded batch length). At least one of the two must be set; a row whose prompt already
    reaches `max_length` gets an empty response.

    Stopping: a row stops after emitting any id of `eos_token_id` or `stop_token_ids`; that token is part
    of the response (its mask is 1), everything after it is `pad_token_id` with mask 0.

    Seeding: the j-th token of a sample is drawn with the j-th uniform of that sample's own stream,
    `sample_uniforms(seed, iteration, sample_ids, ...)` (see `generate`); the global RNG is never used.

    Engine limits (the continuous-batching engine of `generate`, vLLM's names; None: no limit): `max_num_seqs`
    bounds the samples in flight at once, which sizes the KV cache (max_num_seqs rows of max(L + R) slots);
    `max_num_batched_tokens` bounds the tokens of one forward (a decode step: its rows; a prefill: rows x padded
    width, a longer prompt is prefilled in chunks). They change speed and memory, never the tokens.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None  # None or 0: off
    top_p: Optional[float] = None  # None or 1.0: off
    max_new_tokens: Optional[int] = 128
    max_length: Optional[int] = None
    eos_token_id: TokenIds = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    pad_token_id: Optional[int] = None
    seed: int = 1234
    return_log_probs: bool = True
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"SamplingConfig.{name}={value!r} must be an integer >= 1 (None: no limit)")
        if self.max_new_tokens is None and self.max_length is None:
            raise ValueError("SamplingConfig: set max_new_tokens or max_length (or both)")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"SamplingConfig.max_length={self.max_length} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature={self.temperature} must be > 0 (use do_sample=False for greedy)"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 or None disables it)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1] (1 or None disables it)")

    # ------------------------------------------------------------------ derived values
    @property
    def eos_ids(self) -> Tuple[int, ...]:
        return _as_id_tuple(self.eos_token_id)

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        return _as_id_tuple(self.stop_token_ids)

    @property
    def pad_id(self) -> int:
        """`pad_token_id`, else the first EOS id, else 0."""
        if self.pad_token_id is not None:
            return int(self.pad_token_id)
        return self.eos_ids[0] if self.eos_ids else 0

    def response_budgets(self, prompt_lengths: Sequence[int]) -> List[int]:
        """The most response tokens each row may generate."""
        budgets = []
        for length in prompt_lengths:
            cap = self.max_new_tokens if self.max_new_tokens is not None else max(0, self.max_length - length)
            if self.max_length is not None:
                cap = min(cap, max(0, self.max_length - length))
            budgets.append(int(cap))
        return budgets


def sample_uniforms(seed: int, iteration: int, sample_ids: Sequence[int], steps: int) -> np.ndarray:
    """`[len(sample_ids), steps]` float64 uniforms in [0, 1): row b is the start of the stream of sample
    `sample_ids[b]` in RL iteration `iteration` (PCG64 seeded by SeedSequence([seed, iteration, sample id])).

    A stream depends on nothing else, so the same sample draws the same numbers wherever it is generated;
    its first `steps` numbers are the same for any `steps`.
    """
    mask = (1 << 64) - 1  # SeedSequence wants non-negative entries
    out = np.empty((len(sample_ids), steps), dtype=np.float64)
    for row, sample in enumerate(sample_ids):
        key = np.random.SeedSequence([int(seed) & mask, int(iteration) & mask, int(sample) & mask])
        out[row] = np.random.Generator(np.random.PCG64(key)).random(steps)
    return out


def filter_logits(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> torch.Tensor:
    """Set logits outside top-k and then outside the top-p nucleus to -inf ([..., V], float).

    Same semantics as transformers' TopKLogitsWarper (ties with the k-th value are kept) and
    TopPLogitsWarper (keep the smallest set of most likely tokens whose probability mass reaches top_p;
    always at least one token).
    """
    vocab = logits.size(-1)
    if top_k and 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The tokens `filter_logits` keeps, as a short candidate list instead of a full-vocabulary mask.

    Returns (candidate logits [B, m], candidate ids [B, m]) sorted by decreasing logit, -inf for candidates
    top-p removes; or (logits, None) when neither filter is active. With top-k only the k best are sorted;
    with top-p alone the top m (m = 64, 256, ... until every row's nucleus fits) rather than the whole
    vocabulary, which is what makes CPU sampling cheap. Ties at the k-th logit keep exactly k tokens
    (transformers keeps every tie); otherwise the kept set equals `filter_logits`.
    """
    vocab = logits.size(-1)
    k = top_k if top_k and 0 < top_k < vocab else None
    p = top_p if top_p is not None and top_p < 1.0 else None
    if k is None and p is None:
        return logits, None
    if k is not None:
        values, ids = torch.topk(logits, k, dim=-1)
        if p is None:
            return values, ids
        probs = torch.softmax(values, dim=-1)  # top-p acts on the top-k renormalised distribution
    else:
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        m = min(64, vocab)
        while True:
            values, ids = torch.topk(logits, m, dim=-1)
            probs = torch.exp(values - log_norm)
            if m == vocab or bool((probs.sum(-1) >= p).all()):
                break
            m = min(m * 4, vocab)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove = mass_before >= p
    remove[..., 0] = False
    return values.masked_fill(remove, float("-inf")), ids


def choose_tokens(
    logits: torch.Tensor, config: SamplingConfig, uniforms: Optional[torch.Tensor],
    with_log_probs: bool = True, sample_below: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pick one token per row from `logits` [B, V] (only ids < `sample_below`, when given: a padded vocabulary).

    Greedy: argmax (`uniforms` unused, may be None). Sampling: temperature, top-k, top-p, then inverse-CDF
    sampling: with u = `uniforms[b]` (float64 in [0, 1), one per row), the first candidate whose float64
    cumulative probability exceeds u times the total. That is the
    categorical distribution up to float64 rounding, at one random number per row; drawing one per vocabulary
    entry (`torch.multinomial`'s exponential race) cost ~36 ms of a ~250 ms decode step over 49k ids.

    Returns (tokens [B] long, log-probs [B] float32 or None). The log-prob is that of the chosen token under
    softmax(logits / temperature) over the full vocabulary, padding included: the quantity a training forward
    recomputes for the same temperature (top-k/top-p truncation belongs to the sampler, not to the policy).
    """
    logits = logits.float()
    scaled = logits / config.temperature if config.temperature != 1.0 else logits
    allowed = scaled if sample_below is None or sample_below >= logits.size(-1) else scaled[:, :sample_below]
    if config.do_sample:
        cand_logits, cand_ids = top_k_top_p_candidates(allowed, config.top_k, config.top_p)
        cdf = torch.softmax(cand_logits, dim=-1).double().cumsum(dim=-1)
        u = uniforms.to(device=cdf.device, dtype=torch.float64).reshape(-1, 1)
        # right=True: a zero-probability candidate has an empty interval and is never chosen
        choice = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=cdf.size(-1) - 1).squeeze(-1)
        tokens = choice if cand_ids is None else cand_ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    else:
        tokens = torch.argmax(allowed, dim=-1)
    log_probs = None
    if with_log_probs:
        log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs


__all__ = ["SamplingConfig", "sample_uniforms", "filter_logits", "top_k_top_p_candidates", "choose_tokens"]
