"""Fused vocab-parallel log-probs (mindspeed_llm.rl.logprobs) vs the plain reference: values and
gradients w.r.t. the logits, single shard (TP=2 over gloo: tests/dist/test_logprobs_dist.py)."""

import os

import pytest
import torch

from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _compare(logits, targets, temperature, with_entropy, chunk_size, tol, grad_ent_only=False):
    a = logits.detach().clone().requires_grad_()
    b = logits.detach().clone().requires_grad_()
    out = vocab_parallel_logprobs(a, targets, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size)
    ref = reference_logprobs(b, targets, temperature=temperature, with_entropy=with_entropy)
    out = out if with_entropy else (out,)
    ref = ref if with_entropy else (ref,)
    for o, r in zip(out, ref):
        assert o.dtype == torch.float32 and o.shape == targets.shape
        torch.testing.assert_close(o, r, **tol)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(targets.shape, generator=g) for _ in out]
    if grad_ent_only:  # only the entropy feeds the loss: logp gets no gradient at all
        out, ref, weights = out[1:], ref[1:], weights[1:]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    sum((r * w).sum() for r, w in zip(ref, weights)).backward()
    assert a.grad.dtype == logits.dtype
    torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 7, None, 1000])
def test_fused_matches_reference(dtype, with_entropy, temperature, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 257, generator=g) * 4).to(dtype)  # odd vocab, 33 tokens, 3-D input
    targets = torch.randint(0, 257, (3, 11), generator=g)
    _compare(logits, targets, temperature, with_entropy, chunk_size, TOL[dtype])


def test_gradient_through_entropy_only_and_peaked_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 101, generator=g)
    logits[::3, 5] += 40.0  # nearly one-hot rows: p ~ 1 on a single column
    targets = torch.randint(0, 101, (20,), generator=g)
    targets[::6] = 5
    _compare(logits, targets, 1.3, True, 6, TOL[torch.float32], grad_ent_only=True)
    _compare(logits, targets, 1.3, True, 6, TOL[torch.float32])


def test_no_grad_and_noncontiguous_input():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 9, 64, generator=g)
    logits = base[:, 1:-1]  # [B, S-2, V] slice: not viewable as 2-D, copied
    targets = torch.randint(0, 64, (4, 7), generator=g)
    with torch.no_grad():
        out = vocab_parallel_logprobs(logits, targets, with_entropy=True, chunk_size=5)
    ref = reference_logprobs(logits, targets, with_entropy=True)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_invalid_inputs():
    logits = torch.randn(4, 10)
    out = vocab_parallel_logprobs(logits, torch.tensor([0, 9, 10, -1]))
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2:]).all()  # unowned ids give NaN
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="shape"):
        vocab_parallel_logprobs(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(logits, torch.zeros(4, dtype=torch.long), chunk_size=0)
