"""The typed settings of a run (`mindspeed_llm/rl/settings.py`): what `validate_args` builds from a command line
(hand-computed cases), frozen, and every field's default the parser's own (read from the parser, so a default that
drifts on either side fails here); the parser's choice lists read from the registries; the experts' layout rule
(`mindspeed_llm/expert_layout.py`) that the parser and the converter share."""

import dataclasses

import pytest

from mindspeed_llm.arguments import build_parser, parse_args, validate_args
from mindspeed_llm.rl import settings as run_settings

BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "4",
        "--global-batch-size", "4", "--ref-model", "r"]
PPO = ["--stage", "trl_ppo", "--data-path", "d", "--train-iters", "4", "--global-batch-size", "4", "--ref-model", "r",
       "--reward-model", "rm"]


def test_a_parsed_command_line_gives_its_settings():
    args = parse_args(BASE + ["--clip-ratio", "0.3", "--temperature", "0.7", "--stop-token-ids", "7,9",
                              "--verifier-function", "math_acc", "format", "--verifier-weight", "1", "0.5",
                              "--offload-train-grad", "--ppo-epochs", "2", "--max-new-tokens", "16",
                              "--max-prompt-length", "32", "--overlong-buffer-len", "4"])
    s = args.settings
    assert s.sampling == run_settings.SamplingSettings(
        do_sample=False, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=16, max_length=48,  # 32 + 16
        stop_token_ids=(7, 9), seed=1234)
    assert s.loss == run_settings.LossSettings(
        temperature=0.7, clip_ratio=0.3, clip_ratio_high=0.3,  # clip-higher defaults to --clip-ratio
        loss_agg_mode="token-mean", max_new_tokens=16, kl_penalty="low_var_kl")  # grpo's KL estimator
    # 4 prompts x grpo's 8 samples: one mini-batch of the whole batch
    assert s.update == run_settings.UpdateSchedule(ppo_epochs=2, ppo_mini_batch_size=32, seed=1234)
    assert s.reward == run_settings.RewardMixing(verifier_function=("math_acc", "format"), verifier_weight=(1.0, 0.5),
                                                 overlong_buffer_len=4, max_new_tokens=16)
    assert s.offload == run_settings.OffloadSettings(offload_train_grad=True)

    ppo = parse_args(PPO + ["--policy-loss", "gspo", "--offload-ref-reward", "--seed", "7", "--top-k", "5"]).settings
    assert (ppo.loss.kl_penalty, ppo.loss.loss_agg_mode) == ("k1", "seq-mean-token-mean")  # trl_ppo's, gspo's
    assert (ppo.update.ppo_mini_batch_size, ppo.update.seed, ppo.sampling.seed, ppo.sampling.top_k) == (4, 7, 7, 5)
    assert ppo.reward.verifier_function == () and ppo.offload.offload_ref_reward


def test_each_trained_role_gets_its_optimizer_from_the_settings():
    """`OptimizerFlags.for_role`: the actor's --lr, the critic's --critic-lr (--lr when not given), the warmup from
    --lr-warmup-fraction x --train-iters, the decay over --train-iters by default, the resume rule of the scheduler
    flags, and --fp16's grad-scaler flags (megatron's defaults for those not given)."""
    flags = parse_args(PPO + ["--lr", "2e-6", "--critic-lr", "5e-6", "--lr-warmup-fraction", "0.5", "--fp16",
                              "--override-opt_param-scheduler", "--initial-loss-scale", "4096"]).settings.optimizer
    actor, critic = flags.for_role("actor"), flags.for_role("critic")
    assert (actor.lr, actor.lr_flag, critic.lr, critic.lr_flag) == (2e-6, "--lr", 5e-6, "--critic-lr")
    assert (actor.lr_warmup_iters, actor.lr_decay_iters, actor.schedule_on_resume) == (2, 4, "override")
    assert (actor.params_dtype, actor.initial_loss_scale, actor.hysteresis) == ("fp16", 4096.0, 2)
    assert critic == dataclasses.replace(actor, lr=5e-6, lr_flag="--critic-lr")
    default = parse_args(PPO + ["--lr", "3e-6", "--lr-decay-iters", "9", "--use-checkpoint-opt_param-scheduler"])
    critic = default.settings.optimizer.for_role("critic")
    assert (critic.lr, critic.lr_decay_iters, critic.schedule_on_resume) == (3e-6, 9, "checkpoint")
    assert critic.initial_loss_scale == 2.0 ** 32  # megatron's default: no --fp16 here


def test_validate_args_returns_the_settings_it_attaches():
    args = build_parser().parse_args(BASE)
    assert validate_args(args, 1) is args.settings


@pytest.mark.parametrize("part", run_settings.PARTS)
def test_settings_are_frozen(part):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(part(), dataclasses.fields(part)[0].name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run_settings.Settings().loss = part()


def test_every_default_is_the_parsers():
    parser = build_parser()
    dests = {action.dest for action in parser._actions}
    assert {f.name for f in dataclasses.fields(run_settings.Settings)} == {
        "sampling", "loss", "update", "reward", "judge", "offload", "distill", "algorithm", "tools", "batch", "models",
        "parallel", "data", "checkpoint", "loop", "wandb", "profile", "startup", "model", "optimizer", "lora", "moe",
        "recompute"}
    for part in run_settings.PARTS:
        for f in dataclasses.fields(part):
            if f.metadata.get("derived"):  # validate_args works it out of several flags: no flag of its own
                assert f.name not in dests, f"{part.__name__}.{f.name} is a flag's destination, not derived"
                continue
            assert f.name in dests, f"{part.__name__}.{f.name} is no flag's destination"
            default = parser.get_default(f.name)
            default = tuple(default) if isinstance(default, list) else default
            assert f.default == default, f"{part.__name__}.{f.name}: {f.default!r}, the parser's {default!r}"


def test_the_choice_lists_are_the_registries(monkeypatch):
    from mindspeed_llm.rl import core_algos, stages

    def choices(parser, flag):
        return next(a.choices for a in parser._actions if flag in a.option_strings)

    parser = build_parser()
    assert tuple(choices(parser, "--stage")) == ("trl_ppo", "grpo")
    assert tuple(choices(parser, "--kl-penalty")) == ("k1", "k2", "k3", "low_var_kl", "abs")
    assert tuple(choices(parser, "--adv-scale")) == ("group", "batch", "none")
    assert tuple(choices(parser, "--loss-agg-mode")) == (
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    # a stage or an estimator kind added to the registry is a choice at once
    monkeypatch.setitem(stages.STAGES, "planted_stage", object)
    monkeypatch.setattr(core_algos, "KL_KINDS", core_algos.KL_KINDS + ("planted_kl",))
    parser = build_parser()
    assert "planted_stage" in choices(parser, "--stage") and "planted_kl" in choices(parser, "--kl-penalty")


@pytest.mark.parametrize("tp,ep,etp,extend,expected", [
    (1, 3, None, False, (3, 1)),  # expert TP follows TP
    (2, 2, None, False, (2, 2)),
    (2, 2, 1, False, (2, 1)),  # experts whole, EP a multiple of TP
    (2, 2, None, True, (4, 1)),  # --moe-tp-extend-ep: EP x TP ranks, experts whole
    (2, 1, 1, True, (2, 1)),
    (2, 1, 2, True, "extend_with_expert_tp"),
    (2, 1, 4, False, "expert_tp_not_1_or_tp"),
    (2, 1, 1, False, "ep_not_multiple_of_tp"),
    (2, 3, 1, False, "ep_not_multiple_of_tp"),
])
def test_the_expert_layout_rule(tp, ep, etp, extend, expected):
    from mindspeed_llm.expert_layout import ExpertLayoutError, resolve_expert_layout

    if isinstance(expected, str):
        with pytest.raises(ExpertLayoutError) as caught:
            resolve_expert_layout(tp, ep, etp, extend)
        assert caught.value.rule == expected
    else:
        assert resolve_expert_layout(tp, ep, etp, extend) == expected


def test_parser_and_converter_resolve_the_experts_alike():
    """Both callers of the rule, on the same numbers: the same layout, or an error naming each one's flags."""
    from types import SimpleNamespace

    from mindspeed_llm.arguments import ArgumentError
    from mindspeed_llm.checkpoint.convert import expert_layout
    from mindspeed_llm.checkpoint.errors import ConversionError

    moe = SimpleNamespace(is_moe=True, family="qwen3_moe")
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                              "--moe-tp-extend-ep"], world_size=8)
    parallel = args.settings.parallel
    assert (parallel.expert_parallel_size, parallel.expert_tensor_parallel_size) == expert_layout(moe, 2, 2, None,
                                                                                                   True)
    with pytest.raises(ArgumentError, match="--expert-tensor-parallel-size 4 must be 1 or --tensor-model-parallel"):
        parse_args(BASE + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"], world_size=8)
    with pytest.raises(ConversionError, match="--expert-tensor-parallel-size 4 must be 1 or --target-tensor-parallel"):
        expert_layout(moe, 2, 1, 4)


def test_parser_does_not_import_the_stages():
    """`--help` and refused flags answer without megatron-core's import: the stage registry loads lazily."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from mindspeed_llm.arguments import build_parser; p = build_parser(); "
            "assert 'trl_ppo' in p.format_help(); print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("extra,world", [
    ([], 1),
    (["--policy-loss", "gspo", "--split", "98,2,0", "--eval-interval", "2", "--partial-rollout", "--lr-warmup-fraction",
      "0.5"], 1),
    # what Megatron-LM's validate_args writes on its args: sequence parallelism off at TP 1, recompute from
    # --recompute-activations, the experts' layout and dispatcher, the precision; LoRA's switch and its targets
    # without repeats; the startup report's ignored flags and notes
    (["--sequence-parallel", "--recompute-activations", "--expert-model-parallel-size", "2", "--bf16",
      "--lora-target-modules", "linear_qkv", "linear_qkv", "--no-rope-fusion", "--use-fused-rotary-pos-emb"], 2),
    (["--moe-layer-recompute", "--recompute-modules", "mlp", "mlp", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--moe-tp-extend-ep", "--initial-loss-scale", "8"], 4),
])
def test_validation_resolves_into_the_settings_not_the_namespace(extra, world):
    """`validate_args` writes nothing onto the Namespace but `args.settings`: its flags stay as given, and what
    follows from them (the stage defaults, derived values, model building's and the process grid's included, what
    Megatron-LM's own validate_args writes on its args, the startup report) is the settings'. No name stays for
    megatron: its global args are never set."""
    args = build_parser().parse_args(BASE + extra)
    given = dict(vars(args))
    validate_args(args, world)
    written = {name for name, value in vars(args).items() if name not in given or given[name] != value}
    assert written == {"settings"}
    assert args.kl_penalty is None and args.settings.loss.kl_penalty == "low_var_kl"  # grpo's default
    assert args.adv_estimator is None and args.settings.algorithm.adv_estimator == "grpo"
    assert args.clip_ratio_high is None and args.settings.loss.clip_ratio_high == 0.2
