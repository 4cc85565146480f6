"""Training checkpoints of a stage: every trained role (actor, critic) plus the loop's own state.

Layout (Megatron-LM's, one tree per role)::

    <save>/<role>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/<role>/iter_0000010/run_record.json         <- stage, roles, bases, reference (`run_record.py`)
    <save>/actor/iter_0000010/hf/                     <- --save-hf: the actor as transformers loads it (`save_hf.py`)
    <save>/<role>/latest_checkpointed_iteration.txt
    <save>/latest_checkpointed_iteration.txt          <- written last of all: the resume point
    <save>/.writer.lock                               <- host and pid of the run writing here

Each shard holds `model`, `optimizer`, `opt_param_scheduler`, `iteration`, `model_spec` (a LoRA run: `model` holds
the adapters only, and `lora` their config and base, `rl/update/lora.py`) and, in the same file, the loop state (`rng_state`
of every DP rank, `data_position` of the prompt sampler). With
--use-distributed-optimizer the shard folder also holds `distrib_optim.pt` (Megatron-LM's file: the fp32 main
weights and Adam moments that megatron's optimizer `state_dict()` leaves out, gathered over the DP ranks by DP rank
0), staged and published with the rest; a resume scatters it again, at the saved DP size or another one, and checks
that the main weights and moments were restored (`TrainableModel.load_state_dict`). A checkpoint saved with the
other kind of optimizer is refused unless `--no-load-optim`.

What is guaranteed:

* Crash safety: ranks write into staging directories (`.iter_XXXXXXX.staging`); after a barrier rank 0 renames
  each to its final name, then replaces each role's latest file, then the top-level one (temp file +
  `os.replace`). A run killed at any moment leaves the previous complete checkpoint as the resume point;
  staging leftovers are never read and are removed by the next save.
* Nothing non-finite is published: `save` checks every weight first and refuses (`NonFiniteError`).
* A failed write (disk full, permissions) removes its staging files and names the cause; the previous
  checkpoint stays the resume point.
* One writer per directory (`WriterLock`, `checkpoint/writer_lock.py`).
* A shard that cannot be read on any rank stops every rank with the file named (no rank is left waiting in a
  collective).

State a role keeps in host memory between updates (--offload-train-*) comes back to the device for a save or a
load and leaves again after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint import run_record, save_hf
from mindspeed_llm.checkpoint.errors import CheckpointError, NonFiniteError
from mindspeed_llm.files import write_error_message
from mindspeed_llm.checkpoint.writer_lock import WriterLock  # noqa: F401  (re-exported: rl/trainer.py takes it from here)
from mindspeed_llm import device
from mindspeed_llm.distributed import barrier, broadcast_object, gather_messages, is_rank_0



def _rng_state() -> dict:
    import random

    import numpy as np

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "accelerator": device.rng_state(),
        "tracker": _tracker_states(),
    }


def _tracker_states():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    device.set_rng_state(state.get("accelerator"))
    get_cuda_rng_tracker().set_states(state["tracker"])


def _gather_dp(obj):
    """Every DP rank's object, in DP-rank order (the RNG differs per rank)."""
    group = parallel_state.get_data_parallel_group()
    size = parallel_state.get_data_parallel_world_size()
    if not dist.is_initialized() or size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _layout():
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _writes_shard(module) -> bool:
    """Whether this rank writes `module`'s shard: one rank per (tp, pp[, ep]) position.

    Data-parallel replicas hold identical weights and optimizer states, and so do the context-parallel ranks of a
    DP rank (context parallelism splits the sequences, not the weights). With expert parallelism the ranks of
    one dense DP group hold different experts, so a mixture of experts is written by the expert-data-parallel
    rank 0 of each expert group; a dense model (even next to an MoE actor) by DP rank 0 of CP rank 0.
    """
    if layout.model_expert_layout(module)[0] > 1:
        return parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def non_finite_weights(roles: Dict[str, object]) -> Optional[str]:
    """A description of this rank's non-finite weights ('actor: 12 of 4096 values of decoder.x.weight, ...')."""
    found = []
    for name, trainable in roles.items():
        for pname, param in trainable.module.named_parameters():
            bad = int((~torch.isfinite(param.detach())).sum())
            if bad:
                found.append(f"{name}: {bad} of {param.numel()} values of {pname}")
    return "; ".join(found) or None


def _remove_staging_leftovers(folder: str) -> None:
    """Staging directories of killed saves (any iteration) and tracker temp files of a kill between their write and
    rename are never checkpoints: drop them."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith(".iter_") and (name.endswith(".staging") or ".old-" in name):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        elif name.startswith(f".{layout.TRACKER_FILE}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


@contextlib.contextmanager
def _on_device(roles: Dict[str, object]):
    """Every role's offloaded training state on the device for the block (`TrainableModel.on_device`)."""
    with contextlib.ExitStack() as stack:
        for trainable in roles.values():
            if hasattr(trainable, "on_device"):
                stack.enter_context(trainable.on_device())
        yield


def save(root: str, iteration: int, roles: Dict[str, object], loop_state: dict, save_optim: bool = True,
         record: Optional[dict] = None, hf: Optional[save_hf.SaveHF] = None) -> None:
    """Write `roles` ({name: TrainableModel}) and `loop_state` (sampler position etc.) for `iteration`; without
    `save_optim` (--no-save-optim, Megatron-LM's) the weights, RNG and data position only: no optimizer state, no
    LR schedule (a resume then needs --no-load-optim). `record` (`run_record.make_record`: stage, roles, bases,
    reference) goes into every role's folder of the iteration, published with its shards.

    Refuses non-finite weights (`NonFiniteError`, nothing written); a write error on any rank removes the
    staging files and raises `CheckpointError` naming it. Either way the previous checkpoint stays the
    resume point.

    `hf` (--save-hf): the actor also as a Hugging Face folder, `actor/iter_N/hf/` (`save_hf.py`), published
    with the checkpoint; its failure still publishes the checkpoint and raises `CheckpointError` naming the file.
    """
    with _on_device(roles):
        _save(root, iteration, roles, loop_state, save_optim, record, hf)


def _save(root: str, iteration: int, roles: Dict[str, object], loop_state: dict, save_optim: bool,
          record: Optional[dict], hf: Optional[save_hf.SaveHF] = None) -> None:
    problems = gather_messages(non_finite_weights(roles))
    if problems:
        raise NonFiniteError(
            f"the weights are not finite ({'; '.join(problems)}); iteration {iteration} was not saved to {root}"
        )
    rng_states = _gather_dp(_rng_state())
    # the distributed optimizer's sharded state, gathered onto DP rank 0 (collectives: every rank, every role)
    parameter_states = {name: _parameter_state(trainable) if save_optim else None for name, trainable in roles.items()}
    tp_rank, pp_rank, tp, pp = _layout()
    dp = parallel_state.get_data_parallel_world_size()
    staging = {name: layout.staging_dir(os.path.join(root, name), iteration) for name in roles}
    if is_rank_0():
        _remove_staging_leftovers(root)
        for name in roles:
            _remove_staging_leftovers(os.path.join(root, name))
            layout.prepare_staging(os.path.join(root, name), iteration)
    barrier()
    error = None
    for name, trainable in roles.items():
        module = trainable.module
        ep, etp, ep_rank = layout.model_expert_layout(module)
        files = []
        if _writes_shard(module):
            state = trainable.state_dict()
            if not save_optim:
                del state["optimizer"], state["opt_param_scheduler"]
            payload = layout.make_payload(
                state.pop("model"), module.model_spec, tp, pp, tp_rank, pp_rank, module.config.params_dtype,
                bool(getattr(module, "is_value_model", False)), iteration, ep=ep, etp=etp, ep_rank=ep_rank,
                rng_state=rng_states, data_position=loop_state, **state,
            )
            payload["args"].use_distributed_optimizer = bool(_distributed_optimizers(trainable))
            payload["args"].data_parallel_size = dp
            payload["args"].no_save_optim = not save_optim
            files.append((payload, layout.shard_path(staging[name], tp_rank, pp_rank, pp, ep_rank, ep)))
        if parameter_states[name] is not None:
            files.append((parameter_states[name],
                          layout.optimizer_state_path(staging[name], tp_rank, pp_rank, pp, ep_rank, ep)))
        for payload, path in files:
            try:
                layout.save_file(payload, path)
            except OSError as exc:  # layout.CheckpointWriteError names the file and the cause
                error = str(exc) if isinstance(exc, layout.CheckpointWriteError) else \
                    write_error_message(path, exc)
                break
        if error:
            break
    if error is None and record is not None and is_rank_0():
        for name in roles:
            try:
                run_record.write(staging[name], record)
            except OSError as exc:  # a CheckpointWriteError naming the file and the cause
                error = str(exc)
                break
    errors = gather_messages(error)
    if errors:
        if is_rank_0():
            for name in roles:
                shutil.rmtree(staging[name], ignore_errors=True)
        previous = latest_iteration(root) if is_rank_0() else None
        previous = broadcast_object(previous)
        kept = f"iteration {previous} is still the resume point" if previous else "no checkpoint is there yet"
        raise CheckpointError(
            f"saving iteration {iteration} to --save {root} failed: {'; '.join(errors)}; the partial files were "
            f"removed and {kept}; free space there or pass another --save"
        )
    barrier()
    hf_problem = _write_hf(staging, roles, hf, record) if hf is not None else None
    if is_rank_0():
        for name in roles:
            layout.publish(staging[name], layout.checkpoint_dir(os.path.join(root, name), iteration))
        for name in roles:
            layout.write_latest(os.path.join(root, name), iteration)
        layout.write_latest(root, iteration)  # the resume point: only once every role is complete
    barrier()
    if hf_problem:
        raise CheckpointError(
            f"iteration {iteration} was saved to --save {root} and is the resume point, but its Hugging Face folder "
            f"(--save-hf) was not written: {hf_problem}; nothing of that folder was left; free space there and "
            f"resume with --load {root}")


def _write_hf(staging: Dict[str, str], roles: Dict[str, object], options: "save_hf.SaveHF",
              record: Optional[dict]) -> Optional[str]:
    """The actor's Hugging Face folder (`save_hf.py`): each pipeline stage written by its TP-rank-0 shard's writer."""
    actor = roles["actor"]
    tp_rank, pp_rank, _, _ = _layout()
    ep_rank = layout.model_expert_layout(actor.module)[2]
    stages = [pp_rank] if tp_rank == 0 and ep_rank == 0 and _writes_shard(actor.module) else []
    return save_hf.write_actor(staging["actor"], stages, options, getattr(actor, "base", "") or "", record)


def _distributed_optimizers(trainable) -> list:
    return list(getattr(trainable, "distributed_optimizers", []))


def _parameter_state(trainable):
    return trainable.parameter_state() if _distributed_optimizers(trainable) else None


def latest_iteration(root: str) -> Optional[int]:
    """The iteration of the last complete stage checkpoint under `root`, or None when there is none."""
    try:
        value = layout.read_latest(root)
    except layout.CheckpointNotFoundError:
        return None
    return None if value == layout.RELEASE else int(value)


def complete_iterations(root: str, role_names) -> List[int]:
    """The iterations under `root` that every role has published (their shards may still be damaged)."""
    found = None
    for name in role_names:
        role_root = os.path.join(root, name)
        its = set()
        if os.path.isdir(role_root):
            for entry in os.listdir(role_root):
                if entry.startswith("iter_") and entry[5:].isdigit():
                    its.add(int(entry[5:]))
        found = its if found is None else found & its
    return sorted(found or ())


def resume_iteration(load: str, role_names, stage_name: str, save: Optional[str] = None,
                     ckpt_step: Optional[int] = None, finetune: bool = False) -> Optional[int]:
    """The iteration to resume from `load` (None: start fresh), with Megatron-LM's semantics:

    * `--ckpt-step N`: iteration N, which every role must have;
    * else the top-level tracker's iteration (a complete stage checkpoint);
    * `load` equal to `save` and no checkpoint of any kind there (no tracker, no `iter_*`, no `release`; the
      staging leftovers of a killed first save are none): start fresh (the auto-resume pattern of restart loops:
      the same command line for the first run and every restart);
    * another stage's checkpoint (by its record, `run_record.stage_problem`) is refused by name unless `finetune`
      (a new run from its weights), and so is a checkpoint whose recorded role directory is gone;
    * anything else is an error naming what is wrong and, where one exists, the `--ckpt-step` that would work: a
      missing, unreadable or `release` tracker over saved iterations, a tracker iteration some role lacks, a typo'd
      path, a converted model. Nothing under `load` is touched before it returns, so a run never starts over (or
      moves the tracker of) a checkpoint it could not read.
    """
    roles = list(role_names)
    complete = complete_iterations(load, roles)

    def checked(iteration: int) -> int:
        problem = None if finetune else run_record.stage_problem(load, iteration, stage_name, roles)
        if problem:
            raise CheckpointError(f"--load {load}: {problem}")
        return iteration

    if ckpt_step is not None:
        if ckpt_step not in complete:
            problem = run_record.stage_problem(load, ckpt_step, stage_name, roles)
            listed = ", ".join(map(str, complete)) or "none"
            raise CheckpointError(f"--load {load}: {problem}" if problem else
                                  f"--ckpt-step {ckpt_step}: --load {load} has no complete checkpoint of iteration "
                                  f"{ckpt_step} for {', '.join(roles)} (complete iterations: {listed})")
        return checked(ckpt_step)
    tracker, problem = _tracker(load)
    if isinstance(tracker, int) and tracker in complete:
        return checked(tracker)
    traces = layout.checkpoint_traces(load, roles)
    if not traces:
        if save is not None and os.path.abspath(load) == os.path.abspath(save):
            return None
        raise CheckpointError(f"--load {load}: {_why_not_a_checkpoint(load, roles, stage_name)}")
    other_stage = (run_record.stage_problem(load, tracker, stage_name, roles) if isinstance(tracker, int) else
                   None) or _written_by_another_stage(load, roles, stage_name)
    if other_stage or (tracker == layout.RELEASE and not complete and not any(
            os.path.isdir(os.path.join(load, r)) for r in roles)):
        raise CheckpointError(f"--load {load}: {other_stage or _why_not_a_checkpoint(load, roles, stage_name)}")
    if tracker == layout.RELEASE:
        problem = (f"{os.path.join(load, layout.TRACKER_FILE)} says 'release', a converted model's tracker (did "
                   "convert_ckpt.py write into this --save root?), not an iteration")
    elif problem is None:  # the tracker names an iteration that not every role has
        lacking = [os.path.join(load, r, f"iter_{tracker:07d}") for r in roles
                   if tracker not in complete_iterations(load, [r])]
        problem = f"its tracker says iteration {tracker}, but {', '.join(lacking)} is missing"
    fix = (f"pass --ckpt-step {complete[-1]} to resume from its newest complete iteration" if complete else
           f"no iteration there is complete for {' and '.join(roles)}: pass another --load (or --save) directory")
    raise CheckpointError(f"--load {load}: {problem}; it holds {', '.join(traces[:4])}"
                          f"{' ...' if len(traces) > 4 else ''}, so the run does not start over it: {fix}")


def _tracker(root: str):
    """(the top-level tracker's iteration or 'release', None) or (None, what is wrong with it)."""
    try:
        return layout.read_latest(root), None
    except layout.CheckpointNotFoundError:
        path = os.path.join(root, layout.TRACKER_FILE)
        if not os.path.isfile(path):
            return None, f"{path} is missing"
        with open(path, errors="replace") as f:
            return None, f"{path} holds {f.read().strip()[:40]!r}, not an iteration"


def _written_by_another_stage(load: str, roles: List[str], stage_name: str) -> Optional[str]:
    present = [r for r in ("actor", "critic") if os.path.isfile(os.path.join(load, r, layout.TRACKER_FILE))]
    missing = [r for r in roles if r not in present and not os.path.isdir(os.path.join(load, r))]
    if present and missing:
        return (f"it holds a checkpoint of {', '.join(present)} but --stage {stage_name} trains "
                f"{' and '.join(roles)} ({', '.join(os.path.join(load, r) for r in missing)} missing): it was "
                f"written by another stage (to start {stage_name} from its actor pass --ref-model "
                f"{os.path.join(load, 'actor')} and a new --save), or {' and '.join(missing)} was moved or deleted "
                "(put it back)")
    return None


def _why_not_a_checkpoint(load: str, roles: List[str], stage_name: str) -> str:
    if not os.path.exists(load):
        return "no such directory (a typo?); pass the --save directory of an earlier run, or drop --load"
    if os.path.isfile(os.path.join(load, layout.TRACKER_FILE)) and not any(
            os.path.isdir(os.path.join(load, r)) for r in roles):
        return (f"this is a converted model, not a --save directory of a {stage_name} run; pass it as --ref-model "
                "(or --reward-model), or use --finetune with a --save directory")
    return (f"no complete {stage_name} checkpoint there ({os.path.join(load, layout.TRACKER_FILE)} is missing; "
            "the staging leftovers of an interrupted first save are not a checkpoint); pass the --save directory "
            "of an earlier run, or the same directory as --save to start fresh there and resume later")


def load(root: str, roles: Dict[str, object], iteration: int, load_optim: bool = True, load_rng: bool = True,
         on_schedule=None) -> dict:
    """Restore `roles` from `iteration` under `root`; returns the loop state saved with it.

    A shard that cannot be read is an error naming the file and the previous complete iteration to pass as
    `--ckpt-step` (on every rank, whichever rank failed). `on_schedule(name, trainable, state)`, when given, sees
    each role's state before its optimizer and LR schedule are restored (to reconcile the schedule with the
    command line).
    """
    with _on_device(roles):
        return _load(root, roles, iteration, load_optim, load_rng, on_schedule)


def _load(root: str, roles: Dict[str, object], iteration: int, load_optim: bool, load_rng: bool,
          on_schedule) -> dict:
    tp_rank, pp_rank, tp, pp = _layout()
    loop_state = None
    for name, trainable in roles.items():
        role_root = os.path.join(root, name)
        ep, _, ep_rank = layout.model_expert_layout(trainable.module)
        _check_saved_layout(name, role_root, iteration, (tp, pp, ep), list(roles))
        state, error = None, None
        try:
            state = layout.load_shard(role_root, tp_rank, pp_rank, iteration, ep_rank, weights_only=False)
        except Exception as exc:  # a truncated or flipped file: torch raises any of several types
            error = _damaged(role_root, iteration, tp_rank, pp_rank, exc, list(roles), ep_rank)
        _raise_on_every_rank(error)
        if "lora" in state and not getattr(trainable, "is_lora", False):
            raise CheckpointError(f"--load {root}: the {name} checkpoint holds LoRA adapters (targets "
                                  f"{' '.join(state['lora']['config']['target_modules'])}), not full weights; pass "
                                  "the --lora-* flags it was trained with")
        if getattr(trainable, "is_lora", False):
            # before the optimizer state is read: another LoRA config, base or a full checkpoint is named as such,
            # not as a distrib_optim.pt that does not fit (whose fix, --no-load-optim, would not help)
            trainable.check_checkpoint(state.get("lora"))
        parameter_state, source = None, ""
        if load_optim and "optimizer" not in state:
            raise CheckpointError(f"{name}: iteration {iteration} under {role_root} holds no optimizer state (it "
                                  "was saved with --no-save-optim); resume with --no-load-optim (its weights, a "
                                  "fresh optimizer and LR schedule) or --finetune")
        if load_optim:
            parameter_state, source = _read_parameter_state(name, trainable, state, role_root, iteration, roles)
        if on_schedule is not None and load_optim:
            on_schedule(name, trainable, state)
        trainable.load_state_dict(state, load_optim=load_optim, **(
            dict(parameter_state=parameter_state, source=source) if _distributed_optimizers(trainable) else {}))
        loop_state = state["data_position"]
        if load_rng:
            _set_rng_state(_rng_state_of_rank(state["rng_state"]))
    return loop_state


def _rng_state_of_rank(states: list):
    """This DP rank's saved RNG state; at another DP size than the checkpoint's (e.g. another context-parallel
    size at the same world size) DP rank 0's for every rank, as Megatron-LM does without
    --data-parallel-random-init (rollouts draw from per-sample streams, which no RNG state holds)."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return states[rank] if len(states) == dp else states[0]


def _check_saved_layout(name: str, role_root: str, iteration: int, ours, role_names) -> None:
    """The same error on every rank when `iteration` of a role was saved at another TP / PP / EP than this run's (each
    rank would otherwise fail its own way: a size mismatch on one, a missing shard on another), or lacks shard
    folders or files (with the `--ckpt-step` of the last intact iteration)."""
    error = None
    try:
        saved = layout.read_layout(layout.checkpoint_dir(role_root, iteration))
    except (OSError, ValueError) as exc:
        root = os.path.dirname(os.path.abspath(role_root))
        error = (f"{name}: iteration {iteration} under {role_root} is incomplete ({exc}); "
                 f"{_fallback(root, role_names, iteration)}")
    else:
        if (saved.tp, saved.pp, saved.ep) != tuple(ours):
            tp, pp, ep = ours
            error = (f"{name}: iteration {iteration} under {role_root} was saved at TP {saved.tp}, PP {saved.pp}, EP "
                     f"{saved.ep}; this run is TP {tp}, PP {pp}, EP {ep}: run at the layout it was saved with, or "
                     "reshard it with convert_ckpt.py --load-model-type mg --save-model-type mg "
                     f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp} into a new --load")
    _raise_on_every_rank(error)


def _raise_on_every_rank(error: Optional[str]) -> None:
    """A problem found on some ranks stops all of them (with every rank's message), before any collective that
    the failed ranks would never join."""
    errors = gather_messages(error)
    if errors:
        raise CheckpointError(errors[0].split(": ", 1)[1] if len(errors) == 1 else "; ".join(errors))


def _read_parameter_state(name: str, trainable, state: dict, role_root: str, iteration: int, roles):
    """The distributed optimizer's `distrib_optim.pt` for this rank (None where another rank reads it) and its
    path. A checkpoint saved with the other kind of optimizer, a missing or unreadable file, or one that does not
    fit the model is an error on every rank, naming the file and the fix."""
    saved = getattr(state.get("args"), "use_distributed_optimizer", False)
    ours = bool(_distributed_optimizers(trainable))
    if bool(saved) != ours:
        had = lambda flag: ("with" if flag else "without") + " --use-distributed-optimizer"  # noqa: E731
        raise CheckpointError(
            f"{name}: the checkpoint of iteration {iteration} under {role_root} was saved {had(saved)}, this run is "
            f"{had(ours)}: its optimizer state does not load into this optimizer. Run {had(saved)} as it was saved, "
            "or pass --no-load-optim to keep its weights and restart the optimizer")
    if not ours:
        return None, ""
    tp_rank, pp_rank, _, _ = _layout()
    ep_rank = layout.model_expert_layout(trainable.module)[2]
    ckpt_dir = layout.checkpoint_dir(role_root, iteration)
    found = layout.read_layout(ckpt_dir)
    path = layout.optimizer_state_path(ckpt_dir, tp_rank, pp_rank, found.pp, ep_rank, found.ep)
    parameter_state, error = None, None
    if trainable.reads_parameter_state():
        try:
            parameter_state = layout.load_file(path)  # tensors, dtypes and numbers only: weights_only
        except Exception as exc:  # missing, truncated or flipped
            error = _damaged(role_root, iteration, tp_rank, pp_rank, exc, list(roles), ep_rank, path=path)
        else:
            problem = trainable.parameter_state_problem(parameter_state)
            saved_dp = getattr(state.get("args"), "data_parallel_size", None)
            dp = parallel_state.get_data_parallel_world_size()
            if problem:
                error = (f"{path} does not fit this {name} ({problem}); it was saved at data-parallel size {saved_dp}, "
                         f"this run has {dp}: resume with the model and precision it was saved with, or pass "
                         "--no-load-optim to keep the weights and restart the optimizer")
            elif saved_dp is not None and saved_dp != dp and is_rank_0():
                print(f"{name}: the distributed optimizer's state was saved at data-parallel size {saved_dp}; "
                      f"resharded to {dp}", flush=True)
    _raise_on_every_rank(error)
    return parameter_state, path


def _damaged(role_root: str, iteration: int, tp_rank: int, pp_rank: int, exc: BaseException, role_names,
             ep_rank: int = 0, path: Optional[str] = None) -> str:
    root = os.path.dirname(os.path.abspath(role_root))
    try:
        found = layout.read_layout(layout.checkpoint_dir(role_root, iteration))
        path = path or layout.shard_path(layout.checkpoint_dir(role_root, iteration), tp_rank, pp_rank, found.pp,
                                         ep_rank, found.ep)
    except layout.CheckpointNotFoundError as missing:
        path = path or str(missing)
    return f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}): the checkpoint of iteration " \
           f"{iteration} is damaged; {_fallback(root, role_names, iteration)}"


def _fallback(root: str, role_names, iteration: int) -> str:
    """The `--ckpt-step` of the newest iteration before `iteration` whose every role has all its shards."""
    for earlier in reversed([i for i in complete_iterations(root, role_names) if i < iteration]):
        try:
            for name in role_names:
                layout.read_layout(layout.checkpoint_dir(os.path.join(root, name), earlier))
        except (OSError, ValueError):
            continue
        return f"resume from the previous complete one with --ckpt-step {earlier}"
    return "there is no earlier complete checkpoint to fall back on"


# ---------------------------------------------------------------------------------------------- the --save dir
def check_save_dir(save: str, roles: Dict[str, object]) -> None:
    """Before any training: the disk of --save (which `WriterLock` has created and written) has room for a
    checkpoint of `roles`.

    The size is the trained weights plus optimizer state (Adam's two moments; fp32 main copies for bf16/fp16) of
    every rank that writes (DP rank 0), summed over the job.
    """
    local = 0
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        for trainable in roles.values():
            for param in trainable.module.parameters():
                if not param.requires_grad:
                    continue  # a LoRA run's frozen base is not saved
                per_value = param.element_size() + 8 + (4 if param.dtype != torch.float32 else 0)
                local += param.numel() * per_value
    total = torch.tensor([local], dtype=torch.float64, device=device.current_device())
    if dist.is_initialized():
        dist.all_reduce(total)
    needed = int(total.item())
    problem = None
    if is_rank_0():
        problem = _save_dir_problem(save, needed)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)


def _size(nbytes: int) -> str:
    """Bytes in the largest unit that keeps them above 1 (GiB, MiB, KiB, B)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _save_dir_problem(save: str, needed: int) -> Optional[str]:
    free = shutil.disk_usage(save).free
    if free < needed:
        return (f"--save {save}: its disk has {_size(free)} free, but one checkpoint of this run needs about "
                f"{_size(needed)}; free space or pass another --save")
    return None
