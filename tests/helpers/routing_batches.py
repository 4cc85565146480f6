"""Synthetic experience batches in the rollout layout and the small MoE spec whose routing flips under bf16, shared
by the routing-replay and recompute tests."""

import torch

from mindspeed_llm.models.architecture import ArchitectureSpec
from mindspeed_llm.rl.experience import Experience


# Many experts, top-4, small random weights: router margins are small, so bf16 rounding flips some choices.
MOE_SPEC = ArchitectureSpec(family="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                 num_query_groups=2, kv_channels=16, vocab_size=128, qk_layernorm=True, num_experts=16,
                 moe_ffn_hidden_size=32, moe_router_topk=4)


def synthetic_experience(prompt_lengths, response_lengths, width_r=None, vocab=100, seed=0):
    """A synthetic Experience in the rollout layout (`Experience.from_rollout`'s conventions)."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lengths)
    R = width_r or max(response_lengths)
    T = max(p + r for p, r in zip(prompt_lengths, response_lengths))
    tokens = torch.zeros(B, T, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R)
    for b, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        tokens[b, :p + r] = torch.randint(1, vocab, (p + r,), generator=g)
        responses[b, :r] = tokens[b, p:p + r]
        mask[b, :r] = 1
    return Experience(tokens=tokens, position_ids=torch.arange(T).expand(B, T).clone(),
                      prompt_lengths=torch.tensor(prompt_lengths), responses=responses, response_mask=mask,
                      ended_with_eos=torch.zeros(B, dtype=torch.bool))


def groups_share_prompts(exp, n):
    """Make the n samples of each group share the first sample's prompt (packed groups need it)."""
    for b in range(exp.batch_size):
        first = b - b % n
        P = int(exp.prompt_lengths[b])
        exp.tokens[b, :P] = exp.tokens[first, :P]
