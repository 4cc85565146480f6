"""`checkpoint/run_record.py` and its readers in `checkpoint/training.py`, on checkpoint trees built here (tiny
shards, real trackers, records written by `run_record.write`): what a resume refuses before it reads or writes
anything, and what it says. (The real writer, `training.save`, records a run's stage: tests/dist/
test_stages_checkpoint_safety.py resumes a real trl_ppo save as grpo.)

* another stage's checkpoint is refused by name, by its record and, for a checkpoint written before records,
  by the role it holds that the stage does not train (grpo over a trl_ppo save used to resume it and move its
  tracker to iterations without the critic); --finetune from it is allowed;
* a lost role directory is named as lost, not as another stage's;
* a checkpoint without a record still resumes, and the resume says what it cannot check;
* another reference model is refused unless --allow-reference-change (then a line says so); another reward model
  or teacher (--teacher-load) likewise, a LoRA student's teacher too;
* a missing or empty shard folder names the `--ckpt-step` of the last intact iteration.
"""

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint import run_record, training
from mindspeed_llm.checkpoint.errors import CheckpointError

REF = {"path": "/models/ref", "fingerprint": "a" * 64}


RM = {"path": "/models/rm", "fingerprint": "d" * 64}


TEACHER = {"path": "/models/teacher", "fingerprint": "f" * 64}
JUDGE = {"path": "/models/judge", "fingerprint": "b" * 64}


def record(stage, reference=REF, layout_=(1, 1, 1), reward_model=None, teacher=None, judge=None, **bases):
    roles = run_record.STAGE_ROLES[stage]
    initial = {"actor": {"path": "/models/ref", "fingerprint": "a" * 64, "lora": None},  # the reference's weights
               "critic": {"path": "/models/rm", "fingerprint": "d" * 64, "lora": None}}
    return run_record.make_record(stage, roles, layout_, {r: bases.get(r, initial[r]) for r in roles}, reference,
                                  reward_model, teacher, judge)


def save_tree(root: Path, stage: str, iterations=(1, 2, 3), recorded=True, tp=1) -> Path:
    """`root` as `training.save` leaves it: per role iter_* folders with one shard per TP rank (its args only) and
    the record, each role's tracker, the top-level tracker last."""
    for role in run_record.STAGE_ROLES[stage]:
        for it in iterations:
            folder = Path(layout.checkpoint_dir(root / role, it))
            for tp_rank in range(tp):
                args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
                layout.save_file({"args": args, "iteration": it}, layout.shard_path(str(folder), tp_rank, 0, 1))
            if recorded:
                run_record.write(str(folder), record(stage, layout_=(tp, 1, 1)))
        layout.write_latest(str(root / role), iterations[-1])
    layout.write_latest(str(root), iterations[-1])
    return root


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "before_records"])
def test_grpo_never_resumes_a_trl_ppo_checkpoint(tmp_path, recorded):
    root = save_tree(tmp_path / "ppo", "trl_ppo", recorded=recorded)
    before = snapshot(root)
    for step in (None, 2):
        with pytest.raises(CheckpointError) as e:
            training.resume_iteration(str(root), ["actor"], "grpo", save=str(root), ckpt_step=step)
        message = str(e.value)
        assert f"is a checkpoint of --stage trl_ppo (actor and critic" in message, message
        assert "--stage grpo does not resume another stage's checkpoint" in message
        assert "to resume it run --stage trl_ppo" in message
        assert f"--finetune --load {root} with a new --save" in message
    assert snapshot(root) == before
    # a new grpo run from its actor (--finetune, its own --save) is allowed
    assert training.resume_iteration(str(root), ["actor"], "grpo", save=str(tmp_path / "new"), finetune=True) == 3


def test_trl_ppo_refuses_a_grpo_checkpoint_by_its_record(tmp_path):
    root = save_tree(tmp_path / "grpo", "grpo", iterations=(1,))
    with pytest.raises(CheckpointError) as e:
        training.resume_iteration(str(root), ["actor", "critic"], "trl_ppo", save=str(root))
    message = str(e.value)
    assert "is a checkpoint of --stage grpo (actor;" in message and "run_record.json says so" in message
    assert f"start trl_ppo from its actor pass --ref-model {root / 'actor'}" in message


def test_a_lost_role_directory_is_named_lost_not_another_stage(tmp_path):
    root = save_tree(tmp_path / "ppo", "trl_ppo")
    shutil.rmtree(root / "critic")
    with pytest.raises(CheckpointError) as e:
        training.resume_iteration(str(root), ["actor", "critic"], "trl_ppo", save=str(root))
    message = str(e.value)
    assert "saved by --stage trl_ppo with actor and critic" in message, message
    assert f"{root / 'critic'} is missing (moved or deleted?)" in message and "another stage" not in message


def test_a_checkpoint_without_a_record_resumes_and_says_what_is_unknown(tmp_path):
    root = save_tree(tmp_path / "old", "trl_ppo", recorded=False)
    assert training.resume_iteration(str(root), ["actor", "critic"], "trl_ppo", save=str(root)) == 3
    lines = run_record.resume_lines(str(root), 3, record("trl_ppo"))
    assert len(lines) == 1 and "saved before checkpoints recorded their stage" in lines[0]
    assert "not checked" in lines[0]


def test_another_reference_model_is_refused_unless_allowed(tmp_path):
    root = save_tree(tmp_path / "grpo", "grpo")
    same = record("grpo")
    assert run_record.resume_lines(str(root), 3, same) == []
    other = record("grpo", reference={"path": "/models/other", "fingerprint": "b" * 64})
    before = snapshot(root)
    with pytest.raises(CheckpointError) as e:
        run_record.resume_lines(str(root), 3, other)
    message = str(e.value)
    assert "the reference model (the KL term's) of iteration 3 was /models/ref" in message
    assert "/models/other holds other weights" in message and "--allow-reference-change" in message
    assert snapshot(root) == before
    lines = run_record.resume_lines(str(root), 3, other, allow_reference_change=True)
    assert lines == ["--allow-reference-change: the reference model (the KL term's) of iteration 3 was /models/ref; "
                     "this run's /models/other holds other weights; the KL term is computed with it from "
                     "iteration 4 on"]
    moved = record("grpo", reference={"path": "/copies/ref", "fingerprint": "a" * 64})
    assert run_record.resume_lines(str(root), 3, moved) == [
        "the reference model moved from /models/ref to /copies/ref (the same weights)"]
    # a LoRA run's reference is the actor's base: its adapters' own check refuses another one, with its message
    lora = dict(other, bases={"actor": {**other["bases"]["actor"], "lora": {"r": 8}}})
    assert run_record.resume_lines(str(root), 3, lora) == []
    # another layout: fingerprints are not comparable (training.load refuses the layout by name)
    assert run_record.resume_lines(str(root), 3, record("grpo", reference=other["reference"], layout_=(2, 1, 1))) == []


def test_a_full_weight_critic_started_from_other_weights_is_noted(tmp_path):
    root = save_tree(tmp_path / "ppo", "trl_ppo")
    ours = record("trl_ppo", critic={"path": "/models/rm2", "fingerprint": "c" * 64, "lora": None})
    assert run_record.resume_lines(str(root), 3, ours) == [
        "critic: started from /models/rm; this run's /models/rm2 holds other weights, which the resume replaces "
        "with the checkpoint's critic"]


def test_a_damaged_record_is_named(tmp_path):
    root = save_tree(tmp_path / "grpo", "grpo")
    path = Path(layout.checkpoint_dir(str(root / "actor"), 3)) / run_record.RECORD_FILE
    path.write_text("{")
    with pytest.raises(CheckpointError, match=f"{path} cannot be read .* --ckpt-step"):
        training.resume_iteration(str(root), ["actor"], "grpo", save=str(root))


def test_missing_or_empty_shard_folders_name_the_last_intact_iteration(tmp_path):
    root = save_tree(tmp_path / "tp2", "grpo", iterations=(1, 2, 3, 4), tp=2)
    actor = root / "actor"
    shutil.rmtree(Path(layout.checkpoint_dir(str(actor), 4)) / "mp_rank_01")  # the last shard folder lost
    for shard in (Path(layout.checkpoint_dir(str(actor), 3)) / "mp_rank_00").iterdir():
        shard.unlink()  # an empty shard folder
    for folder in ("mp_rank_00", "mp_rank_01"):
        shutil.rmtree(Path(layout.checkpoint_dir(str(actor), 2)) / folder)  # no shard folder at all
    for iteration, hint in ((4, "--ckpt-step 1"), (3, "--ckpt-step 1"), (2, "--ckpt-step 1")):
        with pytest.raises(CheckpointError) as e:
            training._check_saved_layout("actor", str(actor), iteration, (2, 1, 1), ["actor"])
        message = str(e.value)
        assert f"iteration {iteration} under {actor} is incomplete" in message, message
        assert f"resume from the previous complete one with {hint}" in message and "saved at TP" not in message
    assert "mp_rank_01/model_optim_rng.pt is missing" in _message(actor, 4)
    assert "mp_rank_00/model_optim_rng.pt is missing" in _message(actor, 3)
    assert "no mp_rank_* shard folders" in _message(actor, 2)
    training._check_saved_layout("actor", str(actor), 1, (2, 1, 1), ["actor"])  # intact


def _message(actor: Path, iteration: int) -> str:
    with pytest.raises(CheckpointError) as e:
        training._check_saved_layout("actor", str(actor), iteration, (2, 1, 1), ["actor"])
    return str(e.value)


def test_damaged_shard_falls_back_past_incomplete_iterations(tmp_path):
    root = save_tree(tmp_path / "run", "grpo", iterations=(1, 2, 3))
    shutil.rmtree(Path(layout.checkpoint_dir(str(root / "actor"), 2)) / "mp_rank_00")
    message = training._damaged(str(root / "actor"), 3, 0, 0, EOFError("truncated"), ["actor"])
    assert "the checkpoint of iteration 3 is damaged; resume from the previous complete one with --ckpt-step 1" \
        in message


def test_the_record_is_json_beside_the_shards(tmp_path):
    folder = tmp_path / "iter"
    folder.mkdir()
    written = record("trl_ppo")
    run_record.write(str(folder), written)
    assert sorted(p.name for p in folder.iterdir()) == [run_record.RECORD_FILE]  # no temp file left
    assert json.loads((folder / run_record.RECORD_FILE).read_text()) == written
    assert written["roles"] == ["actor", "critic"] and written["reference"] == REF
    assert run_record.combined_fingerprint("x") == hashlib.sha256(b"x").hexdigest()  # one process: its own shard


def test_a_full_weight_fingerprint_sees_every_weight_and_leaves_them_offloadable():
    """`base_fingerprint(frozen_only=False)` (a full-weight role's base) covers the trained weights, which the LoRA
    fingerprint skips, and changes with any of them; afterwards --offload-train-param can still free each weight's
    storage (a `.numpy()` of a view of it made the storage non-resizable: the offload then failed)."""
    from mindspeed_llm.rl.update.lora import base_fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    empty = hashlib.sha256().hexdigest()
    assert base_fingerprint(model) == empty  # every weight trains: the frozen-only fingerprint sees none
    before = base_fingerprint(model, frozen_only=False)
    assert before != empty and base_fingerprint(model, frozen_only=False) == before
    with torch.no_grad():
        model[1].bias[0] += 1
    assert base_fingerprint(model, frozen_only=False) != before
    for param in model.parameters():
        param.data.untyped_storage().resize_(0)  # what rl/update/model_state.offload does


def test_another_reward_model_is_refused_unless_allowed(tmp_path):
    """trl_ppo's reward model scores every response: another one mid-run changes the scores, as another reference
    changes the KL term (a checkpoint that recorded none, written before reward models were recorded, is unchecked)."""
    root = save_tree(tmp_path / "ppo", "trl_ppo")
    for folder in root.glob("*/iter_*"):  # the tree's records, now with the reward model
        run_record.write(str(folder), record("trl_ppo", reward_model=RM))
    assert run_record.resume_lines(str(root), 3, record("trl_ppo", reward_model=RM)) == []
    other = record("trl_ppo", reward_model={"path": "/models/rm2", "fingerprint": "e" * 64})
    with pytest.raises(CheckpointError, match=r"the reward model \(the score's\) of iteration 3 was /models/rm; this "
                                              r"run's /models/rm2 holds other weights .* changes the scores mid-run: "
                                              r"pass the --reward-model it was trained with"):
        run_record.resume_lines(str(root), 3, other)
    assert run_record.resume_lines(str(root), 3, other, allow_reference_change=True)[0].startswith(
        "--allow-reference-change: the reward model (the score's) of iteration 3 was /models/rm")
    old = save_tree(tmp_path / "old", "trl_ppo")  # records without a reward model: not compared
    assert run_record.resume_lines(str(old), 3, other) == []


# the frozen models no trained role has as its base: (record key, its entry, how the messages name it, its flag,
# what another one changes, its verb)
NOT_A_BASE = {
    "teacher": (TEACHER, "the teacher (distillation's)", "--teacher-load", "the distillation signal", "is"),
    "judge": (JUDGE, "the judge (the verdicts')", "--judge-load", "the scores", "are"),
}


@pytest.mark.parametrize("key", sorted(NOT_A_BASE))
@pytest.mark.parametrize("stage", ["grpo", "trl_ppo"])
def test_another_teacher_or_judge_is_refused_unless_allowed(tmp_path, stage, key):
    """The teacher scores every sampled token (on-policy distillation), the judge's verdicts enter the score: another
    --teacher-load mid-run changes the distillation signal, another --judge-load the scores, as another reference
    changes the KL term; a LoRA run's are checked too (they are no role's base, unlike the reference); a checkpoint
    that recorded none is unchecked."""
    entry, named, flag, changes, verb = NOT_A_BASE[key]
    path = entry["path"]
    root = save_tree(tmp_path / stage, stage)
    for folder in root.glob("*/iter_*"):  # the tree's records, now with the teacher / judge
        run_record.write(str(folder), record(stage, **{key: entry}))
    assert run_record.resume_lines(str(root), 3, record(stage, **{key: entry})) == []
    other = record(stage, **{key: {"path": path + "2", "fingerprint": "9" * 64}})
    lora_other = dict(other, bases={r: {**b, "lora": {"r": 8}} for r, b in other["bases"].items()})
    before = snapshot(root)
    for ours in (other, lora_other):
        with pytest.raises(CheckpointError, match=re.escape(
                f"{named} of iteration 3 was {path}; this run's {path}2 holds other weights") + ".* " + re.escape(
                f"changes {changes} mid-run: pass the {flag} it was trained with, or --allow-reference-change")):
            run_record.resume_lines(str(root), 3, ours)
    assert snapshot(root) == before
    assert run_record.resume_lines(str(root), 3, other, allow_reference_change=True) == [
        f"--allow-reference-change: {named} of iteration 3 was {path}; this run's {path}2 holds other weights; "
        f"{changes} {verb} computed with it from iteration 4 on"]
    moved = record(stage, **{key: {"path": "/copies/" + key, "fingerprint": entry["fingerprint"]}})
    assert run_record.resume_lines(str(root), 3, moved) == [
        f"{named.split(' (')[0]} moved from {path} to /copies/{key} (the same weights)"]
    old = save_tree(tmp_path / "old", stage)  # records without one: not compared
    assert run_record.resume_lines(str(old), 3, other) == []
