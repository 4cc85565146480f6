"""Where the ranks of one SPMD world go when generation gets its own (`--rollout-world-size R`, issue 47): the
first W - R ranks train (megatron's TP x CP x DP x PP over them), the last R generate, in blocks of the generators'
own TP size (PP 1). The groups a weight sync needs are made here, on every rank in the same order (torch's
`new_group` is collective over the world, members or not).

Megatron's `parallel_state` is one global per process: it cannot describe the trainers' TP x PP and the
generators' TP at once. So the trainers keep it, over their ranks only, and the generators use explicit groups
(`generator_tp_groups`; megatron-core 0.16's `GPTModel(pg_collection=...)` takes them); see docs/parallelism.md,
"Asynchronous placement".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from mindspeed_llm.errors import ArgumentError


@dataclass(frozen=True)
class Placement:
    world_size: int
    rollout_world_size: int  # R: the generator ranks, the world's last R
    generator_tp: int  # the generators' tensor-parallel size (each block of it holds one actor)

    @property
    def trainer_ranks(self) -> range:
        return range(self.world_size - self.rollout_world_size)

    @property
    def generator_ranks(self) -> range:
        return range(self.world_size - self.rollout_world_size, self.world_size)

    def is_generator(self, rank: int) -> bool:
        return rank in self.generator_ranks

    def generator_tp_rank(self, rank: int) -> int:
        return (rank - self.generator_ranks.start) % self.generator_tp

    def generator_blocks(self) -> List[List[int]]:
        """The generators' TP groups: consecutive blocks of `generator_tp` ranks, one actor each."""
        ranks = list(self.generator_ranks)
        return [ranks[i:i + self.generator_tp] for i in range(0, len(ranks), self.generator_tp)]


def plan_placement(world_size: int, rollout_world_size: int, generator_tp: int = 1, trainer_tp: int = 1,
                   trainer_pp: int = 1, trainer_cp: int = 1) -> Placement:
    """The placement, or an ArgumentError naming the flag to change."""
    trainers = world_size - rollout_world_size
    if rollout_world_size < 1 or trainers < 1:
        raise ArgumentError(f"--rollout-world-size {rollout_world_size} must leave at least one of the world's "
                            f"{world_size} ranks to each of generation and training (1 .. {world_size - 1})")
    if rollout_world_size % generator_tp:
        raise ArgumentError(f"--rollout-world-size {rollout_world_size} is not a multiple of the generators' "
                            f"tensor-parallel size {generator_tp} (--infer-tensor-parallel-size)")
    model_parallel = trainer_tp * trainer_pp * trainer_cp
    if trainers % model_parallel:
        raise ArgumentError(f"the {trainers} trainer ranks (world {world_size} - --rollout-world-size "
                            f"{rollout_world_size}) are not a multiple of --tensor-model-parallel-size {trainer_tp} x "
                            f"--context-parallel-size {trainer_cp} x --pipeline-model-parallel-size {trainer_pp}")
    return Placement(world_size, rollout_world_size, generator_tp)


def trainer_sources(tp: int, pp: int, cp: int = 1, dp: int = 1) -> List[Tuple[int, int, int]]:
    """(global rank, tp_rank, pp_rank) of the trainer ranks that send: data-parallel rank 0, context-parallel rank
    0, in megatron's rank order tp-cp-dp-pp (rank = tp + TP * (cp + CP * (dp + DP * pp)))."""
    return [(t + tp * cp * dp * p, t, p) for p in range(pp) for t in range(tp)]


@dataclass
class SyncGroups:
    """This rank's share of the groups: `sources` ((global rank, group) of every trainer source, on generators),
    `own` (a source's group, on that source), `generator_tp` (a generator's TP group)."""
    sources: List[Tuple[int, object]]
    own: Optional[object]
    generator_tp: Optional[object]
    generator_self: Optional[object] = None  # a generator's group of itself alone (its PP, CP, DP: size 1)

    def model_groups(self):
        """megatron's ProcessGroupCollection of a generator's actor (`models.build_model(groups=...)`): TP over its
        block, every other dimension the rank alone."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        if self.generator_tp is None:
            raise ValueError("model_groups: only a generator rank's actor is built on explicit groups")
        tp, alone = self.generator_tp, self.generator_self
        return ProcessGroupCollection(tp=tp, mp=tp, tp_cp=tp, pp=alone, cp=alone, embd=alone, pos_embd=alone,
                                      dp=alone, dp_cp=alone)


def create_sync_groups(placement: Placement, sources: List[Tuple[int, int, int]],
                       backend: Optional[str] = None) -> SyncGroups:
    """Every rank calls it with the same arguments. One group per trainer source (the source and every generator:
    a source's broadcast reaches the generators and no other trainer), one TP group per generator block and one
    group per generator rank alone (`SyncGroups.model_groups`)."""
    rank = dist.get_rank()
    generators = list(placement.generator_ranks)
    by_source: Dict[int, object] = {}
    for source, _, _ in sources:
        if placement.is_generator(source):
            raise ArgumentError(f"trainer source rank {source} is a generator rank under --rollout-world-size "
                                f"{placement.rollout_world_size}")
        by_source[source] = dist.new_group([source] + generators, backend=backend)
    tp_group = None
    for block in placement.generator_blocks():
        group = dist.new_group(block, backend=backend)
        if rank in block:
            tp_group = group
    alone = None
    for generator in generators:
        group = dist.new_group([generator], backend=backend)
        if rank == generator:
            alone = group
    mine = placement.is_generator(rank)
    return SyncGroups(sources=[(s, by_source[s]) for s, _, _ in sources] if mine else [],
                      own=by_source.get(rank), generator_tp=tp_group if mine else None, generator_self=alone)
