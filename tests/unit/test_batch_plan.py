"""`MicroBatchPlan` (`rl/update/batch_plan.py`): the packed prompt-group layout built with whole-tensor ops equals a
group-by-group construction written out by hand (its attention pattern through `PackedGroups.dense_mask`), and
micro-batches cut from a dealt sample order carry the right rows, reads, packed groups and per-sample tensors. (That
the layouts compute the same outputs is tests/dist/test_packed_layout.py.)"""

import pytest
import torch

from mindspeed_llm.inference.results import Rollout
from mindspeed_llm.rl.core_algos import response_mask_p1
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan, gather_last_token, gather_response, token_budget_groups
from mindspeed_llm.rl.experience import Experience

N = 3
PROMPT_LENGTHS = (4, 2)
RESPONSE_LENGTHS = ((2, 5, 1), (0, 3, 3))  # width 5; one empty response


def _experience():
    g = torch.Generator().manual_seed(1)
    width, pw = 5, max(PROMPT_LENGTHS)
    prompts, responses, lengths, plens = [], [], [], []
    for P, group in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS):
        prompt = torch.randint(10, 99, (P,), generator=g)
        for r in group:
            row = torch.zeros(pw, dtype=torch.long)
            row[:P] = prompt
            prompts.append(row)
            resp = torch.zeros(width, dtype=torch.long)
            resp[:r] = torch.randint(100, 999, (r,), generator=g)
            responses.append(resp)
            lengths.append(r)
            plens.append(P)
    lengths = torch.tensor(lengths)
    return Experience.from_rollout(Rollout(
        prompts=torch.stack(prompts), prompt_lengths=torch.tensor(plens), responses=torch.stack(responses),
        response_mask=(torch.arange(width)[None] < lengths[:, None]).long(), response_lengths=lengths,
        ended_with_eos=torch.zeros(len(lengths), dtype=torch.bool), finish_reasons=["length"] * len(lengths),
        log_probs=None, pad_token_id=0))


def _by_hand(exp, n):
    """The packed layout group by group, sample by sample (the construction the plan vectorises)."""
    G = exp.batch_size // n
    P = [int(exp.prompt_lengths[g * n]) for g in range(G)]
    L = [[int(exp.response_lengths[g * n + k]) for k in range(n)] for g in range(G)]
    W = [max(max(lg), 1) for lg in L]
    S = max(p + n * w for p, w in zip(P, W))
    tokens = torch.zeros(G, S, dtype=torch.long)
    positions = torch.arange(S).repeat(G, 1)
    segment = torch.full((G, S), n)
    response_index = torch.zeros_like(exp.responses)
    last = torch.zeros(exp.batch_size, dtype=torch.long)
    for g in range(G):
        tokens[g, :P[g]] = exp.tokens[g * n, :P[g]]
        segment[g, :P[g]] = -1
        for k in range(n):
            row, begin = g * n + k, P[g] + k * W[g]
            tokens[g, begin:begin + L[g][k]] = exp.responses[row, :L[g][k]]
            positions[g, begin:begin + W[g]] = P[g] + torch.arange(W[g])
            segment[g, begin:begin + W[g]] = k
            for j in range(exp.responses.shape[1]):
                response_index[row, j] = min(P[g] - 1 if j == 0 else begin + j - 1, S - 1)
            last[row] = begin + L[g][k] - 1 if L[g][k] else P[g] - 1
    mask = torch.ones(G, 1, S, S, dtype=torch.bool)
    for g in range(G):
        for q in range(S):
            for key in range(q + 1):
                if segment[g, key] == -1 or segment[g, key] == segment[g, q]:
                    mask[g, 0, q, key] = False
    return tokens, positions, mask, response_index, last


def test_packed_layout_equals_the_construction_by_hand():
    exp = _experience()
    plan = MicroBatchPlan.build(exp, micro_batch_size=N, group_size=N)
    tokens, positions, mask, response_index, last = _by_hand(exp, N)
    assert plan.packed and torch.equal(plan.tokens, tokens) and torch.equal(plan.position_ids, positions)
    # the layout is described (Python ints), and its dense mask (megatron's local attention) is the one by hand
    assert plan.groups.prompt_lengths == PROMPT_LENGTHS and plan.groups.widths == (5, 3)
    assert plan.groups.group_size == N and plan.groups.seq_length == tokens.shape[1]
    assert torch.equal(plan.groups.dense_mask(), mask)
    assert torch.equal(plan.response_index, response_index) and torch.equal(plan.last_token_index, last)
    assert plan.row_of_sample.tolist() == [0, 0, 0, 1, 1, 1]
    # a hand-checked corner: group 1 (prompt of 2, slot width 3): sample 3 is empty, its reads are the prompt's end
    assert plan.last_token_index[3] == 1 and plan.response_index[3, 0] == 1
    assert plan.response_index[4].tolist() == [1, 5, 6, 7, 8] and plan.last_token_index[4] == 7


def test_rows_layout_and_micro_batches_of_a_dealt_order():
    exp = _experience()
    exp.advantages = torch.arange(exp.batch_size, dtype=torch.float32)[:, None].expand(-1, 5).clone()
    rows = MicroBatchPlan.build(exp, micro_batch_size=2)
    assert not rows.packed and rows.tokens is exp.tokens
    assert rows.response_index[0].tolist() == [3, 4, 5, 6, 7] and rows.last_token_index[0] == 5
    batches = rows.micro_batches(exp, torch.tensor([5, 1, 2, 0, 4, 3]))
    assert [mb["advantages"][:, 0].tolist() for mb in batches] == [[5, 1], [2, 0], [4, 3]]
    # each micro-batch at its own length: samples 5 and 1 hold 2 + 3 and 4 + 5 tokens, responses of 3 and 5
    assert torch.equal(batches[0]["tokens"], exp.tokens[[5, 1], :9]) and batches[0]["row_index"].tolist() == [0, 1]
    assert int(batches[0]["logits_from"]) == 1  # the earliest first read of the micro-batch (prompt of 2)
    # samples 4 and 3 (2 + 3 and 2 + 0 tokens): rows of 5, responses cut to 3 columns and the one past them (the
    # critic's value mask), reads clamped into the rows
    assert batches[2]["tokens"].shape == (2, 5) and batches[2]["responses"].shape == (2, 4)
    assert batches[2]["advantages"].shape == (2, 4) and batches[2]["response_index"].tolist() == [[1, 2, 3, 4]] * 2

    packed = MicroBatchPlan.build(exp, micro_batch_size=N, group_size=N)
    batches = packed.micro_batches(exp, torch.tensor([3, 4, 5, 0, 1, 2]))  # groups dealt in another order
    # group 1: a prompt of 2 and 3 slots of 3; group 0: a prompt of 4 and 3 slots of 5
    assert torch.equal(batches[0]["tokens"], packed.tokens[[1], :11]) and batches[0]["row_index"].tolist() == [0, 0, 0]
    assert batches[1]["tokens"].shape == (1, 19) and batches[0]["responses"].shape == (3, 4)
    assert batches[0]["advantages"][:, 0].tolist() == [3, 4, 5] and "attention_mask" not in batches[0]
    # the packed layout of each micro-batch's rows, as wide as the micro-batch
    assert batches[0]["packed_groups"] == packed.groups.select([1], 11)
    assert batches[1]["packed_groups"].prompt_lengths == (4,) and batches[1]["packed_groups"].seq_length == 19
    assert "packed_groups" not in rows.micro_batches(exp)[0]
    # reads pick a sample's positions from its micro-batch's rows, past logits_from
    mb = batches[1]
    out = torch.arange(mb["tokens"].shape[1] - int(mb["logits_from"]))[None, :, None].float()
    assert gather_last_token(out, mb).reshape(-1).tolist() == (packed.last_token_index[:3] - 3).float().tolist()
    assert gather_response(out, mb).shape == (3, 5, 1)


def test_plan_refuses_what_it_cannot_lay_out():
    exp = _experience()
    with pytest.raises(ValueError, match="do not split into micro-batches of 4"):
        MicroBatchPlan.build(exp, micro_batch_size=4)
    with pytest.raises(ValueError, match="prompts of different lengths"):
        MicroBatchPlan.build(exp, micro_batch_size=6, group_size=6)
    assert not MicroBatchPlan.build(exp, micro_batch_size=2, group_size=N).packed  # groups do not fit: rows


def test_position_hooks_refuse_what_they_cannot_index():
    """The RoPE hook indexes megatron's [S, 1, 1, D] table by position ids; any other output is an error, never
    passed through (packed rows would silently get slot positions)."""
    import types

    from mindspeed_llm.models.forward_layout import _POSITIONS, _rotary_by_position_ids

    module = types.SimpleNamespace(**{_POSITIONS: torch.tensor([[0, 1, 2, 1]])})
    table = torch.arange(6.0).view(6, 1, 1, 1)
    assert _rotary_by_position_ids(module, (), table)[:, 0, 0, 0].tolist() == [0, 1, 2, 1]
    for bad in ((table, table), table.view(6, 1, 1), table.expand(6, 2, 1, 1)):
        with pytest.raises(TypeError, match="rotary embedding returned"):
            _rotary_by_position_ids(module, (), bad)
    with pytest.raises(ValueError, match="past the rotary table"):
        _rotary_by_position_ids(types.SimpleNamespace(**{_POSITIONS: torch.tensor([[0, 6]])}), (), table)
    assert _rotary_by_position_ids(types.SimpleNamespace(), (), (table, table)) == (table, table)  # no positions set
    # YaRN's (table, mscale): the table is indexed, the scale kept
    emb, mscale = _rotary_by_position_ids(module, (), (table, 1.25))
    assert emb[:, 0, 0, 0].tolist() == [0, 1, 2, 1] and mscale == 1.25


def test_micro_batches_at_their_own_length_read_what_the_full_width_reads():
    """Cutting a micro-batch to its own longest row and response changes no read: from a model output that is a
    function of (row, position), every sample reads at its response and last token what it reads at full width."""
    exp = _experience()
    exp.advantages = torch.arange(exp.batch_size, dtype=torch.float32)[:, None].expand(-1, 5).clone()
    for micro_batch_size, group_size, order in ((2, 1, [5, 1, 2, 0, 4, 3]), (N, N, [3, 4, 5, 0, 1, 2])):
        plan = MicroBatchPlan.build(exp, micro_batch_size=micro_batch_size, group_size=group_size)
        for mb in plan.micro_batches(exp, torch.tensor(order)):
            samples = mb["advantages"][:, 0].long()
            rows, width = mb["tokens"].shape
            assert width == int(plan.row_lengths[plan.row_of_sample[samples]].max())
            first = int(mb["logits_from"])
            out = (torch.arange(rows)[:, None] * 1000 + torch.arange(first, width)[None, :]).float()[..., None]
            mask = mb["response_mask"].bool()
            assert mask.shape[1] == min(int(exp.response_lengths[samples].max()) + 1, exp.responses.shape[1])
            want = (mb["row_index"][:, None] * 1000 + plan.response_index[samples, :mask.shape[1]]).float()
            assert torch.equal(gather_response(out, mb)[..., 0][mask], want[mask])
            want_last = (mb["row_index"] * 1000 + plan.last_token_index[samples]).float()
            assert torch.equal(gather_last_token(out, mb).reshape(-1), want_last)
            # the critic's value mask (one past each response) loses no column to the cut
            assert response_mask_p1(mb["response_mask"]).sum() == response_mask_p1(exp.response_mask[samples]).sum()


def test_token_budget_groups_by_hand():
    # sorted longest first: 9 (1), 9 (3), 5 (0), 3 (2), 2 (4); 2 x 9 = 18 fits, 3 x 9 does not; 3 x 5 = 15 fits
    assert token_budget_groups([5, 9, 3, 9, 2], 18) == [[1, 3], [0, 2, 4]]
    # more micro-batches on another DP rank: the costliest group of 2+ units is halved (18 > 15, then 15 > 9)
    assert token_budget_groups([5, 9, 3, 9, 2], 18, count=3) == [[1], [3], [0, 2, 4]]
    assert token_budget_groups([5, 9, 3, 9, 2], 18, count=4) == [[1], [3], [0, 2], [4]]
    assert token_budget_groups([5, 9, 3, 9, 2], 18, count=9) == [[1], [3], [0], [2], [4]]  # at most one a unit
    assert token_budget_groups([20, 4], 18) == [[0], [1]]  # wider than the budget: alone
    assert token_budget_groups([4, 4, 4], 100) == [[0, 1, 2]]


def test_token_budget_micro_batches_keep_groups_whole_and_agree_over_ranks():
    exp = _experience()
    exp.advantages = torch.arange(exp.batch_size, dtype=torch.float32)[:, None].expand(-1, 5).clone()
    # rows of 6, 9, 5, 2, 5, 5 tokens (samples 0..5), dealt as 5, 1, 2, 0, 4, 3; sorted: 9 (1), 6 (0), then the
    # 5s in dealt order (5, 2, 4), 2 (3); budget 10: two rows of 5 fit, a row of 6 or 9 goes alone
    plan = MicroBatchPlan.build(exp, micro_batch_size=1, max_tokens=10)
    batches = plan.micro_batches(exp, torch.tensor([5, 1, 2, 0, 4, 3]), update=True)
    assert [mb["advantages"][:, 0].long().tolist() for mb in batches] == [[1], [0], [5, 2], [4, 3]]
    assert [tuple(mb["tokens"].shape) for mb in batches] == [(1, 9), (1, 6), (2, 5), (2, 5)]
    # where each sample stands in the order given (forward_only puts its outputs back there)
    assert [mb["order"].tolist() for mb in batches] == [[1], [3], [0, 2], [4, 5]]
    # the forward passes take the update's budget unless they have their own
    assert [mb["advantages"][:, 0].long().tolist() for mb in plan.micro_batches(exp)] == [[1], [0], [2, 4], [5, 3]]
    forward = MicroBatchPlan.build(exp, micro_batch_size=1, max_tokens=10, forward_max_tokens=18)
    assert [mb["advantages"][:, 0].long().tolist() for mb in forward.micro_batches(exp)] == [[1, 0], [2, 4, 5], [3]]
    # another DP rank needs 3 micro-batches: the costliest group is halved
    calls = []
    wide = MicroBatchPlan.build(exp, micro_batch_size=1, max_tokens=100, equalize=lambda c: calls.append(c) or 3)
    got = [mb["advantages"][:, 0].long().tolist() for mb in wide.micro_batches(exp, torch.arange(6), update=True)]
    assert calls == [1] and got == [[1, 0], [2], [4, 5, 3]]

    packed = MicroBatchPlan.build(exp, micro_batch_size=N, group_size=N, max_tokens=30)
    batches = packed.micro_batches(exp, torch.tensor([3, 4, 5, 0, 1, 2]), update=True)
    # group rows of 11 (group 1) and 19 (group 0): 2 x 19 > 30, one group each, longest first, whole and in order
    assert [tuple(mb["tokens"].shape) for mb in batches] == [(1, 19), (1, 11)]
    assert [mb["advantages"][:, 0].long().tolist() for mb in batches] == [[0, 1, 2], [3, 4, 5]]
    assert [mb["row_index"].tolist() for mb in batches] == [[0, 0, 0]] * 2
