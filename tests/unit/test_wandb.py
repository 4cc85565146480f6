"""Weights & Biases (`rl/metrics/wandb_writer.py`, `arguments/wandb_flags.py`): an offline wandb run holds the same
metric values as the metrics JSONL of the same run, read back from wandb's own files with wandb's own reader
(`tests/helpers/wandb_files.py`: `wandb leet inspect --json` on the run's .wandb transaction log); rank 0 alone logs; a missing install is an
`ArgumentError` naming the flag and the pinned install; the mode (WANDB_MODE, API key); MindSpeed-RL's keys.
(A stage run end to end: tests/dist/test_stages_wandb.py.)
"""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.arguments import wandb_flags
from mindspeed_llm.rl.metrics import MetricsLogger
from mindspeed_llm.run_config import load_run_config
from tests.helpers import wandb_files
from tests.helpers.mindspeed_rl_configs import config_error, grpo_file, parsed, write

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
        "--global-batch-size", "4", "--ref-model", "r"]


def _metrics(iteration: int) -> dict:
    """A metrics dict of the kinds the stages log: floats, ints, a bool, a tensor scalar, a NaN, nested names."""
    return {"actor/pg_loss": 0.1 * iteration - 0.25, "grpo/score/mean": 1 / (iteration + 2),
            "response_length/mean": 12.0 + iteration, "world_size": 1, "global_batch_size": 4,
            "eval/score/mean": torch.tensor(0.5 + iteration / 8, dtype=torch.float64), "dynamic/ok": iteration > 1,
            "critic/vf_loss": float("nan") if iteration == 2 else 0.0625 * iteration}


def _offline_run(tmp_path, monkeypatch, failed=False, iterations=3):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir, jsonl = tmp_path / "wandb_files", tmp_path / "metrics.jsonl"
    config = {"loop": {"train_iters": iterations, "log_interval": 1}, "algorithm": {"stage": "grpo"}}
    logger = MetricsLogger(1, jsonl_path=str(jsonl), total_iterations=iterations, print_fn=lambda s: None,
                           wandb=dict(project="mindspeed-test", name="tiny", save_dir=str(save_dir), mode="offline",
                                      config=config))
    for iteration in range(1, iterations + 1):
        logger.log(iteration, _metrics(iteration))
    logger.close(failed=failed)
    return save_dir, jsonl, config


def test_offline_run_holds_the_jsonl_values(tmp_path, monkeypatch):
    save_dir, jsonl, config = _offline_run(tmp_path, monkeypatch)
    records = wandb_files.records(save_dir)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    history = wandb_files.history(records)
    assert [row["iteration"] for row in rows] == sorted(history) == [1, 2, 3]
    assert wandb_files.differences(rows, history) == {}, "JSONL vs wandb"
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (run["project"], run["display_name"]) == ("mindspeed-test", "tiny")
    assert {k: v for k, v in run["config"]["update"].items() if not k.startswith("_")} == config
    assert wandb_files.state(save_dir) == ("finished", 0)


def test_a_failed_run_finishes_with_exit_code_1(tmp_path, monkeypatch):
    save_dir, _, _ = _offline_run(tmp_path, monkeypatch, failed=True, iterations=1)
    assert wandb_files.state(save_dir) == ("failed", 1)


def test_the_compare_sees_a_changed_value(tmp_path, monkeypatch):
    """The comparison above fails when the writer logs another value (the guard broken once)."""
    from mindspeed_llm.rl.metrics import wandb_writer

    real_log = wandb_writer.WandbWriter.log
    monkeypatch.setattr(wandb_writer.WandbWriter, "log", lambda self, i, m: real_log(
        self, i, {**m, "grpo/score/mean": m["grpo/score/mean"] + 1e-9}))
    with pytest.raises(AssertionError, match="'grpo/score/mean'"):
        test_offline_run_holds_the_jsonl_values(tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------ rank 0, finish, fallback
class FakeWandb(types.ModuleType):
    """A stand-in `wandb` module recording init / log / finish; an init in one of the `failing` modes raises."""

    class Error(Exception):
        pass

    def __init__(self, failing=()):
        super().__init__("wandb")
        self.calls, self.failing = [], failing

    def init(self, **kwargs):
        if kwargs.get("mode") in self.failing:
            raise self.Error("no network")
        self.calls.append(("init", kwargs))
        calls = self.calls
        return types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                     finish=lambda exit_code: calls.append(("finish", exit_code)))


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_alone_logs(monkeypatch, tmp_path, rank):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(1, rank=rank, print_fn=lambda s: None,
                           wandb=dict(project="p", save_dir=str(tmp_path / "w"), mode="offline", config={"a": 1}))
    logger.log(1, {"x": torch.tensor(2.0)})
    logger.log(2, {"x": 3.0})
    logger.close(failed=True)
    if rank:
        assert fake.calls == [] and not (tmp_path / "w").exists()
        return
    (_, init), *rest = fake.calls
    assert init == dict(project="p", name=None, entity=None, config={"a": 1}, mode="offline", dir=str(tmp_path / "w"))
    assert rest == [("log", 1, {"x": 2.0}), ("log", 2, {"x": 3.0}), ("finish", 1)]


def test_an_online_run_without_network_continues_offline(monkeypatch):
    from mindspeed_llm.rl.metrics.wandb_writer import WandbWriter

    fake, printed = FakeWandb(failing=("online",)), []
    monkeypatch.setitem(sys.modules, "wandb", fake)
    WandbWriter("p", mode="online", print_fn=printed.append)
    assert [kwargs["mode"] for _, kwargs in fake.calls] == ["offline"]
    assert "logging offline instead" in printed[0]
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(failing=("online", "offline")))
    with pytest.raises(FakeWandb.Error):  # a run that cannot start offline either stops the run
        WandbWriter("p", mode="online", print_fn=printed.append)
    with pytest.raises(FakeWandb.Error):  # an offline one is not retried
        WandbWriter("p", mode="offline", print_fn=printed.append)


# ------------------------------------------------------------------------------------------ flags
def test_missing_wandb_is_an_argument_error_naming_the_flag_and_the_pin(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    parse_args(BASE)  # without --wandb-project nothing imports it
    with pytest.raises(ArgumentError) as caught:
        parse_args([*BASE, "--wandb-project", "p"])
    assert "--wandb-project" in str(caught.value) and "pip install wandb==0.31.0" in str(caught.value)


def test_the_pin_is_the_tested_one():
    pins = [line.strip() for line in (ROOT / "requirements-test.txt").read_text().splitlines()
            if line.startswith("wandb==")]
    assert pins == [wandb_flags.WANDB_REQUIREMENT]
    import wandb

    assert f"wandb=={wandb.__version__}" == wandb_flags.WANDB_REQUIREMENT


def test_settings_and_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    w = parse_args([*BASE, "--wandb-project", "p", "--wandb-exp-name", "n", "--wandb-entity", "e",
                    "--save", str(tmp_path / "s")]).settings.wandb
    assert (w.wandb_project, w.wandb_exp_name, w.wandb_entity, w.wandb_mode) == ("p", "n", "e", "offline")
    assert w.wandb_save_dir == str(tmp_path / "s" / "wandb")  # Megatron-LM's default: --save/wandb
    w = parse_args([*BASE, "--wandb-project", "p", "--wandb-save-dir", "elsewhere"]).settings.wandb
    assert w.wandb_save_dir == "elsewhere"
    assert parse_args(BASE).settings.wandb.wandb_mode is None
    with pytest.raises(ArgumentError, match="--wandb-exp-name, --wandb-entity have no effect without --wandb-project"):
        parse_args([*BASE, "--wandb-exp-name", "n", "--wandb-entity", "e"])


def test_the_mode(tmp_path, monkeypatch):
    home = {"NETRC": str(tmp_path / "netrc")}
    assert wandb_flags.resolve_mode({**home, "WANDB_MODE": "disabled"}) == ("disabled", None)
    mode, note = wandb_flags.resolve_mode(home)
    assert mode == "offline" and "no wandb API key" in note
    assert wandb_flags.resolve_mode({**home, "WANDB_API_KEY": "k" * 40}) == ("online", None)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_flags.resolve_mode(home) == ("online", None)  # `wandb login`'s entry
    assert wandb_flags.resolve_mode({**home, "WANDB_BASE_URL": "https://wandb.example.com"})[0] == "offline"
    # the startup note says where the offline run goes and how to upload it
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    args = parse_args([*BASE, "--wandb-project", "p", "--wandb-save-dir", str(tmp_path / "w")])
    assert args.settings.wandb.wandb_mode == "offline"
    assert [n for n in args.settings.startup.startup_notes if "wandb" in n] == [
        f"--wandb-project p: no wandb API key (WANDB_API_KEY or `wandb login`) and WANDB_MODE unset: wandb logs "
        f"offline to {tmp_path / 'w'}/wandb/offline-run-*; upload it later with `wandb sync DIR` (WANDB_MODE=online "
        "to log online)"]


# ------------------------------------------------------------------------------------------ MindSpeed-RL's keys
def test_mindspeed_rl_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = grpo_file()
    data["rl_config"].update(use_wandb=True, wandb_project="proj", wandb_exp_name="exp", wandb_save_dir="wdir")
    run = parsed(["--config", write(tmp_path, data)], 16)
    assert (run["wandb_project"], run["wandb_exp_name"], run["wandb_save_dir"]) == ("proj", "exp", "wdir")
    del data["rl_config"]["wandb_project"]
    message = config_error(tmp_path, data)
    assert "rl_config.use_wandb" in message and "needs a project" in message
    assert parsed(["--config", write(tmp_path, data), "--wandb-project", "cli"], 16)["wandb_project"] == "cli"
    data["rl_config"].update(use_wandb=False, wandb_project="proj")  # MindSpeed-RL logs to wandb only when true
    config = load_run_config(write(tmp_path, data))
    assert not any(token.startswith("--wandb") for token in config.argv)
    assert ("rl_config.wandb_project", "use_wandb is not true") in config.ignored
    assert parsed(["--config", write(tmp_path, data)], 16)["wandb_project"] is None


def test_a_sample_table_is_a_wandb_table_at_its_iteration(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))  # where wandb stages a table's artifact
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir = tmp_path / "wandb_files"
    logger = MetricsLogger(1, print_fn=lambda s: None,
                           wandb=dict(project="mindspeed-test", save_dir=str(save_dir), mode="offline"))
    logger.log(1, {"x": 1.0})
    logger.log_samples(1, [{"sample": 0, "score": 1.0, "score_parts": {"acc": 1.0}, "prompt": "2+2", "response": "4"},
                           {"sample": 1, "score": 0.0, "score_parts": {"acc": 0.0}, "prompt": "2+3", "response": "6"}])
    logger.close()
    history = wandb_files.history(wandb_files.records(save_dir))
    assert history[1]["x"] == 1.0  # the table joins the iteration's step
    assert (history[1]["samples._type"], history[1]["samples.nrows"], history[1]["samples.ncols"]) == (
        "table-file", 2, 5)
    files = list((save_dir / "wandb").glob("offline-run-*/files/media/table/samples_1_*.table.json"))
    (content,) = [json.loads(f.read_text()) for f in files]
    assert content["columns"] == ["sample", "score", "score_parts", "prompt", "response"]
    assert content["data"][1] == [1, 0.0, '{"acc": 0.0}', "2+3", "6"]


def test_an_empty_project_is_refused_by_name():
    # Megatron-LM's default '' means "off"; given on the command line it is a mistake that would turn wandb off silently
    for empty in ("", "  "):
        with pytest.raises(ArgumentError, match="--wandb-project .* is empty: .* name the project"):
            parse_args([*BASE, "--wandb-project", empty])
