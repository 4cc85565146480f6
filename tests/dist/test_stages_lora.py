"""Both stages with LoRA (issue 29): layout invariance, exact resume, adapter-only checkpoints, the shared bases.

Models and prompts are the word task of `word_task.py`. The actor starts from a PEFT adapter (`--lora-load`, random
non-zero A and B with their own A per q / k / v: stacked on Megatron's fused linears), so that the first update
moves A as well as B; the critic (trl_ppo) gets fresh adapters (B = 0) and trains its value head fully.

* Layout invariance (as `test_layout_invariance.py`, whose runner and settings this reuses: one update, SGD without
  momentum): trl_ppo (`--whiten-rewards`, two mini-batches) and grpo (`--filter-groups`, KL loss, entropy bonus) at
  TP2, PP2, DP2 and TP2 with --sequence-parallel give the metrics of TP1 (rtol 1e-5) and the same adapters (merged
  from the saved adapter checkpoints: within 1e-5 of their norm; the actor's change from the loaded adapter within
  1e-3 of its norm).
* Resume: 2 iterations straight and 1 + a resume give bit-identical adapters, optimizer states and iteration-2
  metrics (Adam), for trl_ppo in fp32 and grpo in bf16 (bf16 adapters with fp32 masters in the optimizer); full
  activation recompute gives the same run (to float rounding).
* Checkpoints hold the adapters (and the critic's head) and their optimizer state only, plus the base's path and
  fingerprint; loading refuses a full checkpoint into a LoRA run, a LoRA checkpoint into a full run, other LoRA
  flags and another base, each naming what differs.
* The frozen roles are the trained ones' bases: the reference is the actor with a frozen copy of the loaded adapter
  (the initial policy, as TRL's "ref" adapter; with fresh adapters the actor with them off), no model of its own:
  after training its log-probs are those of the base with the loaded adapter built afresh; trl_ppo's reward model
  is the critic with its adapters off and the checkpoint's value head: after training it scores as the frozen
  reward model does, while the critic's own head has moved. With zero-initialised adapters a
  LoRA run's first iteration computes every forward quantity of the full run (same rollout, scores, KL, losses).
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402
from tests.helpers.stage_layouts import (ATOL, KEY_ATOL, RTOL, SKIPPED, layout_argv, metrics_row, odd_first_word,
                                         relative, run_cases, update_cases)

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

LAYOUTS = ("mbs1", "tp2", "pp2", "dp2", "tp2_sp")
WORLD = {"mbs1": 1, "tp2": 2, "pp2": 2, "dp2": 2, "tp2_sp": 2}
CASES = ("trl_ppo", "grpo_token-mean")
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _peft_adapter(hf_dir: str, out: Path) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for module in pm.modules():
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(0, 0.05)
    pm.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    root = tmp_path_factory.mktemp("lora_task")
    paths = word_task.build(root, layouts=((1, 1), (2, 1), (1, 2)), reward=True)
    paths["peft"] = _peft_adapter(str(root / "hf_actor"), root / "peft_actor")
    other = word_task.build(root / "other", model_seed=9)  # another actor of the same shape
    paths["other_actor"] = other["mg_actor_tp1pp1"]
    return paths


def _lora_argv(task, stage, layout, extra, out):
    return layout_argv(task, stage, layout, list(extra) + ["--lora-load", task["peft"]], out)


@pytest.fixture(scope="module")
def layout_runs(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_layouts")
    cases = update_cases()
    dirs = {layout: {case: root / layout / case for case in CASES} for layout in LAYOUTS}
    by_world = {}
    for layout in LAYOUTS:
        by_world.setdefault(WORLD[layout], []).extend(
            _lora_argv(task, cases[case][0], layout, cases[case][1], dirs[layout][case]) for case in CASES)
    for world, runs in by_world.items():
        run_distributed(run_cases, world, runs)
    return dirs


def _adapters(save: Path, role: str):
    from mindspeed_llm.checkpoint import lora as lora_files

    return {k: v.float() for k, v in lora_files.read_checkpoint(str(save / role)).tensors.items()}


def _initial_actor(task):
    from mindspeed_llm.checkpoint import load_spec
    from mindspeed_llm.checkpoint import lora as lora_files

    return lora_files.read_peft(task["peft"], load_spec(task["mg_actor_tp1pp1"])).tensors


@pytest.mark.parametrize("layout,case", [(layout, case) for layout in LAYOUTS if layout != "mbs1" for case in CASES])
def test_one_lora_update_is_layout_invariant(layout_runs, task, layout, case):
    reference, other = layout_runs["mbs1"][case], layout_runs[layout][case]
    ref_metrics, metrics = metrics_row(reference), metrics_row(other)
    assert sorted(metrics) == sorted(ref_metrics)
    shares = {"metrics": 0.0, "adapters": 0.0, "change": 0.0}  # the largest share of each tolerance
    for key, expected in ref_metrics.items():
        bound = KEY_ATOL.get(key, ATOL) + RTOL * abs(expected)
        assert abs(metrics[key] - expected) <= bound, f"{layout} {case} {key}"
        shares["metrics"] = max(shares["metrics"], abs(metrics[key] - expected) / bound)
    initial = _initial_actor(task)
    for role in (["actor", "critic"] if case.startswith("trl_ppo") else ["actor"]):
        ref, got = _adapters(reference / "save", role), _adapters(other / "save", role)
        assert sorted(ref) == sorted(got)
        for name in ref:
            diff = relative(got[name], ref[name])
            assert diff <= 1e-5, f"{layout} {case} {role}/{name}"
            shares["adapters"] = max(shares["adapters"], diff / 1e-5)
            if role == "actor":
                change = relative(got[name] - initial[name], ref[name] - initial[name])
                assert change <= 1e-3, f"{layout} {case} actor/{name}: the update differs by {change:.2e}"
                shares["change"] = max(shares["change"], change / 1e-3)
    print(f"{layout} {case}: largest share of the tolerance: " + ", ".join(f"{k} {v:.2f}" for k, v in shares.items()))


def test_lora_updates_are_not_trivial(layout_runs, task):
    """Both A and B of the actor moved (the loaded adapter's B is non-zero), the critic's B and value head too."""
    initial = _initial_actor(task)
    for case in CASES:
        save = layout_runs["mbs1"][case] / "save"
        actor = _adapters(save, "actor")
        for kind in (".lora.A", ".lora.B"):
            moved = [float((actor[k] - initial[k]).norm()) for k in actor if k.endswith(kind)]
            assert moved and min(moved) > 0, (case, kind)
        if case.startswith("trl_ppo"):
            critic = _adapters(save, "critic")
            assert any(float(v.norm()) > 0 for k, v in critic.items() if k.endswith(".lora.B"))
            assert "output_layer.weight" in critic


# ---------------------------------------------------------------------------------------------- one process
def _argv_iters(task, stage, out: Path, iters: int, extra=(), load=None, lora=True, steps=2):
    argv = layout_argv(task, stage, "mbs1", [], out)
    argv[argv.index("--train-iters") + 1] = str(iters)
    if stage == "trl_ppo":  # `steps` optimizer steps per iteration
        argv += ["--global-batch-size", "4", "--ppo-mini-batch-size", str(4 // steps), "--lr", "0.01"]
    else:
        argv += ["--global-batch-size", "4", "--n-samples-per-prompt", "2", "--verifier-function", "odd_first_word",
                 "--kl-coef", "0.05", "--lr", "0.01"]
    if lora:
        argv += ["--lora-load", task["peft"]]
    if load:
        argv += ["--load", str(load)]
    return argv + list(extra)


def _stage_body(rank, world_size, runs):
    """posttrain_gpt.main on each (argv, check) in this process; `check` inspects the built stage after the run.
    Returns [(exit code, stderr tail, inspection)]."""
    import contextlib
    import io

    import posttrain_gpt
    from mindspeed_llm.rl import stages
    from mindspeed_llm.rl.verifiers import register_verifier

    register_verifier("odd_first_word", override=True)(odd_first_word)
    built = {}
    out = []
    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        for name, cls in list(stages.STAGES.items()):
            def recording(settings, tokenizer, build, cls=cls):
                built["stage"] = cls(settings, tokenizer, build)
                built["settings"] = settings
                return built["stage"]
            patch.setitem(stages.STAGES, name, recording)
        for argv, check in runs:
            built.clear()
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = posttrain_gpt.main(argv)
            info = _inspect(built) if check and code == 0 else None
            out.append((code, err.getvalue()[-2000:], info))
    return out


def _inspect(built):
    """What the built stage shares, and trl_ppo's reward view against the frozen reward model after training."""
    from mindspeed_llm.models import lora
    from mindspeed_llm.rl.update import roles
    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
    from mindspeed_llm.rl.update.lora import SharedBase
    from mindspeed_llm.rl.update.passes import reward_scores
    from mindspeed_llm.rl.rollouts.base import expand

    stage, settings = built["stage"], built["settings"]
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.rl.update.passes import policy_logprobs

    info = {"reference_is_actor": isinstance(stage.reference, SharedBase) and stage.reference.module is
            stage.actor.module, "trained": list(lora.trained_names(stage.actor.module))}
    dataset = PromptDataset(settings.data.data_path)
    rows = [dict(dataset[i], index=i, position=i) for i in range(4)]
    generator, (samples, sample_ids) = stage.rollouts.generator, expand(rows, 1)
    exp = generator.experience(generator.generate(1, samples, sample_ids), samples)
    plan = MicroBatchPlan.for_run(exp, settings.batch, group_size=1)
    # the initial policy: the base with the --lora-load adapter, built afresh
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.rl.update.lora import load_adapter

    initial = roles.load_model(settings.models.ref_model, "--ref-model", settings)
    adapter = lora_files.read_adapter(settings.lora.lora_load, initial.model_spec)
    lora.apply_lora(initial, adapter.config)
    load_adapter(initial, adapter)
    with roles.on_device(stage.reference, False, None) as view:
        ref, _ = policy_logprobs([view], exp, plan)
    info["reference_diff"] = float((ref - policy_logprobs([initial.eval()], exp, plan)[0]).abs().max())
    info["actor_vs_base"] = float((policy_logprobs(stage.actor.chunks, exp, plan)[0] - ref).abs().max())
    reward = stage.scorer.reward_model
    if reward is not None:
        info["reward_is_critic"] = isinstance(reward, SharedBase) and reward.module is stage.critic.module
        fresh = roles.frozen(roles.load_model(settings.models.reward_model, "--reward-model", settings, value_head=True))
        with roles.on_device(reward, False, None) as view:
            shared = reward_scores([view], exp, plan)
        info["reward_diff"] = float((shared - reward_scores([fresh], exp, plan)).abs().max())
        info["head_moved"] = float((stage.critic.module.output_layer.weight - fresh.output_layer.weight).abs().max())
    return info


def _payload(save: Path, role: str, iteration: int):
    from mindspeed_llm.checkpoint import load_shard

    return load_shard(str(save / role), 0, 0, iteration, weights_only=False)


def _flat(obj, prefix=""):
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}/{i}")


@pytest.fixture(scope="module")
def resume_runs(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_resume")
    runs, labels = [], []

    def add(label, argv, check=False):
        labels.append(label)
        runs.append((argv, check))

    for stage, extra in (("trl_ppo", ["--optimizer", "adam"]), ("grpo", ["--bf16", "--optimizer", "adam"])):
        # grpo: --save-hf's PEFT adapter folder here, its merged folder in the resumed run (the same adapters)
        hf = ["--save-hf"] if stage == "grpo" else []
        add(f"{stage}/straight", _argv_iters(task, stage, root / stage / "straight", 2, extra + hf), check=True)
        # full activation recompute: the same run bit for bit (the frozen base leaves the first layer's input
        # without grad unless the embedding's output requires it: the adapters would get no gradient)
        add(f"{stage}/recompute", _argv_iters(task, stage, root / stage / "recompute", 2, extra + [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]))
        add(f"{stage}/first", _argv_iters(task, stage, root / stage / "resumed", 1, extra))
        add(f"{stage}/resumed", _argv_iters(task, stage, root / stage / "resumed", 2,
                                            extra + (hf and ["--save-hf", "--save-hf-merge-lora"]),
                                            load=root / stage / "resumed" / "save"))
    # iteration 1 of the same runs without LoRA (zero-initialised adapters: --lora-target-modules, no --lora-load)
    for stage in ("trl_ppo", "grpo"):
        add(f"{stage}/full", _argv_iters(task, stage, root / stage / "full", 1, lora=False, steps=1))
        add(f"{stage}/zero_lora", _argv_iters(task, stage, root / stage / "zero_lora", 1, ["--lora-target-modules",
                                                                                           *TARGETS], lora=False,
                                              steps=1))
    grpo_save = root / "grpo" / "resumed" / "save"
    errors = {
        "full_into_lora": _argv_iters(task, "grpo", root / "e1", 2, load=root / "grpo" / "full" / "save"),
        "lora_into_full": _argv_iters(task, "grpo", root / "e2", 2, ["--bf16"], load=grpo_save, lora=False),
        "other_flags": _argv_iters(task, "grpo", root / "e3", 2, ["--bf16", "--lora-r", "4", "--lora-alpha", "8",
                                                                  "--lora-target-modules", "linear_qkv"],
                                   load=grpo_save, lora=False),
        "flag_vs_adapter": _argv_iters(task, "grpo", root / "e4", 1, ["--lora-r", "8"]),
        # past the --lora-load base check (--allow-base-mismatch): the resume's own check of the trained adapters
        "other_base": _argv_iters(task, "grpo", root / "e5", 2, ["--bf16", "--ref-model", task["other_actor"],
                                                                 "--allow-base-mismatch"], load=grpo_save),
        # --lora-load onto another model of the same shape: a PEFT folder naming its base, an adapter checkpoint's
        # recorded fingerprints (this rank's, at the adapter's layout and precision)
        "peft_other_base": _argv_iters(task, "grpo", root / "e6", 1, ["--ref-model", task["other_actor"]]),
        "adapter_other_base": _argv_iters(task, "grpo", root / "e7", 1, [
            "--bf16", "--lora-load", str(grpo_save / "actor"), "--ref-model", task["other_actor"]], lora=False),
    }
    # its own base, in another precision than it trained in: its fingerprints recomputed from the base checkpoint
    add("grpo/adapter_own_base_fp32", _argv_iters(task, "grpo", root / "own_base", 1, [
        "--lora-load", str(grpo_save / "actor")], lora=False))
    for label, argv in errors.items():
        add(f"error/{label}", argv)
    results = run_distributed(_stage_body, 1, runs)[0]
    return root, dict(zip(labels, results))


def test_lora_runs_succeed(resume_runs):
    _, results = resume_runs
    for label, (code, err, _) in results.items():
        if not label.startswith("error/"):
            assert code == 0, f"{label}: {err}"


@pytest.mark.parametrize("stage", ["trl_ppo", "grpo"])
def test_resume_is_bit_exact(resume_runs, stage):
    root, _ = resume_runs
    straight, resumed = root / stage / "straight", root / stage / "resumed"
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    skip = SKIPPED
    last, last_again = ({k: v for k, v in r[-1].items() if not k.startswith(skip)} for r in (rows, again))
    assert last["iteration"] == last_again["iteration"] == 2
    assert last == last_again
    for role in (["actor", "critic"] if stage == "trl_ppo" else ["actor"]):
        a, b = _payload(straight / "save", role, 2), _payload(resumed / "save", role, 2)
        for part in ("model", "optimizer"):
            fa, fb = dict(_flat(a[part])), dict(_flat(b[part]))
            assert sorted(fa) == sorted(fb)
            for key in fa:
                assert torch.equal(fa[key], fb[key]), f"{stage} {role} {part}{key}"


def test_save_hf_of_a_lora_actor_is_a_peft_folder_or_merged(resume_runs):
    """--save-hf of a LoRA grpo run: a PEFT adapter folder naming the Hugging Face model of its base, which peft
    loads onto that model; --save-hf-merge-lora of the bit-identical resumed run: full weights with the same
    logits (and not the base's); each noted in the run record."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = resume_runs
    folders = {run: root / "grpo" / run / "save" / "actor" / "iter_0000002" / "hf" for run in ("straight", "resumed")}
    for run, kind in (("straight", "peft"), ("resumed", "merged")):
        record = json.loads((folders[run].parent / "run_record.json").read_text())
        assert record["hf"] == {"dir": "hf", "format": kind}
    base_name = json.loads((folders["straight"] / "adapter_config.json").read_text())["base_model_name_or_path"]
    ids = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32).eval()
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, folders["straight"]).float().eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(folders["resumed"], dtype=torch.float32).eval()(ids).logits
    assert (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stage", ["trl_ppo", "grpo"])
def test_full_recompute_gives_the_same_run(resume_runs, stage):
    """Full recompute: the same metrics and adapters (to float rounding: with a frozen base, autograd sums the
    checkpointed layers' input gradients in another order; grpo here is bit-identical, trl_ppo's metrics within
    ~1e-7, its adapters after two Adam steps within ~1e-4)."""
    root, _ = resume_runs
    plain, recomputed = root / stage / "straight", root / stage / "recompute"
    rows = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (recomputed / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(again) == 2
    for row, other in zip(rows, again):
        for key, value in row.items():
            if not key.startswith(SKIPPED):
                assert math.isclose(other[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, other[key], value)
    for role in (["actor", "critic"] if stage == "trl_ppo" else ["actor"]):
        a, b = _payload(plain / "save", role, 2)["model"], _payload(recomputed / "save", role, 2)["model"]
        # Adam's per-element normalisation lifts the rounding of small gradients (measured up to 1.2e-4 on the
        # critic's B after two steps); a gradient lost under recompute leaves its B at 0, a difference of 1
        for k in a:
            assert relative(b[k].float(), a[k].float()) <= 1e-3, (role, k)
        if stage == "trl_ppo":  # the adapters did train under recompute (a lost gradient leaves B at its start)
            assert any(float(b[k].float().norm()) > 0 for k in b if k.endswith(".lora.B")), role


@pytest.mark.parametrize("stage", ["trl_ppo", "grpo"])
def test_checkpoints_hold_adapters_only(resume_runs, task, stage):
    """The adapters (and the critic's head), their optimizer state and the base; bf16 adapters keep fp32 masters."""
    root, _ = resume_runs
    for role in (["actor", "critic"] if stage == "trl_ppo" else ["actor"]):
        payload = _payload(root / stage / "straight" / "save", role, 2)
        keys = sorted(payload["model"])
        assert keys and all(k.endswith((".lora.A", ".lora.B")) or k == "output_layer.weight" for k in keys), keys
        assert ("output_layer.weight" in keys) == (role == "critic")
        meta = payload["lora"]
        base = task["mg_actor_tp1pp1"] if role == "actor" else task["mg_reward_tp1pp1"]
        assert meta["base"]["path"] == os.path.abspath(base) and len(meta["base"]["fingerprint"]) == 64
        assert meta["config"]["target_modules"] == TARGETS
        if stage == "grpo":  # bf16 adapters, fp32 main copies of exactly them in the optimizer
            assert all(v.dtype == torch.bfloat16 for v in payload["model"].values())
            masters = [t for k, t in _flat(payload["optimizer"]) if "fp32_from_fp16" in k]
            assert masters and all(t.dtype == torch.float32 for t in masters)
            assert sum(t.numel() for t in masters) == sum(v.numel() for v in payload["model"].values())
        # the optimizer state is that of the trained tensors only: Adam's two moments (and bf16's fp32 masters)
        trained = sum(v.numel() for v in payload["model"].values())
        state = sum(t.numel() for k, t in _flat(payload["optimizer"]) if t.dim() > 0)
        assert state == trained * (3 if stage == "grpo" else 2), (state, trained)
        from mindspeed_llm.checkpoint import load_shard

        base_numel = sum(v.numel() for v in load_shard(base, 0, 0)["model"].values() if torch.is_tensor(v))
        assert trained < base_numel / 3, (trained, base_numel)


def test_frozen_roles_share_the_trained_bases(resume_runs):
    _, results = resume_runs
    for stage in ("trl_ppo", "grpo"):
        info = results[f"{stage}/straight"][2]
        assert info["reference_is_actor"], stage
        # its log-probs are the initial policy's (the base with the loaded adapter), not the trained actor's
        assert info["reference_diff"] <= 1e-5 < 1e-3 < info["actor_vs_base"], info
        assert all(".lora." in name for name in info["trained"])
    info = results["trl_ppo/straight"][2]
    assert info["reward_is_critic"]
    assert info["head_moved"] > 1e-3  # the critic's head trained ...
    assert info["reward_diff"] <= 1e-7  # ... the reward model scores with the checkpoint's


@pytest.mark.parametrize("stage", ["trl_ppo", "grpo"])
def test_zero_adapters_first_iteration_equals_full_run(resume_runs, stage):
    """B = 0: the LoRA model is the base, so iteration 1's rollout, scores, KL, values and losses are the full run's
    (the reference and the reward model being the shared bases); only the gradients' parameters differ."""
    root, _ = resume_runs
    full, zero = metrics_row(root / stage / "full"), metrics_row(root / stage / "zero_lora")
    differ = ("grad_norm", "actor/grad_norm", "critic/grad_norm")
    for key, expected in full.items():
        if key in differ:
            continue
        assert math.isclose(zero[key], expected, rel_tol=1e-5, abs_tol=1e-6), (key, zero[key], expected)


@pytest.mark.parametrize("label,message", [
    ("full_into_lora", "holds full weights"),
    ("lora_into_full", "holds LoRA adapters"),
    ("other_flags", "--lora-target-modules"),
    ("flag_vs_adapter", "--lora-r 8 does not match the adapter of --lora-load"),
    ("other_base", "trained on another base model"),
    ("peft_other_base", "its adapter_config.json names the base"),
    ("adapter_other_base", "its adapters were trained on"),
])
def test_lora_checkpoint_errors_name_the_problem(resume_runs, label, message):
    _, results = resume_runs
    code, err, _ = results[f"error/{label}"]
    assert code == 2 and message in err, err
