"""The settings the stages pass around, typed and frozen: one part per consumer, each a function of the validated
command line (`arguments.validate_args` builds them with `from_args` and attaches them as `args.settings`).

    SamplingSettings  the rollout's sampling and generation-engine limits   (`rollout.sampling_config`)
    LossSettings      the actor's and critic's loss closures                  (`loss_closures`)
    UpdateSchedule    epochs x mini-batches of an update                      (`ppo_loop.ppo_update`)
    RewardMixing      verifiers, reward model and penalties, by weight        (`scoring.Scorer.from_settings`)
    OffloadSettings   what waits in host memory between uses                  (`roles.offload_parts`, `on_device`)

A field is named after the flag's destination it holds (`--clip-ratio-high` -> `clip_ratio_high`), and its default
is the parser's, so a part can be read like the Namespace it comes from (tests/test_settings.py checks every
default against the parser). The values are the validated ones: the stage defaults `validate_args` filled in
(`--kl-penalty`, `--clip-ratio-high`, `--ppo-mini-batch-size`, `--loss-agg-mode`, ...), lists as tuples.
Megatron's own needs (model building, optimizer, checkpoints) still read the Namespace.

This module imports nothing of the package: the parser imports it, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Tuple


@dataclass(frozen=True)
class SamplingSettings:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    max_new_tokens: int = 128
    max_length: Optional[int] = None  # prompt + response; validate_args fills it in
    stop_token_ids: Tuple[int, ...] = ()
    seed: int = 1234  # each sample's random stream starts from it
    rollout_max_num_seqs: Optional[int] = None  # None: the whole local batch in flight
    rollout_max_num_batched_tokens: Optional[int] = None  # None: no limit


@dataclass(frozen=True)
class LossSettings:
    temperature: float = 1.0  # the log-probs are the sampler's, at its temperature
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_high: Optional[float] = None  # validate_args: --clip-ratio when not given
    dual_clip: Optional[float] = None
    gspo_clip_ratio: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    loss_agg_mode: Optional[str] = None  # validate_args: by --policy-loss when not given
    max_new_tokens: int = 128  # seq-mean-token-sum-norm's constant
    kl_penalty: Optional[str] = None  # validate_args: by --stage when not given
    entropy_coeff: float = 0.0
    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    cliprange_value: float = 0.2
    vf_coef: float = 0.1


@dataclass(frozen=True)
class UpdateSchedule:
    ppo_epochs: int = 1
    ppo_mini_batch_size: Optional[int] = None  # sequences per optimizer step; validate_args: the whole batch
    seed: int = 1234  # the mini-batches are drawn from (seed, iteration, epoch)


@dataclass(frozen=True)
class RewardMixing:
    verifier_function: Tuple[str, ...] = ()
    verifier_weight: Tuple[float, ...] = ()  # validate_args: 1.0 per verifier when not given
    reward_model_weight: float = 1.0
    missing_eos_penalty: Optional[float] = None
    overlong_buffer_len: Optional[int] = None  # None: no overlong penalty
    overlong_penalty_factor: float = 1.0
    max_new_tokens: int = 128  # the overlong penalty's length limit


@dataclass(frozen=True)
class OffloadSettings:
    offload_ref_reward: bool = False
    offload_train_optimizer: bool = False
    offload_train_grad: bool = False
    offload_train_param: bool = False


@dataclass(frozen=True)
class Settings:
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    update: UpdateSchedule = field(default_factory=UpdateSchedule)
    reward: RewardMixing = field(default_factory=RewardMixing)
    offload: OffloadSettings = field(default_factory=OffloadSettings)


PARTS = (SamplingSettings, LossSettings, UpdateSchedule, RewardMixing, OffloadSettings)


def _part(cls, args):
    """`cls` with each field read from the Namespace entry of its name (lists as tuples: the parts are frozen)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def from_args(args) -> Settings:
    """The settings of a validated command line (`arguments.validate_args`): every field is the flag destination
    of its name."""
    return Settings(sampling=_part(SamplingSettings, args), loss=_part(LossSettings, args),
                    update=_part(UpdateSchedule, args), reward=_part(RewardMixing, args),
                    offload=_part(OffloadSettings, args))
