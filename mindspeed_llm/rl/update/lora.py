"""LoRA in the stages (`--lora-target-modules`, `--lora-load`): the trained roles get adapters on a frozen base,
their checkpoints hold the adapters only, and the frozen roles that share a base cost nothing.

* `trainable`: the actor or the critic with adapters (`models/lora.apply_lora`; the critic's value head trains
  fully), the actor's started from `--lora-load` when given, as a `LoRATrainableModel`. The same flags apply to
  both trained roles.
* `LoRATrainableModel`: its checkpoints hold the trained tensors (adapters, a critic's head), their optimizer state
  and `lora`: the config, whether it is a value model, and the base the adapters belong to -- the checkpoint path
  it was loaded from and a fingerprint of its weights (a strided sample of every frozen tensor, as float32). A
  load refuses another config or another base (fingerprint), and notes a base that moved (same fingerprint, other
  path). A resume is exact as for full training: the adapters, their fp32 masters and Adam moments, the schedule
  and the RNG come back.
* `SharedBase`: a frozen model that is a trained model's base. With LoRA the reference is the actor with its
  adapters disabled (no second copy of the weights; TRL, verl and MindSpeed-RL do the same). With `--lora-load` the
  reference is the initial policy, as without LoRA and as TRL's GRPOTrainer does for a pretrained adapter (its "ref"
  adapter): the base with a frozen copy of the loaded adapter (adapter-sized, `models/lora.freeze_copy`); the
  checkpoint records that adapter, and a resume must pass it again. In trl_ppo the reward model and the critic come
  from the same
  `--reward-model` checkpoint, so the reward model is the critic with its adapters disabled AND the checkpoint's
  value head: the critic's head trains, the reward model's must not, so a frozen copy of the initial head (one
  hidden-sized vector) takes its place in the reward block. `roles.on_device` opens the block.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import replace
from typing import Optional

import torch

from mindspeed_llm.checkpoint.errors import CheckpointError
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models import lora
from mindspeed_llm.rl.update.trainable import TrainableModel
from mindspeed_llm.rl.model_settings import LoRASettings, OptimizerSettings

DEFAULT_R, DEFAULT_ALPHA = 16, 32.0  # MindSpeed-LLM's defaults


def run_config(flags: LoRASettings, adapter=None) -> lora.LoRAConfig:
    """The LoRA config of the run: the flags (MindSpeed-LLM's defaults r 16, alpha 32), or with `adapter`
    (`--lora-load`) the adapter's own r, alpha and targets -- a flag that disagrees is an error; --lora-dropout,
    a training setting, applies."""
    dropout = flags.lora_dropout
    if adapter is None:
        return lora.LoRAConfig(r=flags.lora_r or DEFAULT_R,
                               alpha=flags.lora_alpha if flags.lora_alpha is not None else DEFAULT_ALPHA,
                               dropout=dropout or 0.0, target_modules=tuple(flags.lora_target_modules))
    found = adapter.config
    for flag, given, stored in (("--lora-r", flags.lora_r, found.r), ("--lora-alpha", flags.lora_alpha, found.alpha)):
        if given is not None and float(given) != float(stored):
            raise ArgumentError(f"{flag} {given:g} does not match the adapter of --lora-load {adapter.source} "
                                f"({flag[2:].replace('-', '_')} {stored:g}); drop the flag")
    if flags.lora_target_modules and set(flags.lora_target_modules) != set(found.target_modules):
        raise ArgumentError(f"--lora-target-modules {' '.join(flags.lora_target_modules)} does not match the adapter "
                            f"of --lora-load {adapter.source} ({' '.join(found.target_modules)}); drop the flag")
    return replace(found, dropout=found.dropout if dropout is None else dropout)


def as_flags(config: lora.LoRAConfig, flags: LoRASettings) -> LoRASettings:
    """`flags` whose `run_config` is `config` (its r, alpha, dropout and targets; the ranks of a PEFT adapter's
    stacked matrices stay the adapter's): what the critic's adapters are built with after the actor's, which took an
    adapter of --lora-load's own values."""
    return replace(flags, lora_r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                   lora_target_modules=tuple(config.target_modules))


def read_lora_load(flags: LoRASettings, spec):
    """The adapter of --lora-load (a PEFT folder or an adapter checkpoint), refused by name when it is not one or
    belongs to another model."""
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint.convert import spec_differences
    from mindspeed_llm.checkpoint.errors import ConversionError

    try:
        adapter = lora_files.read_adapter(flags.lora_load, spec)
    except (ConversionError, FileNotFoundError, OSError) as exc:
        raise ArgumentError(f"--lora-load {flags.lora_load}: {exc}") from None
    if adapter.spec is not None:
        diffs = spec_differences(adapter.spec, spec)
        if diffs:
            listed = "; ".join(f"{k}: adapter {a!r} vs model {b!r}" for k, (a, b) in diffs.items())
            raise ArgumentError(f"--lora-load {flags.lora_load}: its adapters belong to another model ({listed})")
    if adapter.value_head:
        raise ArgumentError(f"--lora-load {flags.lora_load} is a value model's adapter (a critic's); --lora-load "
                            "starts the actor")
    return adapter


def load_adapter(model, adapter) -> None:
    """Copy a full adapter (global names) into `model`'s adapters: each rank takes its TP slice."""
    from mindspeed_llm.checkpoint import lora as lora_files

    core_names = getattr(lora._core(model), "lora_global_names")
    problems = []
    with torch.no_grad():
        for local, module in lora.adapters(model).items():
            name = core_names[local]
            a, b = adapter.tensors.get(name + lora_files.A_SUFFIX), adapter.tensors.get(name + lora_files.B_SUFFIX)
            if a is None or b is None:
                problems.append(f"no adapter for {name}")
                continue
            rank = module.tp_group.rank() if module.tp_size > 1 else 0
            a, b = lora_files.split_for_rank(name, a, b, module.tp_size, rank)
            if tuple(a.shape) != tuple(module.A.shape) or tuple(b.shape) != tuple(module.B.shape):
                problems.append(f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} vs the model's "
                                f"{tuple(module.A.shape)} / {tuple(module.B.shape)}")
                continue
            module.A.copy_(a)
            module.B.copy_(b)
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ArgumentError(f"--lora-load {adapter.source} does not fit the model: {'; '.join(problems[:4])}{more}")


def base_fingerprint(model, frozen_only: bool = True) -> str:
    """A fingerprint of this rank's frozen weights (all of them without `frozen_only`: a full-weight role's
    initial weights, `checkpoint/run_record.py`): sha256 over each tensor's name, shape and a strided sample of
    at most 4096 of its values as float32 (exact, device- and order-independent, cheap for any size;
    `checkpoint.lora_base.fingerprint`, which a conversion recomputes from the full base)."""
    from mindspeed_llm.checkpoint.lora_base import fingerprint

    return fingerprint((name, param) for name, param in lora._core(model).named_parameters()
                       if not (frozen_only and param.requires_grad))


def _run_layout(model) -> tuple:
    from megatron.core import parallel_state

    from mindspeed_llm.checkpoint.megatron_layout import model_expert_layout

    ep, etp, ep_rank = model_expert_layout(lora._core(model))
    return ((parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(), ep, etp),
            (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
             ep_rank))


def base_problem(trained: "LoRATrainableModel", adapter) -> Optional[str]:
    """Whether the actor's model is the base `adapter` (--lora-load) was trained on: an adapter checkpoint's
    recorded fingerprints (this rank's own at the adapter's layout and precision, else rank 0 recomputes them from
    the base checkpoint, `checkpoint.lora_base.BaseCheck`), a PEFT folder's base name. The same answer on every
    rank."""
    from mindspeed_llm.checkpoint import lora_base as lora_files
    from mindspeed_llm.checkpoint.convert import _checkpoint_info
    from mindspeed_llm.checkpoint.errors import ConversionError
    from mindspeed_llm.distributed import broadcast_object, gather_messages, is_rank_0

    base = f"the actor's model {trained.base}"
    if not adapter.shard_bases:
        info = _checkpoint_info(trained.base, None) if trained.base else None
        names = lora_files.base_names(trained.base, info) if trained.base else []
        return lora_files.peft_base_problem(adapter, names, base) if names else None
    layout, ranks = _run_layout(trained.module)
    if layout == adapter.layout and adapter.params_dtype == lora._core(trained.module).config.params_dtype:
        recorded = adapter.shard_bases.get(ranks, {}).get("fingerprint")
        mine = None if recorded in (None, trained.fingerprint) else "differs"
        return lora_files.base_mismatch(adapter, base) if gather_messages(mine) else None
    problem = None
    if is_rank_0():
        try:
            check = lora_files.BaseCheck(adapter)
            info = _checkpoint_info(trained.base, None)
            for full in lora_files.base_stages(trained.base, False, info["spec"], info["value_head"]):
                check.add(full)
            problem = check.problem(base)
        except (ConversionError, ValueError, OSError) as exc:  # said on every rank, not raised on rank 0 alone
            problem = f"--lora-load {adapter.source}: {base} cannot be read to check the adapter's base ({exc})"
    return broadcast_object(problem)


def rank_note(model) -> Optional[str]:
    """A line naming the adapted linears whose rank is above what they can use (min(in, out) of the full linear:
    B A has at most that rank); None when every rank fits."""
    over = {}
    for local, adapter in lora.adapters(model).items():
        width = min(adapter.in_features, adapter.out_features)
        if adapter.rank > width:
            key = (local.rsplit(".", 1)[-1], adapter.in_features, adapter.out_features, adapter.rank)
            over[key] = over.get(key, 0) + 1
    if not over:
        return None
    listed = "; ".join(f"{leaf} ({count} on this rank, {n_in} -> {n_out}: rank at most {min(n_in, n_out)}, "
                       f"given {rank})" for (leaf, n_in, n_out, rank), count in sorted(over.items()))
    return (f"note: the LoRA rank is above what these linears can use, so part of each adapter is redundant: "
            f"{listed}; a --lora-r at most their width trains the same updates with fewer parameters")


class LoRATrainableModel(TrainableModel):
    """A `TrainableModel` whose base is frozen and whose checkpoints hold only what trains (module docstring)."""

    is_lora = True

    def __init__(self, model, settings, name: str = "model", base: str = "", initial_adapter: Optional[str] = None,
                 **options):
        self.base = os.path.abspath(base) if base else ""
        self.initial_adapter = os.path.abspath(initial_adapter) if initial_adapter else None  # --lora-load
        self.fingerprint = base_fingerprint(model)
        super().__init__(model, settings, name=name, **options)
        self.trained = lora.trained_names(model)

    @property
    def config(self) -> lora.LoRAConfig:
        return lora._core(self.module).lora_config

    def lora_state(self) -> dict:
        return {"config": self.config.to_dict(), "value_head": bool(getattr(self.module, "is_value_model", False)),
                "base": {"path": self.base, "fingerprint": self.fingerprint}, "initial_adapter": self.initial_adapter}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["lora"] = self.lora_state()
        return state

    def _module_state(self) -> dict:
        return lora.trained_state(self.module)

    def _load_module_state(self, model_state: dict) -> None:
        missing = [k for k in self.trained if k not in model_state]
        unexpected = [k for k in model_state if k not in self.trained]
        if missing or unexpected:
            listed = "; ".join([f"missing {k}" for k in missing[:3]] + [f"unexpected {k}" for k in unexpected[:3]])
            raise CheckpointError(f"{self.name}: the checkpoint's adapters do not fit this model ({listed})")
        self.module.load_state_dict(model_state, strict=False)

    def check_checkpoint(self, stored: Optional[dict]) -> None:
        """The checkpoint's `lora` entry against this run: LoRA at all, the config, the base (`checkpoint.training`'s
        loader calls it before it loads anything of the checkpoint)."""
        if stored is None:
            raise CheckpointError(f"{self.name}: the checkpoint holds full weights (a run without LoRA), but this run "
                                  "trains LoRA adapters; resume it without --lora-target-modules / --lora-load")
        ours, theirs = self.config.to_dict(), stored["config"]
        flags = {"r": "--lora-r", "alpha": "--lora-alpha", "target_modules": "--lora-target-modules",
                 "ranks": "--lora-load (the stacked ranks of a PEFT adapter)"}
        for key, flag in flags.items():
            a, b = ours.get(key), theirs.get(key)
            if key == "target_modules":
                a, b = sorted(a or ()), sorted(b or ())
            if a != b:
                raise CheckpointError(f"{self.name}: the checkpoint's adapters have {key} {b} but this run has {a}; "
                                      f"pass the {flag} they were trained with")
        base = stored.get("base") or {}
        if base.get("fingerprint") != self.fingerprint:
            where = "the same path, whose weights changed since" if base.get("path") == self.base else \
                f"{base.get('path')!r}, not this run's {self.base!r}"
            raise CheckpointError(f"{self.name}: the checkpoint's adapters were trained on another base model "
                                  f"({where}; or in another precision); load them onto the base they were trained "
                                  "on (--ref-model / --reward-model)")
        initial = stored.get("initial_adapter")
        if initial != self.initial_adapter:
            started = f"--lora-load {initial}" if initial else "fresh adapters (no --lora-load)"
            given = f"--lora-load {self.initial_adapter}" if self.initial_adapter else "no --lora-load"
            raise CheckpointError(f"{self.name}: the run started from {started}, the reference policy's adapter, "
                                  f"but this one gives {given}; pass the same --lora-load to resume it")
        if base.get("path") != self.base:
            from mindspeed_llm.distributed import is_rank_0

            if is_rank_0():
                print(f"{self.name}: the adapters were trained on {base.get('path')}; this run's base {self.base} "
                      "holds the same weights", flush=True)


def trainable(model, flags: LoRASettings, settings: OptimizerSettings, name: str, **options) -> LoRATrainableModel:
    """The actor or the critic with adapters (module docstring); `model` is loaded and on the device; `options` are
    `TrainableModel`'s (finite and divergence checks, offload). The critic's adapters are fresh ones of the flags'
    config, which `as_flags` makes the actor's (`roles.RoleFactory`)."""
    adapter = None
    if name == "actor":
        adapter = read_lora_load(flags, model.model_spec) if flags.lora_load else None
        config = run_config(flags, adapter)
    else:
        config = replace(run_config(flags), ranks={})
    try:
        lora.apply_lora(model, config, seed=flags.seed, salt=name)
    except ValueError as exc:
        raise ArgumentError(f"the {name}: {exc}") from None
    if adapter is not None:
        load_adapter(model, adapter)
    from mindspeed_llm.distributed import is_rank_0

    note = rank_note(model)
    if note and is_rank_0():
        print(f"{name}: {note}", flush=True)
    trained = LoRATrainableModel(model, settings, name=name, **options, base=getattr(model, "loaded_from", ""),
                                 initial_adapter=flags.lora_load if adapter is not None else None)
    problem = base_problem(trained, adapter) if adapter is not None else None
    if problem and not flags.allow_base_mismatch:
        raise ArgumentError(problem)
    if problem and is_rank_0():
        print(f"{name}: warning: --allow-base-mismatch: {problem.split('; pass')[0]}", flush=True)
    return trained


class SharedBase:
    """A frozen model that is `trainable`'s base: its module with the adapters disabled (with `frozen_adapters`: with
    their frozen copies; with `keep_head`: the initial value head in place of the training one) within `active()`."""

    def __init__(self, trainable_model: LoRATrainableModel, keep_head: bool = False, frozen_adapters: bool = False):
        self.trainable = trainable_model
        self.module = trainable_model.module
        self.frozen_adapters = frozen_adapters
        if frozen_adapters:
            lora.freeze_copy(self.module)
        self.head = None
        if keep_head and getattr(self.module, "output_layer", None) is not None:
            # the copy shares the model's TransformerConfig (it holds process groups, which cannot be copied)
            config = getattr(self.module, "config", None)
            self.head = copy.deepcopy(self.module.output_layer, {id(config): config} if config is not None else None)
            for param in self.head.parameters():
                param.requires_grad_(False)

    @property
    def model_spec(self):
        return self.module.model_spec

    @contextlib.contextmanager
    def active(self):
        module = self.module
        adapters = lora.frozen_copies(module) if self.frozen_adapters else lora.adapters_disabled(module)
        with adapters:
            if self.head is None:
                yield module
                return
            trained = module.output_layer
            module.output_layer = self.head
            try:
                yield module
            finally:
                module.output_layer = trained


def reference(actor: LoRATrainableModel) -> SharedBase:
    """The reference policy of a LoRA run: the actor with its adapters off, or, started from --lora-load, with a
    frozen copy of the loaded adapter (built before any resume loads the trained adapters)."""
    return SharedBase(actor, frozen_adapters=actor.initial_adapter is not None)


def reward_model(critic: LoRATrainableModel) -> SharedBase:
    """trl_ppo's reward model of a LoRA run: the critic (from the same --reward-model) with its adapters off and
    the checkpoint's value head."""
    return SharedBase(critic, keep_head=True)
