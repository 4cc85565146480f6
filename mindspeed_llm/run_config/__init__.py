"""MindSpeed-RL run configs: ``posttrain_gpt.py --config FILE.yaml [flags ...]``.

The file's sections are mapped onto this program's flags (`arguments.build_parser`), and the flags on the
command line override the file: a flag given there drops what the file says for it (for ``--bf16`` / ``--fp16``
and the two LR-schedule-on-resume flags, giving one drops the file's other). The file becomes command-line
tokens that go in front of the user's, so the parser types and checks both the same way. A switch the file
turns on cannot be turned off from the command line (this program's switches, Megatron's, have no ``--no-``
form): edit the file.

Every key is in a table below (one per section; a Megatron key that is not there is this program's flag of the
same name, and ``rl_config`` takes this program's RL flags by name too): it maps to a flag (typed and checked
as the parser does it), is *ignored* with a reason (vLLM, Ray and NPU settings that mean nothing to an in-process Megatron
stage; listed once at start-up), is accepted only with the one value this program always has (any other
value is an error naming the fix), or feeds the mappings of the stage, the checkpoints, the verifiers and
the sampler (``mapping.resolve``). An unknown key is an error naming the key, its section and the file (and the
nearest known key); a value of the wrong type is an error naming the key and the file.

Sections: ``defaults`` (hydra: ``- model: [NAME]``), ``model`` (``NAME: {Megatron keys}``; a name it lacks is
read from ``model/NAME.yaml`` next to the file when there), ``megatron_training`` (the base),
``actor_config`` (overrides the base), ``critic_config``, ``reward_config``, ``ref_config``, ``rl_config``,
``generate_config``. This program trains every role with one layout and one optimizer setting: the keys of
``critic_config`` / ``reward_config`` / ``ref_config`` must agree with the actor's (``critic_config.lr``
becomes ``--critic-lr``; frozen roles' optimizer and activation recompute keys are ignored). The recompute keys
(``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, MindSpeed-RL's documented
``recompute_activations``) are the flags of their names, applied to the actor and the critic, as are the LoRA keys
(``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``, ``lora_load``; ``lora_fusion`` and
``lora_ckpt_filter`` / ``lora_filter`` are listed as ignored; frozen roles' LoRA keys are ignored;
``rl_config.share_backbone: true`` is what a LoRA run does and needs LoRA, ``false`` is refused with it). The
architecture keys (``model``) become the model flags, which are checked against every checkpoint, only when all
roles use one model.

Checkpoints. Here ``--ref-model`` is the initial actor and the reference; ``--reward-model`` is the reward
model and (trl_ppo) the critic's initial weights; ``--load`` / ``--save`` hold every trained role under one
root (``ROOT/actor``, ``ROOT/critic``); ``--finetune`` loads weights only from a ``--save`` root. So:

* ``actor_config.load`` (or ``megatron_training.load``) is the actor's initial weights, mapped to
  ``--ref-model``, when it is a converted model (``latest_checkpointed_iteration.txt`` and no role folders)
  or when ``finetune: true`` and it is not a save root; ``no_load_optim`` / ``no_load_rng`` mean nothing
  then. Otherwise it is a previous ``--save`` root: ``--load`` (with ``--finetune``, ``--no-load-optim``,
  ``--no-load-rng`` as given), and the reference needs the original weights:
  ``rl_config.integrated_mode_config.ref_model_load_path`` or ``ref_config.load`` (they must agree), mapped
  to ``--ref-model``. With an initial actor, a reference path must equal it (one model starts both).
* ``actor_config.save`` is ``--save``; ``critic_config.save``, when given, must be the same directory.
* ``critic_config.load`` (trl_ppo) is either the actor's ``load`` root (the critic resumes with the actor)
  or the critic's initial weights, a value-head checkpoint, mapped to ``--reward-model``; another save root is
  an error (one root holds both roles). ``reward_config.load`` is ``--reward-model`` too, so the two must
  agree. When neither gives the critic's initial weights, the critic resumes and rule verifiers
  score, ``ROOT/critic`` (its own latest weights) is its starting point. A trl_ppo with rule verifiers and no ``reward_config.load`` gets
  ``--reward-model-weight 0``: the value-head model only starts the critic.

Other mappings: ``stage`` ``ray_grpo``/``grpo`` -> grpo, ``ray_ppo``/``trl_ppo`` -> trl_ppo, ``ray_dapo`` -> grpo
with DAPO's features and its twelve keys (``token_level_loss``, ``clip_*``, ``filter_groups_*``, ``overlong_*``,
``rollout_max_tokens``: `dapo.py`); ``no_save_optim`` -> ``--no-save-optim``, ``no_save_rng: true`` refused (the
RNG state is always saved);
``adv_estimator`` ``group_norm`` -> ``--adv-estimator grpo`` (grpo), ``gae`` is trl_ppo's, other names pass;
``kl_penalty`` ``kl``/``mse``/``abs``/``low_var_kl`` -> k1/k2/abs/low_var_kl; ``init_kl_coef`` -> ``--kl-coef``;
``mini_batch_size`` (sequences per optimizer step) -> ``--ppo-mini-batch-size``; ``epochs`` -> ``--ppo-epochs``;
``rule_reward: true`` without ``verifier_function`` -> MindSpeed-RL's default ``[base_acc]``, ``false`` drops
the verifier lists; verifier names must be registered here (`rl/verifiers`); ``sampling_config``
``temperature`` > 0 -> ``--do-sample --temperature T`` (0: greedy), ``top_k: -1`` -> ``--top-k 0``,
``max_tokens`` -> ``--max-new-tokens``; ``max_model_len`` -> ``--max-length`` (at least
``max_prompt_length + max_tokens``); ``generate_config.max_num_seqs`` / ``max_num_batched_tokens`` ->
``--rollout-max-num-seqs`` / ``--rollout-max-num-batched-tokens`` (the generation engine's limits, vLLM's
meaning); ``rl_config.partial_rollout_max_split`` N > 1 -> ``--partial-rollout --partial-rollout-max-split N``
(1, MindSpeed-RL's default, leaves partial rollouts off); verl's ``custom_reward_function: {path, name}`` (a
top-level section, as verl writes it, or under ``rl_config``) -> ``--custom-reward-function PATH:NAME``, ``path:
null`` sets nothing, a non-empty ``reward_kwargs`` is refused; ``use_tensorboard`` -> ``--tensorboard-dir``
(``megatron_training.tensorboard_dir``, else ``SAVE/tensorboard``); ``use_wandb: true`` -> ``wandb_project`` /
``wandb_exp_name`` / ``wandb_save_dir`` as ``--wandb-project`` / ``--wandb-exp-name`` / ``--wandb-save-dir``
(a project is required), without it those keys are listed as ignored. ``infer_tensor_parallel_size`` / ``_pipeline_`` / ``_expert_`` other than the training
layout are listed as ignored (generation runs on the training model in place, with its layout), except that with
``rl_config.rollout_world_size`` (generator ranks of their own) ``infer_tensor_parallel_size`` is
``--infer-tensor-parallel-size``; ``dtype`` must be
the training precision. ``sampling_config.seed`` must equal the run's seed (``--seed``: each sample's random stream
is keyed by it); ``use_kl_in_reward`` must match the stage (trl_ppo puts the KL in the reward, grpo in the loss).
"""

from mindspeed_llm.run_config.loader import RunConfig, config_argv, load_run_config, split_config
from mindspeed_llm.run_config.tables import (
    EXCLUSIVE, GENERATE, LORA, MEGATRON, OPTIM, RECOMPUTE, RL, ROLE_SECTIONS, SAMPLING, SECTIONS, Accept,
    ConfigError, Flag, Ignored, Nested, Slot,
)

__all__ = [
    "RunConfig", "config_argv", "load_run_config", "split_config", "EXCLUSIVE", "GENERATE", "LORA", "MEGATRON",
    "OPTIM", "RECOMPUTE", "RL", "ROLE_SECTIONS", "SAMPLING", "SECTIONS", "Accept", "ConfigError", "Flag", "Ignored",
    "Nested", "Slot",
]
