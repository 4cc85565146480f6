"""Tests of mindspeed_llm.rl.metrics: timers, throughput formulas, length stats, cross-rank reduction
without a process group (two gloo processes: tests/dist/test_metrics_dist.py), the stdout / JSONL /
TensorBoard writers."""

import json
import os
import time
from contextlib import closing

import pytest
import torch

from mindspeed_llm.rl import metrics as M


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_timers_accumulate_and_pop():
    clock = FakeClock()
    syncs = []
    timers = M.Timers(sync=lambda: syncs.append(clock.now), clock=clock)
    with timers("all"):
        with timers("rollout"):
            clock.now += 2.0
        with timers("update"):
            clock.now += 1.5
        with timers("rollout"):  # a second rollout interval adds up
            clock.now += 0.5
    assert len(syncs) == 8  # before every start and every stop
    assert timers.pop() == {"timing/all": 4.0, "timing/rollout": 2.5, "timing/update": 1.5}
    assert timers.pop() == {}  # reset

    # an exception inside the block still stops the timer
    with pytest.raises(KeyError):
        with timers("adv"):
            clock.now += 0.25
            raise KeyError("x")
    assert timers.pop() == {"timing/adv": 0.25}

    timers.start("critic_model")
    with pytest.raises(RuntimeError):
        timers.start("critic_model")
    with pytest.raises(RuntimeError):
        timers.pop()
    timers.stop("critic_model")
    with pytest.raises(RuntimeError):
        timers.stop("critic_model")


def test_timers_real_clock():
    timers = M.Timers()
    with timers("reward_model"):
        time.sleep(0.05)  # a sleep lasts at least this long: a lower bound holds on any machine
    out = timers.pop()
    assert set(out) == {"timing/reward_model"} and out["timing/reward_model"] >= 0.05


def test_throughput_by_hand():
    # global batch: 4 samples (2 prompts x 2 samples), prompt lengths 10, 10, 20, 20, responses 30, 50, 40, 40
    # tokens = 60 + 160 = 220; world size 4
    timings = {"timing/all": 11.0, "timing/update": 2.75, "timing/rollout": 5.5}
    out = M.throughput_metrics(10 + 10 + 20 + 20, 30 + 50 + 40 + 40, 4, timings)
    assert out == {
        "e2e_tps": pytest.approx(220 / 4 / 11.0),      # 5.0
        "update_tps": pytest.approx(220 / 4 / 2.75),   # 20.0
        "vllm_tps": pytest.approx(220 / 4 / 5.5),      # 10.0 (MindSpeed-RL's name)
        "rollout_tps": pytest.approx(220 / 4 / 5.5),   # its alias
    }
    assert out["e2e_tps"] == pytest.approx(5.0) and out["update_tps"] == pytest.approx(20.0)
    # a missing / zero timing leaves that throughput out
    assert M.throughput_metrics(60, 160, 2, {"timing/all": 10.0, "timing/rollout": 0.0}) == {
        "e2e_tps": pytest.approx(11.0)}
    with pytest.raises(ValueError):
        M.throughput_metrics(1, 1, 0, {"all": 1.0})


def test_mean_min_max():
    assert M.mean_min_max("response_length", [4, 8, 12, 0]) == {
        "response_length/mean": 6.0, "response_length/min": 0.0, "response_length/max": 12.0}
    assert M.mean_min_max("prompt_length", torch.tensor([[3, 5]])) == {
        "prompt_length/mean": 4.0, "prompt_length/min": 3.0, "prompt_length/max": 5.0}
    assert M.mean_min_max("x", []) == {}


def test_masked_mean_min_max_by_hand():
    values = torch.tensor([[1.0, -2.0, 9.0], [4.0, 7.0, -8.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert M.masked_mean_min_max("critic/values", values, mask) == {
        "critic/values/mean": 1.0, "critic/values/min": -2.0, "critic/values/max": 4.0}


def test_masked_mean_is_over_all_ranks_tokens():
    """Two DP shards of one batch: the mean is (1 - 2 + 4) / 3 on both, not the mean of the shards' means; each
    keeps its own extremes for the MIN / MAX reduction; a shard without tokens leaves them to the other."""
    shards = [(torch.tensor([[1.0, -2.0]]), torch.tensor([[1, 1]])), (torch.tensor([[4.0, 3.0]]), torch.tensor([[1, 0]])),
              (torch.tensor([[5.0, 5.0]]), torch.tensor([[0, 0]]))]
    totals = sum(torch.stack([(v.double() * m).sum(), m.sum().double()]) for v, m in shards)
    out = [M.masked_mean_min_max("a", v, m, sum_across=lambda t: totals) for v, m in shards]
    assert [o["a/mean"] for o in out] == [1.0, 1.0, 1.0]
    assert [(o["a/min"], o["a/max"]) for o in out] == [(-2.0, 1.0), (4.0, 4.0), (float("inf"), float("-inf"))]
    assert M.masked_mean_min_max("a", torch.ones(1, 2), torch.zeros(1, 2)) == {"a/mean": 0.0, "a/min": 0.0,
                                                                             "a/max": 0.0}


def test_reduce_without_distributed_returns_input():
    assert M.reduce_metrics({"b": 2, "a/max": 1.5}) == {"a/max": 1.5, "b": 2.0}


def test_log_line_format():
    line = M.format_log_line(3, [("actor/pg_loss", 0.1234), ("global_batch_size", 32)], total_iterations=10)
    assert line == " iteration   3/ 10 | actor/pg_loss: 1.234E-01 | global_batch_size: 32 |"


def test_stdout_interval_and_line_groups():
    printed = []
    logger = M.MetricsLogger(log_interval=2, total_iterations=5, print_fn=printed.append,
                             lines={"actor": ["actor/", "grad_norm"], "critic": ["critic/"]})
    metrics = {"timing/all": 1.5, "actor/pg_loss": -0.5, "critic/vf_loss": 2.0, "grad_norm": 3.0, "e2e_tps": 100.0}
    for it in range(1, 6):
        logger.log(it, metrics)
    logger.close()
    # iterations 2 and 4 (interval) and 5 (the last one), three lines each
    assert len(printed) == 9
    assert printed[0] == " iteration  2/ 5 | [actor] actor/pg_loss: -5.000E-01 | grad_norm: 3.000E+00 |"
    assert printed[1] == " iteration  2/ 5 | [critic] critic/vf_loss: 2.000E+00 |"
    assert printed[2] == " iteration  2/ 5 | timing/all: 1.500E+00 | e2e_tps: 1.000E+02 |"
    assert printed[6].startswith(" iteration  5/ 5 |")


def test_jsonl_content(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    printed = []
    with closing(M.MetricsLogger(log_interval=10, jsonl_path=str(path), print_fn=printed.append)) as logger:
        logger.log(1, {"actor/pg_loss": 0.5, "global_batch_size": 4, "grad_norm": float("nan")})
        logger.log(2, {"actor/pg_loss": torch.tensor(0.25), "global_batch_size": 4, "grad_norm": 1.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"iteration": 1, "actor/pg_loss": 0.5, "global_batch_size": 4, "grad_norm": None},
        {"iteration": 2, "actor/pg_loss": 0.25, "global_batch_size": 4, "grad_norm": 1.0},
    ]
    assert printed == []  # log_interval 10: nothing on stdout
    # other ranks write nothing
    other = tmp_path / "rank1.jsonl"
    printed_other = []
    with closing(M.MetricsLogger(1, jsonl_path=str(other), rank=1, print_fn=printed_other.append)) as logger:
        logger.log(1, {"a": 1.0})
    assert not other.exists() and printed_other == []


def test_tensorboard_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    with closing(M.MetricsLogger(log_interval=100, tensorboard_dir=str(tb_dir), print_fn=lambda s: None)) as logger:
        for it in (1, 2, 3):
            logger.log(it, {"actor/pg_loss": 0.5 * it, "timing/all": 2.0, "note": "text is skipped"})
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb_dir))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"actor/pg_loss", "timing/all"}
    events = acc.Scalars("actor/pg_loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([0.5, 1.0, 1.5])


def test_jsonl_rows_of_rerun_iterations_are_replaced(tmp_path):
    """A resumed run (from iteration 2) logs iterations 3.. again: their old rows go, and a line cut by a kill too."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": i / 10}) + "\n" for i in (1, 2, 3, 4)) + '{"iterat')
    logger = M.MetricsLogger(jsonl_path=str(path), resumed_at=2, print_fn=lambda s: None)
    logger.log(3, {"loss": 0.33})
    logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]
    # without resumed_at the file is appended to, as before
    M.MetricsLogger(jsonl_path=str(path), print_fn=lambda s: None).close()
    assert len(path.read_text().splitlines()) == 3
