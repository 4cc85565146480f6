"""Fused vocab-parallel log-probs (mindspeed_llm.rl.logprobs) at TP=2 over gloo (2 processes): values and gradients
w.r.t. the logits against the reference on the all-gathered logits. A single shard: tests/unit/test_logprobs.py.
"""


import torch


# The worker lives in a helper module (not here), so the spawned workers unpickle it without this module's imports.
from tests.helpers.gloo_logprobs import run_gloo, tp_logprobs_worker  # noqa: E402


def test_tensor_parallel_two_ranks_gloo():
    # One spawn for every case (process start dominates). Each case:
    # (token shape, full vocab, dtype, temperature, with_entropy, chunk_size, atol, rtol)
    cases = [
        ((5, 7), 202, torch.float32, 1.0, False, 4, 1e-5, 1e-5),
        ((5, 7), 202, torch.float32, 0.7, True, 3, 1e-5, 1e-5),
        ((33,), 96, torch.float32, 1.0, True, None, 1e-5, 1e-5),
        ((4, 6), 202, torch.bfloat16, 1.0, True, 5, 1e-2, 1e-2),
        ((4, 6), 202, torch.bfloat16, 0.7, False, 1, 1e-2, 1e-2),
    ]
    run_gloo(tp_logprobs_worker, world_size=2, args=(cases,))
