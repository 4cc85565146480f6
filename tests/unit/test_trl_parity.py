"""Parity of mindspeed_llm.rl.core_algos with Hugging Face TRL 1.12.0 (fp32, equal within 1e-6).

What is exercised, and how:

* ``masked_mean`` / ``masked_var`` / ``masked_whiten``: TRL's own helpers
  (``trl/experimental/ppo/ppo_trainer.py``) called on the same tensors.
* PPO rollout math (score placement, KL rewards, reward whitening, GAE, advantage whitening) and the
  PPO policy / value losses live inside ``PPOTrainer.train()`` with no callable entry point, so
  ``_trl_ppo_*`` below reproduce those lines of TRL 1.12.0 ``trl/experimental/ppo/ppo_trainer.py``
  line for line, using TRL's own ``first_true_indices``, ``truncate_response``, ``masked_mean``,
  ``masked_whiten`` and ``INVALID_LOGPROB``.
* GRPO advantages are computed inside ``GRPOTrainer._generate_and_score_completions`` (which needs
  generation and reward functions), so ``_trl_grpo_advantages`` reproduces that block of TRL 1.12.0
  ``trl/trainer/grpo_trainer.py`` line for line with TRL's own ``nanstd``.
* The GRPO loss runs TRL's real ``GRPOTrainer._compute_loss`` (including its
  ``_get_per_token_logps_and_entropies``, ``selective_log_softmax`` and ``entropy_from_logits``) on an
  instance made with ``object.__new__`` with just the attributes that method reads, and a model stub
  that returns chosen logits. Loss, gradient w.r.t. the logits, and TRL's logged clip/KL/entropy
  metrics are compared with ``policy_loss`` fed by our fused ``vocab_parallel_logprobs``.

Loss-type mapping (documented in ``core_algos.policy_loss``): grpo -> seq-mean-token-mean,
bnpo -> token-mean, dr_grpo -> seq-mean-token-sum-norm with max_len=max_completion_length,
dapo -> token-mean over the generation batch's tokens (``num_items_in_batch``).

The methods selected by flag (issue 16), on the same stubbed ``GRPOTrainer._compute_loss``:

* ``--policy-loss gspo``: TRL's ``importance_sampling_level="sequence"`` (loss and gradient);
* ``--rollout-is tis`` / ``mis``: TRL's vLLM importance-sampling correction in ``token_truncate`` /
  ``token_mask`` mode (``vllm_importance_sampling_clip_max`` = our threshold, no lower bound); its weights are
  made in ``_generate_and_score_completions``, so ``_trl_vllm_is_ratio`` reproduces those lines;
* ``--adv-estimator rloo``: TRL 1.12 ``RLOOTrainer``'s advantages (inline in its
  ``_generate_and_score_completions``), reproduced by ``_trl_rloo_advantages``.
"""

import math
import types
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.ppo import ppo_trainer as trl_ppo
    from trl.experimental.utils import first_true_indices
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd

from mindspeed_llm.rl import core_algos as ca
from mindspeed_llm.rl.logprobs import vocab_parallel_logprobs
from tests.helpers.trl_reference import trl_grpo

ATOL = 1e-6


def assert_eq(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------------
# masked helpers: TRL's own functions
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.long])
def test_masked_helpers_match_trl(mask_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=g) * 3 + 1
    mask = (torch.rand(5, 9, generator=g) > 0.4).to(mask_dtype)
    assert_eq(ca.masked_mean(x, mask), trl_ppo.masked_mean(x, mask))
    assert_eq(ca.masked_mean(x, mask, dim=1), trl_ppo.masked_mean(x, mask, axis=1))
    assert_eq(ca.masked_mean(x, mask, dim=0), trl_ppo.masked_mean(x, mask, axis=0))
    for unbiased in (True, False):
        assert_eq(ca.masked_var(x, mask, unbiased), trl_ppo.masked_var(x, mask, unbiased))
    for shift in (True, False):
        assert_eq(ca.masked_whiten(x, mask, shift), trl_ppo.masked_whiten(x, mask, shift))


# --------------------------------------------------------------------------------------------------
# PPO: rollout math and losses (line-for-line reproduction of TRL 1.12.0 PPOTrainer.train)
# --------------------------------------------------------------------------------------------------
PAD, EOS = 0, 1


def _ppo_batch(seed, batch=10, length=12, vocab=20):
    """Random responses: EOS at random places (first, last, middle), rows without EOS, an empty row."""
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(2, vocab, (batch, length), generator=g)
    responses[0, 0] = EOS  # one-token response (just EOS)
    responses[1, -1] = EOS  # EOS on the last position: no room after it
    responses[2, 4] = EOS
    responses[3, 7] = EOS
    responses[3, 9] = EOS  # a second EOS after the first is truncated away
    responses[4, 0] = PAD  # empty response (first generated token is pad)
    responses[5, 2] = EOS
    # rows 6..9: no EOS (truncated at response_length, fill the tensor)
    return {
        "responses": responses,
        "logprobs": -torch.rand(batch, length, generator=g) * 3,
        "ref_logprobs": -torch.rand(batch, length, generator=g) * 3,
        "values": torch.randn(batch, length, generator=g),
        "scores": torch.randn(batch, generator=g) * 2,
        "new_logprobs": torch.zeros(batch, length),  # filled below
        "vpred": torch.zeros(batch, length),
        "g": g,
    }


def _trl_ppo_rollout(b, kl_coef, kl_estimator, whiten_rewards, gamma, lam, missing_eos_penalty):
    """TRL 1.12.0 trl/experimental/ppo/ppo_trainer.py, PPOTrainer.train: 'Response Processing' 1-3 and
    steps 3-6 (padding masks, rewards, whitening, GAE), line for line."""
    args = types.SimpleNamespace(
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        whiten_rewards=whiten_rewards,
        gamma=gamma,
        lam=lam,
        missing_eos_penalty=missing_eos_penalty,
    )
    responses = b["responses"]
    logprobs, ref_logprobs = b["logprobs"].clone(), b["ref_logprobs"].clone()
    values, scores = b["values"].clone(), b["scores"].clone()
    postprocessed_responses = trl_ppo.truncate_response(EOS, PAD, responses)
    sequence_lengths = first_true_indices(postprocessed_responses == PAD) - 1
    contain_eos_token = torch.any(postprocessed_responses == EOS, dim=-1)
    if args.missing_eos_penalty is not None:
        scores[~contain_eos_token] -= args.missing_eos_penalty
    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if args.kl_estimator == "k1" else (logr.exp() - 1) - logr
    non_score_reward = -args.kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores
    if args.whiten_rewards:
        rewards = trl_ppo.masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
        lastgaelam = delta + args.gamma * args.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    advantages = trl_ppo.masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return {
        "postprocessed_responses": postprocessed_responses,
        "padding_mask": padding_mask,
        "padding_mask_p1": padding_mask_p1,
        "logprobs": logprobs,
        "values": values,
        "scores": scores,
        "kl": kl,
        "rewards": rewards,
        "advantages": advantages,
        "returns": returns,
    }


def _trl_ppo_losses(new_logprobs, vpred_temp, mb, cliprange, cliprange_value, vf_coef):
    """TRL 1.12.0 trl/experimental/ppo/ppo_trainer.py, PPOTrainer.train, the micro-batch loss lines
    (new_logprobs stands for selective_log_softmax(logits, responses))."""
    padding_mask, padding_mask_p1 = mb["padding_mask"], mb["padding_mask_p1"]
    mb_advantage, mb_logprobs = mb["advantages"], mb["logprobs"]
    mb_return, mb_values = mb["returns"], mb["values"]
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    vpred = torch.masked_fill(vpred_temp, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * trl_ppo.masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = trl_ppo.masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = trl_ppo.masked_mean(pg_loss_max, ~padding_mask)
    loss = pg_loss + vf_coef * vf_loss
    pg_clipfrac = trl_ppo.masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
    return loss, pg_loss, vf_loss, pg_clipfrac, vf_clipfrac


PPO_CASES = [
    # (kl_coef, kl_estimator, whiten_rewards, gamma, lam, missing_eos_penalty)
    (0.05, "k1", False, 1.0, 0.95, None),  # TRL's PPOConfig defaults
    (0.2, "k3", False, 0.9, 0.8, 1.0),
    (0.1, "k1", True, 0.99, 0.9, None),
    (0.1, "k3", True, 1.0, 1.0, 0.5),
]


@pytest.mark.parametrize("kl_coef,kl_estimator,whiten_rewards,gamma,lam,missing_eos_penalty", PPO_CASES)
def test_ppo_rollout_and_losses_match_trl(kl_coef, kl_estimator, whiten_rewards, gamma, lam, missing_eos_penalty):
    b = _ppo_batch(seed=PPO_CASES.index((kl_coef, kl_estimator, whiten_rewards, gamma, lam, missing_eos_penalty)))
    trl = _trl_ppo_rollout(b, kl_coef, kl_estimator, whiten_rewards, gamma, lam, missing_eos_penalty)

    # --- ours: response_mask = 1 for real tokens (TRL's ~padding_mask) ---
    response_mask = (~trl["padding_mask"]).long()
    assert ca.last_response_index(response_mask).tolist() == (
        first_true_indices(trl["postprocessed_responses"] == PAD) - 1
    ).tolist()
    assert torch.equal(ca.response_mask_p1(response_mask), ~trl["padding_mask_p1"])
    assert response_mask[4].sum() == 0 and response_mask[6:].all()  # the empty row and the full rows exist
    scores = b["scores"].clone()
    if missing_eos_penalty is not None:
        scores[~(trl["postprocessed_responses"] == EOS).any(-1)] -= missing_eos_penalty
    rewards, kl = ca.compute_token_rewards(scores, b["logprobs"], b["ref_logprobs"], response_mask, kl_coef, kl_estimator)
    value_mask = ca.response_mask_p1(response_mask)
    assert_eq(kl, trl["kl"])
    if whiten_rewards:
        rewards = ca.masked_whiten(rewards, value_mask, shift_mean=False) * value_mask
    assert_eq(rewards, trl["rewards"])
    # raw critic values go in; compute_gae zeroes them outside the value mask as TRL does
    advantages, returns = ca.compute_gae(rewards, b["values"], response_mask, gamma, lam)
    assert_eq(advantages, trl["advantages"])
    assert_eq(returns, trl["returns"])

    # --- losses: one PPO micro-batch (the whole batch) ---
    g = b["g"]
    new_lp = (b["logprobs"] + 0.3 * torch.randn(b["logprobs"].shape, generator=g)).requires_grad_()
    vpred = (b["values"] + 0.3 * torch.randn(b["values"].shape, generator=g)).requires_grad_()
    new_lp_t, vpred_t = new_lp.detach().clone().requires_grad_(), vpred.detach().clone().requires_grad_()
    cliprange, cliprange_value, vf_coef = 0.2, 0.2, 0.1
    t_loss, t_pg, t_vf, t_pgc, t_vfc = _trl_ppo_losses(new_lp_t, vpred_t, trl, cliprange, cliprange_value, vf_coef)
    pg, pm = ca.policy_loss(new_lp, b["logprobs"], advantages, response_mask, clip_low=cliprange)
    vf, vm = ca.value_loss(vpred, b["values"], returns, value_mask, cliprange_value=cliprange_value)
    loss = pg + vf_coef * vf
    assert_eq(pg, t_pg)
    assert_eq(vf, t_vf)
    assert_eq(loss, t_loss)
    assert_eq(pm["pg_clipfrac"], t_pgc)
    assert_eq(vm["vf_clipfrac"], t_vfc)
    assert 0 < t_pgc < 1 and 0 < t_vfc < 1  # the clips are exercised
    loss.backward()
    t_loss.backward()
    assert_eq(new_lp.grad, new_lp_t.grad)
    assert_eq(vpred.grad, vpred_t.grad)


# --------------------------------------------------------------------------------------------------
# GRPO advantages (line-for-line reproduction of TRL 1.12.0 GRPOTrainer._generate_and_score_completions)
# --------------------------------------------------------------------------------------------------
def _trl_grpo_advantages(rewards, num_generations, scale_rewards):
    """TRL 1.12.0 trl/trainer/grpo_trainer.py, the multi_objective_aggregation == "sum_then_normalize"
    block (one reward function of weight 1, so ``rewards`` is already the weighted sum), then the
    ``nan_to_num``."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_group_advantages_match_trl(scale, group_size):
    g = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(24, generator=g) * 2
    rewards[5] = float("nan")  # an unscorable completion
    rewards[8:12] = 1.5  # a group (size 4) with zero spread
    ours = ca.group_advantages(rewards, group_size, eps=1e-4, scale=scale)
    assert_eq(ours, _trl_grpo_advantages(rewards, group_size, scale))


# --------------------------------------------------------------------------------------------------
# GRPO loss: TRL's real GRPOTrainer._compute_loss on a stubbed instance
# --------------------------------------------------------------------------------------------------
class _LogitsModel:
    """Stands in for the policy: returns fixed logits of shape [B, prompt + completion, V]."""

    training = True

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, **kwargs):
        return types.SimpleNamespace(logits=self.logits)


GRPO_LOSS_TYPES = {  # TRL loss_type -> our aggregation mode
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}


@pytest.mark.parametrize("loss_type", list(GRPO_LOSS_TYPES))
@pytest.mark.parametrize("beta,entropy_coef", [(0.0, 0.0), (0.04, 0.0), (0.04, 0.01)])
def test_grpo_loss_matches_trl_compute_loss(loss_type, beta, entropy_coef):
    g = torch.Generator().manual_seed(len(loss_type) * 10 + int(beta * 100) + int(entropy_coef * 1000))
    batch, prompt_len, comp_len, vocab = 6, 3, 9, 37
    max_completion_length = 12  # > comp_len: Dr. GRPO divides by the configured max, not the batch width
    temperature, eps, eps_high = 0.7, 0.2, 0.28  # DAPO-style clip-higher
    completion_ids = torch.randint(0, vocab, (batch, comp_len), generator=g)
    lengths = torch.tensor([9, 4, 1, 7, 9, 2])  # ragged; rows 0 and 4 are truncated (no EOS)
    completion_mask = (torch.arange(comp_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    comp_logits = torch.randn(batch, comp_len, vocab, generator=g) * 2
    advantages = torch.randn(batch, generator=g)

    # TRL side: logits for the full prompt+completion sequence; position P-1+t predicts completion token t
    logits_trl = comp_logits.clone().requires_grad_()
    full = torch.cat([torch.randn(batch, prompt_len - 1, vocab, generator=g), logits_trl, torch.randn(batch, 1, vocab, generator=g)], 1)
    with torch.no_grad():
        logp_now = vocab_parallel_logprobs(comp_logits, completion_ids, temperature=temperature)
    old_logp = logp_now + 0.25 * torch.randn(batch, comp_len, generator=g)  # ratios away from 1: clips fire
    ref_logp = logp_now + 0.3 * torch.randn(batch, comp_len, generator=g)
    local_tokens = completion_mask.sum()
    # dapo: num_items_in_batch counts the tokens of the whole generation batch; with 2 accumulation
    # steps per generation, this micro-batch is half of it.
    gas = spg = 2 if loss_type == "dapo" else 1
    num_items_in_batch = 2 * local_tokens
    inputs = {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt_len), generator=g),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old_logp,
        "ref_per_token_logps": ref_logp,
        "num_items_in_batch": num_items_in_batch,
    }
    model = _LogitsModel(full)
    trainer = trl_grpo(loss_type, beta, entropy_coef, temperature, eps, eps_high, max_completion_length, model, gas, spg)
    trl_loss = trainer._compute_loss(model, inputs)

    # our side: fused log-probs + entropy, then one policy_loss call
    logits_ours = comp_logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs(logits_ours, completion_ids, temperature=temperature, with_entropy=True)
    loss, metrics = ca.policy_loss(
        logp,
        old_logp,
        advantages,
        completion_mask,
        clip_low=eps,
        clip_high=eps_high,
        agg=GRPO_LOSS_TYPES[loss_type],
        max_len=max_completion_length,
        ref_logp=ref_logp,
        kl_coef=beta,
        kl_kind="k3",
        entropy=entropy,
        entropy_coeff=entropy_coef,
    )
    if loss_type == "dapo":
        # token-mean over the whole generation batch: rescale the micro-batch token mean. (TRL divides
        # its entropy bonus by the accumulation steps, 2 = num_items_in_batch / local_tokens here.)
        loss = loss * local_tokens / num_items_in_batch
    else:
        # TRL divides by the accumulation steps (1 here)
        loss = loss / gas
    assert_eq(loss, trl_loss)
    loss.backward()
    trl_loss.backward()
    assert_eq(logits_ours.grad, logits_trl.grad)

    logged = trainer._metrics["train"]
    assert_eq(metrics["pg_clipfrac"], torch.tensor(logged["clip_ratio/region_mean"][-1]))
    assert 0 < metrics["pg_clipfrac"] < 1
    assert_eq(metrics["entropy"], torch.tensor(logged["entropy"][-1]))
    if beta:
        assert_eq(metrics["kl"], torch.tensor(logged["kl"][-1]))


# --------------------------------------------------------------------------------------------------
# Issue 16: GSPO (importance_sampling_level="sequence"), TIS / MIS (TRL's vLLM IS correction), RLOO
# --------------------------------------------------------------------------------------------------
def _grpo_case(seed, old_offsets=None, noise=0.25):
    """A GRPO micro-batch (as in test_grpo_loss_matches_trl_compute_loss) with its TRL inputs."""
    g = torch.Generator().manual_seed(seed)
    batch, prompt_len, comp_len, vocab = 6, 3, 9, 37
    completion_ids = torch.randint(0, vocab, (batch, comp_len), generator=g)
    lengths = torch.tensor([9, 4, 1, 7, 9, 2])
    completion_mask = (torch.arange(comp_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    comp_logits = torch.randn(batch, comp_len, vocab, generator=g) * 2
    advantages = torch.randn(batch, generator=g)
    with torch.no_grad():
        logp_now = vocab_parallel_logprobs(comp_logits, completion_ids, temperature=0.7)
    old_logp = logp_now + noise * torch.randn(batch, comp_len, generator=g)
    if old_offsets is not None:  # per-row shifts: the sequence ratio is exp(-offset), up to the noise
        old_logp = old_logp + old_offsets[:, None]
    ref_logp = logp_now + 0.3 * torch.randn(batch, comp_len, generator=g)
    head = torch.randn(batch, prompt_len - 1, vocab, generator=g)
    tail = torch.randn(batch, 1, vocab, generator=g)
    inputs = {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt_len), generator=g),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old_logp,
        "ref_per_token_logps": ref_logp,
    }
    return comp_logits, head, tail, inputs, g


def _compare_with_trl(comp_logits, head, tail, inputs, trainer_kwargs, ours_kwargs, loss_type="grpo"):
    """TRL's _compute_loss vs policy_loss: loss and gradient w.r.t. the logits. Returns (ours, TRL's trainer)."""
    logits_trl = comp_logits.clone().requires_grad_()
    model = _LogitsModel(torch.cat([head, logits_trl, tail], 1))
    trainer = trl_grpo(loss_type, trainer_kwargs.pop("beta", 0.0), 0.0, 0.7, model=model, gas=1, spg=1,
                       max_completion_length=12, **trainer_kwargs)
    trl_loss = trainer._compute_loss(model, inputs)
    logits_ours = comp_logits.clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs(logits_ours, inputs["completion_ids"], temperature=0.7, with_entropy=True)
    loss, metrics = ca.policy_loss(logp, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"],
                                   agg=GRPO_LOSS_TYPES[loss_type], max_len=12, ref_logp=inputs["ref_per_token_logps"],
                                   kl_kind="k3", entropy=entropy, **ours_kwargs)
    assert_eq(loss, trl_loss)
    loss.backward()
    trl_loss.backward()
    assert_eq(logits_ours.grad, logits_trl.grad)
    return metrics, trainer, (loss - trl_loss).abs().item(), (logits_ours.grad - logits_trl.grad).abs().max().item()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("clip", ["wide", "paper"])
def test_gspo_matches_trl_sequence_importance_sampling(loss_type, clip):
    if clip == "wide":  # TRL's GRPO clip range on noisy ratios, rows shifted in and out of it
        eps, eps_high, noise = 0.2, 0.28, 0.25
        offsets = torch.tensor([0.3, -0.3, 0.05, -0.05, 0.0, 0.5])
    else:  # the GSPO paper's 3e-4 / 4e-4 (our --gspo-clip-ratio defaults): rows inside, above and below the range
        eps, eps_high, noise = 3e-4, 4e-4, 1e-6
        offsets = torch.tensor([1e-4, -1e-4, 1e-3, -1e-3, 0.0, 5e-4])
    comp_logits, head, tail, inputs, _ = _grpo_case(7 + len(loss_type), offsets, noise)
    if clip == "paper":  # signs that put rows 2, 3 and 5 on the clipped side (the ratio moved with the advantage)
        inputs["advantages"] = torch.tensor([0.7, -1.2, -0.5, 1.1, 0.9, -0.8])
    beta = 0.04 if loss_type == "grpo" else 0.0
    metrics, trainer, loss_diff, grad_diff = _compare_with_trl(
        comp_logits, head, tail, inputs,
        dict(eps=eps, eps_high=eps_high, importance_sampling_level="sequence", beta=beta),
        dict(clip_low=eps, clip_high=eps_high, loss_type="gspo", kl_coef=beta), loss_type)
    print(f"gspo {loss_type} {clip}: |loss - TRL| {loss_diff:.1e}, max |grad - TRL| {grad_diff:.1e}")
    # TRL's clip ratio is a mean over sequences at this level; ours a token mean: compare per sequence
    logp = vocab_parallel_logprobs(comp_logits, inputs["completion_ids"], temperature=0.7)
    mask = inputs["completion_mask"].float()
    adv = inputs["advantages"].unsqueeze(-1)
    terms = ca.gspo_policy_terms(logp, inputs["old_per_token_logps"], adv, mask, clip_low=eps, clip_high=eps_high)
    per_sequence = terms.clipped[:, 0].float().mean()
    assert_eq(per_sequence, torch.tensor(trainer._metrics["train"]["clip_ratio/region_mean"][-1]))
    assert 0 < per_sequence < 1  # some sequences clipped, some not


def _trl_vllm_is_ratio(old_logp, sampling_logp, mask, mode, clip_max):
    """TRL 1.12.0 GRPOTrainer._generate_and_score_completions, the token_* modes of its vLLM importance-sampling
    correction (clip_min None), line for line."""
    per_token_logps_diff = (old_logp - sampling_logp) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    ratio = torch.exp(per_token_logps_diff)
    if mode == "token_truncate":
        return torch.clamp(ratio, min=None, max=clip_max)
    invalid = (ratio < -math.inf) | (ratio > clip_max)
    return ratio.masked_fill(invalid, value=0.0)


@pytest.mark.parametrize("mode,trl_mode", [("tis", "token_truncate"), ("mis", "token_mask")])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_rollout_is_matches_trl_vllm_importance_sampling(mode, trl_mode, loss_type):
    comp_logits, head, tail, inputs, g = _grpo_case(21 + len(loss_type))
    mask = inputs["completion_mask"]
    sampling = inputs["old_per_token_logps"] + 0.6 * torch.randn(mask.shape, generator=g)  # a rollout engine's
    threshold = 2.0
    w = torch.exp(inputs["old_per_token_logps"] - sampling)
    assert ((w > threshold) & mask.bool()).any() and ((w <= threshold) & mask.bool()).any()  # both sides exercised
    inputs["importance_sampling_ratio"] = _trl_vllm_is_ratio(inputs["old_per_token_logps"], sampling, mask, trl_mode,
                                                             threshold)
    metrics, _, loss_diff, grad_diff = _compare_with_trl(
        comp_logits, head, tail, inputs, dict(eps=0.2, eps_high=0.28, vllm_is=True, beta=0.04),
        dict(clip_low=0.2, clip_high=0.28, kl_coef=0.04, rollout_logp=sampling, rollout_is=mode,
             rollout_is_threshold=threshold), loss_type)
    print(f"{mode} {loss_type}: |loss - TRL| {loss_diff:.1e}, max |grad - TRL| {grad_diff:.1e}")
    assert 0 < metrics["rollout_is_clipfrac"] < 1


def _trl_rloo_advantages(rewards, num_generations):
    """TRL 1.12.0 trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions: the leave-one-out
    advantages (beta = 0: no KL in the reward; normalize_advantages False, its default), line for line."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if num_generations > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_rloo_matches_trl_rloo_trainer(group_size):
    g = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(24, generator=g) * 2
    rewards[5] = float("nan")  # an unscorable completion
    rewards[8:12] = 1.5
    if group_size == 4:
        rewards[12:15] = float("nan")  # a group with one scorable completion: no baseline, advantage 0
    ours = ca.ADV_ESTIMATORS["rloo"].fn(rewards, group_size)
    assert_eq(ours, _trl_rloo_advantages(rewards, group_size))
    print(f"rloo n={group_size}: max |A - TRL| {(ours - _trl_rloo_advantages(rewards, group_size)).abs().max():.1e}")
