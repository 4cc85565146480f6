"""The sampled-evaluation statistics of held-out prompts (`--eval-n-samples N`), pure arithmetic on per-prompt
scores:

* ``mean@N``: the mean score of a prompt's N samples, averaged over the prompts;
* ``best@N``: the best score of a prompt's N samples, averaged over the prompts;
* ``pass@k`` (k = 1, 2, 4, ... <= N): the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code", the Codex paper): with c of a prompt's n samples correct, the chance that k samples
  drawn without replacement from the n hold a correct one, ``1 - C(n - c, k) / C(n, k)``, averaged over the prompts;
* ``maj@N``: whether the answer most of a prompt's samples give (majority vote over the answers extracted from the
  responses, ties to the answer that came first) is correct, averaged over the prompts; a prompt none of whose
  samples has an extractable answer counts as wrong.

A sample is *correct* when its score reaches the pass threshold (``score >= threshold``; the evaluation's is
``--eval-pass-threshold``, 1.0 by default: ``math_acc`` and the other answer checkers score 1 for a right answer).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that k of n samples, c of them correct, drawn without replacement
    hold a correct one (computed as the product ``prod_{i = n - c + 1}^{n} (1 - k / i)``, which never forms the
    large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n: int) -> List[int]:
    """The k of the reported pass@k: 1, 2, 4, ... up to n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def majority(answers: Sequence[Optional[str]]) -> Optional[int]:
    """The index of the first sample whose answer is the most common of `answers` (None: no answer there), ties
    going to the answer that came first; None when no sample has one."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)


@dataclass(frozen=True)
class PromptResult:
    """One held-out prompt's samples: its position in the held-out set, its `data_source` (None: the rows have
    none), the samples' scores, their extracted answers (None where a response has none), and per-sample means of
    the other evaluation metrics (response length, KL, turns, ...), summed over the samples."""

    position: int
    source: Optional[str]
    scores: tuple
    answers: tuple
    sums: tuple  # ((name, sum over the samples), ...)
    samples: tuple = ()  # the sample-table rows of its samples among its set's first --log-samples (`samples.py`)


def summarize(results: Sequence[PromptResult], threshold: float) -> Dict[str, float]:
    """`score/mean`, `mean@N`, `best@N`, `pass@k`, `maj@N` (when some sample has an answer) and the mean per sample
    of every summed metric, over `results` (all with the same N samples), in position order so that the sums are
    the same whoever computed the parts."""
    results = sorted(results, key=lambda r: r.position)
    if not results:
        return {}
    n = len(results[0].scores)
    if any(len(r.scores) != n for r in results):
        raise ValueError("every prompt needs the same number of samples")
    prompts = len(results)
    out = {"score/mean": sum(sum(r.scores) for r in results) / (prompts * n),
           f"mean@{n}": sum(sum(r.scores) / n for r in results) / prompts,
           f"best@{n}": sum(max(r.scores) for r in results) / prompts}
    correct = [sum(s >= threshold for s in r.scores) for r in results]
    for k in pass_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / prompts
    if any(a is not None for r in results for a in r.answers):
        votes = [majority(r.answers) for r in results]
        out[f"maj@{n}"] = sum(v is not None and r.scores[v] >= threshold for v, r in zip(votes, results)) / prompts
    names = list(dict.fromkeys(name for r in results for name, _ in r.sums))
    for name in names:
        out[name] = sum(dict(r.sums).get(name, 0.0) for r in results) / (prompts * n)
    return out
