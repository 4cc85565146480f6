"""The trl_ppo and grpo stages end to end on 2 gloo processes: TP=2, PP=2, DP=2 (posttrain_gpt.main on the warm
ranks of tests/helpers/multiproc.py: what torchrun runs, without the launch); resume under torchrun after a SIGKILL
in the middle of a checkpoint save equals an uninterrupted run, bit for bit."""

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import _posttrain_main_cases, run_distributed
from tests.helpers.stage_assets import posttrain_argv, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

PPO_KEYS = [
    "actor/pg_loss", "actor/abs_pg_loss", "actor/ppo_ratio", "actor/ppo_ratio_clamped", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/entropy", "actor/lr", "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac",
    "critic/lr", "critic/grad_norm", "score/mean", "kl/mean", "non_score_reward", "response_length/mean",
    "response_length/min", "response_length/max", "prompt_length/mean", "prompt_length/min", "prompt_length/max",
    "timing/all", "timing/rollout", "timing/old_log_p", "timing/reference_model", "timing/reward_model",
    "timing/critic_model", "timing/adv", "timing/update", "timing/update_critic", "e2e_tps", "update_tps",
    "vllm_tps", "rollout_tps", "n_samples_per_prompt", "actor/kl_loss", "grad_norm",
] + [f"critic/{name}/{stat}" for name in ("score", "rewards", "advantages", "returns", "values")
     for stat in ("mean", "max", "min")]  # MindSpeed-RL's PPO names
GRPO_KEYS = [
    "actor/entropy", "actor/kl_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "grad_norm",
    "math_acc_rewards/mean", "actor/lr", "grpo/score/mean", "grpo/score/max", "grpo/score/min", "grpo/rewards/mean",
    "grpo/rewards/max", "grpo/rewards/min", "grpo/advantages/mean", "grpo/advantages/max", "grpo/advantages/min", "response_length/mean", "response_length/min", "response_length/max",
    "prompt_length/mean", "prompt_length/min", "prompt_length/max", "global_batch_size", "n_samples_per_prompt",
    "world_size", "timing/all", "timing/rollout", "timing/old_log_p", "timing/reference_model", "timing/rule_reward",
    "timing/reward_model", "timing/adv", "timing/update", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps",
]
LOSS_KEYS = {"trl_ppo": ["actor/pg_loss", "actor/abs_pg_loss", "critic/vf_loss"],
             "grpo": ["actor/pg_loss", "actor/kl_loss"]}


def stage_argv(paths, stage, tp=1, pp=1, iters=3, extra=()):
    argv = posttrain_argv(paths, stage, tp, pp, iters, extra)
    if stage == "grpo":  # a reward model beside the rule verifier, so that groups have reward variance
        argv += ["--reward-model", paths[f"mg_reward_tp{tp}pp{pp}"]]
    return argv


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def check_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"


def run_ok(argv):
    """posttrain_gpt.main(argv) on the 2 warm ranks; each must exit 0."""
    for rank, ((code, stdout, stderr),) in enumerate(run_distributed(_posttrain_main_cases, 2, [argv])):
        assert code == 0, f"rank {rank}: exit {code}\n{stdout[-4000:]}\n{stderr[-6000:]}"


@pytest.mark.parametrize("stage", ["trl_ppo", "grpo"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_three_iterations(stage_paths, tmp_path, stage, tp, pp):
    metrics_file, save = tmp_path / "metrics.jsonl", tmp_path / "save"
    extra = ["--metrics-jsonl", str(metrics_file), "--save", str(save), "--save-interval", "3",
             "--tensorboard-dir", str(tmp_path / "tb")]
    dp2 = tp == pp == 1
    if dp2:  # held-out evaluation, and grpo's group filter, on one layout
        extra += ["--eval-data-path", stage_paths["data_eval"], "--eval-interval", "2"]
        # trl_ppo: one held-out prompt for two DP ranks (rank 1 evaluates none)
        extra += ["--filter-groups"] if stage == "grpo" else ["--whiten-rewards", "--eval-samples", "1"]
    if stage == "trl_ppo" and tp == 2:  # critic and reward half the actor's width (argparse: the last value wins)
        extra += ["--reward-model", stage_paths["mg_reward_small_tp2pp1"]]
    if stage == "grpo":
        extra += ["--save-hf"]
    run_ok(stage_argv(stage_paths, stage, tp, pp, iters=3, extra=extra))

    records = read_jsonl(metrics_file)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        missing = [k for k in (PPO_KEYS if stage == "trl_ppo" else GRPO_KEYS) if k not in record]
        assert not missing, f"metrics missing: {missing}"
        assert all(math.isfinite(record[k]) for k in LOSS_KEYS[stage])
        assert record["world_size"] == 2
    # MindSpeed-LLM's actor line: its losses in the stage's order, then lr and grad_norm
    if stage == "trl_ppo":
        assert [k for k in records[0] if k.startswith("actor/")] == [
            "actor/pg_loss", "actor/abs_pg_loss", "actor/ppo_ratio", "actor/ppo_ratio_clamped", "actor/pg_clipfrac",
            "actor/ppo_kl", "actor/entropy", "actor/lr", "actor/grad_norm", "actor/kl_loss"]  # the last: MindSpeed-RL's
    # The loss is really computed: it moves between iterations, and some update is non-trivial.
    assert any(r[LOSS_KEYS[stage][0]] != 0 for r in records)
    assert any(r["actor/grad_norm" if stage == "trl_ppo" else "grad_norm"] > 0 for r in records)
    # The logged numbers hang together the way the stage computes them (the layouts' numerical agreement is
    # tests/dist/test_stages_layout_invariance.py's business).
    for r in records:
        assert r["actor/lr"] == pytest.approx(1e-3)
        if stage == "trl_ppo":  # the KL penalty of the rewards, -kl_coef * KL summed over each response (0.3)
            assert r["non_score_reward"] == pytest.approx(-0.3 * r["kl/mean"], rel=1e-5, abs=1e-7)
            assert r["grad_norm"] == r["actor/grad_norm"] and r["actor/kl_loss"] == 0.0
            assert r["critic/score/mean"] == pytest.approx(r["score/mean"], abs=1e-6)
            if not dp2:  # the token rewards sum to the score plus the KL penalty (--whiten-rewards on dp2)
                assert r["critic/rewards/mean"] == pytest.approx(r["score/mean"] + r["non_score_reward"], abs=1e-5)
            for name in ("score", "rewards", "advantages", "returns", "values"):
                assert r[f"critic/{name}/min"] <= r[f"critic/{name}/mean"] <= r[f"critic/{name}/max"]
        else:  # the score is math_acc plus the reward model (weights 1); group advantages have mean 0
            assert r["grpo/score/mean"] == pytest.approx(r["math_acc_rewards/mean"] + r["reward_model/mean"], abs=1e-5)
            assert r["grpo/rewards/mean"] == r["grpo/score/mean"]  # GRPO's KL is a loss, not in the reward
            assert abs(r["grpo/advantages/mean"]) < 1e-5

    if dp2:
        assert "eval/score/mean" in records[1] and "eval/kl/mean" in records[1] and "eval/score/mean" not in records[0]
        if stage == "grpo":  # reward-model scores differ within every group: the filter keeps every group
            assert all(r["grpo/filtered_groups"] == 0.0 for r in records)

    roles = ["actor", "critic"] if stage == "trl_ppo" else ["actor"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    shard = f"mp_rank_0{tp - 1}" if pp == 1 else "mp_rank_00_001"
    for role in roles:
        assert (save / role / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
        state = torch.load(save / role / "iter_0000003" / shard / "model_optim_rng.pt", weights_only=False)
        assert state["iteration"] == 3 and "optimizer" in state and "opt_param_scheduler" in state
        assert state["data_position"]["sampler"]["iteration"] == 3
        if role == "critic" and tp == 2:
            assert state["model_spec"]["hidden_size"] == 32  # trained at its own size beside a 64-wide actor

    # The trained actor goes back to Hugging Face and differs from where it started.
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.checkpoint import convert_mg_to_hf

    convert_mg_to_hf(str(save / "actor"), str(tmp_path / "hf_out"), progress=False)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    initial = AutoModelForCausalLM.from_pretrained(stage_paths["hf_actor"])
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), initial.state_dict().values()))
    if stage == "grpo":
        _check_save_hf(save, tp, pp, tmp_path / "hf_out")


def _greedy_from_checkpoint(rank, world_size, root, tp, pp, prompts, max_new):
    """The project's own greedy rollouts and logits of the Megatron checkpoint under `root` at TP `tp` x PP `pp`."""
    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.inference import SamplingConfig, generate
    from mindspeed_llm.models import build_model
    from tests.helpers.hf_parity import megatron_forward

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    distributed.initialize(tp, pp, seed=0)
    model = build_model(load_spec(root))
    load_megatron_weights(model, root)
    model.eval()
    rollout = generate(model, prompts, SamplingConfig(max_new_tokens=max_new, pad_token_id=0))
    tokens = [rollout.responses[b, :int(rollout.response_lengths[b])].tolist() for b in range(len(prompts))]
    width = min(len(p) for p in prompts)
    logits = megatron_forward(model, torch.tensor([p[:width] for p in prompts]), tp, pp)
    return tokens, logits


def _check_save_hf(save, tp, pp, exported):
    """--save-hf: the folder beside the last checkpoint holds what convert_ckpt.py exports of it, is noted in the
    run record, loads in transformers, and generates the actor's greedy tokens (the project's generation on the
    saved Megatron checkpoint at the run's layout) with its logits."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.convert_checks import assert_identical, hf_tensors

    iteration = save / "actor" / "iter_0000003"
    folder = iteration / "hf"
    assert sorted(p.name for p in iteration.iterdir() if not p.name.startswith("mp_rank")) == ["hf", "run_record.json"]
    assert json.loads((iteration / "run_record.json").read_text())["hf"] == {"dir": "hf", "format": "model"}
    assert_identical(hf_tensors(exported), hf_tensors(folder))
    assert (folder / "tokenizer_config.json").is_file() and (folder / "config.json").is_file()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 150000, (n,), generator=g).tolist() for n in (5, 8, 6)]
    results = run_distributed(_greedy_from_checkpoint, 2, str(save / "actor"), tp, pp, prompts, 10)
    tokens, logits = results[0][0], next(r[1] for r in results if r[1] is not None)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        width = min(len(p) for p in prompts)
        reference = model(torch.tensor([p[:width] for p in prompts])).logits
        torch.testing.assert_close(logits.float(), reference, rtol=1e-4, atol=1e-4)
        for prompt, ours in zip(prompts, tokens):
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
            assert out[0, len(prompt):].tolist() == ours


KILLING_DRIVER = textwrap.dedent("""
    # Runs posttrain_gpt.py, but SIGKILLs rank 0 in the middle of the checkpoint save of iteration KILL_AT:
    # when it is about to publish its KILL_ON_CALL-th staged role directory (1: nothing published yet).
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import mindspeed_llm.checkpoint.megatron_layout as layout
    calls = []
    original = layout.publish
    def publish(tmp, final):
        if final.endswith("iter_%07d" % int(os.environ["KILL_AT"])):
            calls.append(final)
            if len(calls) == int(os.environ["KILL_ON_CALL"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return original(tmp, final)
    layout.publish = publish
    import posttrain_gpt
    sys.exit(posttrain_gpt.main(sys.argv[1:]))
""")


def _final_weights(save, roles, iteration, shard):
    out = {}
    for role in roles:
        state = torch.load(save / role / f"iter_{iteration:07d}" / shard / "model_optim_rng.pt", weights_only=False)
        out[role] = state["model"]
    return out


def _assert_same_weights(a, b):
    for role in a:
        for key, value in a[role].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[role][key]), f"{role}:{key} differs"


@pytest.mark.parametrize("stage,tp", [("trl_ppo", 1), ("grpo", 2)], ids=["trl_ppo-dp2", "grpo-tp2"])
def test_resume_after_kill_during_save_equals_uninterrupted(stage_paths, tmp_path, stage, tp):
    roles = ["actor", "critic"] if stage == "trl_ppo" else ["actor"]
    shard = f"mp_rank_0{tp - 1}"

    straight = tmp_path / "straight"
    argv = stage_argv(stage_paths, stage, tp, 1, iters=4, extra=[
        "--save", str(straight), "--save-interval", "2", "--metrics-jsonl", str(straight / "m.jsonl")])
    check_ok(torchrun(argv, nproc=2))

    # Killed while saving iteration 4: the resume point must stay iteration 2, whatever was half-written.
    resumed = tmp_path / "resumed"
    argv = stage_argv(stage_paths, stage, tp, 1, iters=4, extra=[
        "--save", str(resumed), "--save-interval", "2", "--metrics-jsonl", str(resumed / "m.jsonl")])
    driver = tmp_path / "kill_driver.py"
    driver.write_text(KILLING_DRIVER.format(root=str(Path(__file__).resolve().parents[2])))
    kill_on_call = 2 if stage == "trl_ppo" else 1
    killed = torchrun(argv, nproc=2, env={"KILL_AT": "4", "KILL_ON_CALL": str(kill_on_call)}, script=str(driver))
    assert killed.returncode != 0, "the fault injection did not fire"
    assert (resumed / "actor" / ".iter_0000004.staging").is_dir() or (resumed / "actor" / "iter_0000004").is_dir()
    if stage == "trl_ppo":
        assert (resumed / "actor" / "iter_0000004").is_dir()  # published before the kill ...
        assert not (resumed / "critic" / "iter_0000004").is_dir()  # ... its partner was not
    assert (resumed / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    result = torchrun(argv + ["--load", str(resumed)], nproc=2)
    check_ok(result)
    assert "resumed from" in result.stdout and "at iteration 2" in result.stdout

    _assert_same_weights(_final_weights(straight, roles, 4, shard), _final_weights(resumed, roles, 4, shard))
    logged = {r["iteration"]: r for r in read_jsonl(straight / "m.jsonl")}
    again = {r["iteration"]: r for r in read_jsonl(resumed / "m.jsonl")}
    for it in (3, 4):
        for key in LOSS_KEYS[stage] + ["score/mean" if stage == "trl_ppo" else "grpo/score/mean"]:
            assert logged[it][key] == again[it][key], (it, key)
