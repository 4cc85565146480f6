"""`--use-distributed-optimizer` saves and resumes exactly (README, "Checkpoints").

On 2 gloo processes (DP2, the shared spawn of `model_state_runs.py`), both stages in fp32 and bf16, the critic
included:

* a run resumed from iteration 1 of another (`--load A --ckpt-step 1`) ends at iteration 3 with every weight, every
  tensor of the optimizer's state dict and of `distrib_optim.pt` (fp32 main weights, Adam moments) and every logged
  metric equal to the uninterrupted run's, bit for bit; each shard folder holds `distrib_optim.pt`, the shard's args
  say how it was saved;
* a resume whose distributed optimizer state is not loaded (megatron's `load_parameter_state_from_dp_zero` made a
  no-op) stops with an error naming the stale main weights and the fix, before any iteration: it cannot silently
  continue from the initial weights' fp32 copies and uninitialised moments;
* the model state's bytes per parameter (a real TrainableModel, the grpo actor) are what sharding predicts: bf16
  weights 2, fp32 grads 4, fp32 main weights 4 / DP, Adam moments 8 / DP; fp32 weights have no separate main weights.

In one process (DP1), on the DP2 checkpoints:

* the state saved at DP2 loads at DP1 (megatron's dp_zero format holds the buffers without their DP padding): the
  loaded main weights and moments equal the file's, bit for bit, and training continues, saying it resharded;
* each patch of `patches/optimizer.py` is needed: without it megatron raises its error (the CUDA type check, the
  size mismatch of a param group mixing fp32 and bf16 parameters, `step` / the leaf view on load);
* a checkpoint of the other optimizer kind is refused in both directions, naming the flag and --no-load-optim (which
  then runs); `--finetune` takes the weights only; a truncated `distrib_optim.pt` is an error naming the file and
  the previous complete iteration.
"""

import json
import math
import shutil

import pytest
import torch

from tests.helpers.model_state_runs import nested_tensors
from tests.helpers.multiproc import run_distributed
from tests.helpers.patch_removal import without_patch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

CASES = [("trl_ppo", "fp32"), ("trl_ppo", "bf16"), ("grpo", "fp32"), ("grpo", "bf16")]


def _roles(stage):
    return ["actor", "critic"] if stage == "trl_ppo" else ["actor"]




def _metrics(path):
    return {r["iteration"]: {k: v for k, v in r.items() if not k.startswith("timing/") and not k.endswith("_tps")}
            for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_resume_continues_bit_for_bit(model_state_runs, stage, dtype):
    root, records = model_state_runs["root"], model_state_runs["records"]
    name = f"{stage}_{dtype}"
    assert records[name]["error"] is None and records[f"{name}_resumed"]["error"] is None
    straight, resumed = root / name, root / f"{name}_resumed"
    compared = 0
    for role in _roles(stage):
        a, b = straight / role / "iter_0000003" / "mp_rank_00", resumed / role / "iter_0000003" / "mp_rank_00"
        assert sorted(p.name for p in a.iterdir()) == ["distrib_optim.pt", "model_optim_rng.pt"]
        shard = torch.load(a / "model_optim_rng.pt", weights_only=False)
        assert shard["args"].use_distributed_optimizer and shard["args"].data_parallel_size == 2
        again = torch.load(b / "model_optim_rng.pt", weights_only=False)
        for key in ("model", "optimizer"):
            x, y = nested_tensors(shard[key]), nested_tensors(again[key])
            assert x.keys() == y.keys()
            for path in x:
                assert torch.equal(x[path], y[path]), f"{role} {key}{path}"
            compared += len(x)
        assert shard["optimizer"]["optimizer"]["param_groups"] == again["optimizer"]["optimizer"]["param_groups"]
        state, state_again = (torch.load(d / "distrib_optim.pt", weights_only=False) for d in (a, b))
        x, y = nested_tensors(state), nested_tensors(state_again)
        assert x.keys() == y.keys() and any(path.endswith("exp_avg_sq") for path in x)
        for path, value in x.items():
            assert torch.equal(value, y[path]), f"{role} distrib_optim.pt{path}"
            if path.endswith("exp_avg_sq"):
                assert float(value.abs().sum()) > 0  # Adam really stepped
        compared += len(x)
    assert compared > 10
    logged, again = _metrics(straight / "metrics.jsonl"), _metrics(resumed / "metrics.jsonl")
    assert sorted(again) == [2, 3]
    for iteration in (2, 3):
        assert logged[iteration] == again[iteration], iteration
    key = "actor/pg_loss"
    assert any(logged[i][key] != 0 for i in logged) and all(math.isfinite(logged[i][key]) for i in logged)


def test_a_resume_never_takes_stale_main_weights(model_state_runs):
    record = model_state_runs["records"]["trl_ppo_bf16_stale"]
    error = record["error"]
    assert error is not None, "a resume without the distributed optimizer's state ran"
    assert "actor: the distributed optimizer's state from" in error and "distrib_optim.pt was not restored" in error
    assert "fp32 main weight shards differ from the loaded weights" in error and "moments were not restored" in error
    assert "--no-load-optim" in error
    assert record["update"] == [] and not (model_state_runs["root"] / "stale" / "metrics.jsonl").exists()


def test_model_state_bytes_per_parameter_at_dp2(model_state_runs):
    """The grpo actor's state per parameter at DP2 against the hand count (padding of the buffers allowed: 3%)."""
    records = model_state_runs["records"]
    expected = {  # bytes per parameter: weights, grads, masters, moments
        "grpo_bf16": dict(weights=2, grads=4, masters=4 / 2, moments=8 / 2),
        "grpo_bf16_plain": dict(weights=2, grads=4, masters=4, moments=8),
        "grpo_fp32": dict(weights=4, grads=4, masters=0, moments=8 / 2),
    }
    for name, parts in expected.items():
        measured = records[name]["parts"]["actor"]
        n = measured["parameters"]
        for part, per_parameter in parts.items():
            assert measured[part] / n == pytest.approx(per_parameter, rel=0.03, abs=1e-9), (name, part, measured)
    total = {name: sum(records[name]["parts"]["actor"][p] for p in ("weights", "grads", "masters", "moments"))
             for name in expected}
    assert total["grpo_bf16"] < 0.7 * total["grpo_bf16_plain"]  # 12 against 18 bytes per parameter


# ---------------------------------------------------------------------------------------------- at DP1
PATCHES = {  # patches/optimizer.py target -> what megatron raises without it
    "type checks": "DistributedOptimizer.__init__",
    "group order": "DistributedOptimizer._build_optimizer_group_ranges",
    "loading with step": "DistributedOptimizer._set_main_param_and_optimizer_states",
}


def _patch_cases(reward_checkpoint):
    """Each patch of patches/optimizer.py taken away in turn, on a bf16 value-head model (its fp32 value head shares a
    param group with bf16 weights) with the distributed optimizer: {case: the error megatron raises, or None}."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl.update import roles
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel

    args = parse_args(["--stage", "grpo", "--ref-model", "m", "--data-path", "d", "--global-batch-size", "1",
                       "--train-iters", "1", "--verifier-function", "math_acc", "--bf16"])

    def trainable():
        model = roles.load_model(reward_checkpoint, "--reward-model", args.settings, value_head=True)
        trained = TrainableModel(model, OptimizerSettings(lr=1e-3, params_dtype="bf16", use_distributed_optimizer=True))
        (sub,) = trained.distributed_optimizers
        sub._init_optimizer_states_with_dummy_values()  # Adam's state, as after a first step
        return trained, sub

    def error(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (the message is the result)
            return f"{type(exc).__name__}: {exc}"
        return None

    found = {}
    with without_patch(PATCHES["type checks"]):
        found["type checks"] = error(trainable)
    with without_patch(PATCHES["group order"]):
        found["group order"] = error(lambda: trainable()[0].parameter_state())
    trained, sub = trainable()
    state = trained.parameter_state()
    with without_patch(PATCHES["loading with step"]):
        found["loading with step"] = error(lambda: sub.load_parameter_state_from_dp_zero(state))
    found["all patches"] = error(lambda: sub.load_parameter_state_from_dp_zero(state))
    return found


def _dp1_body(rank, world_size, reshard_argv, distrib_files, cases, reward_checkpoint):
    """Each optimizer patch shown needed; a DP2 checkpoint loaded at DP1, each role's gathered state returned next to
    the file's; then the command lines of `cases` through posttrain_gpt.main."""
    from tests.helpers.multiproc import _posttrain_main_cases

    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.checkpoint import training as training_ckpt
    from mindspeed_llm.rl.stages import STAGES
    from mindspeed_llm.rl.update import roles
    from mindspeed_llm.rl.preflight import load_tokenizer

    args = parse_args(reshard_argv, world_size)
    distributed.initialize(1, 1, args.seed)
    patch_errors = _patch_cases(reward_checkpoint)
    stage = STAGES[args.stage](args.settings, load_tokenizer(args.settings.data), roles.RoleFactory(args.settings))
    training_ckpt.load(args.load, stage.roles(), 1)
    pairs = {name: (trainable.parameter_state(), torch.load(distrib_files[name], weights_only=False))
             for name, trainable in stage.roles().items()}
    parallel_state.destroy_model_parallel()  # posttrain_gpt.main sets it up again, in the same process group
    return patch_errors, pairs, _posttrain_main_cases(rank, world_size, cases)


@pytest.fixture(scope="module")
def dp1(model_state_runs, tmp_path_factory):
    from tests.helpers.model_state_runs import stage_argv

    task, root = model_state_runs["task"], model_state_runs["root"]
    out = tmp_path_factory.mktemp("dp1")
    source = root / "trl_ppo_bf16"
    distrib = {role: source / role / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt" for role in _roles("trl_ppo")}
    damaged = out / "damaged"
    shutil.copytree(source, damaged)
    truncated = damaged / "critic" / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])

    def argv(name, *extra, stage="trl_ppo", iters=4):
        return stage_argv(task, stage, out / name, *extra, iters=iters)

    dist = ("--use-distributed-optimizer", "--bf16")
    cases = {
        "resharded": argv("resharded", *dist, "--load", str(source), "--ckpt-step", "1"),
        "without the flag": argv("without", "--bf16", "--load", str(source)),
        "without the flag, --no-load-optim": argv("no_load_optim", "--bf16", "--load", str(source), "--no-load-optim"),
        "plain checkpoint": argv("plain", *dist, "--load", str(root / "grpo_bf16_plain"), stage="grpo"),
        "finetune": argv("finetune", *dist, "--load", str(source), "--finetune", iters=1),
        "damaged": argv("damaged", *dist, "--load", str(damaged)),
        # --no-save-optim: weights only; a resume needs --no-load-optim (in this order: the first writes the others'
        # --load)
        "no-save-optim": argv("no_save_optim", *dist, "--no-save-optim", iters=2),
        "no-save-optim resumed": argv("nso_resumed", *dist, "--load", str(out / "no_save_optim")),
        "no-save-optim resumed, --no-load-optim": argv("nso_no_load", *dist, "--load", str(out / "no_save_optim"),
                                                       "--no-load-optim", iters=3),
    }
    reshard = argv("reshard_probe", *dist, "--load", str(source), "--ckpt-step", "1")
    patch_errors, pairs, results = run_distributed(_dp1_body, 1, reshard, distrib, list(cases.values()),
                                                   task["mg_reward_tp1pp1"])[0]
    return pairs, dict(zip(cases, results)), {"out": out, "truncated": truncated, "patch_errors": patch_errors}


def test_each_optimizer_patch_is_needed(dp1):
    errors = dp1[2]["patch_errors"]
    assert errors["type checks"].startswith("TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor")
    assert errors["group order"].startswith("RuntimeError: The size of tensor a")
    assert errors["loading with step"] in ("KeyError: 'step'", ) or "a leaf Variable that requires grad" in \
        errors["loading with step"], errors["loading with step"]
    assert errors["all patches"] is None


def test_dp2_state_loads_at_dp1_bit_for_bit(dp1):
    pairs, results, paths = dp1
    assert sorted(pairs) == ["actor", "critic"]
    for role, (loaded, saved) in pairs.items():
        x, y = nested_tensors(loaded), nested_tensors(saved)
        assert x.keys() == y.keys() and len(x) >= 3, role
        for path in x:
            assert torch.equal(x[path], y[path]), f"{role}{path}"
    code, out, err = results["resharded"]
    assert code == 0, err[-3000:]
    assert "actor: the distributed optimizer's state was saved at data-parallel size 2; resharded to 1" in out
    assert "critic: the distributed optimizer's state was saved at data-parallel size 2; resharded to 1" in out
    assert sorted(_metrics(paths["out"] / "resharded" / "metrics.jsonl")) == [2, 3, 4]


def test_the_other_optimizer_kind_is_refused_by_name(dp1):
    _, results, _ = dp1
    code, _, err = results["without the flag"]
    assert code == 2 and "saved with --use-distributed-optimizer, this run is without --use-distributed-optimizer" \
        in err and "--no-load-optim" in err, err[-3000:]
    code, _, err = results["plain checkpoint"]
    assert code == 2 and "saved without --use-distributed-optimizer, this run is with --use-distributed-optimizer" \
        in err, err[-3000:]
    for name in ("without the flag, --no-load-optim", "finetune"):
        code, out, err = results[name]
        assert code == 0, f"{name}: {err[-3000:]}"
    assert "--finetune: weights from" in results["finetune"][1]


def test_damaged_optimizer_state_names_the_file_and_ckpt_step(dp1):
    _, results, paths = dp1
    code, _, err = results["damaged"]
    assert code == 2 and str(paths["truncated"]) in err and "--ckpt-step 2" in err, err[-3000:]
    assert "Traceback" not in err


def test_no_save_optim_saves_weights_only_and_a_resume_says_so(dp1):
    """Megatron-LM's --no-save-optim: no optimizer state (nor distrib_optim.pt) and no LR schedule in the checkpoint;
    resuming it with the optimizer is refused by name, with --no-load-optim it trains on."""
    _, results, paths = dp1
    code, _, err = results["no-save-optim"]
    assert code == 0, err[-3000:]
    shard_dir = paths["out"] / "no_save_optim" / "actor" / "iter_0000002" / "mp_rank_00"
    payload = torch.load(shard_dir / "model_optim_rng.pt", weights_only=False)
    assert "model" in payload and "optimizer" not in payload and "opt_param_scheduler" not in payload
    assert not (shard_dir / "distrib_optim.pt").exists()
    code, _, err = results["no-save-optim resumed"]
    assert code == 2 and "holds no optimizer state (it was saved with --no-save-optim); resume with --no-load-optim" \
        in err and "Traceback" not in err, err[-3000:]
    code, _, err = results["no-save-optim resumed, --no-load-optim"]
    assert code == 0, err[-3000:]
    assert sorted(_metrics(paths["out"] / "nso_no_load" / "metrics.jsonl")) == [3]
