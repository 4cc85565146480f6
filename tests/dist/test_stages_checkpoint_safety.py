"""A checkpoint is never restarted over, and a damaged one is never mistaken for none (issue 27's data-loss paths).

One trl_ppo run saves iterations 1-3 into a --save root; each case copies that root, damages the copy the way a
user or a crash could, and runs the same `--load X --save X` command line on it: the run must stop before training
with a message naming what is wrong and the `--ckpt-step` that works, and leave every file of X as it was. Before
this change each of them printed "holds no checkpoint yet; starting from scratch" and wrote new iterations over the
old ones (checked by running this file against the previous `training.resume_iteration`):

* only the top-level tracker deleted (iterations 1-3 complete);
* the tracker's iteration lacks the critic (`critic/iter_0000003` gone);
* the tracker holds garbage, or `release` (what `convert_ckpt.py --save-dir ROOT` used to write there);
* `convert_ckpt.py --save-model-type mg --save-dir ROOT` onto the training root is refused, ROOT unchanged;
* a run with `--save ROOT` but without `--load ROOT` (it would start at iteration 1 there), and `--finetune` into its
  own `--load` root, are refused;
* output paths under a file (--metrics-jsonl, --tensorboard-dir) are refused before any model is built;
* with the `--ckpt-step` the message offers, the run resumes, and its save removes a tracker temp file that a kill
  between write and rename left behind;
* the checkpoint's record (`checkpoint/run_record.py`, written by the real save): `--stage grpo` over this trl_ppo
  root is refused by name (it used to resume the actor and move the tracker to iterations without the critic), and
  so is a resume with another `--ref-model` (the trained actor), unless `--allow-reference-change`, which says so,
  and one with another `--reward-model` (the trained critic);
* a TP1 checkpoint resumed at TP2 gives the same named error on both ranks (before: a size mismatch on rank 0 and
  "damaged, use --ckpt-step" on rank 1).
"""

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.helpers.multiproc import posttrain_in_process, run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

ROOT = Path(__file__).resolve().parents[2]
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("safety_task"), layouts=((1, 1), (2, 1)), reward=True)


def argv(task, out: Path, *extra, iters=3):
    return ["--stage", "trl_ppo", "--ref-model", task["mg_actor_tp1pp1"], "--reward-model", task["mg_reward_tp1pp1"],
            "--tokenizer-name-or-path", task["tokenizer"], "--data-path", task["data"], "--global-batch-size", "2",
            "--micro-batch-size", "2", "--train-iters", str(iters), "--max-length", "24", "--max-new-tokens", "4",
            "--do-sample", "--seed", "5", "--lr", "1e-3", "--metrics-jsonl", str(out / "metrics.jsonl"), *extra]


def snapshot(root: Path) -> dict:
    """Every file under `root` with its content's hash (what must not change)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "run"
    (code, _, err), = posttrain_in_process([argv(task, root, "--save", str(root), "--save-interval", "1")])
    assert code == 0, err[-3000:]
    assert (root / TRACKER).read_text().strip() == "3"
    return root


def _copy(saved: Path, where: Path, damage) -> Path:
    copy = where / damage.__name__
    shutil.copytree(saved, copy)
    damage(copy)
    return copy


def tracker_deleted(root):
    (root / TRACKER).unlink()


def critic_lacks_the_latest(root):
    shutil.rmtree(root / "critic" / "iter_0000003")


def tracker_garbage(root):
    (root / TRACKER).write_text("xyz\n")


def tracker_release(root):
    (root / TRACKER).write_text("release\n")


CASES = {
    tracker_deleted: [f"{TRACKER} is missing", "pass --ckpt-step 3 to resume from its newest complete iteration"],
    critic_lacks_the_latest: ["its tracker says iteration 3, but", "critic/iter_0000003 is missing",
                              "--ckpt-step 2"],
    tracker_garbage: ["holds 'xyz', not an iteration", "--ckpt-step 3"],
    tracker_release: ["says 'release', a converted model's tracker", "--ckpt-step 3"],
}


def test_a_damaged_save_root_is_never_started_over(task, saved, tmp_path):
    copies = {damage: _copy(saved, tmp_path, damage) for damage in CASES}
    before = {damage: snapshot(copy) for damage, copy in copies.items()}
    fresh_into_saved = tmp_path / "fresh_into_saved"
    shutil.copytree(saved, fresh_into_saved)
    before_fresh = snapshot(fresh_into_saved)
    file = tmp_path / "a_file"
    file.write_text("x")
    cases = [argv(task, tmp_path / "logs" / d.__name__, "--load", str(c), "--save", str(c), "--save-interval", "1",
                  iters=4) for d, c in copies.items()]
    stages = {name: tmp_path / name for name in ("as_grpo", "other_ref", "other_ref_allowed", "other_rm")}
    for copy in stages.values():
        shutil.copytree(saved, copy)
    before_stages = {name: snapshot(copy) for name, copy in stages.items()}
    as_grpo = argv(task, tmp_path / "logs_grpo", "--load", str(stages["as_grpo"]), "--save", str(stages["as_grpo"]),
                   "--n-samples-per-prompt", "2", "--kl-coef", "0.01", iters=4)
    as_grpo[as_grpo.index("--stage") + 1] = "grpo"
    other_refs = []
    for name, extra in (("other_ref", ()), ("other_ref_allowed", ("--allow-reference-change",))):
        other = argv(task, tmp_path / f"logs_{name}", "--load", str(stages[name]), "--save", str(stages[name]),
                     *extra, iters=3)  # at --train-iters already: the allowed one resumes and trains nothing
        other[other.index("--ref-model") + 1] = str(saved / "actor")  # the trained actor: other weights
        other_refs.append(other)
    other_rm = argv(task, tmp_path / "logs_other_rm", "--load", str(stages["other_rm"]), "--save",
                    str(stages["other_rm"]), iters=3)
    other_rm[other_rm.index("--reward-model") + 1] = str(saved / "critic")  # the trained critic: other weights
    cases += [as_grpo, *other_refs, other_rm]
    cases += [
        argv(task, tmp_path / "logs_fresh", "--save", str(fresh_into_saved)),  # no --load of it
        argv(task, tmp_path / "logs_finetune", "--load", str(fresh_into_saved), "--save", str(fresh_into_saved),
             "--finetune"),
        argv(task, tmp_path, "--metrics-jsonl", str(file / "metrics.jsonl")),
        argv(task, tmp_path, "--tensorboard-dir", str(file)),
    ]
    results = posttrain_in_process(cases)
    for (damage, needles), (code, out, err) in zip(CASES.items(), results):
        assert code == 2 and "Traceback" not in err, f"{damage.__name__}: {code}\n{err[-3000:]}"
        assert "starting from scratch" not in out, damage.__name__
        for needle in needles:
            assert needle in err, f"{damage.__name__}: {needle!r} not in {err!r}"
        assert snapshot(copies[damage]) == before[damage], f"{damage.__name__}: files under --load changed"
    (code_grpo, out_grpo, err_grpo), (code_ref, _, err_ref), (code_allowed, out_allowed, err_allowed), \
        (code_rm, _, err_rm) = results[4:8]
    assert code_rm == 2 and "the reward model (the score's) of iteration 3 was" in err_rm, err_rm[-3000:]
    assert "changes the scores mid-run" in err_rm and "pass the --reward-model it was trained with" in err_rm
    # grpo over a trl_ppo save used to resume its actor and move the tracker to iterations without the critic
    assert code_grpo == 2 and "is a checkpoint of --stage trl_ppo (actor and critic" in err_grpo, err_grpo[-3000:]
    assert "run_record.json says so" in err_grpo and "--finetune --load" in err_grpo and "resumed" not in out_grpo
    assert code_ref == 2 and "the reference model (the KL term's) of iteration 3 was" in err_ref, err_ref[-3000:]
    assert f"{saved / 'actor'} holds other weights" in err_ref and "--allow-reference-change" in err_ref
    assert code_allowed == 0 and "--allow-reference-change: the reference model" in out_allowed, err_allowed[-3000:]
    for name, copy in stages.items():
        assert snapshot(copy) == before_stages[name], f"{name}: files under --load changed"
    (code_fresh, _, err_fresh), (code_ft, out_ft, err_ft), (code_jsonl, _, err_jsonl), (code_tb, _, err_tb) = \
        results[8:]
    assert code_fresh == 2 and "already holds checkpoints" in err_fresh and "this run does not resume from it" \
        in err_fresh and f"pass --load {fresh_into_saved}" in err_fresh, err_fresh[-3000:]
    # --finetune with --load = --save (a MindSpeed-LLM script resumed by adding --load): it resumes the run's own
    # checkpoints, which are at --train-iters already, so nothing trains and nothing there changes
    assert code_ft == 0 and "--finetune is overridden" in out_ft, err_ft[-3000:]
    assert f"resumed from {fresh_into_saved} at iteration 3" in out_ft and "nothing" in out_ft, out_ft[-3000:]
    assert snapshot(fresh_into_saved) == before_fresh
    assert code_jsonl == 2 and f"lies under {file}, which is a file" in err_jsonl, err_jsonl[-3000:]
    assert code_tb == 2 and f"--tensorboard-dir {file} is a file" in err_tb, err_tb[-3000:]
    for err in (err_jsonl, err_tb):  # refused before any model was built (no loading line printed)
        assert "Traceback" not in err


def test_the_offered_ckpt_step_resumes_and_the_next_save_removes_tracker_temps(task, saved, tmp_path):
    copy = _copy(saved, tmp_path, tracker_deleted)
    leftover = copy / f".{TRACKER}.tmp-4242"  # a kill between the tracker's write and its rename
    leftover.write_text("3\n")
    (code, out, err), = posttrain_in_process([argv(task, tmp_path / "logs", "--load", str(copy), "--save",
                                                   str(copy), "--save-interval", "1", "--ckpt-step", "3", iters=4)])
    assert code == 0, err[-3000:]
    assert "resumed from" in out and "at iteration 3" in out
    assert (copy / TRACKER).read_text().strip() == "4" and not leftover.exists()


def test_convert_refuses_a_training_root(saved, tmp_path):
    import convert_ckpt

    copy = tmp_path / "root"
    shutil.copytree(saved, copy)
    before = snapshot(copy)
    code = convert_ckpt.main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir",
                              str(saved / "actor"), "--save-dir", str(copy), "--no-progress"])
    assert code == 1 and snapshot(copy) == before


def _tp2_resume(rank, world_size, argv_):
    from tests.helpers.multiproc import _posttrain_main_cases

    return _posttrain_main_cases(rank, world_size, [argv_])[0]


def test_a_tp1_save_resumed_at_tp2_says_so_on_every_rank(task, saved, tmp_path):
    copy = tmp_path / "root"
    shutil.copytree(saved, copy)
    command = argv(task, tmp_path / "logs", "--load", str(copy), "--save", str(copy), "--tensor-model-parallel-size",
                   "2", iters=4)
    command[command.index("--ref-model") + 1] = task["mg_actor_tp2pp1"]  # the initial models at the run's TP
    command[command.index("--reward-model") + 1] = task["mg_reward_tp2pp1"]
    results = run_distributed(_tp2_resume, 2, command)
    for rank, (code, _, err) in enumerate(results):
        assert code == 2 and "was saved at TP 1, PP 1, EP 1; this run is TP 2, PP 1, EP 1" in err, \
            f"rank {rank}: {err[-3000:]}"
        assert "damaged" not in err and "Traceback" not in err
