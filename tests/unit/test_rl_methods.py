"""The RL methods selected by flag (issue 16): advantage estimators (dr_grpo, reinforce_plus_plus,
reinforce_plus_plus_baseline) against numbers worked out by hand from verl's formulas, the rollout-mismatch
correction (TIS / MIS weights, the mismatch statistics), DAPO's overlong penalty, --mask-truncated-completions, GSPO
on a hand case, and the registries: one decorator makes a new estimator / policy loss selectable by flag.

TRL parity of GSPO, RLOO and TIS / MIS is in test_trl_parity.py.
"""

import math

import pytest
import torch

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.rl import core_algos as ca


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------
# advantage estimators, by hand
# --------------------------------------------------------------------------------------------------
def test_dr_grpo_is_the_group_mean_baseline_without_std():
    # groups of 3: [1, 2, 6] (mean 3), [0, NaN, 3] (mean 1.5 over the scored two; NaN -> 0)
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, float("nan"), 3.0])
    close(ca.dr_grpo_advantages(scores, 3), [-2.0, -1.0, 3.0, -1.5, 0.0, 1.5])
    assert ca.ADV_ESTIMATORS["dr_grpo"].kind == "outcome"
    with pytest.raises(ValueError, match="--adv-scale group does not apply"):
        ca.dr_grpo_advantages(scores, 3, scale="group")


def test_reinforce_plus_plus_by_hand():
    """verl: G_t = r_t + gamma G_{t+1}, the running return reset after each padding position, then masked_whiten
    over every response token of the batch, zero outside the mask."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # row 0: KL penalties -0.1, -0.2 and score 1.0 - 0.1 on the last token; row 1: a reward sits on its padding
    # position (7.0), which must not flow back into the response
    rewards = torch.tensor([[-0.1, -0.2, 0.9], [-0.5, 1.5, 7.0]])
    # gamma 0.5 -> row 0: G2 = 0.9, G1 = -0.2 + 0.45 = 0.25, G0 = -0.1 + 0.125 = 0.025
    #              row 1: G1 = 1.5 (the padding's 7.0 is cut), G0 = -0.5 + 0.75 = 0.25
    returns = torch.tensor([0.025, 0.25, 0.9, 0.25, 1.5])
    mean = 2.925 / 5  # 0.585
    var = ((returns - mean) ** 2).sum() / 4  # unbiased: 1.4745 / 4 = 0.368625
    close(var, 0.368625)
    expected = (returns - mean) / math.sqrt(0.368625 + 1e-8)  # -0.92235, -0.55176, 0.51882, -0.55176, 1.50705
    adv = ca.reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(adv[mask.bool()], expected)
    assert adv[1, 2] == 0
    close(adv[mask.bool()], [-0.92235, -0.55176, 0.51882, -0.55176, 1.50705], atol=1e-5)
    entry = ca.ADV_ESTIMATORS["reinforce_plus_plus"]
    assert entry.kind == "token" and entry.kl_in_reward


def test_reinforce_plus_plus_baseline_by_hand():
    """verl: the score less its group's mean on every response token, then masked_whiten over the batch's response
    tokens (a token-weighted statistic: the 2-token response counts twice)."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])  # groups of 2: means 2 and 2 -> centred -1, +1, 0, 0
    token_rewards, _ = ca.compute_token_rewards(scores, torch.zeros(4, 3), torch.zeros(4, 3), mask, 0.0,
                                                score_at="last")
    # tokens: -1, -1 | 1 | 0, 0, 0 | 0 -> mean -1/7, unbiased var (3 - 7/49) / 6 = 10/21
    std = math.sqrt(10 / 21 + 1e-8)
    expected = torch.tensor([[-6 / 7, -6 / 7, 0], [8 / 7, 0, 0], [1 / 7, 1 / 7, 1 / 7], [1 / 7, 0, 0]]) / std * mask
    adv = ca.reinforce_plus_plus_baseline_advantages(token_rewards, mask, 2)
    close(adv, expected)
    close(adv[0, 0], -1.242118, atol=1e-5)
    # a group of one has no baseline (verl: mean 0): the scores themselves are whitened
    raw = ca.reinforce_plus_plus_baseline_advantages(token_rewards, mask, 1)
    close(raw, ca.masked_whiten(scores[:, None] * mask, mask) * mask)


def test_token_estimators_take_the_whole_batch_statistics():
    from tests.helpers.threads import shards_in_threads

    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    rewards = torch.randn(8, 5, generator=g) * mask
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        fn = ca.ADV_ESTIMATORS[name].fn
        whole = fn(rewards, mask, 2, gamma=0.9)
        halves = shards_in_threads(lambda s, sum_across: fn(s[0], s[1], 2, gamma=0.9, sum_across=sum_across),
                                   [(rewards[:4], mask[:4]), (rewards[4:], mask[4:])])
        close(torch.cat(halves), whole)
        assert not torch.allclose(fn(rewards[:4], mask[:4], 2, gamma=0.9), whole[:4])  # the reduction matters


# --------------------------------------------------------------------------------------------------
# rollout correction: TIS / MIS weights in policy_loss, the mismatch statistics
# --------------------------------------------------------------------------------------------------
def test_tis_and_mis_weights_in_policy_loss_by_hand():
    # three tokens whose training / sampler probability ratios w are 0.5, 1.5 and 3.0; threshold C = 2
    rollout = torch.log(torch.tensor([[0.2, 0.4, 0.1]]))
    old = rollout + torch.log(torch.tensor([[0.5, 1.5, 3.0]]))
    mask = torch.ones(1, 3)
    adv = torch.ones(1)
    expected = {"tis": [0.5, 1.5, 2.0], "mis": [0.5, 1.5, 0.0]}  # min(w, C); w where w <= C, else 0
    for mode, weights in expected.items():
        close(ca.rollout_is_weights(old, rollout, mode, 2.0), [weights])
        logp = old.clone().requires_grad_()  # on-policy: ratio 1, so the token loss is -A * weight
        loss, m = ca.policy_loss(logp, old, adv, mask, rollout_logp=rollout, rollout_is=mode, rollout_is_threshold=2.0)
        close(loss, -sum(weights) / 3)
        loss.backward()
        close(logp.grad, [[-w / 3 for w in weights]])  # d(-A r w)/dlogp = -A w at r = 1; token-mean over 3
        close(m["rollout_is_weight"], sum(weights) / 3)
        close(m["rollout_is_clipfrac"], 1 / 3)
    # none: the weights are not applied (and rollout_logp is not needed)
    loss, m = ca.policy_loss(old.clone(), old, adv, mask)
    close(loss, -1.0)
    assert "rollout_is_weight" not in m
    with pytest.raises(ValueError, match="needs rollout_logp"):
        ca.policy_loss(old, old, adv, mask, rollout_is="tis")


def test_rollout_mismatch_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.2, -1.5, -0.5], [-0.7, 5.0, 5.0]])  # row 1's padding differs wildly: not counted
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    d = torch.tensor([-0.2, 0.5, 0.0, 0.3])  # rollout - old on the response tokens
    m = ca.rollout_mismatch(old, rollout, mask)
    close(m["abs_diff_mean"], 1.0 / 4)
    close(m["abs_diff_max"], 0.5)
    close(m["k3_kl"], (torch.exp(-d) + d - 1).mean())  # k3 of KL(rollout || training), from the sampled tokens
    assert m["k3_kl"] > 0


# --------------------------------------------------------------------------------------------------
# GSPO by hand
# --------------------------------------------------------------------------------------------------
def test_gspo_by_hand():
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: token log-ratios 0.2, -0.1 -> s = exp(0.05) inside [1 - 0.2, 1 + 0.2]; its padding's 5.0 is ignored
    # row 1: 0.5, 0.4, 0.3 -> s = exp(0.4) = 1.4918 > 1.2, A > 0: clipped, no gradient
    logp = torch.tensor([[0.2, -0.1, 5.0], [0.5, 0.4, 0.3]], requires_grad=True)
    adv = torch.tensor([1.0, 2.0])
    loss, m = ca.policy_loss(logp, old, adv, mask, clip_low=0.2, loss_type="gspo", agg="seq-mean-token-mean")
    s0 = math.exp(0.05)
    close(loss, (-1.0 * s0 + -2.0 * 1.2) / 2)
    loss.backward()
    # d/dlogp_t of -A s (GSPO-token: value s, gradient s * dlogp_t), weight 1 / (n_b * 2 sequences)
    close(logp.grad, [[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]])
    close(m["pg_clipfrac"], 3 / 5)  # row 1's three tokens of the five
    close(m["ppo_ratio"], (2 * s0 + 3 * math.exp(0.4)) / 5)
    with pytest.raises(ValueError, match="no dual clip"):
        ca.policy_loss(logp, old, adv, mask, loss_type="gspo", dual_clip=3.0)
    with pytest.raises(ValueError, match="valid names are: vanilla, gspo"):
        ca.policy_loss(logp, old, adv, mask, loss_type="nope")


# --------------------------------------------------------------------------------------------------
# DAPO overlong penalty (scoring.py) and --mask-truncated-completions
# --------------------------------------------------------------------------------------------------
def _experience(lengths, reasons, width=10):
    from mindspeed_llm.rl.experience import Experience, SampleData

    n = len(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    exp = Experience(tokens=torch.zeros(n, width + 1, dtype=torch.long),
                     position_ids=torch.zeros(n, width + 1, dtype=torch.long), prompt_lengths=torch.ones(n, dtype=torch.long),
                     responses=torch.zeros(n, width, dtype=torch.long), response_mask=mask,
                     ended_with_eos=torch.tensor([r == "eos" for r in reasons]))
    exp.sample_data = SampleData(finish_reasons=list(reasons), texts=[""] * n, labels=[None] * n,
                                 indices=list(range(n)))
    return exp


def test_overlong_penalty_by_hand():
    from mindspeed_llm.rl.metrics import Timers
    from mindspeed_llm.rl.scoring import Scorer

    # M = 10, L = 4, F = 0.5: no penalty up to 6 tokens, then (6 - n) / 4 * 0.5
    lengths = torch.tensor([3, 6, 7, 9, 10])
    close(ca.overlong_penalty(lengths, 10, 4, 0.5), [0.0, 0.0, -0.125, -0.375, -0.5])
    exp = _experience(lengths.tolist(), ["eos"] * 4 + ["length"])
    total, metrics = Scorer([], [], overlong_buffer_len=4, overlong_penalty_factor=0.5, max_new_tokens=10)(
        exp, None, Timers())
    close(total, [0.0, 0.0, -0.125, -0.375, -0.5])
    close(metrics["overlong/penalty_mean"], -1.0 / 5)
    close(metrics["overlong/penalised_fraction"], 3 / 5)
    total, metrics = Scorer([], [])(exp, None, Timers())  # off by default
    assert total.tolist() == [0.0] * 5 and not metrics


def test_mask_truncated_completions_removes_exactly_the_truncated_responses():
    from mindspeed_llm.rl.rollouts.plain import mask_truncated_completions

    reasons = ["eos", "length", "stop", "length", "eos"]
    exp = _experience([4, 10, 2, 7, 5], reasons)
    metrics = mask_truncated_completions(exp)
    assert metrics == {"truncated_masked_fraction": pytest.approx(2 / 5)}
    assert torch.equal(exp.loss_mask.sum(-1), torch.tensor([4.0, 0.0, 2.0, 0.0, 5.0]))
    assert torch.equal(exp.response_mask.sum(-1), torch.tensor([4.0, 10.0, 2.0, 7.0, 5.0]))  # lengths stay
    # the loss is that of the other three responses alone, and the truncated ones get no gradient
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(5, 10, generator=g).requires_grad_()
    old, adv = logp.detach() + 0.1 * torch.randn(5, 10, generator=g), torch.randn(5, generator=g)
    kept = torch.tensor([0, 2, 4])
    for agg in ca.AGG_MODES:
        loss, _ = ca.policy_loss(logp, old, adv, exp.loss_mask, agg=agg, total_sequences=3)
        alone, _ = ca.policy_loss(logp[kept], old[kept], adv[kept], exp.loss_mask[kept], agg=agg)
        close(loss, alone)
        (grad,) = torch.autograd.grad(loss, logp)
        assert grad[[1, 3]].abs().sum() == 0 and grad[kept].abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# registries and flags
# --------------------------------------------------------------------------------------------------
BASE = ["--data-path", "d", "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r"]
GRPO = BASE + ["--stage", "grpo", "--verifier-function", "math_acc"]
PPO = BASE + ["--stage", "trl_ppo", "--reward-model", "x"]


def test_defaults_per_stage():
    ppo, grpo = parse_args(PPO).settings, parse_args(GRPO).settings
    assert (ppo.algorithm.adv_estimator, ppo.loss.policy_loss, ppo.algorithm.rollout_is,
            ppo.algorithm.recompute_old_logprobs) == ("gae", "vanilla", "none", False)
    assert (grpo.algorithm.adv_estimator, grpo.loss.policy_loss) == ("grpo", "vanilla")
    # the correction implies it
    assert parse_args(GRPO + ["--rollout-is", "tis"]).settings.algorithm.recompute_old_logprobs


def test_one_decorator_makes_an_estimator_and_a_policy_loss_selectable():
    from mindspeed_llm.rl.stages.grpo import _advantage_estimator

    with pytest.raises(ArgumentError, match="--adv-estimator half: unknown"):
        parse_args(GRPO + ["--adv-estimator", "half"])

    @ca.register_advantage("half")
    def half(scores, group_size, *, scale="none", sum_across=None):
        return scores / 2

    @ca.register_policy_loss("plain")
    def plain(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip=None):
        ratio = torch.exp(logp - old_logp)
        pg = -advantages * ratio
        return ca.PolicyTerms(pg, ratio, ratio, torch.zeros_like(mask, dtype=torch.bool), None, pg.abs())

    try:
        args = parse_args(GRPO + ["--adv-estimator", "half", "--policy-loss", "plain"])
        entry, estimator = _advantage_estimator(args.settings.algorithm)
        assert entry.fn is half and estimator(torch.tensor([2.0, 4.0]), 2).tolist() == [1.0, 2.0]
        loss, _ = ca.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([3.0]), torch.ones(1, 2),
                                 loss_type=args.policy_loss)
        assert loss.item() == -3.0
        with pytest.raises(ArgumentError, match="critic-free: --stage trl_ppo"):
            parse_args(PPO + ["--adv-estimator", "half"])
    finally:
        del ca.ADV_ESTIMATORS["half"], ca.POLICY_LOSSES["plain"]
    with pytest.raises(ArgumentError, match="--policy-loss plain: unknown; valid names: vanilla, gspo"):
        parse_args(GRPO + ["--policy-loss", "plain"])


@pytest.mark.parametrize("argv,needle", [
    (GRPO + ["--adv-estimator", "gae"], "--adv-estimator gae needs a critic: --stage trl_ppo only"),
    (PPO + ["--adv-estimator", "reinforce_plus_plus"], "reinforce_plus_plus is critic-free"),
    (PPO + ["--adv-estimator", "nope"], "valid names for --stage trl_ppo: gae"),
    (GRPO + ["--adv-estimator", "nope"], "grpo, rloo, dr_grpo, reinforce_plus_plus, reinforce_plus_plus_baseline"),
    (GRPO + ["--adv-estimator", "reinforce_plus_plus", "--adv-scale", "group"], "--adv-scale group applies to the"),
    (GRPO + ["--policy-loss", "gspo", "--dual-clip", "3"], "gspo has no dual clip"),
    (GRPO + ["--gspo-clip-ratio", "-1"], "--gspo-clip-ratio -1.0 must be"),
    (GRPO + ["--overlong-buffer-len", "200"], "--overlong-buffer-len 200 must be in [1, --max-new-tokens 128]"),
    (GRPO + ["--overlong-buffer-len", "0"], "--overlong-buffer-len 0 must be"),
    (GRPO + ["--rollout-is", "mis", "--rollout-is-threshold", "0.5"], "--rollout-is-threshold 0.5 must be"),
])
def test_bad_method_flags_are_refused_by_name(argv, needle):
    with pytest.raises(ArgumentError) as err:
        parse_args(argv)
    assert needle in str(err.value)


def test_the_stage_probes_the_estimator_options():
    from mindspeed_llm.rl.stages.grpo import _advantage_estimator

    with pytest.raises(ArgumentError, match="--adv-estimator dr_grpo: dr_grpo advantages are not scaled"):
        _advantage_estimator(
            parse_args(GRPO + ["--adv-estimator", "dr_grpo", "--adv-scale", "group"]).settings.algorithm)
    entry, fn = _advantage_estimator(parse_args(GRPO + ["--adv-estimator", "reinforce_plus_plus", "--gamma",
                                                           "0.5"]).settings.algorithm)
    assert entry.kind == "token" and fn.keywords == {"gamma": 0.5}
