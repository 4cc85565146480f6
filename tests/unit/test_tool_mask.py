"""Training on multi-turn trajectories with tool-response tokens (`Experience.tool_mask`, `core_algos/actions.py`):
the action mask, GAE and the token estimators stepping over the model's own tokens only, tool tokens out of every
loss, the KL and the entropy, `tool_mask` carried by select / concat / micro-batches, and the single-turn path
unchanged. Hand-built trajectories; the references are hand-computed numbers or the same trajectory written out
without its tool tokens (the columns deleted, the unchanged single-turn functions, zeros put back)."""

from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.rl import core_algos as ca
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.rollout import mismatch_metrics, rollout_metrics
from mindspeed_llm.rl.stages import grpo as grpo_stage
from mindspeed_llm.rl.stages import trl_ppo as trl_ppo_stage

# m: a model token, t: a tool-response token; padding after. Row 2 ends with a tool span (the rollout stopped after
# a tool call): its terminal position is the first token of that span.
LAYOUTS = ("mmttmm", "mtttmtmm", "mmmtt")
WIDTH = 10


def _masks(layouts, width=WIDTH):
    response = torch.zeros(len(layouts), width)
    tool = torch.zeros(len(layouts), width)
    for b, layout in enumerate(layouts):
        response[b, :len(layout)] = 1
        tool[b, [j for j, c in enumerate(layout) if c == "t"]] = 1
    return response, tool


def _experience(layouts, width=WIDTH, prompt=3, seed=0, tool_mask=True):
    g = torch.Generator().manual_seed(seed)
    response, tool = _masks(layouts, width)
    B = len(layouts)
    lengths = response.sum(-1).long()
    T = prompt + width
    tokens = torch.zeros(B, T, dtype=torch.long)
    responses = torch.randint(1, 50, (B, width), generator=g) * response.long()
    for b in range(B):
        tokens[b, :prompt] = 7
        tokens[b, prompt:prompt + lengths[b]] = responses[b, :lengths[b]]
    exp = Experience(tokens=tokens, position_ids=torch.arange(T).expand(B, T), prompt_lengths=torch.full((B,), prompt),
                     responses=responses, response_mask=response, ended_with_eos=torch.ones(B, dtype=torch.bool),
                     rollout_logp=-torch.rand(B, width, generator=g) * response,
                     tool_mask=tool if tool_mask else None)
    exp.old_logp = -torch.rand(B, width, generator=g) * response
    exp.ref_logp = -torch.rand(B, width, generator=g) * response
    exp.values = torch.randn(B, width, generator=g) * ca.response_mask_p1(response)
    exp.scores = torch.randn(B, generator=g)
    exp.sample_data = SampleData(finish_reasons=["eos"] * B, texts=[""] * B)
    return exp


def _kept_columns(response_row, tool_row):
    """The columns of one row written out without its tool tokens: every non-tool column, and the terminal one (one
    past the last action) even when it is a tool token (a trajectory that ends with a tool span)."""
    actions = (response_row * (1 - tool_row)).bool()
    terminal = int(ca.last_response_index(actions[None])[0]) + 1
    return [j for j in range(len(tool_row)) if not tool_row[j] or j == terminal]


def _delete_tools(x, response, tool):
    """`x` [B, R] with each row's tool columns deleted (`_kept_columns`), right-padded with zeros to R."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        cols = _kept_columns(response[b], tool[b])
        out[b, :len(cols)] = x[b, cols]
    return out


def _put_back(x, response, tool):
    """The inverse of `_delete_tools`: column k of row b goes back to its place; zeros at the deleted columns."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        cols = _kept_columns(response[b], tool[b])
        out[b, cols] = x[b, :len(cols)]
    return out


def _identity(t):
    return t


def _trl_ppo_self(kl_coef=0.05, whiten_rewards=False, gamma=1.0, lam=0.95):
    return SimpleNamespace(algorithm=SimpleNamespace(kl_coef=kl_coef, whiten_rewards=whiten_rewards, gamma=gamma,
                                                     lam=lam),
                           settings=SimpleNamespace(loss=SimpleNamespace(kl_penalty="k1")), gae=ca.compute_gae)


# ------------------------------------------------------------------------------------------------ masks
def test_the_action_mask_and_the_default_loss_mask_leave_the_tool_tokens_out():
    exp = _experience(LAYOUTS)
    assert exp.action_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 0, 0]
    assert torch.equal(exp.loss_mask, exp.action_mask)
    assert exp.action_lengths.tolist() == [4, 4, 3] and exp.response_lengths.tolist() == [6, 8, 5]
    single = _experience(LAYOUTS, tool_mask=False)
    assert single.action_mask is single.response_mask and torch.equal(single.loss_mask, single.response_mask)
    # actions first, then the terminal position (one past the last action), then the rest in order
    assert ca.action_order(exp.action_mask)[1].tolist() == [0, 4, 6, 7, 8, 1, 2, 3, 5, 9]
    assert ca.action_order(exp.action_mask)[2].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert torch.equal(ca.action_order(single.response_mask), torch.arange(WIDTH).expand(3, WIDTH))


def test_the_loss_mask_is_derived_from_its_parts_by_hand():
    """`core_algos.loss_mask` from hand-made parts: response 1 1 1 1 0 / tool 0 1 0 0 0 per row, row 1 truncated,
    row 2 filtered: the hand-written mask below."""
    response = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    tool = torch.tensor([[0.0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1]])
    truncated = torch.tensor([False, True, False, False])
    filtered = torch.tensor([False, False, True, False])
    expected = torch.tensor([[1.0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    assert torch.equal(ca.loss_mask(response, tool, truncated, filtered), expected)
    assert torch.equal(ca.loss_mask(response, tool), response * (1 - tool))
    assert torch.equal(ca.loss_mask(response, None, truncated), response * torch.tensor([1.0, 0, 1, 1])[:, None])
    alone = ca.loss_mask(response)
    assert torch.equal(alone, response) and alone is not response  # a copy: editing it leaves response_mask alone
    assert ca.loss_mask(response.bool(), tool, truncated, filtered).tolist() == expected.bool().tolist()


def test_the_experience_loss_mask_follows_its_parts_set_at_any_time():
    exp = _experience(LAYOUTS, tool_mask=False)
    assert torch.equal(exp.loss_mask, exp.response_mask) and exp.loss_mask is exp.loss_mask  # made once
    exp.truncated_out = torch.tensor([False, False, True])  # --mask-truncated-completions
    exp.tool_mask = _masks(LAYOUTS)[1]  # a strategy that sets tool_mask afterwards: its tokens leave every loss
    assert torch.equal(exp.loss_mask, exp.action_mask * torch.tensor([1.0, 1.0, 0.0])[:, None])
    exp.filtered_out = torch.tensor([True, False, False])  # --filter-groups
    assert torch.equal(exp.loss_mask, exp.action_mask * torch.tensor([0.0, 1.0, 0.0])[:, None])
    picked = exp.select(torch.tensor([2, 1]))  # the row masks go with their rows
    assert torch.equal(picked.loss_mask, exp.loss_mask[[2, 1]])
    single = _experience(["mm"], width=WIDTH, seed=3, tool_mask=False)
    for part in (picked, single):
        part.old_logp = part.ref_logp = part.values = None
    joined = Experience.concat([picked, single], "cpu")  # a part without them leaves no row out
    assert joined.truncated_out.tolist() == [True, False, False] and joined.filtered_out.tolist() == [False] * 3
    assert joined.loss_mask.sum(-1).tolist() == [0.0, 4.0, 2.0]


# ------------------------------------------------------------------------------------------------ GAE
def test_gae_over_tool_spans_by_hand():
    """gamma 1, lam 0.95; the row `m m t t m` + padding: 3 model tokens, 2 tool tokens, the score 1.0 one past the
    last model token (column 5). Model-token rewards -KL = (-0.1, 0, -0.2), values (0.5, 0.2, 0.4) and 0.1 at the
    terminal. Over the model tokens (tool tokens skipped):
        d3 = 1.0 - 0.1 = 0.9                  A3 = 0.9
        d2 = -0.2 + 0.1 - 0.4 = -0.5          A2 = -0.5 + 0.95 * 0.9 = 0.355
        d1 = 0 + 0.4 - 0.2 = 0.2              A1 = 0.2 + 0.95 * 0.355 = 0.53725
        d0 = -0.1 + 0.2 - 0.5 = -0.4          A0 = -0.4 + 0.95 * 0.53725 = 0.1103875
    returns A + V: 0.6103875, 0.73725, 0.755 and 1.0 at the terminal; the tool columns' values (99, -99) unused."""
    response = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    tool = torch.tensor([[0.0, 0, 1, 1, 0, 0]])
    actions = ca.action_mask(response, tool)
    logp = torch.tensor([[-0.9, -2.0, 50.0, -50.0, -2.8, 0.0]])
    ref_logp = torch.tensor([[-1.0, -2.0, -50.0, 50.0, -3.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 99.0, -99.0, 0.4, 0.1]])
    rewards, kl = ca.compute_token_rewards(torch.tensor([1.0]), logp, ref_logp, actions, 1.0, "k1")
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.0, 0.0, 0.0, -0.2, 1.0]]), atol=1e-6)
    adv, ret = ca.gae_over_actions(rewards, values, response, tool, 1.0, 0.95, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.1103875, 0.53725, 0, 0, 0.355, 0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.6103875, 0.73725, 0, 0, 0.755, 1.0]]), atol=1e-6)
    # whatever a registered estimator leaves off the actions, the advantages are 0 there (returns: off the value mask)
    ones, ones_ret = ca.gae_over_actions(rewards, values, response, tool, 1.0, 0.95,
                                         gae=lambda r, *a, **k: (torch.ones_like(r), torch.ones_like(r)))
    assert ones.tolist() == actions.tolist() and ones_ret.tolist() == [[1.0, 1, 0, 0, 1, 1]]
    # the plain GAE over every fed token is another thing (the tool columns' values leak in)
    plain, _ = ca.compute_gae(rewards, values, actions, 1.0, 0.95, whiten=False, value_mask=response)
    assert not torch.allclose(plain, adv, atol=1e-3)


@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_equals_the_trajectory_written_out_without_its_tool_tokens(monkeypatch, whiten_rewards, gamma, lam):
    """trl_ppo's advantages (its `_advantages`: the token rewards, whitening, GAE) on trajectories with tool spans
    equal the unchanged single-turn functions on the same trajectories with the tool columns deleted, put back."""
    monkeypatch.setattr(trl_ppo_stage, "sum_over_data_parallel", _identity)
    exp = _experience(LAYOUTS, seed=1)
    response, tool = exp.response_mask, exp.tool_mask
    stage = _trl_ppo_self(whiten_rewards=whiten_rewards, gamma=gamma, lam=lam)
    rewards, kl = trl_ppo_stage.TrlPPOStage._advantages(stage, exp)

    def deleted(x):
        return _delete_tools(x, response, tool)
    mask = deleted(exp.action_mask)
    ref_rewards, ref_kl = ca.compute_token_rewards(exp.scores, deleted(exp.old_logp), deleted(exp.ref_logp), mask,
                                                   0.05, "k1")
    value_mask = ca.response_mask_p1(mask)
    if whiten_rewards:
        ref_rewards = ca.masked_whiten(ref_rewards, value_mask, shift_mean=False) * value_mask
    ref_adv, ref_ret = ca.compute_gae(ref_rewards, deleted(exp.values), mask, gamma, lam, whiten=True,
                                      value_mask=value_mask)
    assert torch.allclose(rewards, _put_back(ref_rewards, response, tool), atol=1e-6)
    assert torch.allclose(kl, _put_back(ref_kl, response, tool), atol=1e-6)
    assert torch.allclose(exp.advantages, _put_back(ref_adv, response, tool), atol=1e-5)
    assert torch.allclose(exp.returns, _put_back(ref_ret, response, tool), atol=1e-5)
    assert (exp.advantages * exp.tool_mask).abs().sum() == 0


def test_a_trajectory_that_ends_with_a_tool_span_has_its_terminal_on_that_span_and_the_critic_trains_it():
    exp = _experience(LAYOUTS)
    critic = ca.critic_mask(exp.loss_mask, exp.response_mask)
    # rows 0 and 1 end with model tokens: their terminal is the first padding column; row 2's is column 3, a tool
    # token (the critic's state right after the model's last token)
    assert [torch.nonzero(critic[b] & ~exp.action_mask[b].bool()).flatten().tolist() for b in range(3)] == \
        [[6], [8], [3]]
    rewards, _ = ca.compute_token_rewards(exp.scores, exp.old_logp, exp.ref_logp, exp.action_mask, 0.0, "k1")
    assert torch.equal(rewards[2], torch.zeros(WIDTH).index_fill(0, torch.tensor([3]), exp.scores[2]))
    _, ret = ca.gae_over_actions(rewards, exp.values, exp.response_mask, exp.tool_mask, 1.0, 1.0, whiten=False)
    assert ret[2, 3] == exp.scores[2] and ret[2, 4] == 0  # the terminal's return is the score; past it nothing


def test_a_row_without_room_after_its_last_model_token_gets_the_score_on_it():
    """`m t m m` filling the tensor: as TRL's row without padding, the score on the last token (no terminal
    position); gamma 0.5, lam 1, values 0.1 / 0.2 / 0.3 on the model tokens, score 2, no KL:
    A(3) = 2 - 0.3 = 1.7; A(2) = 0.5 * 0.3 - 0.2 + 0.5 * 1.7 = 0.8; A(0) = 0.5 * 0.2 - 0.1 + 0.5 * 0.8 = 0.4
    (the tool column's value 5 unused); returns A + V: 0.5, 1.0, 2.0."""
    response, tool = _masks(["mtmm"], 4)
    values = torch.tensor([[0.1, 5.0, 0.2, 0.3]])
    rewards, _ = ca.compute_token_rewards(torch.tensor([2.0]), torch.zeros(1, 4), torch.zeros(1, 4),
                                          ca.action_mask(response, tool), 0.0, "k1")
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 2.0]]
    adv, ret = ca.gae_over_actions(rewards, values, response, tool, 0.5, 1.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.4, 0.0, 0.8, 1.7]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.5, 0.0, 1.0, 2.0]]), atol=1e-6)


# ------------------------------------------------------------------------------------------------ losses
def _perturbed(x, where, value):
    return torch.where(where, torch.full_like(x, value), x)


@pytest.mark.parametrize("loss_type,agg,kl_kind,rollout_is", [
    ("vanilla", "token-mean", "k1", "none"), ("vanilla", "seq-mean-token-mean", "k3", "tis"),
    ("vanilla", "seq-mean-token-sum-norm", "k2", "mis"), ("gspo", "seq-mean-token-sum", "abs", "none"),
])
def test_a_tool_token_never_reaches_a_loss_the_kl_or_the_entropy(loss_type, agg, kl_kind, rollout_is):
    """Extreme log-probs, reference log-probs, sampler log-probs, entropies, advantages, values and returns at the
    tool positions leave the policy loss (with its KL and entropy terms), every metric and the value loss unchanged,
    and their gradients there are exactly zero."""
    exp = _experience(LAYOUTS, seed=2)
    tools = exp.tool_mask.bool()
    critic = ca.critic_mask(exp.loss_mask, exp.response_mask)
    g = torch.Generator().manual_seed(3)
    logp = exp.old_logp + 0.1 * torch.randn(exp.old_logp.shape, generator=g)
    entropy = torch.rand(logp.shape, generator=g)
    advantages = torch.randn(logp.shape, generator=g) * exp.action_mask
    new_values = exp.values + 0.3 * torch.randn(logp.shape, generator=g)
    returns = torch.randn(logp.shape, generator=g)

    def losses(extreme):
        def pick(x, v):
            return (_perturbed(x, tools, v) if extreme else x).detach().clone()
        lp = pick(logp, -30.0).requires_grad_()
        ent = pick(entropy, 40.0).requires_grad_()
        loss, metrics = ca.policy_loss(
            lp, pick(exp.old_logp, 25.0), pick(advantages, 1e4), exp.loss_mask, 0.2, 0.28, agg=agg,
            loss_type=loss_type, ref_logp=pick(exp.ref_logp, -45.0), kl_coef=0.1, kl_kind=kl_kind, entropy=ent,
            entropy_coeff=0.01, rollout_logp=pick(exp.rollout_logp, -60.0), rollout_is=rollout_is)
        loss.backward()
        off_critic = tools & ~critic  # the terminal of a trajectory ending with a tool span is the critic's
        v = (_perturbed(new_values, off_critic, 1e3) if extreme else new_values.clone()).requires_grad_()
        vloss, vmetrics = ca.value_loss(v, _perturbed(exp.values, off_critic, -1e3) if extreme else exp.values,
                                        _perturbed(returns, off_critic, 1e3) if extreme else returns, critic, 0.2)
        vloss.backward()
        return loss, metrics, vloss, vmetrics, lp.grad, ent.grad, v.grad

    plain, extreme = losses(False), losses(True)
    assert torch.allclose(plain[0], extreme[0], atol=1e-6) and torch.allclose(plain[2], extreme[2], atol=1e-6)
    for name in plain[1]:
        assert torch.allclose(plain[1][name], extreme[1][name], atol=1e-6), name
    for name in plain[3]:
        assert torch.allclose(plain[3][name], extreme[3][name], atol=1e-6), name
    for grad in extreme[4:6]:
        assert torch.isfinite(grad).all() and grad[tools].abs().max() == 0
        assert grad[exp.action_mask.bool()].abs().max() > 0
    assert extreme[6][tools & ~critic].abs().max() == 0


# ------------------------------------------------------------------------------------------------ grpo
def _grpo_self(estimator, gamma=1.0, kl_coef=0.0, n=1):
    algorithm = SimpleNamespace(adv_estimator=estimator, n_samples_per_prompt=n, adv_scale=None, gamma=gamma,
                                kl_coef=kl_coef)
    entry, fn = grpo_stage._advantage_estimator(algorithm)
    return SimpleNamespace(algorithm=algorithm, estimator=entry, advantages=fn, reference=object() if kl_coef else None,
                           settings=SimpleNamespace(loss=SimpleNamespace(kl_penalty="k1")))


def test_grpo_group_advantages_are_zero_at_tool_tokens(monkeypatch):
    monkeypatch.setattr(grpo_stage, "sum_over_data_parallel", _identity)
    exp = _experience(LAYOUTS * 2, seed=4)
    _, per_sample = grpo_stage.GRPOStage._advantages(_grpo_self("grpo", n=2), exp)
    assert torch.equal(exp.advantages, per_sample[:, None] * exp.action_mask)
    assert (exp.advantages * exp.tool_mask).abs().sum() == 0 and exp.advantages[0, 0] != 0


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_discounts_over_model_tokens_only(monkeypatch, estimator):
    """gamma 0.9 with the KL in the reward: the stage's advantages equal the estimator on the trajectories written
    out without their tool tokens, put back; and the per-sample mean is over the model's tokens."""
    monkeypatch.setattr(grpo_stage, "sum_over_data_parallel", _identity)
    exp = _experience(LAYOUTS * 2, seed=5)
    stage = _grpo_self(estimator, gamma=0.9, kl_coef=0.1, n=2)
    rewards, per_sample = grpo_stage.GRPOStage._advantages(stage, exp)
    response, tool = exp.response_mask, exp.tool_mask

    def deleted(x):
        return _delete_tools(x, response, tool)
    mask = deleted(exp.action_mask)
    kl_coef = 0.1 if stage.estimator.kl_in_reward else 0.0
    ref_rewards, _ = ca.compute_token_rewards(exp.scores, deleted(exp.old_logp), deleted(exp.ref_logp), mask, kl_coef,
                                              "k1", score_at="last")
    ref = ca.ADV_ESTIMATORS[estimator].fn(ref_rewards, mask, 2, gamma=0.9)
    assert torch.allclose(exp.advantages, _put_back(ref, response, tool), atol=1e-5)
    assert torch.allclose(rewards, ref_rewards.sum(-1), atol=1e-6)
    assert torch.allclose(per_sample, (ref * mask).sum(-1) / mask.sum(-1), atol=1e-5)


def test_discounted_returns_skip_the_tool_spans_by_hand():
    """gamma 0.5, the score 1 on the last model token of `m t t m t m`: G = 0.25, 0.5, 1 on the model tokens (one
    discount per model token, the tool span does not cut the return), 0 on the tool tokens."""
    response, tool = _masks(["mttmtm"], 8)
    rewards = torch.zeros(1, 8)
    rewards[0, 5] = 1.0

    def returns(token_rewards, mask, group_size, *, sum_across=None):
        return ca.discounted_returns(token_rewards, mask, 0.5)
    out = ca.token_advantages_over_actions(returns, rewards, response, tool, 1)
    assert out.tolist() == [[0.25, 0, 0, 0.5, 0, 1.0, 0, 0]]
    assert ca.discounted_returns(rewards, ca.action_mask(response, tool), 0.5)[0, 0] == 0  # in place: cut


# ------------------------------------------------------------------------------------------------ rows
def test_select_concat_and_micro_batches_keep_the_tool_mask_aligned():
    exp = _experience(LAYOUTS, seed=6)
    exp.old_logp = exp.ref_logp = exp.values = None  # a join comes before the passes (dynamic sampling's refill)
    exp.sample_data.trajectories = [{"num_turns": b} for b in range(3)]
    picked = exp.select(torch.tensor([2, 0]))
    assert torch.equal(picked.tool_mask, exp.tool_mask[[2, 0]])
    assert picked.sample_data.trajectories == [{"num_turns": 2}, {"num_turns": 0}]
    single = _experience(["mmm"], width=3, seed=7, tool_mask=False)
    short = _experience(["mtm"], width=3, seed=8)
    for part in (single, short):
        part.old_logp = part.ref_logp = part.values = None
    joined = Experience.concat([short, single], "cpu")  # a part without tool tokens joins with zeros
    assert joined.tool_mask.tolist() == [[0, 1, 0], [0, 0, 0]]
    assert torch.equal(joined.loss_mask, joined.action_mask)
    joined = Experience.concat([picked, short], "cpu")
    assert joined.tool_mask.shape == (3, 6)  # cut to the longest fed response (5, 6 and 3 tokens)
    assert torch.equal(joined.tool_mask[:2], exp.tool_mask[[2, 0], :6])
    assert torch.equal(joined.tool_mask[2], torch.tensor([0.0, 1, 0, 0, 0, 0]))
    assert torch.equal(joined.loss_mask, joined.action_mask)
    plan = MicroBatchPlan.build(exp, micro_batch_size=1, max_tokens=2 * (3 + 6))  # a token budget reorders
    for mb in plan.micro_batches(exp, update=True):
        rows = torch.tensor([int(mb["order"][i]) for i in range(len(mb["order"]))])
        width = mb["response_mask"].shape[1]
        assert width == int(exp.response_lengths[rows].max()) + 1 or width == WIDTH  # fed tokens and one more
        assert torch.equal(mb["tool_mask"], exp.tool_mask[rows, :width])
        assert torch.equal(mb["loss_mask"], exp.action_mask[rows, :width])


# ------------------------------------------------------------------------------------------------ metrics
def test_response_length_counts_model_tokens_and_mismatch_reads_model_tokens():
    exp = _experience(LAYOUTS, seed=9)
    metrics = rollout_metrics(exp)
    assert metrics["response_length/mean"] == pytest.approx(11 / 3)
    assert metrics["response_length_with_tools/max"] == 8
    exp.rollout_logp = _perturbed(exp.rollout_logp, exp.tool_mask.bool(), 0.0)  # the sampler has none there
    exp.old_logp = _perturbed(exp.old_logp, exp.tool_mask.bool(), -40.0)
    stats = mismatch_metrics(exp)
    actions = exp.action_mask.bool()
    assert stats["rollout_mismatch/abs_diff_max"] == pytest.approx(
        float((exp.rollout_logp - exp.old_logp)[actions].abs().max()))
    assert "response_length_with_tools/mean" not in rollout_metrics(_experience(LAYOUTS, tool_mask=False))
    from mindspeed_llm.rl.metrics import tool_response_length
    assert tool_response_length(exp.tool_mask) == {"tool/response_length/mean": pytest.approx(8 / 3)}


# ------------------------------------------------------------------------------------------------ single turn
def _old_trl_ppo_advantages(exp, kl_coef, whiten_rewards, gamma, lam):
    """trl_ppo's advantages as the stage computed them before tool masks (a copy of that code)."""
    rewards, kl = ca.compute_token_rewards(exp.scores, exp.old_logp, exp.ref_logp, exp.response_mask, kl_coef, "k1")
    value_mask = ca.response_mask_p1(exp.response_mask)
    if whiten_rewards:
        rewards = ca.masked_whiten(rewards, value_mask, shift_mean=False) * value_mask
    adv, ret = ca.compute_gae(rewards, exp.values, exp.response_mask, gamma, lam, whiten=True, value_mask=value_mask)
    return rewards, kl, adv, ret


@pytest.mark.parametrize("tool_mask", [None, "zeros"])
def test_single_turn_is_unchanged_bit_for_bit(monkeypatch, tool_mask):
    """Without tool tokens (no tool_mask, or one of zeros) the advantages, returns and rewards of both stages are
    the tensors the code before tool masks gave, bit for bit, on random right-padded batches."""
    monkeypatch.setattr(trl_ppo_stage, "sum_over_data_parallel", _identity)
    monkeypatch.setattr(grpo_stage, "sum_over_data_parallel", _identity)
    g = torch.Generator().manual_seed(10)
    layouts = ["m" * int(n) for n in torch.randint(1, WIDTH + 1, (8,), generator=g)]
    exp = _experience(layouts, seed=11, tool_mask=False)
    if tool_mask == "zeros":
        exp.tool_mask = torch.zeros_like(exp.response_mask)
    assert torch.equal(exp.loss_mask, exp.response_mask)
    ref = _old_trl_ppo_advantages(exp, 0.05, True, 0.9, 0.95)
    rewards, kl = trl_ppo_stage.TrlPPOStage._advantages(_trl_ppo_self(0.05, True, 0.9, 0.95), exp)
    assert all(torch.equal(a, b) for a, b in zip((rewards, kl, exp.advantages, exp.returns), ref))
    stage = _grpo_self("reinforce_plus_plus", gamma=0.9, kl_coef=0.1, n=2)
    grpo_stage.GRPOStage._advantages(stage, exp)
    token_rewards, _ = ca.compute_token_rewards(exp.scores, exp.old_logp, exp.ref_logp, exp.response_mask, 0.1, "k1",
                                                score_at="last")
    assert torch.equal(exp.advantages, ca.reinforce_plus_plus_advantages(token_rewards, exp.response_mask, 2,
                                                                         gamma=0.9))
