"""`rl/trainer.py`'s checks without a process group: the entropy guard of --check-for-divergence (log V, hand-computed),
the output paths found unwritable before any model is built (`rl/preflight.py`), and the typed result a stage's
iteration hands the trainer (`rl/stages/base.py`). (The loop itself, end to end: tests/dist/test_stages*.py.)"""

import math
from types import SimpleNamespace

import pytest
import torch

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


class _Records:
    """`RolloutRecords`' two calls, noted."""

    def __init__(self):
        self.added, self.finished = [], []

    def add(self, exp, metrics):
        self.added.append((exp, metrics))

    def finish(self, iteration, prompts):
        self.finished.append((iteration, prompts))
        return [{"sample": 0}]


def test_a_stage_iteration_scores_into_its_records_finishes_them_and_returns_typed_counts(monkeypatch):
    """The stage base's frame: each scored batch goes to the records with the schedule's and the scorer's
    metrics, the records are finished with the iteration's prompts, and the result carries the sample rows, the
    actor's entropy and this DP rank's tokens: the mean lengths (MindSpeed-RL's `prompt_length/mean`,
    `response_length/mean`, from `rollout_metrics`) times global batch / DP x n, hand-computed here."""
    from mindspeed_llm import distributed
    from mindspeed_llm.rl.experience import Experience
    from mindspeed_llm.rl.rollouts.plain import rollout_metrics
    from mindspeed_llm.rl.stages import IterationResult
    from mindspeed_llm.rl.stages.base import StageBase, Trained

    tokens = torch.arange(12).reshape(2, 6)
    exp = Experience(tokens=tokens, position_ids=torch.arange(6).expand(2, 6), prompt_lengths=torch.tensor([3, 2]),
                     responses=tokens[:, 3:], response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 0]]),
                     ended_with_eos=torch.tensor([True, True]))

    class ToyStage(StageBase):
        def _train(self, iteration, prompts):
            self.score_metrics = self._score(exp, "plan", "timers", {"rollout/x": 1.0})
            return Trained({"loss": 0.5}, exp, {"entropy": 1.25, "pg_loss": 0.5})

    stage = ToyStage(with_values(Settings(), global_batch_size=8, n_samples_per_prompt=2), tokenizer=None)
    stage.records = _Records()
    stage.rollouts = SimpleNamespace(scored=False)  # a schedule whose batches the stage scores
    stage.scorer = lambda e, plan, timers: (torch.tensor([1.0, 0.0]), {"score/x": 2.0})
    monkeypatch.setattr(distributed, "data_parallel_info", lambda: (1, 2))  # DP rank 1 of 2: 4 prompts, 8 samples
    prompts = SimpleNamespace(drawn=1)
    result = stage.iteration(5, prompts)
    assert isinstance(result, IterationResult)
    assert result.metrics == {"loss": 0.5} and result.entropy == 1.25 and result.samples == [{"sample": 0}]
    assert result.prompt_tokens == 2.5 * 8 and result.response_tokens == 2.0 * 8  # means (3+2)/2, (3+1)/2
    logged = rollout_metrics(SimpleNamespace(action_lengths=exp.action_lengths, prompt_lengths=exp.prompt_lengths,
                                             tool_mask=None, sample_data=SimpleNamespace(finish_reasons=[]),
                                             response_mask=exp.response_mask))
    assert result.prompt_tokens == logged["prompt_length/mean"] * 4 * 2  # the trainer's former formula, exactly
    assert result.response_tokens == logged["response_length/mean"] * 4 * 2
    assert exp.scores.tolist() == [1.0, 0.0] and stage.score_metrics == {"score/x": 2.0}
    assert stage.records.added == [(exp, {"rollout/x": 1.0, "score/x": 2.0})]
    assert stage.records.finished == [(5, prompts)]


def test_a_stage_without_entropy_on_this_rank_says_none(monkeypatch):
    """Not the last pipeline stage: the actor's losses (entropy among them) are not on this rank."""
    from mindspeed_llm import distributed
    from mindspeed_llm.rl.stages.base import StageBase, Trained

    exp = SimpleNamespace(prompt_lengths=torch.tensor([4]), action_lengths=torch.tensor([6]))

    class ToyStage(StageBase):
        def _train(self, iteration, prompts):
            return Trained({}, exp, {})

    stage = ToyStage(with_values(Settings(), global_batch_size=2, n_samples_per_prompt=1), tokenizer=None)
    stage.records = _Records()
    monkeypatch.setattr(distributed, "data_parallel_info", lambda: (0, 1))
    result = stage.iteration(1, SimpleNamespace())
    assert result.entropy is None and (result.prompt_tokens, result.response_tokens) == (8.0, 12.0)
