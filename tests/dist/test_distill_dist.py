"""On-policy distillation's top-k forward KL (mindspeed_llm.rl.core_algos.distill) at TP=2 over gloo (2 processes)
equals TP=1: each rank holds half the vocabulary, and the teacher's top-k, the KL, the top-k mass, the loss and each
shard's gradient are those of one rank with the whole vocabulary. A single shard: tests/unit/test_distill.py."""

import torch

from tests.helpers.gloo_logprobs import run_gloo, tp_distill_worker


def test_topk_forward_kl_at_tp2_equals_tp1():
    # One spawn for every case (process start dominates). Each case: (token shape, full vocab, k, dtype, temperature,
    # tolerance of the values, of the gradient). k = 3 < V/TP; k = 17 > V/TP = 12 (one rank's candidates cannot hold
    # the top-k); k = V (every id). bf16: the fp32 results of the same inputs agree as closely, the bf16 gradient to
    # its rounding.
    cases = [
        ((3, 5), 24, 3, torch.float32, 1.0, 1e-6, 1e-6),
        ((3, 5), 24, 17, torch.float32, 0.7, 1e-6, 1e-6),
        ((2, 4), 24, 24, torch.float32, 1.0, 1e-6, 1e-6),
        ((4, 3), 64, 8, torch.bfloat16, 1.0, 1e-5, 1e-2),
    ]
    run_gloo(tp_distill_worker, world_size=2, args=(cases,))
