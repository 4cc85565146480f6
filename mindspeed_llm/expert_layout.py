"""The experts' parallel layout rule, which the training flags (`arguments.validate_args`) and the checkpoint converter
(`checkpoint/convert.expert_layout`) both resolve: from the tensor-parallel size, the expert-parallel size, the expert
tensor-parallel size (None: not given) and MindSpeed's --moe-tp-extend-ep, the effective (expert-parallel size, expert
tensor-parallel size).

* --moe-tp-extend-ep: the TP ranks split the experts too, experts are kept whole: (EP x TP, 1); an expert TP other
  than 1 contradicts it.
* otherwise expert TP defaults to TP (experts split like the dense MLP) and must be 1 or TP (a checkpoint keeps the
  experts whole or split like the dense layers);
* expert TP 1 under TP > 1 needs EP a multiple of TP: megatron gives rank r the TP rank r % TP and the EP rank
  r % EP, and the shards are kept one per expert-parallel rank.

A broken rule raises `ExpertLayoutError`, which says which rule (`rule`) so that each caller names its own flags.
A leaf: it imports nothing.
"""

from __future__ import annotations

from typing import Optional, Tuple

# the rules an ExpertLayoutError names
EXTEND_WITH_EXPERT_TP = "extend_with_expert_tp"
EXPERT_TP_NOT_1_OR_TP = "expert_tp_not_1_or_tp"
EP_NOT_MULTIPLE_OF_TP = "ep_not_multiple_of_tp"


class ExpertLayoutError(ValueError):
    def __init__(self, rule: str, tp: int, ep: int, etp: Optional[int]):
        super().__init__(f"expert layout TP {tp}, EP {ep}, expert TP {etp}: {rule}")
        self.rule, self.tp, self.ep, self.etp = rule, tp, ep, etp


def resolve_expert_layout(tp: int, ep: int = 1, etp: Optional[int] = None,
                          moe_tp_extend_ep: bool = False) -> Tuple[int, int]:
    """(effective expert-parallel size, expert tensor-parallel size); see the module docstring."""
    if moe_tp_extend_ep:
        if etp not in (None, 1):
            raise ExpertLayoutError(EXTEND_WITH_EXPERT_TP, tp, ep, etp)
        return ep * tp, 1
    etp = tp if etp is None else etp
    if etp not in (1, tp):
        raise ExpertLayoutError(EXPERT_TP_NOT_1_OR_TP, tp, ep, etp)
    if etp == 1 and tp > 1 and ep % tp:
        raise ExpertLayoutError(EP_NOT_MULTIPLE_OF_TP, tp, ep, etp)
    return ep, etp
