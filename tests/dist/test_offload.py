"""`--offload-train-optimizer`, `--offload-train-grad`, `--offload-train-param`: the actor's and critic's training
state waits in host memory from one update to the next, and the training result does not change.

On the DP2 runs of `model_state_runs.py` (bf16, 3 iterations):

* with all three flags, trl_ppo (distributed optimizer) and grpo (megatron's plain mixed-precision optimizer) end
  with every weight, optimizer tensor and logged metric equal to the run without them, bit for bit, and log
  `timing/offload_train` / `timing/onload_train` (the runs without the flags do not);
* at every rollout nothing offloaded is allocated on the device: the actor holds its weights alone (it generates),
  the critic nothing; at every optimizer step the state is all back (the bytes equal the run without the flags);
  the bytes are counted by a traversal of megatron's own attributes (`model_state_runs.allocated_bytes`);
* each flag alone takes exactly its part off the device at the rollout: --offload-train-optimizer the Adam moments,
  --offload-train-grad the grad buffers, --offload-train-param the fp32 main weights (and the critic's weights);
* under the virtual-device guard (`device_guard.py`) both stages run with the distributed optimizer and every flag:
  no host tensor meets device math on the way off the device and back.
"""

import json

import pytest
import torch

from tests.helpers.model_state_runs import nested_tensors

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

PAIRS = [("trl_ppo_bf16_offload", "trl_ppo_bf16"), ("grpo_bf16_plain_offload", "grpo_bf16_plain")]




def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("offloaded,reference", PAIRS, ids=["trl_ppo-distributed", "grpo-plain"])
def test_offload_trains_bit_for_bit(model_state_runs, offloaded, reference):
    root, records = model_state_runs["root"], model_state_runs["records"]
    assert records[offloaded]["error"] is None and records[reference]["error"] is None
    roles = ["actor", "critic"] if offloaded.startswith("trl_ppo") else ["actor"]
    for role in roles:
        a, b = root / offloaded / role / "iter_0000003" / "mp_rank_00", root / reference / role / "iter_0000003" / \
            "mp_rank_00"
        files = sorted(p.name for p in b.iterdir())
        assert files == sorted(p.name for p in a.iterdir())
        for name in files:
            x, y = (torch.load(d / name, weights_only=False) for d in (a, b))
            if name == "model_optim_rng.pt":
                x, y = {k: x[k] for k in ("model", "optimizer")}, {k: y[k] for k in ("model", "optimizer")}
            x, y = nested_tensors(x), nested_tensors(y)
            assert x.keys() == y.keys()
            for path in x:
                assert torch.equal(x[path], y[path]), f"{offloaded} {role} {name}{path}"
    with_flags, without = _rows(root / offloaded / "metrics.jsonl"), _rows(root / reference / "metrics.jsonl")
    assert [r["iteration"] for r in with_flags] == [1, 2, 3]
    for a, b in zip(with_flags, without):
        steady = lambda r: {k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_tps")}  # noqa: E731
        assert steady(a) == steady(b), a["iteration"]
        assert a["timing/offload_train"] >= 0 and a["timing/onload_train"] >= 0
        assert "timing/offload_train" not in b and "timing/onload_train" not in b


@pytest.mark.parametrize("offloaded,reference", PAIRS, ids=["trl_ppo-distributed", "grpo-plain"])
def test_nothing_offloaded_stays_on_the_device_during_the_rollout(model_state_runs, offloaded, reference):
    records = model_state_runs["records"]
    rollouts = records[offloaded]["rollout"]
    assert len(rollouts) == 3
    for seen in rollouts:
        assert seen["actor"]["allocated"] == seen["actor"]["weights"] > 0  # the weights that generate, nothing else
        if "critic" in seen:
            assert seen["critic"]["allocated"] == 0
    reference_seen = records[reference]["rollout"]
    assert all(seen["actor"]["allocated"] > 2 * seen["actor"]["weights"] for seen in reference_seen)
    # every optimizer step finds the whole state back on the device, as in the run without the flags
    assert records[offloaded]["update"] == records[reference]["update"] and len(records[reference]["update"]) >= 3


@pytest.mark.parametrize("flag,parts", [("optimizer", {"actor": ["moments"], "critic": ["moments"]}),
                                        ("grad", {"actor": ["grads"], "critic": ["grads"]}),
                                        ("param", {"actor": ["masters"], "critic": ["masters", "weights"]})])
def test_each_flag_takes_its_part_off_the_device(model_state_runs, flag, parts):
    records = model_state_runs["records"]
    reference, single = records["trl_ppo_bf16"], records[f"trl_ppo_bf16_{flag}"]
    assert single["error"] is None
    for role, moved in parts.items():
        sizes = reference["parts"][role]  # the run without flags: every part on the device at the end
        assert all(sizes[p] > 0 for p in moved)
        expected = reference["rollout"][1][role]["allocated"] - sum(sizes[p] for p in moved)
        assert single["rollout"][1][role]["allocated"] == expected, (role, flag)  # iteration 2: moments exist


def test_offload_param_without_main_weights_says_so():
    from mindspeed_llm.arguments import parse_args

    base = ["--stage", "grpo", "--ref-model", "m", "--data-path", "d", "--global-batch-size", "2", "--train-iters", "1",
            "--verifier-function", "math_acc", "--offload-train-param"]
    def notes(argv):
        return parse_args(argv).settings.startup.startup_notes

    assert any("--offload-train-param offloads nothing here" in n for n in notes(base))
    assert not any("--offload-train-param" in n for n in notes(base + ["--bf16"]))
    assert not any("--offload-train-param" in n for n in notes(base[:-1]))


def _guarded(rank, world_size, runs):
    """posttrain_gpt.main on each argv inside the virtual-device guard (`device_guard.py`): its exit codes."""
    import os

    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from tests.helpers.device_guard import virtual_device
    from megatron.core import parallel_state

    import posttrain_gpt

    codes = []
    for argv in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        with virtual_device():
            codes.append(posttrain_gpt.main(argv))
    return codes


def test_offload_and_the_distributed_optimizer_keep_device_tensors_on_the_device(model_state_runs, tmp_path):
    """Under the virtual-device guard (an op mixing host and device tensors fails, as on a GPU), both stages run two
    iterations with the distributed optimizer, bf16 and every offload flag: the host copies and the freed and
    re-allocated device storage never meet device math. (No --save: the checkpoint gathers on megatron's gloo
    group, host tensors by design, which the guard cannot tell from a device group.)"""
    from tests.helpers.model_state_runs import OFFLOAD, stage_argv

    from tests.helpers.multiproc import run_distributed

    task = model_state_runs["task"]
    runs = [stage_argv(task, stage, tmp_path / stage, "--use-distributed-optimizer", "--bf16", *OFFLOAD, iters=2,
                       save=False) for stage in ("trl_ppo", "grpo")]
    assert run_distributed(_guarded, 1, runs) == [[0, 0]]
