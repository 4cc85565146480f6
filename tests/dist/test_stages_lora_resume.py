"""LoRA with `--use-distributed-optimizer` saves and resumes (issue 35, item 4).

On 2 gloo processes (DP2), the word task of `word_task.py`, fresh adapters on linear_qkv linear_proj linear_fc1
linear_fc2 (`model_state_runs.stage_argv`'s runs plus the LoRA flags), one spawn for every run of the module:

* both stages (grpo in bf16: bf16 adapters with sharded fp32 masters; trl_ppo in fp32, the critic's value head
  training fully): 3 iterations straight, and a resume from iteration 2 of that run (`--load A --ckpt-step 2`)
  into another --save end at iteration 3 with bit-identical adapters, optimizer state dict, `distrib_optim.pt`
  (fp32 main weights, Adam moments) and iteration-3 metrics; the distributed optimizer's buffers hold the trained
  tensors only (the frozen base has no grads, masters or moments);
* `--no-load-optim` on that resume (trl_ppo): it resumes, the adapters are loaded exactly, the optimizer and the LR
  schedule start fresh (no Adam state, the masters equal the loaded adapters), and iteration 3 trains;
* MindSpeed-RL's published LoRA config (grpo_lora_qwen25_32b_A2.yaml: lora_r 128, lora_alpha 128, the four targets,
  use_distributed_optimizer, bf16, finetune on the first run, no_load_optim and no_load_rng on the resume) on the
  tiny model: 2 iterations, then one resume for iteration 3, with the adapters loaded exactly;
* a full checkpoint into a LoRA run, or other LoRA flags, are refused by what differs, not as a `distrib_optim.pt`
  that does not fit (whose advice, --no-load-optim, would not help);
* a LoRA student distilled from a teacher of another size (`--teacher-load`, `word_task.build(teacher=True)`; k3 as a
  loss in grpo, k1 as a reward in trl_ppo), SIGKILLed right after its save of iteration 2 and run again with the
  same command line (one process, `kill_driver.py`): the metrics rows and the iteration-3 adapters, optimizer state
  and `distrib_optim.pt` of a run that was never killed, bit for bit (the frozen teacher is read again from
  --teacher-load, never saved); a resume with another teacher is refused by name before it writes anything.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.model_state_runs import nested_tensors, stage_argv
from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import SKIPPED

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA = ["--use-distributed-optimizer", "--lora-target-modules", *TARGETS]
DTYPE = {"grpo": ["--bf16"], "trl_ppo": []}
# grpo_lora_qwen25_32b_A2.yaml's LoRA and optimizer settings (r 128 is above the tiny model's width 64: still a
# valid adapter, only overparameterised)
PUBLISHED = ["--use-distributed-optimizer", "--bf16", "--lora-r", "128", "--lora-alpha", "128",
             "--lora-target-modules", *TARGETS]


def _roles(stage):
    return ["actor", "critic"] if stage == "trl_ppo" else ["actor"]


def _run_table(task, root: Path) -> dict:
    runs = {}
    for stage in ("grpo", "trl_ppo"):
        flags = LORA + DTYPE[stage]
        straight = root / stage
        runs[stage] = stage_argv(task, stage, straight, *flags)
        runs[f"{stage}_resumed"] = stage_argv(task, stage, root / f"{stage}_resumed", *flags, "--load", str(straight),
                                              "--ckpt-step", "2")
    runs["trl_ppo_no_load_optim"] = stage_argv(task, "trl_ppo", root / "trl_ppo_no_load_optim", *LORA, "--load",
                                               str(root / "trl_ppo"), "--ckpt-step", "2", "--no-load-optim")
    # refused by what differs, before the distributed optimizer's state is read (it does not fit either)
    runs["full"] = stage_argv(task, "grpo", root / "full", "--use-distributed-optimizer", "--bf16", iters=1)
    runs["error_full_into_lora"] = stage_argv(task, "grpo", root / "e1", *LORA, "--bf16", "--load", str(root / "full"))
    runs["error_other_r"] = stage_argv(task, "grpo", root / "e2", *LORA, "--bf16", "--lora-r", "8", "--load",
                                       str(root / "grpo"), "--ckpt-step", "2")
    published = root / "published"
    runs["published"] = stage_argv(task, "grpo", published, *PUBLISHED, "--finetune", iters=2)
    runs["published_resumed"] = stage_argv(task, "grpo", published, *PUBLISHED, "--load", str(published),
                                           "--no-load-optim", "--no-load-rng")
    return runs


def _state_after_resume(stage) -> dict:
    """Per trained role, what the run starts its first iteration with: the trained tensors, the optimizer's Adam
    state, the scheduler's step count, how many fp32 main weight shards differ from the weights, and how many values
    the distributed optimizer's buffers hold against how many train."""
    out = {}
    with torch.no_grad():
        for name, trainable in stage.roles().items():
            subs = trainable.distributed_optimizers
            stale = 0
            for optimizer in subs:
                for model_group, main_group in zip(optimizer.model_float16_groups,
                                                   optimizer.shard_fp32_from_float16_groups):
                    for model_param, main in zip(model_group, main_group):
                        where = optimizer._get_model_param_range_map(model_param)["param"]
                        weights = model_param.detach().view(-1)[where.start:where.end]
                        stale += int(not torch.equal(main.to(weights.dtype), weights))
            module = trainable.module
            out[name] = dict(
                trained={k: v.detach().clone() for k, v in trainable._module_state().items() if torch.is_tensor(v)},
                adam=sum(len(s) for o in subs for s in o.optimizer.state.values()),
                scheduler_steps=trainable.scheduler.num_steps, stale=stale,
                buffered=sum(b.numel_unpadded for o in subs for b in o.buffers),
                trains=sum(p.numel() for p in module.parameters() if p.requires_grad),
                total=sum(p.numel() for p in module.parameters()),
            )
    return out


def _runs_body(rank, world_size, runs):
    """trainer.run on each (name, argv): {name: {"error", "start" (`_state_after_resume`)}}."""
    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer

    records = {}
    resume = trainer._resume
    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        for name, argv in runs:
            current = {}

            def recording_resume(checkpoint, stage, *rest):
                iteration = resume(checkpoint, stage, *rest)
                current["start"] = _state_after_resume(stage)
                return iteration

            patch.setattr(trainer, "_resume", recording_resume)
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            error = None
            try:
                trainer.run(parse_args(argv, world_size))
            except Exception as exc:  # recorded: the tests say which runs must succeed
                error = f"{type(exc).__name__}: {exc}"
            records[name] = dict(error=error, start=current.get("start"))
    return records


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("lora_distopt_task"), reward=True, teacher=True)


@pytest.fixture(scope="module")
def lora_runs(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_distopt")
    table = _run_table(task, root / "runs")
    per_rank = run_distributed(_runs_body, 2, list(table.items()))
    return {"root": root / "runs", "ranks": per_rank}


def _ok(lora_runs, name):
    for rank, records in enumerate(lora_runs["ranks"]):
        assert records[name]["error"] is None, f"{name} rank {rank}: {records[name]['error']}"




def _metrics(path: Path) -> dict:
    return {r["iteration"]: {k: v for k, v in r.items() if not k.startswith(SKIPPED)}
            for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}


def _shard(save: Path, role: str, iteration: int, name="model_optim_rng.pt"):
    return torch.load(save / role / f"iter_{iteration:07d}" / "mp_rank_00" / name, weights_only=False)


def _equal(a: dict, b: dict, what: str) -> int:
    assert a.keys() == b.keys(), what
    for path in a:
        assert torch.equal(a[path], b[path]), f"{what}{path}"
    return len(a)


@pytest.mark.parametrize("stage", ["grpo", "trl_ppo"])
def test_lora_distributed_optimizer_resume_is_bit_exact(lora_runs, stage):
    _ok(lora_runs, stage)
    _ok(lora_runs, f"{stage}_resumed")
    root = lora_runs["root"]
    straight, resumed = root / stage, root / f"{stage}_resumed"
    compared = 0
    for role in _roles(stage):
        a, b = _shard(straight, role, 3), _shard(resumed, role, 3)
        assert "lora" in a and a["args"].use_distributed_optimizer and a["args"].data_parallel_size == 2
        assert all(".lora." in k or k == "output_layer.weight" for k in a["model"]), sorted(a["model"])
        for key in ("model", "optimizer"):
            compared += _equal(nested_tensors(a[key]), nested_tensors(b[key]), f"{stage} {role} {key}")
        state, again = (nested_tensors(_shard(d, role, 3, "distrib_optim.pt")) for d in (straight, resumed))
        compared += _equal(state, again, f"{stage} {role} distrib_optim.pt")
        # the distributed optimizer's state is the trained tensors': masters (bf16) / weights and two moments each
        trained = sum(v.numel() for v in a["model"].values())
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert sum(v.numel() for k, v in state.items() if k.endswith("/" + kind)) == trained, (role, kind)
        assert any(float(v.abs().sum()) > 0 for k, v in state.items() if k.endswith("exp_avg_sq"))
    assert compared > 10
    logged, again = _metrics(straight), _metrics(resumed)
    assert sorted(logged) == [1, 2, 3] and sorted(again) == [3]
    assert logged[3] == again[3]
    # what the distributed optimizer shards is what trains: the adapters (and the critic's head), not the base
    for records in lora_runs["ranks"]:
        for role, start in records[stage]["start"].items():
            assert start["buffered"] == start["trains"] < start["total"] / 2, (role, start)


def test_no_load_optim_keeps_the_adapters_and_restarts_the_optimizer(lora_runs):
    _ok(lora_runs, "trl_ppo_no_load_optim")
    root = lora_runs["root"]
    for records in lora_runs["ranks"]:
        start, resumed = records["trl_ppo_no_load_optim"]["start"], records["trl_ppo_resumed"]["start"]
        for role in ("actor", "critic"):
            saved = _shard(root / "trl_ppo", role, 2)["model"]
            _equal(start[role]["trained"], saved, f"{role} adapters ")
            # fresh: no Adam state, the schedule at 0, the masters the loaded weights; the full resume had them all
            assert start[role]["adam"] == 0 and start[role]["scheduler_steps"] == 0, start[role]
            assert start[role]["stale"] == 0
            assert resumed[role]["adam"] > 0 and resumed[role]["scheduler_steps"] > 0
    logged = _metrics(root / "trl_ppo_no_load_optim")
    assert sorted(logged) == [3]
    # the first step of a fresh Adam: each saved exp_avg_sq is (1 - beta2) g^2 of that one step, unlike the
    # straight run's after three steps
    fresh = nested_tensors(_shard(root / "trl_ppo_no_load_optim", "actor", 3, "distrib_optim.pt"))
    straight = nested_tensors(_shard(root / "trl_ppo", "actor", 3, "distrib_optim.pt"))
    assert fresh.keys() == straight.keys()
    assert any(not torch.equal(fresh[k], straight[k]) for k in fresh if k.endswith("exp_avg_sq"))


def test_published_lora_config_resumes(lora_runs):
    """grpo_lora_qwen25_32b_A2.yaml's settings: the first run (finetune) saves iterations 1 and 2, the resume with
    no_load_optim and no_load_rng loads the adapters of iteration 2 exactly and trains iteration 3."""
    _ok(lora_runs, "published")
    _ok(lora_runs, "published_resumed")
    save = lora_runs["root"] / "published"
    assert sorted(_metrics(save)) == [1, 2, 3]
    payload = _shard(save, "actor", 2)
    assert payload["lora"]["config"]["r"] == 128 and payload["lora"]["config"]["alpha"] == 128
    assert sorted(payload["lora"]["config"]["target_modules"]) == sorted(TARGETS)
    for records in lora_runs["ranks"]:
        start = records["published_resumed"]["start"]["actor"]
        _equal(start["trained"], payload["model"], "actor adapters ")
        assert start["adam"] == 0 and start["stale"] == 0
    final = _shard(save, "actor", 3)["model"]
    assert any(not torch.equal(final[k], payload["model"][k]) for k in final)  # iteration 3 trained


@pytest.mark.parametrize("label,message", [
    ("full_into_lora", "actor: the checkpoint holds full weights (a run without LoRA)"),
    ("other_r", "actor: the checkpoint's adapters have r 16 but this run has 8; pass the --lora-r"),
])
def test_lora_checkpoint_errors_come_before_the_optimizer_state(lora_runs, label, message):
    """Not "distrib_optim.pt does not fit ... pass --no-load-optim", which would not help."""
    _ok(lora_runs, "full")
    for records in lora_runs["ranks"]:
        error = records[f"error_{label}"]["error"]
        assert error is not None and message in error and "distrib_optim.pt" not in error, error


# the student's distillation per stage: grpo takes the teacher's k3 as a loss (bf16 adapters, sharded fp32 masters),
# trl_ppo its k1 as a per-token reward (fp32; the critic trains beside)
DISTILL = {"grpo": ["--bf16", "--distill-loss", "k3", "--distill-mode", "loss", "--distill-coef", "0.5"],
           "trl_ppo": ["--distill-loss", "k1", "--distill-mode", "reward", "--distill-coef", "0.5"]}


@pytest.mark.parametrize("stage", ["grpo", "trl_ppo"])
def test_lora_student_of_a_teacher_resumes_after_sigkill_bit_for_bit(task, tmp_path, stage):
    from tests.helpers.kill_driver import write_kill_after_save
    from tests.helpers.multiproc import single_rank_env
    from tests.helpers.stage_assets import ROOT

    whole, split = tmp_path / "whole", tmp_path / "split"
    driver = write_kill_after_save(tmp_path / "kill_after_save.py")

    def run(script, out, teacher=task["mg_teacher_tp1pp1"], **env):
        argv = stage_argv(task, stage, out, *LORA, "--teacher-load", teacher, *DISTILL[stage], "--load", str(out))
        return subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, capture_output=True, text=True,
                              env=dict(single_rank_env(), **env), timeout=300)

    done = run(ROOT / "posttrain_gpt.py", whole)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run(driver, split, KILL_AT="2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(_metrics(split)) == [1, 2]
    # another teacher (the actor's weights: the same vocabulary) would change the distillation signal mid-run
    other = run(ROOT / "posttrain_gpt.py", split, teacher=task["mg_actor_tp1pp1"])
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert (f"the teacher (distillation's) of iteration 2 was {task['mg_teacher_tp1pp1']}; this run's "
            f"{task['mg_actor_tp1pp1']} holds other weights") in other.stderr
    assert "pass the --teacher-load it was trained with, or --allow-reference-change" in other.stderr
    assert sorted(_metrics(split)) == [1, 2] and not (split / "actor" / "iter_0000003").exists()
    again = run(ROOT / "posttrain_gpt.py", split)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {split} at iteration 2" in again.stdout

    logged, resumed = _metrics(whole), _metrics(split)
    assert sorted(logged) == sorted(resumed) == [1, 2, 3]
    assert logged == resumed
    # the teacher really took part: its log-probs of the student's tokens, a KL that moves as the student trains
    assert all(row["distill/teacher_logp_mean"] < 0 for row in logged.values())
    assert len({row["distill/kl_mean"] for row in logged.values()}) == 3
    compared = 0
    for role in _roles(stage):
        a, b = _shard(whole, role, 3), _shard(split, role, 3)
        assert "lora" in a and a["args"].use_distributed_optimizer
        for key in ("model", "optimizer"):
            compared += _equal(nested_tensors(a[key]), nested_tensors(b[key]), f"{stage} {role} {key}")
        compared += _equal(*(nested_tensors(_shard(d, role, 3, "distrib_optim.pt")) for d in (whole, split)),
                           f"{stage} {role} distrib_optim.pt")
        # iteration 3 trained after the resume (the adapters moved from the killed run's iteration 2)
        before = _shard(split, role, 2)["model"]
        assert any(not torch.equal(b["model"][k], before[k]) for k in before), role
    assert compared > 10
    # the frozen teacher is no part of the checkpoint: the roles saved are the trained ones
    assert sorted(p.name for p in whole.iterdir() if p.is_dir()) == sorted(_roles(stage))
