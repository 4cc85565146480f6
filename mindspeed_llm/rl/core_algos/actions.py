"""Trajectories with tool-response tokens: the action mask, and the advantage estimators run over the model's own
tokens only.

A multi-turn rollout feeds the model ``prompt | turn_1 | tool_1 | turn_2 | ... `` : the response holds the model's
sampled tokens (its *actions*) and, between its turns, the tool-role deltas the chat template appends (tool-response
tokens, *context*). ``tool_mask`` ``[B, T]`` is 1 on the latter; ``response_mask`` keeps meaning "fed after the
prompt" (both kinds). The action mask is ``response_mask * (1 - tool_mask)`` (:func:`action_mask`); the loss mask
is the action mask less the rows a stage leaves out of the losses (:func:`loss_mask`, its only writer).

A per-token estimator that steps from position to position (GAE, REINFORCE++'s discounted return) must step over
the actions only, as if the tool tokens were absent: the permutation :func:`action_order` puts each row's action
positions first (in order), then the position one past the last action (TRL's terminal position, where the score
and the critic's last value sit), then the rest (tool tokens and padding, in order). The unchanged estimators run on
the permuted ("compacted") tensors, whose action mask is then a right-padded prefix as in a single-turn batch, and the
results are put back (:func:`from_actions`) and zeroed off the actions. Without ``tool_mask`` (None) nothing is
permuted: the estimator is called on the given tensors, bit for bit the single-turn computation.

The terminal position is one past the last *action*, not one past the last fed token: a trajectory normally ends
with the model's turn, and the two are the same position; one that ends with a tool response (the rollout stopped
after a tool call, e.g. at its turn or length limit) has its terminal at the first token of that final tool span,
i.e. the critic's state right after the model's last action, the tool's answer to which no action follows.
That is the position ``critic_mask(loss_mask, response_mask)`` already trains (``response_mask_p1`` of the action
mask), so the value loss and GAE agree on it.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from mindspeed_llm.rl.core_algos.rewards import compute_gae, last_response_index, response_mask_p1
from mindspeed_llm.rl.core_algos.stats import SumAcross


def action_mask(response_mask: torch.Tensor, tool_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's own sampled tokens: ``response_mask * (1 - tool_mask)`` in ``response_mask``'s dtype (bool:
    ``response_mask & ~tool_mask``); ``response_mask`` itself (the same tensor) when ``tool_mask`` is None."""
    if tool_mask is None:
        return response_mask
    if response_mask.dtype == torch.bool:
        return response_mask & ~tool_mask.bool()
    return response_mask * (1 - tool_mask.to(response_mask.dtype))


def loss_mask(response_mask: torch.Tensor, tool_mask: Optional[torch.Tensor] = None,
              truncated: Optional[torch.Tensor] = None, filtered: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]``: the tokens that take part in the losses, the one place they are decided. The action mask
    (:func:`action_mask`: no tool-response token is an action) less whole rows: ``truncated`` ``[B]`` bool, the
    truncated responses ``--mask-truncated-completions`` leaves out, and ``filtered`` ``[B]`` bool, the samples of the
    groups ``--filter-groups`` leaves out (None: no row left out). In ``response_mask``'s dtype, and never the same
    tensor as ``response_mask`` (a caller may edit it in place)."""
    mask = action_mask(response_mask, tool_mask)
    kept = None
    for out in (truncated, filtered):
        if out is not None:
            kept = ~out.bool() if kept is None else kept & ~out.bool()
    if kept is None:
        return mask.clone()
    return mask * kept.to(mask.dtype)[:, None]


def action_order(actions: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` long: for each row, the positions of ``actions`` (the action mask) in order, then the position one
    past the last action when it is inside the row (TRL's terminal position), then every other position in order
    (a stable sort). ``x.gather(-1, order)`` is the compacted row (:func:`to_actions`); a right-padded mask without
    gaps gives the identity."""
    valid = actions.bool()
    terminal = last_response_index(actions) + 1  # in [0, T]; T: no room, no terminal position
    idx = torch.arange(valid.size(-1), device=valid.device)
    key = torch.where(valid, 0, torch.where(idx.unsqueeze(0) == terminal.unsqueeze(-1), 1, 2))
    return torch.sort(key.to(torch.int8), dim=-1, stable=True).indices


def to_actions(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T]`` compacted by ``order`` (:func:`action_order`): position ``k`` of the result is position
    ``order[b, k]`` of ``x``."""
    return x.gather(-1, order)


def from_actions(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_actions`: position ``order[b, k]`` of the result is position ``k`` of ``x``
    (differentiable)."""
    return x.new_zeros(x.shape).scatter(-1, order, x)


def gae_over_actions(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                     tool_mask: Optional[torch.Tensor], gamma: float, lam: float, *, whiten: bool = True,
                     value_mask: Optional[torch.Tensor] = None, sum_across: SumAcross = None,
                     gae: Optional[Callable] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE (``gae``, default :func:`~.rewards.compute_gae`) stepping over the model's own tokens only.

    With ``m = action_mask(response_mask, tool_mask)`` and ``value_mask`` (default ``response_mask_p1(m)``: the
    actions and the position one past the last one), every tensor is compacted by ``action_order(m)``, GAE runs
    there with the compacted ``m`` and value mask, and advantages and returns are put back in place::

        A, R = from_actions(gae(to_actions(r), to_actions(V), to_actions(m), ..., to_actions(value_mask)))
        A = A * m;  R = R * value_mask

    So the tool tokens are skipped as if absent: the next value after the last action before a tool span is the
    value at the first action after it (the critic's state that includes the tool's response), the discount
    ``gamma * lam`` applies once per action, not per fed token. ``rewards`` must be zero outside ``value_mask`` (as
    :func:`~.rewards.compute_token_rewards` with the action mask makes them: the KL penalty on actions only, the score
    at ``e = last action + 1``, or at the last action when the row has no room); ``values`` at tool positions are
    not used (the value mask leaves them out), and advantages and returns are 0 there. Whitening (``whiten``) is
    over the actions. ``tool_mask`` None: ``gae(rewards, values, response_mask, ...)`` as it is, unchanged.

    Returns ``(advantages, returns)``, ``[B, T]`` each.
    """
    gae = compute_gae if gae is None else gae
    if tool_mask is None:
        return gae(rewards, values, response_mask, gamma, lam, whiten=whiten, value_mask=value_mask,
                   sum_across=sum_across)
    actions = action_mask(response_mask, tool_mask)
    if value_mask is None:
        value_mask = response_mask_p1(actions)
    order = action_order(actions)
    advantages, returns = gae(
        to_actions(rewards, order), to_actions(values, order), to_actions(actions, order), gamma, lam, whiten=whiten,
        value_mask=to_actions(value_mask, order), sum_across=sum_across)
    advantages = from_actions(advantages, order) * actions.to(advantages.dtype)
    returns = from_actions(returns, order) * value_mask.to(returns.dtype)
    return advantages, returns


def token_advantages_over_actions(estimator: Callable, token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  tool_mask: Optional[torch.Tensor], group_size: int, *,
                                  sum_across: SumAcross = None) -> torch.Tensor:
    """A ``"token"`` advantage estimator (``estimator(token_rewards, mask, group_size, sum_across=...)``, e.g.
    REINFORCE++ with its ``gamma`` bound) over the model's own tokens only: compacted by
    ``action_order(action_mask(response_mask, tool_mask))`` as :func:`gae_over_actions`, so a return is discounted
    once per action and a tool span does not cut it; the advantages put back, 0 off the actions.
    ``token_rewards`` must be zero off the actions (:func:`~.rewards.compute_token_rewards` with the action mask).
    ``tool_mask`` None: ``estimator(token_rewards, response_mask, ...)`` unchanged."""
    if tool_mask is None:
        return estimator(token_rewards, response_mask, group_size, sum_across=sum_across)
    actions = action_mask(response_mask, tool_mask)
    order = action_order(actions)
    advantages = estimator(to_actions(token_rewards, order), to_actions(actions, order), group_size,
                           sum_across=sum_across)
    return from_actions(advantages, order) * actions.to(advantages.dtype)
