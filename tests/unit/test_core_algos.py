"""Hand-computed checks for mindspeed_llm.rl.core_algos (numbers worked out in the comments)."""

import math

import pytest
import torch

from mindspeed_llm.rl import core_algos as ca
from tests.helpers.threads import shards_in_threads


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0, equal_nan=True)


# x = [[1, 2, 3], [4, 5, 6]] with mask [[1, 1, 0], [1, 0, 0]] selects {1, 2, 4}.
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_mean():
    close(ca.masked_mean(X, M), 7 / 3)  # (1 + 2 + 4) / 3
    close(ca.masked_mean(X, M.bool()), 7 / 3)
    close(ca.masked_mean(X, M, dim=1), [1.5, 4.0])  # row means (1 + 2) / 2 and 4 / 1
    close(ca.masked_mean(X, M, dim=0), [2.5, 2.0, float("nan")])  # column 2 is empty -> NaN (TRL semantics)


def test_masked_var():
    # mean 7/3; deviations -4/3, -1/3, 5/3; squares sum to (16 + 1 + 25) / 9 = 42/9
    close(ca.masked_var(X, M, unbiased=False), 42 / 9 / 3)  # 14/9
    close(ca.masked_var(X, M), 42 / 9 / 2)  # Bessel n/(n-1) = 3/2 -> 7/3
    with pytest.raises(ValueError, match="no element"):
        ca.masked_var(X, torch.zeros_like(M))


def test_masked_whiten():
    std = math.sqrt(7 / 3 + 1e-8)
    out = ca.masked_whiten(X, M)
    close(out[M.bool()], [(1 - 7 / 3) / std, (2 - 7 / 3) / std, (4 - 7 / 3) / std])  # -0.8729, -0.2182, 1.0911
    close(out[0, 2], (3 - 7 / 3) / std)  # unmasked positions are transformed too (caller zeroes them)
    out = ca.masked_whiten(X, M, shift_mean=False)
    close(out[M.bool()], [(1 - 7 / 3) / std + 7 / 3, (2 - 7 / 3) / std + 7 / 3, (4 - 7 / 3) / std + 7 / 3])


def test_kl_penalty_kinds():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # log_r = ref - logp = log(1/2) = -0.693147
    close(ca.kl_penalty(logp, ref, "k1"), [math.log(2)])  # logp - ref = 0.693147
    close(ca.kl_penalty(logp, ref, "abs"), [math.log(2)])
    close(ca.kl_penalty(logp, ref, "k2"), [0.5 * math.log(2) ** 2])  # 0.240227
    close(ca.kl_penalty(logp, ref, "k3"), [0.5 + math.log(2) - 1])  # exp(-ln2) + ln2 - 1 = 0.193147
    close(ca.kl_penalty(logp, ref, "low_var_kl"), [0.5 + math.log(2) - 1])
    # |log_r| = 30: the k3 value (~19 or ~1e13) is clamped to 10, and stays finite
    out = ca.kl_penalty(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "k3")
    close(out, [10.0, 10.0])
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl, abs"):
        ca.kl_penalty(logp, ref, "full")


def test_k3_gradient_is_finite_when_clamped():
    logp = torch.tensor([-40.0], requires_grad=True)
    ca.kl_penalty(logp, torch.tensor([0.0]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()


# Rewards: B=4, T=4; logp - ref = 0.1 on every token (k1 KL 0.1), kl_coef 0.5 -> -0.05 per response token.
RESP_MASK = torch.tensor(
    [
        [1, 1, 0, 0],  # last token s=1 -> TRL puts the score at s+1 = 2 (first pad)
        [1, 1, 1, 1],  # full row, s=3 -> s+1 = 4 is outside, score at 3
        [1, 1, 1, 0],  # s=2 -> score at 3 (= T-1, still inside)
        [0, 0, 0, 0],  # empty response, s=-1 -> score at 0
    ]
)
SCORES = torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_last_index_and_mask_p1():
    assert ca.last_response_index(RESP_MASK).tolist() == [1, 3, 2, -1]
    assert ca.response_mask_p1(RESP_MASK).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_compute_token_rewards_trl_placement():
    logp = torch.full((4, 4), -1.0)
    ref = logp - 0.1
    rewards, kl = ca.compute_token_rewards(SCORES, logp, ref, RESP_MASK, kl_coef=0.5, kind="k1")
    close(kl, 0.1 * RESP_MASK.float())
    expected = [
        [-0.05, -0.05, 1.0, 0.0],
        [-0.05, -0.05, -0.05, -0.05 + 2.0],
        [-0.05, -0.05, -0.05, 3.0],
        [4.0, 0.0, 0.0, 0.0],
    ]
    close(rewards, expected)


def test_compute_token_rewards_last_placement():
    logp = torch.full((4, 4), -1.0)
    rewards, _ = ca.compute_token_rewards(SCORES, logp, logp - 0.1, RESP_MASK, kl_coef=0.5, score_at="last")
    expected = [
        [-0.05, 0.95, 0.0, 0.0],
        [-0.05, -0.05, -0.05, 1.95],
        [-0.05, -0.05, 2.95, 0.0],
        [0.0, 0.0, 0.0, 0.0],  # empty row: no token to carry the score
    ]
    close(rewards, expected)
    with pytest.raises(ValueError, match="after_last, last"):
        ca.compute_token_rewards(SCORES, logp, logp, RESP_MASK, 0.5, score_at="eos")


def test_compute_gae_hand_computed():
    # One row, T=4, response mask [1,1,0,0] -> value mask [1,1,1,0]; the value 9.0 at t=3 is zeroed.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # score 1 at t=2 (one past the last token)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0]])
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t -> A = [1-0.5, 1-0.6, 1-0.7, 0]; returns = A + V
    adv, ret = ca.compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.5, 0.4, 0.0, 0.0]])  # advantages zeroed outside the response mask
    close(ret, [[1.0, 1.0, 1.0, 0.0]])
    # gamma 0.9, lam 0.5 (gamma*lam = 0.45):
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3            A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03         A1 = 0.03 + 0.45*0.3 = 0.165
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04         A0 = 0.04 + 0.45*0.165 = 0.11425
    adv, ret = ca.compute_gae(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    close(adv, [[0.11425, 0.165, 0.0, 0.0]])
    close(ret, [[0.61425, 0.765, 1.0, 0.0]])
    # whitened over {A0, A1}: two points with the unbiased std -> -/+ 1/sqrt(2)
    adv, ret2 = ca.compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0]], atol=1e-5)
    close(ret2, ret)  # returns use the raw advantages
    # explicit value mask = response mask ("last" placement): V at t=2 is dropped as well
    adv, ret = ca.compute_gae(
        torch.tensor([[0.0, 1.0, 0.0, 0.0]]), values, mask, gamma=1.0, lam=1.0, whiten=False, value_mask=mask
    )
    close(adv, [[0.5, 0.4, 0.0, 0.0]])  # A1 = 1 - 0.6, A0 = 1 - 0.5
    close(ret, [[1.0, 1.0, 0.0, 0.0]])


L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_aggregate_loss_modes():
    close(ca.aggregate_loss(L, M, "token-mean"), 7 / 3)  # (1 + 2 + 4) / 3
    close(ca.aggregate_loss(L, M, "seq-mean-token-sum"), 3.5)  # (3 + 4) / 2
    close(ca.aggregate_loss(L, M, "seq-mean-token-mean"), 2.75)  # (3/2 + 4/1) / 2
    close(ca.aggregate_loss(L, M, "seq-mean-token-sum-norm"), 7 / 6)  # (3/3 + 4/3) / 2, max_len = T = 3
    close(ca.aggregate_loss(L, M, "seq-mean-token-sum-norm", max_len=4), 0.875)  # (3/4 + 4/4) / 2
    # an empty row contributes 0 but still counts (TRL's clamp(min=1)): (1.5 + 0) / 2
    close(ca.aggregate_loss(L, torch.tensor([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-mean"), 0.75)
    close(ca.aggregate_loss(L, torch.zeros_like(M), "token-mean"), 0.0)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        ca.aggregate_loss(L, M, "sum")


# Policy loss: one row, ratios r = [1.5, 0.5, 1.1, 1.0], A = [1, -1, 2, 5], mask [1, 1, 1, 0], eps 0.2
#   t0: l1 = -1.5, l2 = -1*1.2 = -1.2 -> max -1.2 (clipped)
#   t1: l1 = 0.5,  l2 = +1*0.8 = 0.8  -> max 0.8  (clipped)
#   t2: l1 = -2.2, l2 = -2.2          -> -2.2    (not clipped)
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 1.0]])
ADV = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
PMASK = torch.tensor([[1, 1, 1, 0]])


def _logps(ratios):
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    new = (old + ratios.log()).requires_grad_()
    return new, old


def test_policy_loss_hand_computed():
    new, old = _logps(RATIOS)
    loss, m = ca.policy_loss(new, old, ADV, PMASK)
    close(loss, -2.6 / 3)  # (-1.2 + 0.8 - 2.2) / 3
    close(m["pg_loss"], -2.6 / 3)
    close(m["pg_clipfrac"], 2 / 3)
    close(m["ppo_ratio"], 3.1 / 3)  # (1.5 + 0.5 + 1.1) / 3
    close(m["ppo_ratio_clamped"], 3.1 / 3)  # (1.2 + 0.8 + 1.1) / 3
    close(m["abs_pg_loss"], 1.5)  # (max(1.5,1.2) + max(0.5,0.8) + 2.2) / 3
    close(m["ppo_kl"], -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)  # 0.0641239
    close(m["approx_kl"], 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2) / 3)
    close(m["pg_clipfrac_lower"], 0.0)
    loss.backward()
    # only the unclipped token has a gradient: d(-A r / 3)/d logp = -A r / 3 = -2 * 1.1 / 3
    close(new.grad, [[0.0, 0.0, -2.2 / 3, 0.0]])


def test_policy_loss_clip_high_and_agg():
    new, old = _logps(RATIOS)
    # clip_high 0.3: t0 becomes max(-1.5, -1.3) = -1.3 -> (-1.3 + 0.8 - 2.2) / 3 = -0.9
    loss, _ = ca.policy_loss(new, old, ADV, PMASK, clip_low=0.2, clip_high=0.3)
    close(loss, -0.9)
    # seq-mean-token-sum-norm with max_len 6: (-1.2 + 0.8 - 2.2) / 6
    loss, _ = ca.policy_loss(new, old, ADV, PMASK, agg="seq-mean-token-sum-norm", max_len=6)
    close(loss, -2.6 / 6)


def test_policy_loss_dual_clip():
    # A = -1: r = 4 -> l1 = 4, l2 = 1.2, max 4; dual clip c = 3 caps it at -A*c = 3 (active)
    #         r = 2 -> max(2, 1.2) = 2 < 3 (inactive); A = +1, r = 4 -> max(-4, -1.2) = -1.2 (dual clip n/a)
    new, old = _logps(torch.tensor([[4.0, 2.0, 4.0, 1.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, 0.0]])
    loss, m = ca.policy_loss(new, old, adv, PMASK, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["pg_clipfrac_lower"], 1 / 3)
    # l2 > l1 only at t2 (A > 0, r > 1.2); for A < 0 and large r the plain max keeps the unclipped l1,
    # which is exactly the unbounded case the dual clip caps
    close(m["pg_clipfrac"], 1 / 3)
    loss.backward()
    close(new.grad, [[0.0, 2.0 / 3, 0.0, 0.0]])  # the dual-clipped token is constant; t1: -A r / 3 = 2/3
    with pytest.raises(ValueError, match="dual_clip"):
        ca.policy_loss(new, old, adv, PMASK, dual_clip=1.0)


def test_policy_loss_kl_and_entropy_terms():
    new, old = _logps(RATIOS)
    ref = new.detach() - 0.2  # k1 KL = 0.2 on every token
    entropy = torch.tensor([[1.0, 2.0, 3.0, 100.0]])  # masked mean = 2
    loss, m = ca.policy_loss(
        new, old, ADV, PMASK, ref_logp=ref, kl_coef=0.1, kl_kind="k1", entropy=entropy, entropy_coeff=0.01
    )
    close(loss, -2.6 / 3 + 0.1 * 0.2 - 0.01 * 2.0)
    close(m["kl"], 0.2)
    close(m["kl_loss"], 0.2)
    close(m["entropy"], 2.0)
    close(m["loss"], -2.6 / 3 + 0.02 - 0.02)
    with pytest.raises(ValueError, match="ref_logp"):
        ca.policy_loss(new, old, ADV, PMASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        ca.policy_loss(new, old, ADV, PMASK, entropy_coeff=0.1)


def test_policy_loss_sequence_advantages_broadcast():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    old = logp - 0.05
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    a, _ = ca.policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    b, _ = ca.policy_loss(logp, old, adv.unsqueeze(1).expand(2, 2), mask, agg="seq-mean-token-mean")
    close(a, b)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.1, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    # t0: clip(1.0, 0.3, 0.7) = 0.7; vf1 = (1-2)^2 = 1, vf2 = (0.7-2)^2 = 1.69 -> 1.69 (clipped)
    # t1: clip(2.0, 1.9, 2.3) = 2.0; vf1 = vf2 = 1 -> 1
    loss, m = ca.value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.5 * (1.69 + 1.0) / 2)  # 0.6725
    close(m["vf_clipfrac"], 0.5)
    close(m["vf_loss"], 0.6725)
    loss.backward()
    # t0 is clipped (constant), t1: d/dv 0.5 * (v - R)^2 / 2 = (2 - 1) / 2 = 0.5
    close(values.grad, [[0.0, 0.5, 0.0]])


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
    # group 0: mean 2, unbiased std 1 -> [-1, 0, 1]; group 1: std 0 -> all 0
    close(ca.group_advantages(scores, 3), [-1 / (1 + 1e-6), 0, 1 / (1 + 1e-6), 0, 0, 0])
    # batch: group means subtracted, divided by the batch std: mean 3, squares 4+1+0+1+1+1 = 8,
    # var = 8/5 = 1.6, std = 1.2649111
    s = math.sqrt(1.6)
    close(ca.group_advantages(scores, 3, scale="batch"), [-1 / s, 0, 1 / s, 0, 0, 0])
    close(ca.group_advantages(scores, 3, scale="none"), [-1, 0, 1, 0, 0, 0])  # Dr. GRPO
    close(ca.group_advantages(scores, 3, eps=1.0), [-0.5, 0, 0.5, 0, 0, 0])  # std + eps = 2


def test_group_advantages_edge_cases():
    # NaN (unscorable) is left out: {1, 3} -> mean 2, std sqrt(2); the NaN sample gets 0
    close(ca.group_advantages(torch.tensor([1.0, float("nan"), 3.0]), 3), [-1 / math.sqrt(2), 0, 1 / math.sqrt(2)])
    close(ca.group_advantages(torch.tensor([5.0, 7.0]), 1), [0.0, 0.0])  # a group of one has no spread
    close(ca.group_advantages(torch.tensor([1, 3]), 2, eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2)])  # ints
    with pytest.raises(ValueError, match="divisible"):
        ca.group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="group, batch, none"):
        ca.group_advantages(torch.ones(4), 2, scale="global")


# ----------------------------------------------------------------------------------------------------
# A batch split into shards: the totals / sum_across give the whole batch's numbers
# ----------------------------------------------------------------------------------------------------


def test_split_batch_losses_add_up_to_the_whole_batch():
    """Each micro-batch's loss with the batch's totals is its share: the shares of any split add up to the loss
    of the whole batch, in every aggregation mode (verl's global token / sequence normalisation)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g) * 3
    old = logp + 0.3 * torch.randn(6, 5, generator=g)
    ref = logp + 0.1 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, 5, generator=g)
    entropy = torch.rand(6, 5, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    mask[3] = 0  # a sequence left out of the loss (a filtered group): it counts in no total
    tokens, sequences = mask.sum(), mask.any(-1).sum().float()

    def loss(rows, mode, **totals):
        return ca.policy_loss(logp[rows], old[rows], adv[rows], mask[rows], agg=mode, max_len=5, ref_logp=ref[rows],
                              kl_coef=0.1, kl_kind="k3", entropy=entropy[rows], entropy_coeff=0.01, **totals)

    for mode in ca.AGG_MODES:
        whole, whole_m = loss(slice(None), mode, total_tokens=tokens, total_sequences=sequences)
        for split in ([slice(0, 2), slice(2, 6)], [slice(0, 1), slice(1, 4), slice(4, 6)]):
            parts = [loss(rows, mode, total_tokens=tokens, total_sequences=sequences) for rows in split]
            close(sum(p[0] for p in parts), whole)
            for key in ("pg_loss", "pg_clipfrac", "kl_loss", "entropy", "ppo_ratio", "abs_pg_loss"):
                close(sum(p[1][key] for p in parts), whole_m[key])
        # with the batch's own totals, the result is the plain (unsplit) aggregation over the kept sequences
        close(whole, loss(mask.any(-1), mode)[0])
    # the value loss: shares of the batch's value tokens
    values, returns = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    whole, _ = ca.value_loss(values, old, returns, mask, total_tokens=tokens)
    halves = [ca.value_loss(values[s], old[s], returns[s], mask[s], total_tokens=tokens)[0] for s in (slice(0, 3), slice(3, 6))]
    close(sum(halves), whole)
    close(whole, ca.value_loss(values, old, returns, mask)[0])


def test_sum_across_shards_gives_the_whole_batch_statistics():
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(6, 4, generator=g), (torch.rand(6, 4, generator=g) > 0.3).float()
    shards = [(x[:2], mask[:2]), (x[2:], mask[2:])]
    whitened = shards_in_threads(lambda s, sum_across: ca.masked_whiten(s[0], s[1], sum_across=sum_across), shards)
    close(torch.cat(whitened), ca.masked_whiten(x, mask))
    kept = shards_in_threads(lambda s, sum_across: ca.masked_whiten(s[0], s[1], False, sum_across=sum_across), shards)
    close(torch.cat(kept), ca.masked_whiten(x, mask, shift_mean=False))
    # GAE's whitening, and the batch std of group advantages (groups never span shards)
    values = torch.randn(6, 4, generator=g)
    gae = shards_in_threads(lambda s, sum_across: ca.compute_gae(s[0], s[1], s[2], 1.0, 0.95, sum_across=sum_across)[0],
                            [(x[:2], values[:2], mask[:2]), (x[2:], values[2:], mask[2:])])
    close(torch.cat(gae), ca.compute_gae(x, values, mask, 1.0, 0.95)[0])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, float("nan"), 2.0])
    adv = shards_in_threads(lambda s, sum_across: ca.group_advantages(s, 2, scale="batch", sum_across=sum_across),
                            [scores[:4], scores[4:]])
    close(torch.cat(adv), ca.group_advantages(scores, 2, scale="batch"))
    # the local statistics of one shard are not the batch's: the reduction matters here
    assert not torch.allclose(ca.masked_whiten(x[:2], mask[:2]), ca.masked_whiten(x, mask)[:2])


def test_rloo_advantages_hand_computed():
    # group 0: scores 1, 2, 6 -> baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5 -> -3, -1.5, 4.5
    # group 1: 0, NaN, 3 -> the NaN sample gets 0; the others' baselines are each other: -3, +3
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, float("nan"), 3.0])
    close(ca.rloo_advantages(scores, 3), [-3.0, -1.5, 4.5, -3.0, 0.0, 3.0])
    close(ca.rloo_advantages(torch.tensor([5.0, 7.0]), 1), [0.0, 0.0])  # no other sample: no baseline
    # = n / (n - 1) x the unscaled group advantage (GRPO with --adv-scale none)
    close(ca.rloo_advantages(scores[:3], 3), 1.5 * ca.group_advantages(scores[:3], 3, scale="none"))
    with pytest.raises(ValueError, match="not scaled by a std"):
        ca.rloo_advantages(scores, 3, scale="group")
    assert ca.ADV_ESTIMATORS["rloo"].fn is ca.rloo_advantages
    assert ca.ADV_ESTIMATORS["grpo"].fn(scores[:3], 3).tolist() == ca.group_advantages(scores[:3], 3).tolist()


def test_critic_mask_leaves_out_rows_the_loss_mask_took_out():
    response = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    loss = response * torch.tensor([[1.0], [0.0], [1.0]])  # row 1 masked out whole; row 2 an empty response
    assert ca.critic_mask(loss, response).int().tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
