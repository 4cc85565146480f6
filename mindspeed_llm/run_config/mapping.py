"""The run config's mappings that depend on more than one key (the package docstring's "Other mappings"): the
other roles against the actor, the stage, partial rollouts, verifiers, sampling, token budgets, the KL's
placement, TensorBoard, wandb, LoRA's shared backbone and the advantage estimator; the checkpoints are
`checkpoints.py`'s."""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from mindspeed_llm.run_config.checkpoints import resolve_checkpoints
from mindspeed_llm.run_config.dapo import resolve_dapo
from mindspeed_llm.run_config.reader import ConfigReader, FlagValue, RoleKeys, cli_value
from mindspeed_llm.run_config.tables import DTYPES, PACKING_DEFAULT, stage_of


def resolve(reader: ConfigReader, run: RoleKeys, roles: Dict[str, Tuple[RoleKeys, Optional[str]]],
            cli_argv) -> Dict[str, FlagValue]:
    """The flags of the whole file: the run's, then those of the stage-dependent mappings (module doc)."""
    flags = dict(run.flags)
    given = reader.given

    def put(flag: str, value, where: str) -> None:
        typed = reader.typed(flag, value, where)
        flags[typed.action.dest] = typed

    def effective(dest: str):
        """The run's value of `dest` as far as the file decides it (else the parser's default)."""
        if dest in flags:
            return flags[dest].value
        return reader.parser.get_default(dest)

    file_stage = _resolve_stage(reader, run, roles, put)
    stage = cli_value(cli_argv, "--stage") or effective("stage")

    # -- the other roles: one layout and one optimizer setting for all (module doc)
    for section, (role, name) in roles.items():
        if section == "critic_config" and stage == "grpo":
            raise reader.error(section, "grpo trains no critic: drop critic_config (or use stage: ray_ppo)")
        for dest, v in role.flags.items():
            if section == "critic_config" and dest == "lr":
                flags["critic_lr"] = reader.typed("--critic-lr", v.value, v.origin)
                continue
            if v.action.dest in given or v.value == effective(dest):
                continue
            if (name not in (None, run.slot("model"))) and reader.is_arch(v):
                continue  # another model: its architecture is its checkpoint's
            opt = v.action.option_strings[0]
            raise reader.error(v.origin, f"{v.value!r} differs from the run's {opt} {effective(dest)!r}: this "
                                         "program runs every role with the actor's layout and settings (only "
                                         "critic_config.lr is the critic's own, as --critic-lr); make them equal or "
                                         "drop the key")
    models = {run.slot("model")} | {name for _, name in roles.values() if name is not None}
    if len(models - {None}) > 1:
        dropped = [dest for dest, v in flags.items() if reader.is_arch(v)]
        for dest in dropped:
            del flags[dest]
        if dropped:
            reader.notes.append(f"the roles use different models ({', '.join(sorted(m for m in models if m))}): "
                                "each architecture is read from its checkpoint, the model keys are not passed")

    split = run.slot("partial_rollout_max_split")
    if split is not None:  # MindSpeed-RL: N > 1 turns partial rollouts on, 1 (its default) leaves them off
        where = run.origin("partial_rollout_max_split")
        if split != int(split) or split < 1:
            raise reader.error(where, f"{split} must be an integer >= 1 (1: no partial rollouts)")
        if split > 1:
            put("--partial-rollout", True, where)
            put("--partial-rollout-max-split", int(split), where)
    rule_verifiers = _resolve_verifiers(reader, run, put, flags)
    rule_verifiers = _resolve_custom_reward(run, put) or rule_verifiers  # scores like rule verifiers (checkpoints)
    resolve_checkpoints(reader, run, roles, stage, put, flags, given, rule_verifiers, cli_argv)
    _resolve_sampling(reader, run, put, flags, effective, given)
    resolve_dapo(reader, run, put, flags, effective, stage, file_stage == "ray_dapo")
    _resolve_token_budgets(reader, run, put, reference=not (file_stage == "ray_dapo" and stage == "grpo"))
    _resolve_kl_placement(reader, run, stage, effective)

    if run.slot("use_tensorboard") and "tensorboard_dir" not in flags:
        save = flags["save"].value if "save" in flags else cli_value(cli_argv, "--save")
        if save is None:
            raise reader.error(run.origin("use_tensorboard"), "true needs a directory: set "
                                                              "megatron_training.tensorboard_dir or actor_config.save")
        put("--tensorboard-dir", os.path.join(save, "tensorboard"), run.origin("use_tensorboard"))

    _resolve_wandb(reader, run, flags, cli_argv)
    share = run.slot("share_backbone")
    if share is not None:
        lora = "lora_target_modules" in flags or "lora_load" in flags or any(
            token.split("=", 1)[0] in ("--lora-target-modules", "--lora-load") for token in cli_argv)
        if share and not lora:
            raise reader.error(run.origin("share_backbone"), "true shares the actor's base with the reference, which "
                                                             "needs LoRA adapters to switch off: set "
                                                             "lora_target_modules, or share_backbone: false")
        if not share and lora:
            raise reader.error(run.origin("share_backbone"), "false would load the reference as a model of its own; "
                                                             "with LoRA the reference here is always the actor's "
                                                             "base with its adapters off: set it to true or drop it")
    estimator = run.slot("adv_estimator")
    if estimator is not None:
        where = run.origin("adv_estimator")
        if estimator == "gae":  # trl_ppo's own (its default: nothing to pass)
            if stage != "trl_ppo":
                raise reader.error(where, f"gae needs a critic, but the stage is {stage}; use group_norm")
        elif estimator == "group_norm":
            if stage == "trl_ppo":
                raise reader.error(where, "group_norm is critic-free (grpo's); trl_ppo estimates with gae")
            put("--adv-estimator", "grpo", where)
        else:  # this program's own estimator names: the parser / stage checks them
            put("--adv-estimator", estimator, where)
    return flags


def _resolve_stage(reader, run, roles, put) -> Optional[str]:
    """`stage` -> --stage (`tables.stage_of`); a role section's must be the run's. Returns the file's own name for it
    (ray_dapo turns DAPO's features on, `dapo.py`)."""
    name = run.slot("stage")
    if name is not None:
        try:
            put("--stage", stage_of(name), run.origin("stage"))
        except ValueError as exc:
            raise reader.error(run.origin("stage"), str(exc)) from None
    for role, _ in roles.values():
        other = role.slot("stage")
        if other is not None and other != name:
            raise reader.error(role.origin("stage"), f"{other!r} differs from the run's stage {name!r}: one stage "
                                                     "trains every role; make them equal or drop the key")
    return name


def _resolve_wandb(reader, run, flags, cli_argv) -> None:
    """MindSpeed-RL logs to wandb with use_wandb: true only, to wandb_project (required then); without it the
    wandb_* keys mean nothing and are listed as ignored (a --wandb-project on the command line still logs)."""
    use = run.slot("use_wandb")
    keys = [dest for dest in ("wandb_project", "wandb_exp_name", "wandb_save_dir") if dest in flags]
    if use:
        if "wandb_project" not in flags and cli_value(cli_argv, "--wandb-project") is None:
            raise reader.error(run.origin("use_wandb"), "true needs a project: set rl_config.wandb_project (or "
                                                        "pass --wandb-project)")
        return
    for dest in keys:
        reader.ignored.append((flags.pop(dest).origin, "use_wandb is not true"))


def _resolve_verifiers(reader, run, put, flags) -> bool:
    """--verifier-function from rule_reward / verifier_function; whether rule verifiers score the run."""
    rule, names = run.slot("rule_reward"), run.slot("verifier_function")
    if rule is False:
        for name in ("verifier_function", "verifier_weight"):
            where = run.origin(name) if name in run.slots else (flags[name].origin if name in flags else None)
            if where is not None:
                reader.ignored.append((where, "rule_reward is false"))
        flags.pop("verifier_weight", None)
        return False
    if names is None and rule is True:
        names = ["base_acc"]  # MindSpeed-RL's default
    if names is None:
        return bool(flags.get("verifier_function") and flags["verifier_function"].value)
    from mindspeed_llm.rl.verifiers import available_verifiers

    valid = available_verifiers()
    for name in names:
        if name not in valid:
            where = run.origin("verifier_function") if "verifier_function" in run.slots else run.origin("rule_reward")
            raise reader.error(where, f"'{name}' is not a verifier of this program; the valid names are: "
                                      f"{', '.join(valid)}")
    where = run.origin("verifier_function") if "verifier_function" in run.slots else run.origin("rule_reward")
    put("--verifier-function", names, where)
    return bool(names)


def _resolve_custom_reward(run, put) -> bool:
    """verl's ``custom_reward_function: {path, name}`` -> ``--custom-reward-function PATH:NAME`` (NAME: verl's
    ``compute_score`` when not given); ``path: null`` (verl's default) sets nothing. Whether it sets a function."""
    path, name = run.slot("custom_reward_path"), run.slot("custom_reward_name")
    if path is None:
        return False
    put("--custom-reward-function", path if name is None else f"{path}:{name}", run.origin("custom_reward_path"))
    return True


def _resolve_token_budgets(reader, run, put, reference: bool = True) -> None:
    """MindSpeed-RL's dynamic batch size: with ``use_dynamic_bsz: true``, ``update_max_packing_token_size`` (else
    ``max_packing_token_size``, else MindSpeed-RL's 4096) -> ``--max-tokens-per-micro-batch``, and the smaller of
    ``actor_max_packing_token_size`` / ``ref_max_packing_token_size`` (each else ``max_packing_token_size``) ->
    ``--forward-max-tokens-per-micro-batch`` (one budget serves every forward-only pass here). MindSpeed-RL counts a
    micro-batch's real tokens (its rows flattened); here rows x its longest row (sorted by length, the padding is
    small). Without it the budgets are ignored; without a reference model (`reference` false: ray_dapo's)
    ``ref_max_packing_token_size`` is."""
    names = ("max_packing_token_size", "update_max_packing_token_size", "actor_max_packing_token_size",
             "ref_max_packing_token_size")
    if not run.slot("use_dynamic_bsz", False):
        for name in names:
            if name in run.slots:
                reader.ignored.append((run.origin(name), "use_dynamic_bsz is not true: micro-batches are "
                                                         "--micro-batch-size samples each"))
        return
    where = run.origin("use_dynamic_bsz")
    base = run.slot("max_packing_token_size", PACKING_DEFAULT)
    update = run.slot("update_max_packing_token_size", base)
    forward = {name: run.slot(name, base) for name in ("actor_max_packing_token_size", "ref_max_packing_token_size")}
    if not reference:
        del forward["ref_max_packing_token_size"]
        if "ref_max_packing_token_size" in run.slots:
            reader.ignored.append((run.origin("ref_max_packing_token_size"), "ray_dapo builds no reference model"))
    put("--max-tokens-per-micro-batch", int(update), run.origin("update_max_packing_token_size")
        if "update_max_packing_token_size" in run.slots else where)
    smallest = min(forward, key=forward.get)
    if len(set(forward.values())) > 1:
        reader.notes.append(f"{', '.join(f'{k} {v}' for k, v in forward.items())}: every forward-only pass here takes "
                            f"one budget, the smaller ({int(forward[smallest])})")
    put("--forward-max-tokens-per-micro-batch", int(forward[smallest]),
        run.origin(smallest) if smallest in run.slots else where)


def _resolve_kl_placement(reader, run, stage, effective) -> None:
    """MindSpeed-RL's `use_kl_in_reward`: where the KL to the reference goes, which here follows from the stage
    (trl_ppo: a per-token reward penalty, TRL's; grpo: a loss, or the reward with reinforce_plus_plus). Accepted
    when it says the same, or when the KL coefficient is 0 (no KL at all)."""
    use_kl = run.slot("use_kl_in_reward")
    if use_kl is None:
        return
    coef = effective("kl_coef")
    in_reward = stage == "trl_ppo" or effective("adv_estimator") == "reinforce_plus_plus"
    if coef != 0 and bool(use_kl) != in_reward:
        where = "a per-token reward penalty (trl_ppo)" if in_reward else "a loss term (grpo)"
        raise reader.error(run.origin("use_kl_in_reward"), f"{use_kl} cannot be honoured: the KL to the reference "
                                                           f"is {where} in this run; set it to {in_reward} or set "
                                                           "init_kl_coef: 0")


def _resolve_sampling(reader, run, put, flags, effective, given) -> None:
    temperature = run.slot("temperature")
    if temperature is not None:
        where = run.origin("temperature")
        if temperature < 0:
            raise reader.error(where, f"{temperature} must be >= 0 (0: greedy)")
        if temperature > 0:
            put("--do-sample", True, where)
            put("--temperature", temperature, where)
    if all(dest in flags for dest in ("max_length", "max_prompt_length", "max_new_tokens")) \
            and not given & {"max_length", "max_prompt_length", "max_new_tokens"}:
        length, prompt, new = (flags[d].value for d in ("max_length", "max_prompt_length", "max_new_tokens"))
        if length < prompt + new:
            raise reader.error(flags["max_length"].origin,
                               f"{length} is less than {flags['max_prompt_length'].origin} {prompt} + "
                               f"{flags['max_new_tokens'].origin} {new} (it bounds prompt + response); raise it")
    # vLLM's own layout for generation: here generation runs on the training model in place, with its layout; with
    # generator ranks of their own (--rollout-world-size R > 0, rl_config.rollout_world_size) their TP is this key's
    generator_ranks = bool(effective("rollout_world_size")) or "rollout_world_size" in given
    if generator_ranks and run.slot("infer_tensor_parallel_size") is not None \
            and "infer_tensor_parallel_size" not in given:
        put("--infer-tensor-parallel-size", run.slot("infer_tensor_parallel_size"),
            run.origin("infer_tensor_parallel_size"))
    for key, training in (("infer_tensor_parallel_size", "tensor_model_parallel_size"),
                          ("infer_pipeline_parallel_size", "pipeline_model_parallel_size"),
                          ("infer_expert_parallel_size", "expert_model_parallel_size")):
        value, size = run.slot(key), effective(training)
        if generator_ranks and key == "infer_tensor_parallel_size":
            continue
        if value is not None and value != size:
            reader.ignored.append((run.origin(key), f"{value}: generation runs on the training model in place, "
                                                    f"with its layout ({training} {size}); no vLLM resharding"))
    sampling_seed = run.slot("sampling_seed")
    if sampling_seed is not None:  # vLLM's sampler seed; here every sample's stream is keyed by --seed
        where = run.origin("sampling_seed")
        if "seed" not in flags and "seed" not in given:
            put("--seed", int(sampling_seed), where)
        elif int(sampling_seed) != effective("seed") and "seed" not in given:
            raise reader.error(where, f"{sampling_seed} differs from {flags['seed'].origin} {effective('seed')}: the "
                                      "samples' random streams are keyed by the run's one seed here; make them equal")
    dtype = run.slot("dtype")
    if dtype is not None:
        where = run.origin("dtype")
        if dtype not in DTYPES:
            raise reader.error(where, f"{dtype!r} is not one of {', '.join(DTYPES)}")
        precision = "bf16" if effective("bf16") else ("fp16" if effective("fp16") else "fp32")
        if DTYPES[dtype] != precision and not given & {"bf16", "fp16"}:
            raise reader.error(where, f"{dtype} differs from the training precision ({precision}): generation runs "
                                      "on the training model in place; set bf16 / fp16 and dtype alike")
