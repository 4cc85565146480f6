"""`rl/trainer.py`'s checks without a process group: the entropy guard of --check-for-divergence (log V, hand-computed)
and the output paths found unwritable before any model is built. (The loop itself, end to end:
tests/dist/test_stages*.py.)"""

import math

import pytest

from mindspeed_llm.checkpoint.errors import DivergenceError
from mindspeed_llm.rl.settings import Settings, with_values
from mindspeed_llm.rl.preflight import finetune_on_own_save, output_path_problem
from mindspeed_llm.rl.trainer import EntropyGuard, fresh_on_resume


def test_entropy_rising_to_the_uniform_maximum_is_divergence():
    guard = EntropyGuard(vocab_size=256)  # log 256 = 5.545
    guard.check(3.0)  # the first iteration, below 0.9 log V = 4.99
    guard.check(5.4)  # 0.974 log V: not yet uniform
    guard.check(None)  # a rank without the metric (not the last pipeline stage)
    with pytest.raises(DivergenceError, match=r"rose from 3\.000 to 5\.500, the uniform maximum log 256 = 5\.545"):
        guard.check(5.5)  # 0.992 log V


def test_a_policy_that_starts_uniform_is_not_flagged():
    guard = EntropyGuard(vocab_size=256)
    for entropy in (0.95 * math.log(256), math.log(256)):  # a random model: near uniform from the start
        guard.check(entropy)


def _args(**over):
    """The run's settings with these fields (in every part that has them)."""
    return with_values(Settings(), **{"stage": "trl_ppo", **over})


def _checkpoint(**over):
    return _args(**over).checkpoint


def test_output_paths_of_the_wrong_kind_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    assert output_path_problem(_args(metrics_jsonl=str(tmp_path))) == \
        f"--metrics-jsonl {tmp_path} is a directory; pass a file"
    assert output_path_problem(_args(save=str(tmp_path / "file"))) == \
        f"--save {tmp_path / 'file'} is a file; pass a directory"
    under_a_file = tmp_path / "file" / "tb"
    assert output_path_problem(_args(tensorboard_dir=str(under_a_file))) == \
        f"--tensorboard-dir {under_a_file} lies under {tmp_path / 'file'}, which is a file; pass a path in a " \
        "directory"
    assert output_path_problem(_args(metrics_jsonl=str(tmp_path / "new" / "m.jsonl"), save=str(tmp_path / "s"))) is None


def test_a_save_holding_checkpoints_is_refused_unless_the_run_resumes_it(tmp_path):
    save = tmp_path / "save"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    problem = output_path_problem(_args(save=str(save)))
    assert problem.startswith(f"--save {save} already holds checkpoints (") and "this run does not resume" in problem
    assert output_path_problem(_args(save=str(save), load=str(save))) is None  # it resumes them
    # grpo without --ref-model: --load is the initial actor, not a run to resume
    assert "this run does not resume" in output_path_problem(_args(stage="grpo", save=str(save), load=str(save)))


def test_finetune_of_the_runs_own_save_resumes_it(tmp_path):
    """MindSpeed-LLM's scripts carry --finetune; resuming one by adding --load <its --save> resumes (a line says
    --finetune is overridden) instead of being refused with a fix that is already on the command line."""
    save = tmp_path / "save"
    args = _checkpoint(save=str(save), load=str(save), finetune=True)
    assert finetune_on_own_save(args) is None  # nothing saved yet: --load holds no checkpoint, nothing to resume
    (save / "actor" / "iter_0000002").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    line = finetune_on_own_save(args)
    assert line == (f"--finetune is overridden: --load {save} is this run's own --save and holds its checkpoints, so "
                    "the run resumes them (--finetune would restart the iteration count and write over them)")
    assert finetune_on_own_save(_checkpoint(save=str(save), load=str(save) + "/", finetune=True)) == line.replace(
        f"--load {save}", f"--load {save}/")
    # --finetune from another checkpoint (or without it) is what it says
    other = tmp_path / "sft"
    assert finetune_on_own_save(_checkpoint(save=str(save), load=str(other), finetune=True)) is None
    assert finetune_on_own_save(_checkpoint(save=str(save), load=str(save))) is None
    # grpo without --ref-model: --load is the initial actor, never a resume
    assert finetune_on_own_save(_checkpoint(stage="grpo", save=str(save), load=str(save), finetune=True)) is None


def test_a_resume_says_what_starts_over():
    both = fresh_on_resume(_checkpoint(no_load_optim=True, no_load_rng=True))
    assert [line.split(":")[0] for line in both] == ["--no-load-optim", "--no-load-rng"]
    assert "Adam moments from zero" in both[0] and "LR schedule" in both[0] and "start from --seed" in both[1]
    assert fresh_on_resume(_checkpoint(no_load_optim=False, no_load_rng=False)) == []
