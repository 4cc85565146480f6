"""DAPO's dynamic sampling with refill (`--dynamic-sampling`, `--max-num-gen-batches`): groups whose samples all
scored the same carry no signal, so more prompt groups are generated until the global batch holds
`--global-batch-size` groups with reward variance (or, with `--dynamic-sampling-metric NAME`, variance in verifier
NAME's own scores: MindSpeed-RL's `filter_groups_metric`).

The kept groups are the first informative ones in the global order (generation batch, then position in the
global batch), whatever the DP size: each DP rank generates its share of every generation batch, the ranks
exchange their informative groups (CPU tensors, over the DP group), and rank r takes the kept groups
[r * L, (r + 1) * L), L the local batch in prompts. Every rank therefore runs the same number of generation
batches and ends with the same number of groups, and a run gives the same kept set at any DP size. The prompts
come from the trainer's sampler, whose position is saved with every checkpoint, so a resumed run draws the same
generation batches.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from mindspeed_llm import distributed
from mindspeed_llm.rl.experience import Experience


class GenerationBudgetError(RuntimeError):
    """`--max-num-gen-batches` generation batches did not give a full batch of informative groups."""


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: the groups of `group_size` consecutive samples whose scores are not all equal."""
    return scores.view(-1, group_size).std(dim=1, unbiased=False) > 0


def group_signal(exp: Experience, metric: str) -> torch.Tensor:
    """[B] what must differ within a kept group: the scores ("reward") or verifier `metric`'s own scores (before its
    weight), from the scorer's per-row parts (`SampleData.score_parts`)."""
    if metric == "reward":
        return exp.scores
    parts = exp.sample_data.score_parts if exp.sample_data is not None else None
    if parts is None or any(metric not in part for part in parts):
        raise ValueError(f"--dynamic-sampling-metric {metric}: the scored rollouts carry no '{metric}' scores")
    return torch.tensor([part[metric] for part in parts], dtype=torch.float32)


def refill(first: Experience, generate: Callable[[int], Experience], group_size: int, local_groups: int,
           max_gen_batches: int, metric: str = "reward") -> Tuple[Experience, Dict[str, float]]:
    """The iteration's batch of `local_groups` informative groups on this rank, from the scored generation
    batch `first` and, while the global batch lacks informative groups, `generate(j)` (j = 1, 2, ...: the j-th
    extra generation batch, scored, `local_groups` prompts on every rank).

    Returns the Experience (its rows in the kept groups' global order) and the metrics
    `dynamic_sampling/num_gen_batches` and `dynamic_sampling/filtered_fraction` (the generated groups left out
    for having no reward variance). Raises `GenerationBudgetError` naming `--max-num-gen-batches` when that
    many batches are not enough (0: no limit). `metric` (--dynamic-sampling-metric): whose variance keeps a group, the
    rewards or one verifier's own scores (`group_signal`).
    """
    dp_rank = distributed.data_parallel_info()[0]
    samples = torch.arange(group_size)
    candidates: List[Experience] = []  # per generation batch: every rank's informative rows (host), in rank order
    kept = generated = 0
    exp, j = first, 0
    while True:
        mask = informative_groups(group_signal(exp, metric), group_size)
        groups = torch.nonzero(mask).flatten().cpu()
        rows = (groups[:, None] * group_size + samples[None, :]).reshape(-1)
        shares = distributed.gather_over_data_parallel((len(groups), exp.select(rows, device="cpu")))
        candidates.extend(part for count, part in shares if count)
        kept += sum(count for count, _ in shares)
        generated += local_groups * len(shares)
        j += 1
        if kept >= local_groups * len(shares):
            break
        if 0 < max_gen_batches <= j:
            raise GenerationBudgetError(
                f"--max-num-gen-batches {max_gen_batches}: {j} generation batches gave {kept} groups with reward "
                f"variance, fewer than the {local_groups * len(shares)} of a global batch; raise "
                "--max-num-gen-batches, or make the task's rewards vary more (temperature, harder/easier prompts)"
            )
        exp = generate(j)
    everything = Experience.concat(candidates, "cpu")  # every rank's candidates stay in host memory; only this rank's
    mine = torch.arange(dp_rank * local_groups, (dp_rank + 1) * local_groups)  # go over
    rows = (mine[:, None] * group_size + samples[None, :]).reshape(-1)
    batch = Experience.concat([everything.select(rows)], first.tokens.device)
    metrics = {"dynamic_sampling/num_gen_batches": float(j),
               "dynamic_sampling/filtered_fraction": 1.0 - kept / generated}
    return batch, metrics
