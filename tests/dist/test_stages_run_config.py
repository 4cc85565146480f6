"""A MindSpeed-RL run config end to end (slow, one spawned process): a first-run file trains a tiny trl_ppo for 2
iterations, and the resume file (finetune false, load = that save, no_load_optim false, the reference's original
weights) resumes at iteration 2. The mapping itself: tests/unit/test_run_config.py.
"""

import json
import os
from pathlib import Path

import pytest
import yaml

from mindspeed_llm.run_config import RL
from tests.helpers.mindspeed_rl_configs import actor_config, generate_config, megatron_training, write

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


@pytest.mark.slow
def test_a_mindspeed_rl_file_trains_and_its_resume_file_resumes(tmp_path):
    """A first-run file (finetune true, load = the converted policy) trains a tiny trl_ppo for 2 iterations and
    saves; the resume file of MindSpeed-RL's docs (finetune false, load = that save, no_load_optim / no_load_rng
    false, the reference's original weights in integrated_mode_config) trains iteration 3 from iteration 2."""
    from tests.helpers import word_task
    from tests.helpers.multiproc import posttrain_in_process

    task = word_task.build(tmp_path / "task", reward=True)
    save, metrics = str(tmp_path / "save"), tmp_path / "metrics.jsonl"
    common = {"stage": "ray_ppo", "tokenizer_name_or_path": task["tokenizer"], "data_path": task["data"],
              "global_batch_size": 2, "seed": 5, "save_interval": 1}
    rl = {"adv_estimator": "gae", "rule_reward": False, "max_prompt_length": 16}
    generate = {"max_model_len": 24, "sampling_config": {"max_tokens": 4, "temperature": 1.0}}
    first = {
        "megatron_training": {**common, "train_iters": 2},
        "actor_config": {"micro_batch_size": 2, "lr": "1e-3", "finetune": True, "load": task["mg_actor_tp1pp1"],
                         "save": save, "no_load_optim": True, "no_load_rng": True},
        "critic_config": {"micro_batch_size": 2, "lr": "1e-3", "finetune": True, "load": task["mg_reward_tp1pp1"],
                          "save": save, "no_load_optim": True, "no_load_rng": True},
        "reward_config": {"load": task["mg_reward_tp1pp1"]},
        "rl_config": rl, "generate_config": generate,
    }
    resume = {
        "megatron_training": {**common, "train_iters": 3},
        "actor_config": {"micro_batch_size": 2, "lr": "1e-3", "finetune": False, "load": save, "save": save,
                         "no_load_optim": False, "no_load_rng": False},
        "critic_config": {"micro_batch_size": 2, "lr": "1e-3", "finetune": False, "load": save, "save": save,
                          "no_load_optim": False, "no_load_rng": False},
        "reward_config": {"load": task["mg_reward_tp1pp1"]},
        "rl_config": {**rl, "integrated_mode_config": {"ref_model_load_path": task["mg_actor_tp1pp1"]}},
        "generate_config": generate,
    }
    cases = [["--config", write(tmp_path, first, "first.yaml"), "--metrics-jsonl", str(metrics)],
             ["--config", write(tmp_path, resume, "resume.yaml"), "--metrics-jsonl", str(metrics)]]
    (code1, out1, err1), (code2, out2, err2) = posttrain_in_process(cases)
    assert code1 == 0, err1[-3000:]
    assert code2 == 0, err2[-3000:]
    assert "resumed" not in out1
    assert f"resumed from {save} at iteration 2" in out2
    assert (Path(save) / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    for role in ("actor", "critic"):
        assert (Path(save) / role / "iter_0000002").is_dir() and (Path(save) / role / "iter_0000003").is_dir()
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
