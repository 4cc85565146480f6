"""`mindspeed_llm.rl.metrics`'s cross-rank reduction on two gloo processes. The rest of the module:
tests/unit/test_metrics.py.
"""

import json
import os

import torch

from mindspeed_llm.rl import metrics as M
from tests.helpers.ports import free_port


def _reduce_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        local = {
            "actor/pg_loss": [1.0, 3.0][rank],
            "response_length/max": [7.0, 5.0][rank],
            "response_length/min": [2.0, -1.0][rank],
            "grpo/score/mean": [0.25, 0.75][rank],
            "math_acc_rewards/failures": [1.0, 2.0][rank],
            "rollout_mismatch/abs_diff_max": [0.5, 0.25][rank],
        }
        results = {
            "mean": M.reduce_metrics(local),
            "group": M.reduce_metrics(local, group=dist.new_group([0, 1])),
        }
        try:
            M.reduce_metrics({"only_on_rank_%d" % rank: 1.0})
            results["mismatch"] = "no error"
        except ValueError as exc:
            results["mismatch"] = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_reduce_metrics_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_reduce_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["mean"] == {"actor/pg_loss": 2.0, "grpo/score/mean": 0.5, "math_acc_rewards/failures": 3.0,
                               "response_length/max": 7.0, "response_length/min": -1.0,
                               "rollout_mismatch/abs_diff_max": 0.5}
        assert res["group"] == res["mean"]
        assert list(res["mean"]) == ["actor/pg_loss", "response_length/max", "response_length/min",
                                     "grpo/score/mean", "math_acc_rewards/failures",
                                     "rollout_mismatch/abs_diff_max"]  # the caller's order
        assert res["mean"]["rollout_mismatch/abs_diff_max"] == 0.5  # a max stays a max
        assert "different metric keys" in res["mismatch"]
