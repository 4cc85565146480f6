"""`posttrain_gpt.py --config FILE.yaml`: MindSpeed-RL run configs mapped onto this program's flags
(`mindspeed_llm/run_config/`).

* every section maps as the equivalent command line parses (grpo and PPO files in MindSpeed-RL's layout, a model
  from `model/NAME.yaml`, roles of different models), and the shipped configs/rl files equal their launchers;
* the command line overrides the file (exclusive switches included);
* unknown keys (naming key, section, file, the nearest key), wrong types (naming key and file), settings this
  program cannot honour, and ignored keys (listed once, on rank 0);
* the checkpoint mapping: first run, resume, fine-tune from a save, and every combination that cannot map;
* end to end (a first-run file trains, its resume file resumes): tests/dist/test_stages_run_config.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindspeed_llm.arguments import ArgumentError, build_parser
from mindspeed_llm.run_config import GENERATE, MEGATRON, RL, SAMPLING, ConfigError, Flag, config_argv, load_run_config
from tests.helpers.mindspeed_rl_configs import (GRPO_FLAGS, GRPO_IGNORED, PPO_FLAGS, QWEN25_7B, actor_config,
                                                config_error, converted_model, generate_config, grpo_file,
                                                megatron_training, parsed, ppo_file, save_root, write)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ MindSpeed-RL files


def test_every_flag_of_the_tables_is_a_flag_of_the_parser():
    actions = build_parser()._option_string_actions
    for table in (MEGATRON, RL, GENERATE, SAMPLING):
        for key, entry in table.items():
            if isinstance(entry, Flag):
                assert entry.flag in actions, f"{key} -> {entry.flag}"


def test_grpo_file_maps_as_its_command_line(tmp_path):
    path = write(tmp_path, grpo_file())
    assert parsed(["--config", path], 16) == parsed(GRPO_FLAGS, 16)
    config = load_run_config(path)
    assert [key for key, _ in config.ignored] == GRPO_IGNORED
    assert not config.notes


def test_ppo_file_maps_as_its_command_line(tmp_path):
    path = write(tmp_path, ppo_file())
    assert parsed(["--config", path], 16) == parsed(PPO_FLAGS, 16)
    ignored = [key for key, _ in load_run_config(path).ignored]
    # a frozen model's optimizer keys and load flags mean nothing
    assert "reward_config.lr" in ignored and "reward_config.no_load_optim" in ignored
    assert "rl_config.critic_resource" in ignored


def test_model_from_a_model_file_next_to_the_config(tmp_path):
    data = grpo_file()
    del data["model"]
    write(tmp_path, {"qwen25_7b": QWEN25_7B}, "model/qwen25_7b.yaml")
    assert parsed(["--config", write(tmp_path, data)], 16) == parsed(GRPO_FLAGS, 16)
    data["defaults"] = [{"model": ["qwen25_7b"]}, "_self_"]
    data["megatron_training"]["model"] = data["actor_config"]["model"] = "qwen25_14b"  # defined nowhere
    config = load_run_config(write(tmp_path, data))
    assert not any(flag.startswith("--num-layers") for flag in config.argv)
    assert any("model 'qwen25_14b' is not defined" in note for note in config.notes)


def test_roles_of_different_models_leave_the_architecture_to_the_checkpoints(tmp_path):
    data = ppo_file()
    data["model"]["qwen25_1b_rm"] = {"num_layers": 4, "hidden_size": 896}
    data["reward_config"]["model"] = "qwen25_1b_rm"
    config = load_run_config(write(tmp_path, data))
    assert not any(token.startswith(("--num-layers", "--hidden-size", "--swiglu")) for token in config.argv)
    assert any("different models" in note for note in config.notes)
    assert parsed(["--config", write(tmp_path, data)], 16)["num_layers"] is None


@pytest.mark.parametrize("config,launcher,nodes", [
    ("configs/rl/trl_ppo_llama32_1b.yaml", "examples/mcore/llama32/trl_ppo_llama32_1b.sh", 2),
    ("configs/rl/grpo_qwen25_7b.yaml", "examples/mcore/qwen25/grpo_qwen25_7b.sh", 2),
    ("configs/rl/ppo_qwen25_32b.yaml", "examples/mcore/qwen25/ppo_qwen25_32b.sh", 4),
    ("configs/rl/grpo_qwen3_30b_a3b.yaml", "examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh", 2),
])
def test_shipped_configs_equal_their_launchers(tmp_path, config, launcher, nodes):
    """The launcher's command line (recorded by a stub) and the file plus the launcher's run-control flags
    (auto-resume --load, SIGTERM handler, metrics file) parse to the same arguments."""
    stub, record = tmp_path / "stub.py", tmp_path / "argv.json"
    stub.write_text("import json, sys\njson.dump(sys.argv[2:], open(sys.argv[1], 'w'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NPUS_PER_NODE", "NODE_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "CURRENT_IP", "TP", "PP", "EP")}
    env.update(PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=str(tmp_path / "log"), NPUS_PER_NODE="8",
               NNODES=str(nodes), NODE_RANK="0", MASTER_ADDR="10.0.0.1", CURRENT_IP="10.0.0.1")
    result = subprocess.run(["bash", str(ROOT / launcher)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    launched = argv[argv.index("posttrain_gpt.py") + 1:]
    save = launched[launched.index("--save") + 1]
    from_file = ["--config", str(ROOT / config), "--load", save, "--exit-signal-handler",
                 "--metrics-jsonl", f"{save}/metrics.jsonl"]
    assert parsed(from_file, 8 * nodes) == parsed(launched, 8 * nodes)


def test_tiny_configs_map(tmp_path):
    args = parsed(["--config", ROOT / "configs/rl/trl_ppo_tiny.yaml"])
    assert (args["stage"], args["ref_model"], args["reward_model"], args["reward_model_weight"]) == \
        ("trl_ppo", "runs/tiny_trl_ppo/mg_model", "runs/tiny_trl_ppo/mg_value", 0.0)
    assert (args["save"], args["load"], args["critic_lr"], args["stop_token_ids"]) == \
        ("runs/tiny_trl_ppo_yaml/ckpt", None, 1e-3, [198, 1116])
    args = parsed(["--config", ROOT / "configs/rl/trl_ppo_tiny_resume.yaml"])
    assert (args["load"], args["ref_model"], args["finetune"], args["no_load_optim"], args["train_iters"]) == \
        ("runs/tiny_trl_ppo_yaml/ckpt", "runs/tiny_trl_ppo/mg_model", False, False, 4)
    assert args["reward_model"] == "runs/tiny_trl_ppo_yaml/ckpt/critic"  # its own latest weights start the critic
    args = parsed(["--config", ROOT / "configs/rl/grpo_tiny.yaml"])
    assert (args["stage"], args["n_samples_per_prompt"], args["ref_model"]) == ("grpo", 2, "runs/tiny_grpo/mg_model")


def test_the_launcher_runs_the_two_tiny_configs():
    text = (ROOT / "examples/mcore/tiny/trl_ppo_tiny_yaml.sh").read_text()
    assert "--config configs/rl/trl_ppo_tiny.yaml" in text or "configs/rl/trl_ppo_tiny.yaml" in text
    assert "configs/rl/trl_ppo_tiny_resume.yaml" in text
    subprocess.run(["bash", "-n", str(ROOT / "examples/mcore/tiny/trl_ppo_tiny_yaml.sh")], check=True)


# ------------------------------------------------------------------------------------------ the command line wins
def test_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, grpo_file())
    args = parsed(["--config", path, "--lr", "1e-3", "--tensor-model-parallel-size", "8", "--fp16",
                   "--verifier-function", "format", "--ref-model", "/elsewhere", "--temperature", "0.5"], 16)
    assert (args["lr"], args["tensor_model_parallel_size"], args["fp16"], args["bf16"]) == (1e-3, 8, True, False)
    assert (args["verifier_function"], args["ref_model"], args["temperature"]) == (["format"], "/elsewhere", 0.5)
    assert args["weight_decay"] == 0.01 and args["do_sample"]  # the rest is the file's
    # --config=FILE and the flags in any order
    assert parsed(["--lr", "1e-3", f"--config={path}"], 16)["lr"] == 1e-3
    # without --config the command line is untouched
    assert config_argv(["--stage", "grpo", "--lr", "1"]) == ["--stage", "grpo", "--lr", "1"]


def test_command_line_supplies_what_the_file_lacks(tmp_path):
    data = grpo_file()
    data["actor_config"].update(finetune=False, load="./ckpt/qwen25_7b")  # a resume without the reference's path
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match="ref_model_load_path"):
        parsed(["--config", path], 16)
    args = parsed(["--config", path, "--ref-model", "./model_weights/qwen25_7b_mcore"], 16)
    assert (args["load"], args["ref_model"]) == ("./ckpt/qwen25_7b", "./model_weights/qwen25_7b_mcore")


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("section,key,near", [
    ("megatron_training", "global_batch_sise", "global_batch_size"),
    ("actor_config", "npu_count", None),
    ("rl_config", "clip_ratioo", "clip_ratio"),
    ("generate_config", "gpu_mem", None),
])
def test_unknown_key_names_key_section_file_and_nearest(tmp_path, section, key, near):
    data = grpo_file()
    data[section][key] = 1
    message = config_error(tmp_path, data)
    assert f"unknown key '{key}' in section '{section}'" in message
    if near:
        assert f"did you mean '{near}'" in message
    else:
        assert "the known keys of" in message


def test_unknown_nested_keys_and_sections(tmp_path):
    data = grpo_file()
    data["rl_config"]["integrated_mode_config"] = {"ref_model_path": "x"}
    assert "unknown key 'ref_model_path' in section 'rl_config.integrated_mode_config' (did you mean " \
           "'ref_model_load_path'?)" in config_error(tmp_path, data)
    data = grpo_file()
    data["generate_config"]["sampling_config"]["top_kk"] = 5
    assert "'generate_config.sampling_config' (did you mean 'top_k'?)" in config_error(tmp_path, data)
    data = grpo_file()
    data["model"]["qwen25_7b"]["num_layer"] = 28
    assert "unknown key 'num_layer' in section 'model.qwen25_7b' (did you mean 'num_layers'?)" in \
        config_error(tmp_path, data)
    data = grpo_file()
    data["rl_confg"] = {}
    assert "unknown section 'rl_confg' (did you mean 'rl_config'?)" in config_error(tmp_path, data)


@pytest.mark.parametrize("section,key,value,expected", [
    ("actor_config", "lr", "fast", "actor_config.lr: 'fast' is not a number (it sets --lr)"),
    ("megatron_training", "train_iters", 2.5, "megatron_training.train_iters: 2.5 is not an integer"),
    ("megatron_training", "bf16", "yes", "megatron_training.bf16: 'yes' is not true or false"),
    ("actor_config", "load", ["a", "b"], "actor_config.load: ['a', 'b'] is not a path"),
    ("rl_config", "n_samples_per_prompt", True, "rl_config.n_samples_per_prompt: True is not an integer"),
    ("rl_config", "verifier_weight", ["high"], "rl_config.verifier_weight: ['high'] is not a number"),
    ("actor_config", "lr_decay_style", "exp", "actor_config.lr_decay_style: 'exp' is not one of constant, linear"),
    ("rl_config", "integrated_mode_config", "/path", "rl_config.integrated_mode_config: must be a mapping"),
    ("rl_config", "verifier_function", 3, "rl_config.verifier_function: 3 is not a list of names"),
])
def test_wrong_type_names_key_and_file(tmp_path, section, key, value, expected):
    data = grpo_file()
    data[section][key] = value
    assert expected in config_error(tmp_path, data)


@pytest.mark.parametrize("section,key,value,expected", [
    ("megatron_training", "reuse_fp32_param", True, "fp32 main-weight reuse is not implemented"),
    ("actor_config", "num_layer_list", "16,17,16,15", "the layers are split evenly over the pipeline stages"),
    ("rl_config", "use_kl_in_reward", True, "the KL to the reference is a loss term (grpo) in this run"),
    ("actor_config", "attention_mask_type", "general", "the models here are causal decoders"),
    ("megatron_training", "stage", "ray_dpo", "'ray_dpo' is not a stage of this program"),
    ("actor_config", "no_save_rng", True, "this program always saves the RNG state"),
    ("rl_config", "kl_ctrl_type", "adaptive", "the KL coefficient is fixed here"),
    ("rl_config", "shuffle_minibatch", True, "mini-batches are taken in order"),
    ("rl_config", "kl_penalty", "full", "'full' is not a KL estimator"),
    ("rl_config", "adv_estimator", "gae", "gae needs a critic, but the stage is grpo"),
    ("rl_config", "verifier_function", ["acc"], "'acc' is not a verifier of this program; the valid names are: "),
    ("generate_config", "dtype", "float16", "float16 differs from the training precision (bf16)"),
    ("generate_config", "max_model_len", 1024, "1024 is less than rl_config.max_prompt_length 2048"),
])
def test_settings_that_cannot_be_honoured(tmp_path, section, key, value, expected):
    data = grpo_file()
    data[section][key] = value
    message = config_error(tmp_path, data)
    assert f"{section}.{key}" in message and expected in message, message


def test_group_norm_is_grpos(tmp_path):
    data = ppo_file()
    data["rl_config"]["adv_estimator"] = "group_norm"
    assert "rl_config.adv_estimator: group_norm is critic-free" in config_error(tmp_path, data)


def test_role_settings_must_be_the_actors(tmp_path):
    data = ppo_file()
    data["critic_config"]["weight_decay"] = 0.1
    message = config_error(tmp_path, data)
    assert "critic_config.weight_decay: 0.1 differs from the run's --weight-decay 0.01" in message
    assert "critic_config.lr is the critic's own" in message
    data = ppo_file()
    data["reward_config"]["tensor_model_parallel_size"] = 8
    assert "reward_config.tensor_model_parallel_size: 8 differs" in config_error(tmp_path, data)
    # the command line's value overrides the file's for every role
    assert parsed(["--config", write(tmp_path, data), "--tensor-model-parallel-size", "8"], 16)[
        "tensor_model_parallel_size"] == 8
    data = grpo_file()
    data["critic_config"] = {"lr": 1e-5}
    assert "grpo trains no critic" in config_error(tmp_path, data)


def test_rule_reward(tmp_path):
    data = grpo_file()
    del data["rl_config"]["verifier_function"]  # MindSpeed-RL's default verifier list
    assert parsed(["--config", write(tmp_path, data)], 16)["verifier_function"] == ["base_acc"]
    data = grpo_file()
    data["rl_config"].update(rule_reward=False, verifier_function=["format"])  # the lists then mean nothing
    config = load_run_config(write(tmp_path, data), ["--reward-model", "rm"])
    assert not any(token.startswith("--verifier") for token in config.argv)
    assert ("rl_config.verifier_function", "rule_reward is false") in config.ignored
    assert parsed(["--config", write(tmp_path, data), "--reward-model", "rm"], 16)["verifier_function"] == []


def test_ignored_keys_are_listed_once_on_rank_0(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, grpo_file())
    monkeypatch.setenv("RANK", "0")
    config_argv(["--config", path])
    out = capsys.readouterr().out
    assert f"--config {path}: {len(GRPO_IGNORED)} keys have no meaning here and are ignored:" in out
    for key in GRPO_IGNORED:
        assert out.count(f"  {key}: ") == 1, key
    monkeypatch.setenv("RANK", "1")
    config_argv(["--config", path])
    assert capsys.readouterr().out == ""


def test_config_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config_argv(["--config", str(tmp_path / "missing.yaml")])
    (tmp_path / "bad.yaml").write_text("rl_config: [unclosed\n")
    with pytest.raises(ConfigError, match=f"--config {tmp_path / 'bad.yaml'}: line 2, column 1: not valid YAML"):
        config_argv(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ConfigError, match="given twice"):
        config_argv(["--config", "a.yaml", "--config", "b.yaml"])
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        config_argv(["--config", write(tmp_path, ["a"])])


@pytest.mark.parametrize("text,expected", [
    # a null or empty value would leave the default in its place
    ("megatron_training:\n  seq_length: 64\n  lr: ~\n", "line 3: 'megatron_training.lr' has no value"),
    ("megatron_training:\n  lr:\n  seq_length: 64\n", "line 2: 'megatron_training.lr' has no value"),
    ("rl_config:\n  clip_ratio: null\n", "line 2: 'rl_config.clip_ratio' has no value"),
    # a key given twice, anywhere: YAML keeps the last
    ("megatron_training:\n  lr: 1.0e-6\n  seq_length: 64\n  lr: 1.0e-5\n",
     "'megatron_training.lr' is given twice (lines 2 and 4)"),
    ("rl_config:\n  clip_ratio: 0.2\nactor_config:\n  lr: 1.0e-6\nrl_config:\n  kl_coef: 0.1\n",
     "'rl_config' is given twice (lines 1 and 5)"),
    ("model:\n  tiny:\n    num_layers: 2\n    hidden_size: 8\n    num_layers: 4\n",
     "'model.tiny.num_layers' is given twice (lines 3 and 5)"),
])
def test_null_values_and_repeated_keys_are_refused_with_their_lines(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        config_argv(["--config", str(path)])
    assert f"--config {path}: " in str(caught.value) and expected in str(caught.value), str(caught.value)


def test_a_section_left_empty_is_an_empty_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(grpo_file(), sort_keys=False) + "custom_reward_function:\n")
    assert parsed(["--config", str(path)], 16) == parsed(GRPO_FLAGS, 16)


def test_a_config_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("megatron_training:\n  seq_length: 64\n# r\u00e9glages\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"--config {path}: line 3: byte 0xe9 is not UTF-8 text; save the file "
                                          "as UTF-8"):
        config_argv(["--config", str(path)])


# ------------------------------------------------------------------------------------------ checkpoints
def _ppo(tmp_path, actor, critic=None, reward=None, rl=None, **megatron):
    data = {
        "megatron_training": {"stage": "ray_ppo", "data_path": "d", "global_batch_size": 2, "train_iters": 3, **megatron},
        "actor_config": actor,
        "rl_config": {"adv_estimator": "gae", **(rl or {})},
    }
    if critic is not None:
        data["critic_config"] = critic
    if reward is not None:
        data["reward_config"] = reward
    return write(tmp_path, data)


def _map(path, *argv):
    return parsed(["--config", path, *argv])


def test_first_run_and_resume(tmp_path):
    policy, value = converted_model(tmp_path / "policy"), converted_model(tmp_path / "value")
    save = str(tmp_path / "save")
    first = _ppo(tmp_path, {"finetune": True, "load": policy, "save": save, "no_load_optim": True, "no_load_rng": True},
                 {"finetune": True, "load": value, "save": save}, rl={"verifier_function": ["format"]})
    args = _map(first)
    assert (args["ref_model"], args["load"], args["save"], args["reward_model"], args["reward_model_weight"]) == \
        (policy, None, save, value, 0.0)  # rule reward: the value-head model only starts the critic
    assert not (args["finetune"] or args["no_load_optim"] or args["no_load_rng"])
    save_root(Path(save))
    resume = _ppo(tmp_path, {"finetune": False, "load": save, "save": save, "no_load_optim": False,
                             "no_load_rng": False},
                  {"finetune": False, "load": save, "save": save}, {"load": value},
                  rl={"integrated_mode_config": {"ref_model_load_path": policy}})
    args = _map(resume)
    assert (args["ref_model"], args["load"], args["save"], args["reward_model"], args["reward_model_weight"]) == \
        (policy, save, save, value, 1.0)
    assert not (args["finetune"] or args["no_load_optim"] or args["no_load_rng"])


def test_resume_flags_and_reference_sources(tmp_path):
    policy, value = converted_model(tmp_path / "policy"), converted_model(tmp_path / "value")
    save = save_root(tmp_path / "save")
    data = {
        "megatron_training": {"stage": "ray_grpo", "data_path": "d", "global_batch_size": 2, "train_iters": 3,
                              "load": save},
        "actor_config": {"no_load_optim": True, "no_load_rng": True},
        "ref_config": {"load": policy},
        "rl_config": {"verifier_function": ["math_acc"]},
    }
    args = _map(write(tmp_path, data))
    assert (args["load"], args["ref_model"], args["no_load_optim"], args["no_load_rng"]) == (save, policy, True, True)
    data["actor_config"]["finetune"] = True  # a previous save's weights only, the original reference
    args = _map(write(tmp_path, data))
    assert (args["load"], args["finetune"], args["ref_model"]) == (save, True, policy)
    data["rl_config"]["integrated_mode_config"] = {"ref_model_load_path": value}
    assert "differs from rl_config.integrated_mode_config.ref_model_load_path" in config_error(tmp_path, data)
    # Megatron's way to start from converted weights without finetune: a converted model is the initial actor
    data = {"megatron_training": {"stage": "ray_grpo", "data_path": "d", "global_batch_size": 2, "train_iters": 3},
            "actor_config": {"load": policy, "no_load_optim": True, "no_load_rng": True},
            "rl_config": {"verifier_function": ["math_acc"]}}
    args = _map(write(tmp_path, data))
    assert (args["ref_model"], args["load"], args["no_load_optim"]) == (policy, None, False)


@pytest.mark.parametrize("case,expected", [
    ("actor and reference differ", "this program starts actor and reference from one model (--ref-model)"),
    ("resume without the reference", "set rl_config.integrated_mode_config.ref_model_load_path (or ref_config.load)"),
    ("two save directories", "this program saves actor and critic under one --save (DIR/actor, DIR/critic)"),
    ("critic resumes elsewhere", "saves and resumes actor and critic under one directory"),
    ("critic from the policy", "the critic starts from a value-head checkpoint here"),
    ("critic and reward differ", "this program starts the critic from the reward model"),
    ("save into the initial weights", "which would replace that model's own; save to another directory"),
    ("critic restarts, actor resumes", "the critic would start afresh while the actor resumes"),
    ("critic flags differ", "resumes actor and critic together from one --load, with one setting"),
    ("no critic weights", "trl_ppo needs the critic's initial weights"),
])
def test_checkpoint_combinations_that_cannot_map(tmp_path, case, expected):
    policy, value = converted_model(tmp_path / "policy"), converted_model(tmp_path / "value")
    other_value = converted_model(tmp_path / "value2")
    save, other = save_root(tmp_path / "save"), save_root(tmp_path / "other")
    first = {"finetune": True, "load": policy, "save": str(tmp_path / "new")}
    resume = {"load": save, "save": save}
    integrated = {"integrated_mode_config": {"ref_model_load_path": policy}}
    path = {
        "actor and reference differ": lambda: _ppo(tmp_path, first, {"load": value}, rl={
            "integrated_mode_config": {"ref_model_load_path": value}}),
        "resume without the reference": lambda: _ppo(tmp_path, resume, {"load": save}, {"load": value}),
        "two save directories": lambda: _ppo(tmp_path, first, {"load": value, "save": str(tmp_path / "elsewhere")}),
        "critic resumes elsewhere": lambda: _ppo(tmp_path, resume, {"load": other}, {"load": value}, rl=integrated),
        "critic from the policy": lambda: _ppo(tmp_path, first, {"load": policy}),
        "critic and reward differ": lambda: _ppo(tmp_path, first, {"load": value}, {"load": other_value}),
        "save into the initial weights": lambda: _ppo(tmp_path, {**first, "save": policy}, {"load": value}),
        "critic restarts, actor resumes": lambda: _ppo(tmp_path, resume, {"load": value, "finetune": True},
                                                       {"load": value}, rl=integrated),
        "critic flags differ": lambda: _ppo(tmp_path, {**resume, "no_load_optim": True},
                                            {"load": save, "no_load_optim": False}, {"load": value}, rl=integrated),
        "no critic weights": lambda: _ppo(tmp_path, resume, {"load": save}, rl={**integrated, "rule_reward": False}),
    }[case]()
    with pytest.raises(ConfigError) as caught:
        _map(path)
    assert expected in str(caught.value) and path in str(caught.value)


# ------------------------------------------------------------------------------------------ end to end


def test_mindspeed_moe_keys(tmp_path):
    """MindSpeed-RL's MoE keys: the experts' flags by name, its sequence-keeping all-to-all as megatron's all-to-all,
    the router's normalisation left to the checkpoint, and expert-parallel switches ignored once."""
    data = grpo_file()
    data["megatron_training"].update(moe_token_dispatcher_type="alltoall_seq", norm_topk_prob=True,
                                     enable_expert_parallel=True, gemm_gradient_accumulation_fusion=True,
                                     moe_aux_loss_coeff=0.001, expert_model_parallel_size=2)
    data["generate_config"]["infer_expert_parallel_size"] = 2
    path = write(tmp_path, data)
    config = load_run_config(path)
    ignored = [key for key, _ in config.ignored]
    for key in ("norm_topk_prob", "enable_expert_parallel", "gemm_gradient_accumulation_fusion"):
        assert f"megatron_training.{key}" in ignored, ignored
    args = parsed(["--config", path], 16)
    assert args["moe_token_dispatcher_type"] == "alltoall" and args["expert_parallel_size"] == 2
    assert args["moe_aux_loss_coeff"] == 0.001


def test_mindspeed_dynamic_batch_size_keys(tmp_path):
    """MindSpeed-RL's dynamic batch size: with use_dynamic_bsz, update_max_packing_token_size is the update's token
    budget, the smaller of actor_ / ref_max_packing_token_size the forward passes' (each else
    max_packing_token_size, else MindSpeed-RL's 4096); without it the budgets are listed as ignored."""
    data = grpo_file()
    data["rl_config"].update(use_dynamic_bsz=True, max_packing_token_size=20000, update_max_packing_token_size=18432,
                             ref_max_packing_token_size=24576, actor_dynamic_max_batch_size=8,
                             use_remove_padding=True)
    path = write(tmp_path, data)
    config = load_run_config(path)
    args = parsed(["--config", path], 8)
    assert args["max_tokens_per_micro_batch"] == 18432
    assert args["forward_max_tokens_per_micro_batch"] == 20000  # actor's: max_packing_token_size, below ref's
    ignored = [key for key, _ in config.ignored]
    assert "rl_config.actor_dynamic_max_batch_size" in ignored and "rl_config.use_remove_padding" in ignored
    assert any("one budget" in note for note in config.notes), config.notes

    data["rl_config"] = {k: v for k, v in data["rl_config"].items() if "packing" not in k}
    args = parsed(["--config", write(tmp_path, data, "default.yaml")], 8)
    assert args["max_tokens_per_micro_batch"] == args["forward_max_tokens_per_micro_batch"] == 4096

    data["rl_config"].update(use_dynamic_bsz=False, update_max_packing_token_size=8192)
    path = write(tmp_path, data, "off.yaml")
    assert "rl_config.update_max_packing_token_size" in [key for key, _ in load_run_config(path).ignored]
    assert parsed(["--config", path], 8)["max_tokens_per_micro_batch"] is None

    data["rl_config"].update(use_dynamic_bsz=True, update_max_packing_token_size=1000)  # below --max-length 4096
    with pytest.raises(ArgumentError, match="--max-tokens-per-micro-batch 1000 is smaller than the widest model row"):
        parsed(["--config", write(tmp_path, data, "small.yaml")], 8)


def test_recompute_keys_map_to_the_flags(tmp_path):
    """MindSpeed-RL's recompute keys (actor_config, as its DeepSeek-V3 and Qwen3-235B configs set them; the
    critic's must agree) are Megatron-LM's flags; a frozen role's are ignored (no backward); its documented
    recompute_activations is --recompute-activations."""
    keys = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4}
    data = ppo_file()
    data["actor_config"].update(keys)
    data["critic_config"].update(keys)
    data["ref_config"].update(keys)
    data["reward_config"]["recompute_activations"] = True
    path = write(tmp_path, data)
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "4"]
    assert parsed(["--config", path], 16) == parsed(PPO_FLAGS + flags, 16)
    ignored = dict(load_run_config(path).ignored)
    for key in keys:
        assert ignored[f"ref_config.{key}"] == "a frozen model runs no backward: nothing to recompute"
    assert "reward_config.recompute_activations" in ignored
    assert not any(key.startswith(("actor_config.recompute", "critic_config.recompute")) for key in ignored)

    data["critic_config"]["recompute_num_layers"] = 2
    with pytest.raises(ConfigError, match="critic_config.recompute_num_layers: 2 differs from the run's "
                                          "--recompute-num-layers 4"):
        load_run_config(write(tmp_path, data))

    data = grpo_file()
    data["actor_config"]["recompute_activations"] = True
    assert parsed(["--config", write(tmp_path, data)], 16) == parsed(GRPO_FLAGS + ["--recompute-activations"], 16)


# ------------------------------------------------------------------------------------------ published configs
# MindSpeed-RL's own files, verbatim (tests/fixtures/mindspeed_rl/README.md names the commit)
PUBLISHED = ROOT / "tests" / "fixtures" / "mindspeed_rl"


def test_published_grpo_config_parses_with_sequence_parallel():
    """MindSpeed-RL's grpo_qwen25_7b_A3.yaml (TP2 x PP2 on 16 NPUs, sequence_parallel, the distributed optimizer,
    offload_train_*): every key maps; vLLM's generation layout (infer TP1 x PP1) is listed as ignored."""
    path = str(PUBLISHED / "grpo_qwen25_7b_A3.yaml")
    config = load_run_config(path)
    ignored = dict(config.ignored)
    assert "generation runs on the training model in place" in ignored["generate_config.infer_tensor_parallel_size"]
    args = parsed(["--config", path], 16)
    assert args["stage"] == "grpo" and args["sequence_parallel"] and args["use_distributed_optimizer"]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"], args["data_parallel_size"]) == (
        2, 2, 4)
    assert args["offload_train_optimizer"] and args["offload_train_grad"] and args["offload_train_param"]
    assert args["verifier_function"] == ["math_17k_acc"] and args["seed"] == 1 and args["micro_batch_size"] == 4
    assert args["num_layers"] == 28 and args["num_query_groups"] == 4  # model/qwen25_7b.yaml next to it


def test_published_ppo_config_parses_with_sequence_parallel():
    """MindSpeed-RL's ppo_qwen25_32b_A3.yaml (TP8 on 32 NPUs, sequence_parallel, the acc_for_ppo verifier): its
    critic starts from the policy's checkpoint (a value head MindSpeed-RL initialises), here from a value-head
    checkpoint, which the command line names (--reward-model); the verifier then scores alone."""
    path = str(PUBLISHED / "ppo_qwen25_32b_A3.yaml")
    assert "critic starts from a value-head checkpoint here" in str(pytest.raises(
        ConfigError, parsed, ["--config", path], 32).value)
    args = parsed(["--config", path, "--reward-model", "./critic_init"], 32)
    assert args["stage"] == "trl_ppo" and args["sequence_parallel"] and args["use_distributed_optimizer"]
    assert args["tensor_model_parallel_size"] == 8 and args["verifier_function"] == ["acc_for_ppo"]
    assert args["reward_model"] == "./critic_init" and args["reward_model_weight"] == 0.0
    assert args["seed"] == 1 and args["kl_coef"] == 0.0 and args["critic_lr"] == 5e-6  # sampling_config.seed


def test_published_configs_that_stop_say_why():
    """grpo_qwen25_32b_A3.yaml splits its 64 layers 16,17,16,15 over 4 pipeline stages (num_layer_list), which this
    program's even PP split cannot load."""
    message = str(pytest.raises(ConfigError, parsed, ["--config", str(PUBLISHED / "grpo_qwen25_32b_A3.yaml")],
                                16).value)
    assert "actor_config.num_layer_list: '16,17,16,15' cannot be honoured" in message


# MindSpeed-RL's DAPO configs (stage ray_dapo), each key's flag: (file, world size, the flags it sets, whether its
# filter_groups_* / overlong_* keys are off and so listed as ignored)
DAPO_PUBLISHED = {
    "dapo_qwen25_32b_A3.yaml": (16, dict(dynamic_sampling=True, dynamic_sampling_metric="acc_for_dapo",
                                         max_num_gen_batches=0, overlong_buffer_len=512, overlong_penalty_factor=1.0,
                                         max_new_tokens=2048)),
    "dapo_qwen25_32b_A3_32k.yaml": (64, dict(dynamic_sampling=False, overlong_buffer_len=4096,
                                             overlong_penalty_factor=1.0, max_new_tokens=30720,
                                             context_parallel_size=2, max_tokens_per_micro_batch=32768,
                                             forward_max_tokens_per_micro_batch=65536)),
    "dapo_qwen25_32b_A2_20k.yaml": (64, dict(dynamic_sampling=False, overlong_buffer_len=4096,
                                             overlong_penalty_factor=1.0, max_new_tokens=20480,
                                             max_tokens_per_micro_batch=22528,
                                             forward_max_tokens_per_micro_batch=45056)),
    "dapo_qwen3_30b_a3b_A3.yaml": (16, dict(dynamic_sampling=True, dynamic_sampling_metric="acc_for_dapo",
                                            max_num_gen_batches=0, overlong_buffer_len=512,
                                            overlong_penalty_factor=0.1, expert_model_parallel_size=2)),
    "dapo_qwen3_32b_A3.yaml": (16, dict(dynamic_sampling=True, dynamic_sampling_metric="acc_for_dapo",
                                        max_num_gen_batches=0, overlong_buffer_len=512, overlong_penalty_factor=0.1)),
    "dapo_qwen25_7b_A2_multi_turn.yaml": (8, dict(dynamic_sampling=False, overlong_buffer_len=None,
                                                  verifier_function=["retool_reward"], tool_parser_format="hermes",
                                                  max_tool_calls=1, max_total_response_length=2048)),
}


def _published_dapo(name, tmp_path, monkeypatch) -> str:
    """The published file; the multi-turn one with its tool config's path substituted (MindSpeed-RL's
    configs/tools/retool_config.yaml naming the stand-in of its ReTool, tests/fixtures/mindspeed_rl/tools/)."""
    if "multi_turn" not in name:
        return str(PUBLISHED / name)
    from tests.helpers.published_clients import rewrite_run_config

    tools = PUBLISHED / "tools"
    monkeypatch.syspath_prepend(str(tools))
    config = yaml.safe_load((tools / "retool_config.yaml").read_text())
    config["tools"][0]["class_name"] = "retool_standin.ReTool"
    (tmp_path / "retool_config.yaml").write_text(yaml.safe_dump(config))
    return str(rewrite_run_config(name, tmp_path, {("rl_config", "tool_config_path"): str(tmp_path / "retool_config.yaml")},
                                  model_shape={}))


@pytest.mark.parametrize("name", list(DAPO_PUBLISHED))
def test_published_dapo_configs_map_each_key(name, tmp_path, monkeypatch):
    """MindSpeed-RL's ray_dapo is grpo without a reference model (its DAPO loss has no KL term), with DAPO's
    token-mean loss, clip-higher, dynamic sampling on a verifier's scores (-1: no limit on generation batches) and
    the overlong penalty; no_save_optim / no_save_rng false are what this program does. The features are named at
    startup; switched-off DAPO keys are listed as ignored."""
    world, expected = DAPO_PUBLISHED[name]
    path = _published_dapo(name, tmp_path, monkeypatch)
    args = parsed(["--config", path], world)
    assert args["stage"] == "grpo" and args["kl_coef"] == 0.0 and args["adv_estimator"] == "grpo"
    assert args["loss_agg_mode"] == "token-mean" and args["clip_ratio"] == 0.2 and args["clip_ratio_high"] == 0.28
    assert not args["no_save_optim"]
    for key, value in expected.items():
        assert args[key] == value, key
    config = load_run_config(path)
    (note,) = [n for n in config.notes if "ray_dapo" in n]
    assert "no reference model or KL loss (--kl-coef 0)" in note and "clip-higher" in note
    assert ("dynamic sampling on acc_for_dapo's scores (no limit" in note) == expected["dynamic_sampling"]
    ignored = dict(config.ignored)
    for key in ("filter_groups_metric", "filter_groups_max_batches", "filter_groups_train_batch_size"):
        assert (ignored.get(f"rl_config.{key}") == "filter_groups_enable is not true") != expected["dynamic_sampling"]
    for key in ("rollout_max_tokens", "overlong_buffer", "overlong_buffer_penalty_factor"):
        assert (f"rl_config.{key}" in ignored) == (expected["overlong_buffer_len"] is None)


def dapo_file(**rl):
    """grpo_file as a ray_dapo file (no KL coefficient) with DAPO's keys of `rl`."""
    data = grpo_file()
    data["megatron_training"]["stage"] = "ray_dapo"
    data["megatron_training"]["global_batch_size"] = 32
    del data["rl_config"]["init_kl_coef"]
    data["rl_config"].update(rl)
    return data


def test_dapo_keys_apply_by_their_switches(tmp_path):
    args = parsed(["--config", write(tmp_path, dapo_file())], 16)
    assert args["kl_coef"] == 0.0 and args["loss_agg_mode"] == "token-mean" and args["clip_ratio_high"] == 0.2
    assert not args["dynamic_sampling"] and args["overlong_buffer_len"] is None
    # token_level_loss false: the mean of each sequence's token mean (MindSpeed-RL's seq-mean-token-mean)
    args = parsed(["--config", write(tmp_path, dapo_file(token_level_loss=False))], 16)
    assert args["loss_agg_mode"] == "seq-mean-token-mean"
    # clip-higher with MindSpeed-RL's defaults (0.1 / 0.1); clip_ratio is then not the loss's
    data = dapo_file(clip_higher_enable=True, clip_ratio_high=0.3)
    args = parsed(["--config", write(tmp_path, data)], 16)
    assert (args["clip_ratio"], args["clip_ratio_high"]) == (0.1, 0.3)
    assert "DAPO's loss clips at" in dict(load_run_config(write(tmp_path, data)).ignored)["rl_config.clip_ratio"]
    # clip_higher_enable false: the two ratios are listed as ignored, the loss clips at clip_ratio on both sides
    data = dapo_file(clip_higher_enable=False, clip_ratio_low=0.1, clip_ratio_high=0.3)
    args = parsed(["--config", write(tmp_path, data)], 16)
    assert (args["clip_ratio"], args["clip_ratio_high"]) == (0.2, 0.2)
    ignored = dict(load_run_config(write(tmp_path, data)).ignored)
    assert ignored["rl_config.clip_ratio_high"].startswith("clip_higher_enable is not true")
    # dynamic sampling: a positive filter_groups_max_batches is the budget; the metric is a verifier of the run
    data = dapo_file(filter_groups_enable=True, filter_groups_metric="base_acc", filter_groups_max_batches=3,
                     filter_groups_train_batch_size=32)
    args = parsed(["--config", write(tmp_path, data)], 16)
    assert args["dynamic_sampling"] and args["dynamic_sampling_metric"] == "base_acc"
    assert args["max_num_gen_batches"] == 3
    # the overlong penalty
    data = dapo_file(overlong_buffer_enable=True, overlong_buffer=256, overlong_buffer_penalty_factor=0.5,
                     rollout_max_tokens=2048)
    args = parsed(["--config", write(tmp_path, data)], 16)
    assert (args["overlong_buffer_len"], args["overlong_penalty_factor"], args["max_new_tokens"]) == (256, 0.5, 2048)


def test_dapo_keys_outside_ray_dapo():
    """Under ray_grpo MindSpeed-RL's grpo loss and trainer read neither the DAPO loss keys nor filter_groups_*:
    listed as ignored; its rule reward applies the overlong penalty in every stage."""
    data = grpo_file()
    data["rl_config"].update(token_level_loss=False, clip_higher_enable=True, clip_ratio_high=0.28,
                             filter_groups_enable=True, overlong_buffer_enable=True, overlong_buffer=128,
                             rollout_max_tokens=2048)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), data)
        args = parsed(["--config", path], 16)
        ignored = dict(load_run_config(path).ignored)
    assert args["kl_coef"] == 0.001 and args["loss_agg_mode"] == "token-mean" and args["clip_ratio_high"] == 0.2
    assert not args["dynamic_sampling"] and args["overlong_buffer_len"] == 128
    for key in ("token_level_loss", "clip_higher_enable", "clip_ratio_high", "filter_groups_enable"):
        assert "stage: ray_dapo" in ignored[f"rl_config.{key}"], key


@pytest.mark.parametrize("rl,key,expected", [
    (dict(init_kl_coef=0.001), "rl_config.init_kl_coef", "cannot be honoured with stage ray_dapo"),
    (dict(filter_groups_enable=True, filter_groups_metric="acc_for_dapo", filter_groups_train_batch_size=32),
     "rl_config.filter_groups_metric", "'acc_for_dapo' is not one of rl_config.verifier_function ['base_acc']"),
    (dict(filter_groups_enable=True, filter_groups_metric="base_acc", filter_groups_train_batch_size=16),
     "rl_config.filter_groups_train_batch_size", "16 differs from global_batch_size 32"),
    (dict(filter_groups_enable=True, filter_groups_metric="base_acc"),
     "rl_config.filter_groups_enable", "1 differs from global_batch_size 32"),  # MindSpeed-RL's default 1
    (dict(filter_groups_enable=True, filter_groups_metric="base_acc", filter_groups_train_batch_size=32,
          filter_groups_max_batches=2.5), "rl_config.filter_groups_max_batches", "2.5 must be an integer"),
    (dict(overlong_buffer_enable=True, overlong_buffer=256, rollout_max_tokens=1024), "rl_config.rollout_max_tokens",
     "1024 differs from the response limit 2048"),
    (dict(overlong_buffer_enable=True), "rl_config.overlong_buffer_enable", "true needs rl_config.overlong_buffer"),
    (dict(overlong_buffer_enable=True, overlong_buffer=0), "rl_config.overlong_buffer", "0 must be an integer >= 1"),
])
def test_dapo_keys_that_cannot_map_are_named(tmp_path, rl, key, expected):
    message = config_error(tmp_path, dapo_file(**rl))
    assert f"{key}: " in message and expected in message, message


def test_no_save_optim_is_megatrons_flag(tmp_path):
    data = grpo_file()
    data["actor_config"].update(no_save_optim=True, no_save_rng=False)
    assert parsed(["--config", write(tmp_path, data)], 16)["no_save_optim"]


def test_sequence_and_context_parallel_keys(tmp_path):
    """sequence_parallel and context_parallel_size are the flags of their names; megatron_cp_algo is how the CP
    ranks attend here anyway (listed as ignored); vLLM's generation layout other than the training one is ignored."""
    data = grpo_file()
    data["megatron_training"].update(sequence_parallel=True)
    data["actor_config"].update(context_parallel_size=2, context_parallel_algo="megatron_cp_algo",
                                attention_mask_type="causal")
    data["generate_config"]["infer_tensor_parallel_size"] = 2
    path = write(tmp_path, data)
    ignored = dict(load_run_config(path).ignored)
    assert "all-gathers the keys and values" in ignored["actor_config.context_parallel_algo"]
    assert "tensor_model_parallel_size 4" in ignored["generate_config.infer_tensor_parallel_size"]
    args = parsed(["--config", path], 16)
    assert args["sequence_parallel"] and args["context_parallel_size"] == 2 and args["data_parallel_size"] == 2


def test_infer_tensor_parallel_size_is_the_generators_tp_with_generator_ranks(tmp_path):
    """With generator ranks of their own (rl_config.rollout_world_size, asynchronous RL) MindSpeed-RL's
    infer_tensor_parallel_size is --infer-tensor-parallel-size, not an ignored vLLM layout; and such a run is refused
    by name until the asynchronous schedule exists (issue 47)."""
    data = grpo_file()
    data["generate_config"]["infer_tensor_parallel_size"] = 2
    data["rl_config"]["rollout_world_size"] = 4
    path = write(tmp_path, data)
    assert "generate_config.infer_tensor_parallel_size" not in dict(load_run_config(path).ignored)
    argv = config_argv(["--config", path])
    assert "--infer-tensor-parallel-size=2" in argv and "--rollout-world-size=4" in argv
    with pytest.raises(ArgumentError, match=r"--rollout-world-size 4: asynchronous training .* is not built yet "
                                            r"\(issue 47"):
        parsed(["--config", path], 16)
