"""MindSpeed-RL run configs (`posttrain_gpt.py --config FILE.yaml`) for the tests of their mapping: the grpo and PPO
files of a Qwen2.5-7B run in MindSpeed-RL's layout (`grpo_file`, `ppo_file`) with the command lines they must
equal (`GRPO_FLAGS`, `PPO_FLAGS`), their sections, and how a test writes, parses and expects a refusal of one
(`write`, `parsed`, `config_error`)."""

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.run_config import config_argv


def write(tmp_path, data, name="run.yaml") -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def parsed(argv, world_size=1) -> dict:
    """The resolved run of a command line: its Namespace with every typed settings field's value (the stage
    defaults and derived values `validate_args` resolves into the settings, not the Namespace), lists as given."""
    # as posttrain_gpt.main: --config is resolved before parsing
    args = parse_args(config_argv(list(map(str, argv))), world_size=world_size)
    values = vars(args)
    for part in dataclasses.fields(args.settings):
        for name, value in dataclasses.asdict(getattr(args.settings, part.name)).items():
            values[name] = list(value) if isinstance(values.get(name), list) else value
    return values


def converted_model(path: Path) -> str:
    """A directory that looks like a convert_ckpt.py output (the mapping only looks at its shape)."""
    (path / "release").mkdir(parents=True)
    (path / "latest_checkpointed_iteration.txt").write_text("release")
    return str(path)


def save_root(path: Path) -> str:
    """A directory that looks like a --save root of this program."""
    for role in ("actor", "critic"):
        (path / role / "iter_0000002").mkdir(parents=True)
    (path / "latest_checkpointed_iteration.txt").write_text("2")
    return str(path)


QWEN25_7B = {
    "use_mcore_models": True, "num_layers": 28, "hidden_size": 3584, "ffn_hidden_size": 18944,
    "num_attention_heads": 28, "rotary_base": 1000000, "max_position_embeddings": 32768,
    "make_vocab_size_divisible_by": 1, "padded_vocab_size": 152064, "untie_embeddings_and_output_weights": True,
    "add_qkv_bias": True, "disable_bias_linear": True, "group_query_attention": True, "num_query_groups": 4,
    "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "attention_softmax_in_fp32": True,
}
QWEN25_7B_FLAGS = [
    "--use-mcore-models", "--num-layers", "28", "--hidden-size", "3584", "--ffn-hidden-size", "18944",
    "--num-attention-heads", "28", "--rotary-base", "1000000", "--max-position-embeddings", "32768",
    "--make-vocab-size-divisible-by", "1", "--padded-vocab-size", "152064", "--untie-embeddings-and-output-weights",
    "--add-qkv-bias", "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "4",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--attention-softmax-in-fp32",
]


def megatron_training(stage="ray_grpo"):
    return {
        "model": "qwen25_7b", "use_fused_rmsnorm": True, "use_mcore_models": True, "sequence_parallel": False,
        "use_flash_attn": True, "no_masked_softmax_fusion": True, "attention_softmax_in_fp32": True,
        "no_gradient_accumulation_fusion": True, "use_fused_swiglu": True, "use_fused_rotary_pos_emb": True,
        "bf16": True, "use_distributed_optimizer": True, "tokenizer_type": "PretrainedFromHF",
        "tokenizer_name_or_path": "./Qwen2.5-7B", "global_batch_size": 32, "seq_length": 2048, "save_interval": 200,
        "train_iters": 1000, "stage": stage, "attention_dropout": 0.0, "init_method_std": 0.01, "hidden_dropout": 0.0,
        "distributed_backend": "nccl", "no_shared_storage": True, "variable_seq_lengths": True,
        "dataset_additional_keys": ["labels"], "data_path": "./dataset/deepscaler/data", "split": "100,0,0",
        "no_shuffle": False, "full_shuffle_instruction_dataset": False, "seed": 1234,
    }


MEGATRON_FLAGS = [
    "--use-fused-rmsnorm", "--use-flash-attn", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
    "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--bf16", "--use-distributed-optimizer",
    "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", "./Qwen2.5-7B", "--global-batch-size", "32",
    "--seq-length", "2048", "--save-interval", "200", "--train-iters", "1000", "--attention-dropout", "0.0",
    "--init-method-std", "0.01", "--hidden-dropout", "0.0", "--distributed-backend", "nccl", "--no-shared-storage",
    "--variable-seq-lengths", "--data-path", "./dataset/deepscaler/data", "--split", "100,0,0", "--seed", "1234",
]


def actor_config(**over):
    config = {
        "model": "qwen25_7b", "micro_batch_size": 1, "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1,
        "lr": "1e-6", "lr_decay_style": "constant", "min_lr": 0, "weight_decay": 0.01, "lr_warmup_fraction": 0.0,
        "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95, "initial_loss_scale": 4096, "finetune": True,
        "load": "./model_weights/qwen25_7b_mcore", "save": "./ckpt/qwen25_7b", "no_load_optim": True,
        "no_load_rng": True,
    }
    config.update(over)
    return config


ACTOR_FLAGS = [
    "--micro-batch-size", "1", "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "1",
    "--lr", "1e-6", "--lr-decay-style", "constant", "--min-lr", "0", "--weight-decay", "0.01",
    "--lr-warmup-fraction", "0.0", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--initial-loss-scale", "4096", "--ref-model", "./model_weights/qwen25_7b_mcore", "--save", "./ckpt/qwen25_7b",
]


def generate_config(**sampling):
    return {
        "trust_remote_code": True, "offload_train_optimizer": True, "offload_train_grad": True,
        "offload_train_param": True, "infer_tensor_parallel_size": 4, "infer_pipeline_parallel_size": 1,
        "infer_expert_parallel_size": 1, "max_num_seqs": 1024, "max_model_len": 4096, "max_num_batched_tokens": 8192,
        "dtype": "bfloat16", "gpu_memory_utilization": 0.4, "enforce_eager": True, "enable_prefix_caching": False,
        "sampling_config": {"logprobs": 1, "max_tokens": 2048, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                            "temperature": 1.0, "detokenize": False, **sampling},
    }


GENERATE_FLAGS = ["--offload-train-optimizer", "--offload-train-grad", "--offload-train-param",
                  "--rollout-max-num-seqs", "1024", "--max-length", "4096", "--rollout-max-num-batched-tokens", "8192",
                  "--max-new-tokens", "2048", "--top-p", "1.0", "--top-k", "0", "--do-sample", "--temperature", "1.0"]


def grpo_file():
    return copy.deepcopy({
        "defaults": [{"model": ["qwen25_7b"]}],
        "model": {"qwen25_7b": QWEN25_7B},
        "megatron_training": megatron_training(),
        "actor_config": actor_config(),
        "rl_config": {
            "guarantee_order": False, "use_integrated_worker": True, "blocking": True, "gamma": 1.0, "lam": 0.95,
            "actor_forward_micro_batch_size": 1, "ref_forward_micro_batch_size": 1, "adv_estimator": "group_norm",
            "kl_penalty": "low_var_kl", "kl_ctrl_type": "fixed", "init_kl_coef": 0.001, "mini_batch_size": 32,
            "max_prompt_length": 2048, "epochs": 1, "clip_ratio": 0.2, "entropy_coeff": 0.0, "shuffle_minibatch": False,
            "n_samples_per_prompt": 8, "rule_reward": True, "verifier_function": ["base_acc"], "verifier_weight": [1.0],
            "verifier_parallel": 4, "verifier_timeout": 30, "num_cpus_for_local_task": 1.0, "use_tensorboard": True,
            "actor_resource": {"num_npus": 16},
        },
        "generate_config": generate_config(),
    })


GRPO_FLAGS = ["--stage", "grpo", *QWEN25_7B_FLAGS, *MEGATRON_FLAGS, *ACTOR_FLAGS, "--gamma", "1.0", "--lam", "0.95",
              "--adv-estimator", "grpo", "--kl-penalty", "low_var_kl", "--kl-coef", "0.001", "--ppo-mini-batch-size",
              "32", "--max-prompt-length", "2048", "--ppo-epochs", "1", "--clip-ratio", "0.2", "--entropy-coeff",
              "0.0", "--n-samples-per-prompt", "8", "--verifier-function", "base_acc", "--verifier-weight", "1.0",
              "--tensorboard-dir", "./ckpt/qwen25_7b/tensorboard", *GENERATE_FLAGS]
GRPO_IGNORED = [
    "megatron_training.dataset_additional_keys", "megatron_training.full_shuffle_instruction_dataset",
    "rl_config.guarantee_order", "rl_config.use_integrated_worker", "rl_config.blocking",
    "rl_config.actor_forward_micro_batch_size", "rl_config.ref_forward_micro_batch_size", "rl_config.verifier_parallel",
    "rl_config.verifier_timeout", "rl_config.num_cpus_for_local_task", "rl_config.actor_resource",
    "generate_config.trust_remote_code", "generate_config.gpu_memory_utilization", "generate_config.enforce_eager",
    "generate_config.enable_prefix_caching",
    "generate_config.sampling_config.logprobs", "generate_config.sampling_config.detokenize",
]


def ppo_file(critic_load="./model_weights/qwen25_7b_rm_mcore"):
    critic = actor_config(lr="5e-6", load=critic_load)
    del critic["initial_loss_scale"]
    return copy.deepcopy({
        "defaults": [{"model": ["qwen25_7b"]}],
        "model": {"qwen25_7b": QWEN25_7B},
        "megatron_training": megatron_training("ray_ppo"),
        "actor_config": actor_config(),
        "critic_config": critic,
        "reward_config": {"model": "qwen25_7b", "tensor_model_parallel_size": 4, "micro_batch_size": 1,
                          "lr": 1e-5, "load": "./model_weights/qwen25_7b_rm_mcore", "no_load_optim": True},
        "ref_config": {"model": "qwen25_7b", "load": "./model_weights/qwen25_7b_mcore"},
        "rl_config": {
            "guarantee_order": True, "use_integrated_worker": True, "blocking": True, "gamma": 1.0, "lam": 1.0,
            "adv_estimator": "gae", "kl_penalty": "kl", "kl_ctrl_type": "fixed", "init_kl_coef": 0.0,
            "mini_batch_size": 32, "max_prompt_length": 2048, "epochs": 1, "clip_ratio": 0.2, "cliprange_value": 0.5,
            "entropy_coeff": 0, "shuffle_mini_batch": False, "n_samples_per_prompt": 1, "rule_reward": False,
            "advantage_whiten": True, "num_cpus_for_local_task": 1.0, "use_tensorboard": False,
            "actor_resource": {"num_npus": 8}, "critic_resource": {"num_npus": 8},
        },
        "generate_config": generate_config(),
    })


PPO_FLAGS = ["--stage", "trl_ppo", *QWEN25_7B_FLAGS, *MEGATRON_FLAGS, *ACTOR_FLAGS, "--critic-lr", "5e-6",
             "--reward-model", "./model_weights/qwen25_7b_rm_mcore", "--gamma", "1.0", "--lam", "1.0", "--kl-penalty",
             "k1", "--kl-coef", "0.0", "--ppo-mini-batch-size", "32", "--max-prompt-length", "2048", "--ppo-epochs",
             "1", "--clip-ratio", "0.2", "--cliprange-value", "0.5", "--entropy-coeff", "0", "--n-samples-per-prompt",
             "1", *GENERATE_FLAGS]


def config_error(tmp_path, data, *argv) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ArgumentError) as caught:
        parsed(["--config", path, *argv], 16)
    assert path in str(caught.value)
    return str(caught.value)
