"""LoRA flags (MindSpeed-LLM's names) and MindSpeed-RL's YAML keys (its grpo_lora_* configs): what maps, what is
ignored and printed, what is refused by name; convert_ckpt.py's LoRA flags' refusals. No model is built."""

import pytest

from mindspeed_llm import compat_flags
from mindspeed_llm.arguments import ArgumentError, parse_args
from tests.helpers.mindspeed_rl_configs import config_error, grpo_file, parsed, ppo_file, write

BASE = ["--stage", "grpo", "--ref-model", "m", "--data-path", "d", "--global-batch-size", "8", "--train-iters", "1",
        "--verifier-function", "math_acc"]


def test_lora_flags_parse_with_mindspeed_llm_names():
    args = parse_args(BASE + ["--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0.05", "--lora-target-modules",
                              "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_qkv"])
    lora = args.settings.lora
    assert lora.lora and (lora.lora_r, lora.lora_alpha, lora.lora_dropout) == (8, 16.0, 0.05)
    assert lora.lora_target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # without repeats
    assert parse_args(BASE + ["--lora-load", "adapter"]).settings.lora.lora
    assert not parse_args(BASE).settings.lora.lora


@pytest.mark.parametrize("extra,message", [
    (["--lora-r", "8"], "--lora-r has no effect without --lora-target-modules"),
    (["--lora-target-modules", "q_proj"], "q_proj: not a LoRA target here; the megatron-core linears are linear_qkv"),
    (["--lora-target-modules", "linear_qkv", "--lora-r", "0"], "--lora-r 0 must be >= 1"),
    (["--lora-target-modules", "linear_qkv", "--lora-alpha", "-1"], "--lora-alpha -1.0 must be a finite number > 0"),
    (["--lora-target-modules", "linear_qkv", "--lora-dropout", "1"], "--lora-dropout 1.0 must be in [0, 1)"),
    (["--lora-target-modules", "linear_qkv", "--lora-modules-to-save", "word_embeddings"],
     "--lora-modules-to-save word_embeddings: training whole modules beside the adapters is not supported"),
])
def test_bad_lora_flags_are_refused_by_name(extra, message):
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + extra)
    assert message in str(err.value)


def test_lora_with_context_parallel_is_refused():
    extra = ["--context-parallel-size", "2"]
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + ["--lora-target-modules", "linear_qkv"] + extra, 2)
    assert "with --context-parallel-size 2 is not supported" in str(err.value)
    parse_args(BASE + extra, 2)  # without LoRA the layout is valid


def test_lora_with_sequence_parallel_is_accepted():
    args = parse_args(BASE + ["--lora-target-modules", "linear_qkv", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel"], 2)
    assert args.settings.lora.lora and args.settings.model.sequence_parallel


def test_mindspeed_lora_switches_are_ignored_and_printed():
    args = parse_args(BASE + ["--lora-target-modules", "linear_qkv", "--lora-fusion", "--lora-ckpt-filter",
                              "--lora-register-forward-hook", "word_embeddings", "input_layernorm",
                              "--offload-ref-reward"])
    ignored = dict(args.settings.startup.ignored_flags)
    assert set(ignored) >= {"--lora-fusion", "--lora-ckpt-filter", "--lora-register-forward-hook"}
    lines = "\n".join(compat_flags.startup_lines(args.settings.startup, "gloo"))
    assert "CCLoRA" in lines and "adapters (and their optimizer state) only" in lines
    assert "--offload-ref-reward: with LoRA the reference is the trained models' bases" in lines


def _lora_megatron(data):
    data["megatron_training"].update(lora_r=128, lora_alpha=128, lora_fusion=True, lora_ckpt_filter=True,
                                     lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    return data


def test_mindspeed_rl_grpo_lora_keys_map_to_the_flags(tmp_path):
    """MindSpeed-RL's configs/grpo_lora_qwen25_32b_A2.yaml LoRA keys (megatron_training) and share_backbone."""
    data = _lora_megatron(grpo_file())
    data["rl_config"]["share_backbone"] = True
    got = parsed(["--config", write(tmp_path, data)], 16)
    want = parsed(["--config", write(tmp_path, grpo_file(), "plain.yaml"), "--lora-r", "128", "--lora-alpha", "128",
                   "--lora-fusion", "--lora-ckpt-filter", "--lora-target-modules", "linear_qkv", "linear_proj",
                   "linear_fc1", "linear_fc2"], 16)
    assert got == want
    assert got["lora"] and set(dict(got["ignored_flags"])) >= {"--lora-fusion", "--lora-ckpt-filter"}
    # grpo_lora.md's spelling of the filter
    data = grpo_file()
    data["megatron_training"].update(lora_target_modules=["linear_qkv"], lora_filter=True)
    assert "--lora-ckpt-filter" in dict(parsed(["--config", write(tmp_path, data)], 16)["ignored_flags"])


def test_frozen_roles_lora_keys_are_ignored_and_the_critics_must_be_the_actors(tmp_path):
    from mindspeed_llm.run_config import load_run_config

    data = _lora_megatron(ppo_file())
    data["ref_config"]["lora_r"] = 8
    data["reward_config"]["lora_target_modules"] = ["linear_qkv"]
    config = load_run_config(write(tmp_path, data))
    ignored = dict(config.ignored)
    assert "a frozen model trains no adapters" in ignored["ref_config.lora_r"]
    assert "reward_config.lora_target_modules" in ignored
    data = _lora_megatron(ppo_file())
    data["critic_config"]["lora_r"] = 8
    assert "critic_config.lora_r: 8 differs from the run's --lora-r 128" in config_error(tmp_path, data)


def test_share_backbone_needs_lora_and_false_is_refused_with_it(tmp_path):
    data = grpo_file()
    data["rl_config"]["share_backbone"] = True
    assert "needs LoRA adapters to switch off" in config_error(tmp_path, data)
    data = _lora_megatron(grpo_file())
    data["rl_config"]["share_backbone"] = False
    assert "with LoRA the reference here is always the actor's base" in config_error(tmp_path, data)
    data = grpo_file()
    data["rl_config"]["share_backbone"] = True  # LoRA from the command line
    assert parsed(["--config", write(tmp_path, data), "--lora-target-modules", "linear_qkv"], 16)["lora"]


@pytest.mark.parametrize("extra,message", [
    (["--save-lora-to-hf"], "--save-lora-to-hf writes the adapter of --lora-load DIR"),
    (["--lora-load", "x", "--save-lora-to-hf", "--save-model-type", "mg"], "use --save-model-type hf"),
])
def test_convert_lora_flags_refused_by_name(tmp_path, capsys, extra, message):
    import convert_ckpt

    argv = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path), "--save-dir",
            str(tmp_path / "out")] + extra
    assert convert_ckpt.main(argv) == 1
    assert message in capsys.readouterr().err


def test_a_rank_above_what_a_linear_can_use_is_named():
    """B A of a linear with in x out has rank at most min(in, out): an adapter rank above it is named at startup
    (which linears, their widths, the rank given); ranks that fit say nothing."""
    from types import SimpleNamespace

    from mindspeed_llm.rl.update.lora import rank_note

    def model(rank):
        adapters = {f"decoder.layers.{i}.self_attention.{leaf}": SimpleNamespace(rank=rank, in_features=n_in,
                                                                                out_features=n_out)
                    for i in range(2) for leaf, n_in, n_out in (("linear_qkv", 64, 192), ("linear_proj", 64, 64))}
        adapters["decoder.layers.0.mlp.linear_fc2"] = SimpleNamespace(rank=rank, in_features=24, out_features=64)
        return SimpleNamespace(lora_adapters=adapters)

    assert rank_note(model(16)) is None
    note = rank_note(model(32))
    assert note.startswith("note: the LoRA rank is above what these linears can use") and \
        "linear_fc2 (1 on this rank, 24 -> 64: rank at most 24, given 32)" in note and "linear_qkv" not in note
    note = rank_note(model(128))
    assert "linear_proj (2 on this rank, 64 -> 64: rank at most 64, given 128)" in note and \
        "linear_qkv (2 on this rank, 64 -> 192: rank at most 64, given 128)" in note


def test_the_critics_adapters_take_the_actors_config():
    """The actor's adapters may take an adapter's own r / alpha / dropout / targets (--lora-load); trl_ppo's critic
    gets fresh adapters of that same config (`roles.RoleFactory` hands it on through `lora.as_flags`), without the
    adapter's stacked ranks."""
    from mindspeed_llm.models.lora import LoRAConfig
    from mindspeed_llm.rl.update.lora import as_flags, run_config

    flags = parse_args(BASE + ["--lora-load", "adapter"]).settings.lora  # no r / alpha given: the adapter's apply
    actor = LoRAConfig(r=4, alpha=8.0, dropout=0.1, target_modules=("linear_proj", "linear_qkv"),
                       ranks={"decoder.layers.0.self_attention.linear_qkv": 12})
    assert run_config(as_flags(actor, flags)) == LoRAConfig(r=4, alpha=8.0, dropout=0.1,
                                                            target_modules=("linear_proj", "linear_qkv"))
    # without an adapter the flags' own config (MindSpeed-LLM's defaults r 16, alpha 32)
    plain = parse_args(BASE + ["--lora-target-modules", "linear_qkv"]).settings.lora
    assert run_config(plain) == LoRAConfig(r=16, alpha=32.0, dropout=0.0, target_modules=("linear_qkv",))
