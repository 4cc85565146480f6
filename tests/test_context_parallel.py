"""Context parallelism (`--context-parallel-size`, `mindspeed_llm/models/context_parallel.py`).

* the load-balanced layout's arithmetic (pure): the CP ranks hold every position exactly once, chunks r and
  2N-1-r; a read's local index is its place in the rank's outputs from `logits_from` on;
* the core attention alone at CP2 (2 gloo processes) against the whole sequence on one rank: causal rows and packed
  prompt groups whose prompt and response slots are cut by the chunk boundaries, fp32 outputs and the q / k / v
  gradients (those of k and v come back through the all-gather's reduce-scatter);
* a training checkpoint written at CP2 resumes at CP1 and one written at CP1 at CP2 (`test_checkpoint_moves_between_
  cp_sizes`, slow: both stages' real runs); the training results of CP2 and SP against the TP1 reference are in
  tests/test_layout_invariance.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from multiproc import run_distributed  # noqa: E402

TOL = 5e-6


# ============================================================================================ layout arithmetic

@pytest.mark.parametrize("size,seq_length,logits_from", [(2, 24, 0), (2, 24, 7), (3, 36, 20), (4, 16, 15)])
def test_layout_covers_every_position_once(size, seq_length, logits_from):
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    positions = torch.arange(seq_length)
    seen = torch.zeros(seq_length, dtype=torch.long)
    for rank in range(size):
        layout = ContextParallelLayout(size, rank, seq_length)
        c = seq_length // (2 * size)
        local = layout.split(positions[None], dim=1)[0]
        assert local.tolist() == list(range(rank * c, (rank + 1) * c)) + list(
            range((2 * size - 1 - rank) * c, (2 * size - rank) * c))
        seen[local] += 1
        # the outputs this rank computes: its local positions at or after logits_from, in local order
        kept = torch.cat([local[a:b] for a, b in layout.local_output_spans(logits_from)]) \
            if layout.local_output_spans(logits_from) else local[:0]
        assert bool((kept >= logits_from).all()) and len(kept) == int((local >= logits_from).sum())
        index, held = layout.local_index(positions, logits_from)
        assert held.tolist() == [bool(p in kept.tolist()) for p in range(seq_length)]
        assert kept[index[held]].tolist() == positions[held].tolist()
        # the gathered local sequences in rank order, put back in natural order
    gathered = torch.cat([ContextParallelLayout(size, r, seq_length).split(positions[None], 1)[0]
                          for r in range(size)])
    assert gathered[ContextParallelLayout(size, 0, seq_length).natural_order("cpu")].tolist() == positions.tolist()
    assert seen.tolist() == [1] * seq_length


def test_layout_refuses_a_width_that_does_not_split():
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    with pytest.raises(ValueError, match="do not split into 4 chunks"):
        ContextParallelLayout(2, 0, 10)


# ============================================================================================ the attention alone

# (name, packed layout (n, prompt lengths, slot widths) or None, width S, batch): S = 24 splits into 4 chunks of 6
ATTENTION_CASES = [
    ("causal", None, 24, 2),
    # prompts of 5 and 9 with slots of 4 and 3: chunk borders at 6, 12, 18 cut prompts and slots
    ("packed", (3, (5, 9), (4, 3)), 24, 2),
    ("packed_gqa_one_slot", (2, (7,), (8,)), 24, 1),
]


def _attention_worker(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_llm import device
    from mindspeed_llm.models.attention import PackedGroups, SDPAttention, layout_params
    from mindspeed_llm.models.context_parallel import ContextParallelLayout

    device.setup()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world_size)
    heads, groups, hn = 4, 2, 8
    config = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=hn, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    module = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self", softmax_scale=1.0 / math.sqrt(hn)).eval()
    out = {}
    for name, packed, S, b in ATTENTION_CASES:
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(S, b, h, hn, generator=g) for h in (heads, groups, groups))
        weights = torch.randn(S, b, heads * hn, generator=g)
        layout_groups = None if packed is None else PackedGroups(packed[0], packed[1], packed[2], S)
        # the whole sequence here (no context parallelism): the reference
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = module(*full, None, packed_seq_params=layout_params(layout_groups, None, S))
        (reference * weights).sum().backward()
        layout = ContextParallelLayout.current(S)
        local = [layout.split(t, dim=0).detach().requires_grad_() for t in (q, k, v)]
        got = module(*local, None, packed_seq_params=layout_params(layout_groups, layout, S))
        (got * layout.split(weights, dim=0)).sum().backward()
        # the tail of a packed row (past its slots) is zeros and never read; compare everything
        out[name] = {
            "out": (got - layout.split(reference, dim=0)).abs().max().item(),
            "grads": max((t.grad - layout.split(f.grad, dim=0)).abs().max().item() for t, f in zip(local, full)),
            "scale": reference.abs().max().item(),
        }
    return out


@pytest.fixture(scope="module")
def attention_cp2():
    return run_distributed(_attention_worker, 2)


@pytest.mark.parametrize("case", [c[0] for c in ATTENTION_CASES])
def test_attention_at_cp2_equals_the_whole_sequence(attention_cp2, case):
    for rank, result in enumerate(attention_cp2):
        r = result[case]
        assert r["scale"] > 0.1
        assert r["out"] <= TOL and r["grads"] <= TOL, (rank, case, r)
