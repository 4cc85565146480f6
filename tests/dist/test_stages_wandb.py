"""Weights & Biases through a real stage run (`trainer.run` with --wandb-project, WANDB_MODE=offline): at DP2 one
offline wandb run is written (rank 0's) whose history holds the metrics JSONL's values at the JSONL's iterations and
whose config is the run's settings; a run that fails after logging finishes its wandb run with exit code 1. The
writer and the flags: tests/unit/test_wandb.py; the reader: tests/helpers/wandb_files.py."""

import dataclasses
import json

import pytest

from tests.helpers import wandb_files

pytestmark = pytest.mark.usefixtures("warm_ranks")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("wandb_task"), prompts=8)


def _argv(task, out, iterations=2):
    return ["--stage", "grpo", "--micro-batch-size", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "2",
            "--seed", "5", "--data-path", task["data"], "--tokenizer-name-or-path", task["tokenizer"],
            "--max-length", "16", "--max-new-tokens", "4", "--do-sample", "--ref-model", task["mg_actor_tp1pp1"],
            "--verifier-function", "odd_first_word", "--train-iters", str(iterations), "--no-check-for-divergence",
            "--metrics-jsonl", str(out / "metrics.jsonl"), "--wandb-project", "mindspeed-test", "--wandb-exp-name",
            "tiny", "--wandb-save-dir", str(out / "wandb_files")]


def _run(rank, world_size, argv, failing_argv):
    """The run, then one whose loop raises after logging iteration 1; returns the settings and the error."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from tests.helpers.stage_layouts import run_stages

    def failing_loop(settings, stage, dataset, evaluator, sampler, logger, start, exit_signal, *rest):
        logger.log(1, {"x": 1.0})
        raise RuntimeError("stopped by the test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        run_stages(rank, world_size, [argv])
        settings = parse_args(argv, world_size).settings
        mp.setattr(trainer, "_loop", failing_loop)
        try:
            run_stages(rank, world_size, [failing_argv])
        except RuntimeError as exc:
            return dataclasses.asdict(settings), str(exc)
    return dataclasses.asdict(settings), None


def test_dp2_writes_one_wandb_run_with_the_jsonl_values(task, tmp_path):
    from tests.helpers.multiproc import run_distributed

    out, failed = tmp_path / "run", tmp_path / "failed"
    results = run_distributed(_run, 2, _argv(task, out), _argv(task, failed, iterations=1))
    settings, error = results[0]
    assert [error for _, error in results] == ["stopped by the test"] * 2
    runs = list((out / "wandb_files" / "wandb").glob("*run-*"))
    assert len(runs) == 1, runs  # rank 0's alone
    records = wandb_files.records(out / "wandb_files")
    history = wandb_files.history(records)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == sorted(history) == [1, 2]
    assert wandb_files.differences(rows, history) == {}
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert {k: v for k, v in config.items() if not k.startswith("_")} == json.loads(json.dumps(settings))
    assert wandb_files.state(out / "wandb_files") == ("finished", 0)
    assert wandb_files.state(failed / "wandb_files") == ("failed", 1)
