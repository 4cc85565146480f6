"""What a stage checkpoint records about the run that wrote it, and what a resume checks against it.

Every role's folder of a published iteration holds `run_record.json`, written into the staging directory with the
shards and published with them (`training.save`)::

    {"version": 1, "stage": "trl_ppo", "roles": ["actor", "critic"], "layout": [TP, PP, EP],
     "bases": {"actor": {"path": ..., "fingerprint": ..., "lora": {...} | null}, "critic": {...}},
     "reference": {"path": ..., "fingerprint": ...} | null,
     "reward_model": {"path": ..., "fingerprint": ...} | null,
     "teacher": {"path": ..., "fingerprint": ...} | null,
     "judge": {"path": ..., "fingerprint": ...} | null}

`bases`: the checkpoint each trained role was started from (--ref-model / --load / --reward-model) and a fingerprint
of its weights (`rl/update/lora.base_fingerprint`'s strided sample, over every rank's shard); `lora`: the adapters' config
(their own check is `LoRATrainableModel.check_checkpoint`). `reference`: the frozen model the KL term is computed
against (None: no reference, --kl-coef 0); `reward_model`: the frozen model that scores the responses (None: rule
rewards alone; a checkpoint written before it was recorded has no key: unchecked); `teacher`: the frozen
--teacher-load of on-policy distillation, and `judge`: the frozen --judge-load whose verdicts enter the score (None:
none; unchecked in older checkpoints, likewise). A fingerprint
depends on the layout, so it is compared only at the layout it was taken at (another layout is refused by
`training.load` anyway).

The readers: `training.resume_iteration` (a run never resumes into, or moves the tracker of, another stage's
checkpoint; a lost role directory is named as such) and `resume_lines` (another reference model, reward model,
teacher or judge is refused unless --allow-reference-change). A checkpoint written before records existed has none: its
stage, bases and reference are unknown, and the resume says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint.errors import CheckpointError

RECORD_FILE = "run_record.json"
RECORD_VERSION = 1
STAGE_ROLES = {"grpo": ("actor",), "trl_ppo": ("actor", "critic")}  # what each stage trains (and saves)


# the frozen models a run is judged against: (record key, what it is, its flag, what another one changes)
FROZEN_MODELS = (("reference", "the reference model (the KL term's)", "--ref-model", "the KL term"),
                 ("reward_model", "the reward model (the score's)", "--reward-model", "the scores"),
                 ("teacher", "the teacher (distillation's)", "--teacher-load", "the distillation signal"),
                 ("judge", "the judge (the verdicts')", "--judge-load", "the scores"))
# a LoRA run's frozen model that is a trained role's base, which its adapters cannot leave (`check_checkpoint`)
LORA_BASE_OF = {"reference": "actor", "reward_model": "critic"}


def make_record(stage: str, roles: Sequence[str], layout_: Sequence[int], bases: Dict[str, dict],
                reference: Optional[dict], reward_model: Optional[dict] = None, teacher: Optional[dict] = None,
                judge: Optional[dict] = None) -> dict:
    return {"version": RECORD_VERSION, "stage": stage, "roles": list(roles), "layout": [int(v) for v in layout_],
            "bases": bases, "reference": reference, "reward_model": reward_model, "teacher": teacher,
            "judge": judge}


def combined_fingerprint(local: str) -> str:
    """One fingerprint of a model from every rank's fingerprint of its shard: the distinct shards, in sorted order
    (data-parallel replicas are one; the TP / PP / EP layout is part of it)."""
    import torch.distributed as dist

    found = [local]
    if dist.is_available() and dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)
    return hashlib.sha256("\n".join(sorted(set(found))).encode()).hexdigest()


def write(ckpt_dir: str, record: dict) -> None:
    """`record` into a (staging) checkpoint directory of one role, through a temp name."""
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)

    layout.write_atomically(os.path.join(ckpt_dir, RECORD_FILE), dump)


def read(root: str, role_names: Sequence[str], iteration: int) -> Tuple[Optional[dict], Optional[str]]:
    """(the record of `iteration` under `root`, its path) from the first role folder that has one; (None, None) when
    none has (a checkpoint written before records, or no such iteration). An unreadable record is an error naming
    it (a published one is never half-written)."""
    for name in dict.fromkeys((*role_names, "actor", "critic")):
        path = os.path.join(layout.checkpoint_dir(os.path.join(root, name), iteration), RECORD_FILE)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                record = json.load(f)
            if not isinstance(record, dict) or "stage" not in record:
                raise ValueError("no stage in it")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} cannot be read ({exc}): the record of iteration {iteration} is damaged; "
                                  "pass --ckpt-step with an earlier iteration") from None
        return record, path
    return None, None


def stage_problem(load: str, iteration: int, stage_name: str, role_names: Sequence[str]) -> Optional[str]:
    """Why `--stage stage_name` must not resume iteration `iteration` of `load` (None: it may): another stage wrote
    it (by its record, or, without one, by a role this stage does not train), or a role directory it recorded is
    gone."""
    record, where = read(load, role_names, iteration)
    roles = list(role_names)
    if record is None:
        extra = [r for r in ("actor", "critic") if r not in roles and
                 os.path.isfile(os.path.join(load, r, layout.TRACKER_FILE))]
        if not extra:
            return None
        writer = next((s for s, r in STAGE_ROLES.items() if set(r) == set(roles) | set(extra)), "another stage")
        return _another_stage(load, iteration, writer, roles + extra, stage_name, roles,
                              f"it holds {', '.join(os.path.join(load, r) for r in extra)}, which --stage "
                              f"{stage_name} does not train")
    if record["stage"] != stage_name:
        return _another_stage(load, iteration, record["stage"], record.get("roles", []), stage_name, roles,
                              f"{where} says so")
    lost = [r for r in record.get("roles", roles) if not os.path.isdir(os.path.join(load, r))]
    if lost:
        return (f"its iteration {iteration} was saved by --stage {stage_name} with {' and '.join(record['roles'])}, "
                f"but {', '.join(os.path.join(load, r) for r in lost)} is missing (moved or deleted?): put it back, "
                f"or start a new run from the rest with --finetune and another --save")
    return None


def _another_stage(load, iteration, writer, writer_roles, stage_name, roles, evidence) -> str:
    start = (f"--finetune --load {load} with a new --save (the actor's weights; iteration, optimizer and data start "
             "fresh)" if set(roles) <= set(writer_roles) else
             f"--ref-model {os.path.join(load, 'actor')} with a new --save (or convert_ckpt.py its actor)")
    return (f"iteration {iteration} is a checkpoint of --stage {writer} ({' and '.join(writer_roles)}; {evidence}), "
            f"and --stage {stage_name} does not resume another stage's checkpoint (its saves would move the tracker "
            f"to iterations the {writer} run cannot resume): to resume it run --stage {writer}; to start {stage_name} "
            f"from its actor pass {start}")


def resume_lines(load: str, iteration: int, ours: dict, allow_reference_change: bool = False,
                 role_names: Sequence[str] = ("actor", "critic")) -> List[str]:
    """The startup lines of resuming iteration `iteration` of `load` with this run's record `ours` (`make_record`):
    a checkpoint without a record (unknown: nothing checked), a reference or base that moved (same weights), an
    allowed reference change. Another reference model raises `CheckpointError` unless `allow_reference_change`."""
    saved, where = read(load, role_names, iteration)
    if saved is None:
        return [f"--load {load} iteration {iteration} was saved before checkpoints recorded their stage, bases and "
                "reference model: they are unknown and not checked (resume with the --ref-model it was trained "
                "with; the next save records them)"]
    same_layout = list(saved.get("layout") or ()) == list(ours["layout"])
    lines = []
    bases = ours.get("bases") or {}
    for key, what_it_is, flag, changes in FROZEN_MODELS:
        theirs, mine = saved.get(key), ours.get(key)
        # a LoRA run's reference is the actor's base and its reward model the critic's, which their adapters cannot
        # leave (`check_checkpoint` names it); the teacher is no role's base
        lora_base = key in LORA_BASE_OF and bool((bases.get(LORA_BASE_OF[key]) or {}).get("lora"))
        if not (theirs and mine and same_layout) or lora_base:
            continue
        if theirs["fingerprint"] != mine["fingerprint"]:
            what = (f"{what_it_is} of iteration {iteration} was {theirs['path']}; this run's {mine['path']} holds "
                    "other weights")
            if not allow_reference_change:
                raise CheckpointError(
                    f"--load {load}: {what} ({where}), and a resume with another one changes {changes} mid-run: "
                    f"pass the {flag} it was trained with, or --allow-reference-change to continue with this one")
            lines.append(f"--allow-reference-change: {what}; {changes} {'are' if key in ('reward_model', 'judge') else 'is'} "
                         f"computed with it from iteration {iteration + 1} on")
        elif theirs["path"] != mine["path"]:
            lines.append(f"{what_it_is.split(' (')[0]} moved from {theirs['path']} to {mine['path']} (the same "
                         "weights)")
    theirs = saved.get("reference")
    for name, base in (ours.get("bases") or {}).items():
        before = (saved.get("bases") or {}).get(name)
        if not before or not same_layout or base.get("lora") or before.get("lora"):
            continue  # LoRA adapters check their own base (`LoRATrainableModel.check_checkpoint`)
        if before["fingerprint"] != base["fingerprint"] and before["path"] != (theirs or {}).get("path"):
            lines.append(f"{name}: started from {before['path']}; this run's {base['path']} holds other weights, "
                         f"which the resume replaces with the checkpoint's {name}")
    return lines
