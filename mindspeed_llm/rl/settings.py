"""The settings of a run, typed and frozen: one part per consumer, each a function of the validated command line
(`arguments.validate_args` builds them with `from_args` and attaches them as `args.settings`).

    SamplingSettings   the rollout's sampling and generation-engine limits   (`rollout.sampling_config`)
    LossSettings       the actor's and critic's loss closures                  (`loss_closures`)
    UpdateSchedule     epochs x mini-batches of an update                      (`ppo_loop.ppo_update`)
    RewardMixing       verifiers, reward model and penalties, by weight        (`scoring.Scorer.from_settings`)
    JudgeSettings      the LLM judge: checkpoint, template, parser, weight     (`rl/judge.py`)
    OffloadSettings    what waits in host memory between uses                  (`roles.offload_parts`, `on_device`)
    DistillSettings    the teacher and on-policy distillation                  (`rl/distillation.py`)
    AlgorithmSettings  estimator, KL, discounting, filters, samples per prompt (`rl/stages/*`)
    BatchSettings      micro-batches and their token budgets                   (`batch_plan.MicroBatchPlan.for_run`)
    ModelSources       which checkpoints the stage's roles load                (`rl/stages/*` constructors)
    ParallelSettings   the process grid                                         (`trainer.run`)
    DataSettings       prompts, held-out prompts, tokenizer                    (`preflight.prompt_sets`, ...)
    CheckpointSettings save / load / resume                                    (`trainer._resume`, `_loop`)
    LoopSettings       iterations, evaluation and logging                      (`trainer._loop`)
    WandbSettings      Weights & Biases: project, run name, directory, mode   (`metrics.MetricsLogger`)
    ProfileSettings    profiler window and ranks, memory history, timing lines (`profiling.Profiler`)
    StartupReport      the command line's ignored flags and notes, printed once (`compat_flags.startup_lines`)

A field is named after the flag's destination it holds (`--clip-ratio-high` -> `clip_ratio_high`), and its default
is the parser's, so a part can be read like the Namespace it comes from (tests/unit/test_settings.py checks every
default against the parser): a new option of an estimator is one flag and one field. The values are the validated
ones: the stage defaults `validate_args` filled in (`--kl-penalty`, `--clip-ratio-high`, `--ppo-mini-batch-size`,
`--loss-agg-mode`, ...), lists as tuples. The few fields no flag sets (`derived`: the world size, the resolved
expert layout, `--split`'s weights, ...) are values `validate_args` works out of several flags.
The same field may sit in several parts (`max_new_tokens`, `seed`, `stage`): each part is whole for its consumer.
Model building's parts (model, optimizer, LoRA, MoE, recompute) are in `rl/model_settings.py`.

This module imports nothing of the package but `rl/model_settings.py` (as pure): the parser imports it, never the other
way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional, Tuple

# model building's parts (`rl/model_settings.py`); `derived`: a field no flag sets, `validate_args` works it out of
# several flags (and names it in its doc)
from mindspeed_llm.rl.model_settings import (
    LoRASettings,
    ModelBuild,
    MoESettings,
    OptimizerFlags,
    RecomputeSettings,
    derived,
)


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
    custom_reward_function: Optional[str] = None  # PATH[:NAME] of a user's reward function (`rl/reward_functions`)
    custom_reward_weight: Optional[float] = None  # validate_args: 1.0 with --custom-reward-function
    reward_model_weight: float = 1.0
    missing_eos_penalty: Optional[float] = None
    overlong_buffer_len: Optional[int] = None  # None: no overlong penalty
    overlong_penalty_factor: float = 1.0
    max_new_tokens: int = 128  # the overlong penalty's length limit
    tool_rewards: Optional[str] = None  # validate_args: "add" (a trajectory's tool rewards enter its score) or
    # "record" (only recorded)


@dataclass(frozen=True)
class JudgeSettings:
    """The LLM judge (`rl/judge.py`, docs/algorithms.md "LLM-as-judge rewards"): on with --judge-load."""
    judge_load: Optional[str] = None  # a Megatron checkpoint of any supported family and size; None: no judge
    judge_tokenizer_name_or_path: Optional[str] = None  # None: the run's tokenizer
    judge_template: Optional[str] = None  # the prompt template file ({prompt}, {response}, optionally {label})
    judge_parser: Optional[str] = None  # PATH[:NAME] of a verdict parser; None: the number after the last "Score:"
    judge_weight: float = 1.0
    judge_max_new_tokens: int = 256
    judge_unparsed_score: float = 0.0  # the score of a verdict the parser reads no number from


@dataclass(frozen=True)
class OffloadSettings:
    offload_ref_reward: bool = False
    offload_train_optimizer: bool = False
    offload_train_grad: bool = False
    offload_train_param: bool = False


@dataclass(frozen=True)
class DistillSettings:
    """On-policy distillation from a frozen teacher (`rl/distillation.py`): on with --teacher-load."""
    teacher_load: Optional[str] = None  # the teacher's Megatron checkpoint; None: no teacher
    distill_loss: Optional[str] = None  # validate_args: k1 with --teacher-load (k1, k3, topk_forward_kl)
    distill_mode: Optional[str] = None  # validate_args: reward with --teacher-load (reward, loss)
    distill_topk: Optional[int] = None  # validate_args: 32 with --distill-loss topk_forward_kl
    distill_coef: Optional[float] = None  # validate_args: 1.0 with --teacher-load


@dataclass(frozen=True)
class AlgorithmSettings:
    """What the stages compute from the scored rollouts, and how many samples they draw."""
    stage: Optional[str] = None
    adv_estimator: Optional[str] = None  # validate_args: gae for trl_ppo, grpo for grpo
    adv_scale: Optional[str] = None  # None: the outcome estimator's own default
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: Optional[float] = None  # validate_args: by --stage when not given
    kl_penalty: Optional[str] = None  # validate_args: by --stage when not given
    whiten_rewards: bool = False
    n_samples_per_prompt: Optional[int] = None  # validate_args: by --stage when not given
    filter_groups: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_metric: str = "reward"  # or a verifier's name: whose scores must differ within a kept group
    max_num_gen_batches: int = 10  # 0: no limit (--dynamic-sampling only)
    partial_rollout: bool = False
    partial_rollout_max_split: Optional[int] = None  # validate_args: 2 with --partial-rollout
    mask_truncated_completions: bool = False
    recompute_old_logprobs: bool = False  # validate_args: on with --rollout-is / --partial-rollout
    rollout_is: str = "none"


@dataclass(frozen=True)
class ToolSettings:
    """Multi-turn tool use (`rl/rollouts/tool_turns.py`): the tools, how calls are read, and the trajectory's limits (verl's and
    MindSpeed-RL's names)."""
    tool_config: Optional[str] = None  # on: the run's rollouts are multi-turn
    tool_parser_format: Optional[str] = None  # validate_args resolves it (hermes, `tools.parsers.DEFAULT_TOOL_PARSER`)
    max_assistant_turns: Optional[int] = None  # None: bounded by the budgets only
    max_tool_calls: Optional[int] = None  # per trajectory
    max_parallel_calls: int = 1  # per turn
    max_tool_response_length: int = 256  # tokens of one tool's answer
    tool_response_truncate_side: str = "middle"
    max_total_response_length: Optional[int] = None  # validate_args: --max-length - --max-prompt-length
    max_new_tokens: int = 128  # one model turn's tokens
    tool_timeout: float = 30.0  # seconds per call
    tool_workers: int = 8
    parked_kv: str = "auto"  # a sample waiting on a tool keeps its KV ("keep"), frees it ("free"), or keeps it until
    # a pending sample needs its slot ("auto")


@dataclass(frozen=True)
class BatchSettings:
    global_batch_size: Optional[int] = None  # prompts per iteration (a required flag)
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: Optional[int] = None
    forward_max_tokens_per_micro_batch: Optional[int] = None
    context_parallel_size: int = 1  # the budgets count one rank's tokens: 1 / CP of each row


@dataclass(frozen=True)
class ModelSources:
    ref_model: Optional[str] = None
    reward_model: Optional[str] = None
    load: Optional[str] = None
    lora: bool = derived(False)  # --lora-target-modules or --lora-load given


@dataclass(frozen=True)
class ParallelSettings:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = derived(1)  # ranks the experts are split over (EP x TP with --moe-tp-extend-ep)
    expert_tensor_parallel_size: Optional[int] = None  # validate_args: 1 or TP
    world_size: int = derived(1)
    data_parallel_size: int = derived(1)  # megatron's: world / (TP x PP x CP), the CP ranks not in it


@dataclass(frozen=True)
class DataSettings:
    data_path: Optional[str] = None
    eval_data_path: Optional[Tuple[str, ...]] = None
    # --eval-data-path's sets as (name, prefix); name None: the one unnamed set (metrics `eval/...`)
    eval_sets: Tuple[Tuple[Optional[str], str], ...] = derived(())
    split: Optional[str] = None
    split_weights: Optional[Tuple[float, float, float]] = derived()  # --split's, normalised; None: no --split
    eval_interval: Optional[int] = None  # validate_args: None when there is nothing to evaluate
    global_batch_size: Optional[int] = None
    seed: int = 1234
    no_shuffle: bool = False
    max_prompt_length: Optional[int] = None  # validate_args: --max-length - --max-new-tokens when not given
    tokenizer_name_or_path: Optional[str] = None
    tokenizer_not_use_fast: bool = False
    ref_model: Optional[str] = None  # the tokenizer's fallback places
    load: Optional[str] = None


@dataclass(frozen=True)
class CheckpointSettings:
    stage: Optional[str] = None
    ref_model: Optional[str] = None  # grpo without it: --load is the initial actor, not a run to resume
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    save_hf: bool = False  # the actor also as a Hugging Face folder at every save (checkpoint/hf_export.py)
    save_hf_merge_lora: bool = False  # a LoRA actor's folder merged instead of a PEFT adapter
    ckpt_step: Optional[int] = None
    exit_signal_handler: bool = False
    allow_reference_change: bool = False  # a resume with another --ref-model (checkpoint/run_record.py)


@dataclass(frozen=True)
class LoopSettings:
    train_iters: Optional[int] = None  # a required flag
    global_batch_size: Optional[int] = None
    log_interval: int = 1
    metrics_jsonl: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    eval_interval: Optional[int] = None  # validate_args: None when there is nothing to evaluate
    eval_prompts: int = derived(0)  # held-out prompts per evaluation: --eval-samples, else --eval-iters x batch; 0 all
    eval_n_samples: int = 1  # responses per held-out prompt (`evaluation.evaluate_policy`)
    eval_temperature: Optional[float] = None  # None: greedy at 1 sample, 1.0 at more
    eval_top_p: float = 1.0
    eval_pass_threshold: float = 1.0  # a sample is correct when its score >= this (pass@k, maj@N)
    eval_before_train: bool = False  # an evaluation at iteration 0
    log_samples: int = 0  # rollout / held-out samples per table (`rollout_records`, `metrics/samples.py`); 0 off
    log_samples_interval: Optional[int] = None  # validate_args: --log-interval when not given
    rollout_dump_dir: Optional[str] = None  # each iteration's scored rollout written there (`rollout_dump.py`)
    rollout_replay_dir: Optional[str] = None  # a dump replayed instead of generating (the `replay` strategy)
    check_for_divergence: bool = True


@dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases (`rl/metrics/wandb_writer.py`), Megatron-LM's flags: on with --wandb-project."""
    wandb_project: Optional[str] = None  # None: no wandb run
    wandb_exp_name: Optional[str] = None  # None: wandb names the run
    wandb_save_dir: Optional[str] = None  # validate_args: --save/wandb when not given (Megatron-LM's), else wandb's
    wandb_entity: Optional[str] = None  # None: the API key's default entity
    wandb_mode: Optional[str] = derived()  # WANDB_MODE, else offline without an API key; None without a project


@dataclass(frozen=True)
class ProfileSettings:
    """Megatron-LM's profiling flags (`rl/profiling.py`): iterations profile_step_start + 1 .. profile_step_end (as
    logged, from 1: Megatron-LM's window) on the ranks `profile_ranks`."""
    profile: bool = False
    use_pytorch_profiler: bool = False  # with --profile: torch.profiler traces; without: nsys's range (CUDA)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: Tuple[int, ...] = (0,)
    # what a torch.profiler trace records beyond the ops' times (each multiplies its size; off unless asked)
    pytorch_profiler_collect_shapes: bool = False  # the ops' input shapes (and nsys's NVTX ranges carry them)
    pytorch_profiler_collect_callstack: bool = False  # the Python stack of every op
    profile_with_memory: bool = False  # each op's tensor allocations
    record_memory_history: bool = False  # CUDA: torch's allocator history, dumped on the last rank
    memory_snapshot_path: str = "snapshot.pickle"
    timing_log_level: Optional[int] = None  # 0: timing/all alone on the stdout line; None, 1, 2: every phase
    log_interval: int = 1  # the memory snapshot is dumped every log interval (Megatron-LM's)
    trace_dir: Optional[str] = derived()  # where the traces go: <--tensorboard-dir or --save>/profile


@dataclass(frozen=True)
class StartupReport:
    """What rank 0 says once before training about the command line (`compat_flags.startup_lines`)."""
    # (flag, why it has no effect) of the given flags that change nothing here (`compat_flags.ignored_flags`)
    ignored_flags: Tuple[Tuple[str, str], ...] = derived(())
    startup_notes: Tuple[str, ...] = derived(())  # what validate_args resolved that a user would not expect
    distributed_backend: Optional[str] = None  # said when the device's collectives backend overrides it


@dataclass(frozen=True)
class Settings:
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    update: UpdateSchedule = field(default_factory=UpdateSchedule)
    reward: RewardMixing = field(default_factory=RewardMixing)
    judge: JudgeSettings = field(default_factory=JudgeSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    tools: ToolSettings = field(default_factory=ToolSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    models: ModelSources = field(default_factory=ModelSources)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    loop: LoopSettings = field(default_factory=LoopSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    startup: StartupReport = field(default_factory=StartupReport)
    # model building (`rl/model_settings.py`)
    model: ModelBuild = field(default_factory=ModelBuild)
    optimizer: OptimizerFlags = field(default_factory=OptimizerFlags)
    lora: LoRASettings = field(default_factory=LoRASettings)
    moe: MoESettings = field(default_factory=MoESettings)
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)


# Settings' fields and their part classes, in order
PART_OF = {f.name: f.default_factory for f in fields(Settings)}
PARTS = tuple(PART_OF.values())
FIELD_NAMES = frozenset(f.name for cls in PARTS for f in fields(cls))


def _part(cls, args, resolved):
    """`cls` with each field read from `resolved` or else the Namespace entry of its name (lists as tuples: the
    parts are frozen)."""
    values = {f.name: resolved[f.name] if f.name in resolved else getattr(args, f.name) for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def from_args(args, **resolved) -> Settings:
    """The settings of a validated command line (`arguments.validate_args`): every field is the flag destination
    (or the derived value) of its name, taken from `resolved` when there, else from the Namespace."""
    unknown = set(resolved) - FIELD_NAMES  # a value resolved for no field would be lost
    if unknown:
        raise TypeError(f"no settings field named {', '.join(sorted(unknown))}")
    return Settings(**{name: _part(cls, args, resolved) for name, cls in PART_OF.items()})


def with_values(settings: Settings, **values) -> Settings:
    """`settings` with the named fields set in every part that has them (a field may sit in several)."""
    parts = {}
    for name, cls in PART_OF.items():
        part = getattr(settings, name)
        own = {k: v for k, v in values.items() if k in {f.name for f in fields(cls)}}
        parts[name] = replace(part, **own) if own else part
    unknown = set(values) - FIELD_NAMES
    if unknown:
        raise TypeError(f"no settings field named {', '.join(sorted(unknown))}")
    return Settings(**parts)
