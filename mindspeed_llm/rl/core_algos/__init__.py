"""Pure tensor math for RL post-training (TRL-style PPO and GRPO).

Everything here is a plain function of tensors: torch only, no I/O, no global state, and no distributed code but
the tensor-parallel collectives of :mod:`.distill` over the group its caller passes. Each docstring states the
formula it implements so it can be read next to the paper. The one exception is the choice of an accelerator
kernel: the scans (:mod:`.scans`) and the two losses (:mod:`.losses`) ask ``mindspeed_llm.kernels.select_kernel``
for their inputs' device (an environment variable can force either path) and run a Triton kernel of the same math
on CUDA / Ascend; the torch code here is always their reference.

Conventions used throughout
---------------------------
* Tensors are ``[batch, response_len]`` ("B x T"); position ``t`` of row ``b`` is the ``t``-th generated
  token of response ``b``. Responses are right padded.
* ``response_mask`` is 1 (or True) for real response tokens (up to and including EOS) and 0 for padding.
  It is TRL's ``~padding_mask``. Masks may be bool or float; float masks act as per-token weights
  where that makes sense (means, losses).
* ``value_mask`` is the mask of positions where the critic's values (and the PPO rewards) live. TRL
  places the scalar score one position *after* the last response token (see
  :func:`compute_token_rewards`), so its value mask is the response mask extended by that one position
  (TRL's ``~padding_mask_p1``); :func:`response_mask_p1` builds it.
* Loss functions return ``(loss, metrics)`` where ``loss`` is a differentiable 0-d tensor and
  ``metrics`` is a dict of detached 0-d tensors (no host sync is forced here; call ``.item()`` when
  logging).
* Global statistics. A batch may be split into micro-batches and data-parallel shards. Every mean here can
  take the totals of the whole (mini-)batch: the losses take ``total_tokens`` / ``total_sequences`` (then a
  micro-batch's loss is its SHARE of the batch's loss, and the shares add up to it, whatever the split),
  and the statistics (whitening, the batch std) take ``sum_across``, a function that sums a tensor over
  the shards (an all-reduce; identity when absent). The math stays here; the communication is the caller's.

References: PPO (Schulman et al. 2017, arXiv:1707.06347); GAE (Schulman et al. 2015,
arXiv:1506.02438); dual-clip PPO (Ye et al. 2020, arXiv:1912.09729); GRPO (Shao et al. 2024,
arXiv:2402.03300); DAPO (Yu et al. 2025, arXiv:2503.14476); Dr. GRPO (Liu et al. 2025,
arXiv:2503.20783); RLOO (Ahmadian et al. 2024, arXiv:2402.14740); REINFORCE++ (Hu 2025, arXiv:2501.03262; verl's
formulas); GSPO (Zheng et al. 2025, arXiv:2507.18071); KL estimators k1/k2/k3 (J. Schulman, "Approximating KL
divergence", 2020); on-policy distillation (Agarwal et al. 2024, arXiv:2306.13649; Thinking Machines, "On-Policy
Distillation", 2025; verl's ``forward_kl_topk``).
Behaviour is matched to Hugging Face TRL 1.12.0 where TRL has the same quantity (see
tests/unit/test_trl_parity.py).

What is where
-------------
* :mod:`.stats`: ``SumAcross``; ``masked_mean``, ``masked_var``, ``masked_whiten`` (and the NaN-ignoring std
  of the outcome advantages).
* :mod:`.kl`: ``KL_KINDS``, ``kl_penalty`` (the k1 / k2 / k3 / abs estimators), ``rollout_mismatch``.
* :mod:`.scans`: ``reverse_linear_scan`` (``x_t = a_t + c_t x_{t+1}`` in log-depth torch steps), ``gae_scan``,
  ``discounted_returns`` (on CUDA / Ascend the Triton kernels of ``mindspeed_llm.kernels.triton_scans``),
  ``gae_scan_loop``, ``discounted_returns_loop`` (the per-position definitions, for tests and benchmarks).
* :mod:`.rewards`: ``last_response_index``, ``response_mask_p1``, ``critic_mask``, ``compute_token_rewards``, ``compute_gae``
  (registered as the ``gae`` estimator), ``overlong_penalty`` (DAPO).
* :mod:`.losses`: ``AGG_MODES``, ``aggregation_denominator``, ``aggregation_weights``, ``aggregate_loss``, the
  policy-loss registry
  (``POLICY_LOSSES``, ``register_policy_loss``: ``vanilla``, ``gspo``), ``rollout_is_weights`` (TIS / MIS),
  ``policy_loss``, ``value_loss`` (on CUDA / Ascend the fused kernels of ``mindspeed_llm.kernels.triton_rl_losses``).
* :mod:`.advantages`: the advantage-estimator registry (``ADV_ESTIMATORS``, ``register_advantage``; kinds
  ``outcome`` / ``token`` / ``critic``), ``GROUP_SCALES``, ``group_advantages``, ``grpo_advantages``,
  ``rloo_advantages``, ``dr_grpo_advantages``, ``reinforce_plus_plus_advantages``,
  ``reinforce_plus_plus_baseline_advantages``.
* :mod:`.actions`: trajectories with tool-response tokens: ``action_mask`` (``response_mask * (1 - tool_mask)``),
  ``loss_mask`` (the action mask less the truncated and filtered rows: the one place the loss mask is made),
  ``action_order`` / ``to_actions`` / ``from_actions`` (each row's actions first), ``gae_over_actions`` and
  ``token_advantages_over_actions`` (the estimators stepping over the model's own tokens only).
* :mod:`.distill`: on-policy distillation's math: ``DISTILL_ESTIMATORS``, ``DISTILL_LOSSES`` (what each signal needs
  and whether it may be a loss), ``reverse_kl`` (k1 / k3 on the sampled tokens), ``distill_token_rewards``,
  ``reverse_kl_loss``; the forward KL over the teacher's top-k from vocab-parallel logits: ``TeacherTopK``,
  ``teacher_topk``, ``forward_kl_on_teacher_topk``, ``topk_forward_kl``, ``topk_forward_kl_loss``, ``topk_kl_loss``
  (the stages' wiring: ``rl/distillation.py``).

Registering a method is one decorator: ``@register_advantage(name, kind)`` adds a ``--adv-estimator`` choice,
``@register_policy_loss(name)`` a ``--policy-loss`` choice (``validate_args`` checks the flags against these
registries).

Every public name is re-exported here: use ``core_algos.X`` (callers and tests patch and read the package's
attributes).
"""

from mindspeed_llm.rl.core_algos.advantages import (
    ADV_ESTIMATORS,
    ADV_KINDS,
    GROUP_SCALES,
    AdvantageEstimator,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    register_advantage,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from mindspeed_llm.rl.core_algos.actions import (
    action_mask,
    action_order,
    loss_mask,
    from_actions,
    gae_over_actions,
    to_actions,
    token_advantages_over_actions,
)
from mindspeed_llm.rl.core_algos.distill import (
    DISTILL_ESTIMATORS,
    DISTILL_LOSSES,
    DistillLoss,
    TeacherTopK,
    distill_token_rewards,
    forward_kl_on_teacher_topk,
    reverse_kl,
    reverse_kl_loss,
    teacher_topk,
    topk_forward_kl,
    topk_forward_kl_loss,
    topk_kl_loss,
)
from mindspeed_llm.rl.core_algos.kl import KL_KINDS, kl_penalty, rollout_mismatch
from mindspeed_llm.rl.core_algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
    PolicyTerms,
    aggregate_loss,
    aggregation_denominator,
    aggregation_weights,
    gspo_policy_terms,
    policy_loss,
    register_policy_loss,
    rollout_is_weights,
    vanilla_policy_terms,
    value_loss,
)
from mindspeed_llm.rl.core_algos.rewards import (
    compute_gae,
    compute_token_rewards,
    last_response_index,
    overlong_penalty,
    critic_mask,
    response_mask_p1,
)
from mindspeed_llm.rl.core_algos.scans import (
    discounted_returns,
    discounted_returns_loop,
    gae_scan,
    gae_scan_loop,
    reverse_linear_scan,
)
from mindspeed_llm.rl.core_algos.stats import SumAcross, masked_mean, masked_var, masked_whiten

__all__ = [
    "SumAcross",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "KL_KINDS",
    "kl_penalty",
    "rollout_mismatch",
    "last_response_index",
    "critic_mask",
    "response_mask_p1",
    "compute_token_rewards",
    "compute_gae",
    "overlong_penalty",
    "reverse_linear_scan",
    "gae_scan",
    "discounted_returns",
    "gae_scan_loop",
    "discounted_returns_loop",
    "AGG_MODES",
    "aggregation_denominator",
    "aggregation_weights",
    "aggregate_loss",
    "POLICY_LOSSES",
    "PolicyTerms",
    "register_policy_loss",
    "vanilla_policy_terms",
    "gspo_policy_terms",
    "ROLLOUT_IS_MODES",
    "rollout_is_weights",
    "policy_loss",
    "value_loss",
    "GROUP_SCALES",
    "group_advantages",
    "ADV_KINDS",
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "register_advantage",
    "grpo_advantages",
    "rloo_advantages",
    "dr_grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "action_mask",
    "loss_mask",
    "action_order",
    "to_actions",
    "from_actions",
    "gae_over_actions",
    "token_advantages_over_actions",
    "DISTILL_ESTIMATORS",
    "DISTILL_LOSSES",
    "DistillLoss",
    "TeacherTopK",
    "reverse_kl",
    "distill_token_rewards",
    "reverse_kl_loss",
    "teacher_topk",
    "forward_kl_on_teacher_topk",
    "topk_forward_kl",
    "topk_forward_kl_loss",
    "topk_kl_loss",
]
