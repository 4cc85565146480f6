"""The run config's checkpoint and role mapping (the package docstring's "Checkpoints"): which of the file's
`load` / `save` paths are the initial actor (`--ref-model`), a resume root (`--load`), the critic's initial
weights or the reward model (`--reward-model`), and `--save`."""

from __future__ import annotations

import os
from typing import Optional

from mindspeed_llm.run_config.reader import cli_value
from mindspeed_llm.run_config.tables import ConfigError


def same_path(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def checkpoint_kind(path: str) -> str:
    """'save' (a --save root: role folders), 'model' (a converted model), 'none' (missing or empty)."""
    if any(os.path.isdir(os.path.join(path, role)) for role in ("actor", "critic")):
        return "save"
    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        return "model"
    return "none"


def resolve_checkpoints(reader, run, roles, stage, put, flags, given, rule_verifiers: bool, cli_argv) -> None:
    load, where_load = run.slot("load"), run.origin("load")
    finetune = bool(run.slot("finetune", False))
    ref, where_ref = _reference(reader, run, roles)

    resumes = False
    if load is not None:
        kind = checkpoint_kind(load)
        if kind == "model" or (finetune and kind != "save"):  # the actor's initial weights
            if ref is not None and not same_path(ref, load) and "ref_model" not in given:
                raise reader.error(where_ref, f"{ref!r} differs from the actor's initial weights {where_load} "
                                              f"{load!r}: this program starts actor and reference from one model "
                                              "(--ref-model); to fine-tune a previous run of this program against "
                                              "the original reference, set the actor's load to that run's save "
                                              "directory (finetune: true)")
            put("--ref-model", load, where_load)
        else:  # a previous --save root: resume (or, with finetune, its weights only)
            resumes = True
            put("--load", load, where_load)
            for name, flag in (("finetune", "--finetune"), ("no_load_optim", "--no-load-optim"),
                               ("no_load_rng", "--no-load-rng")):
                if name in run.slots:
                    put(flag, run.slot(name), run.origin(name))
            if ref is not None:
                put("--ref-model", ref, where_ref)
            elif "ref_model" not in given:
                how = "fine-tunes the weights of" if finetune else "resumes"
                raise reader.error(where_load, f"{load!r} {how} a previous run (a --save directory of this program): "
                                               "set rl_config.integrated_mode_config.ref_model_load_path (or "
                                               "ref_config.load) to the original weights, which the reference model "
                                               "keeps (and the actor's initial weights when nothing is saved there yet)")
    elif ref is not None:
        put("--ref-model", ref, where_ref)
    save = run.slot("save")
    if save is not None:
        if load is not None and not resumes and same_path(save, load) and checkpoint_kind(load) == "model":
            raise reader.error(run.origin("save"), f"{save!r} is the directory of the initial weights ({where_load}): "
                                                   "this program writes SAVE/actor, SAVE/critic and "
                                                   "SAVE/latest_checkpointed_iteration.txt, which would replace that "
                                                   "model's own; save to another directory")
        put("--save", save, run.origin("save"))

    # -- critic (trl_ppo) and reward model
    critic = roles.get("critic_config", (None, None))[0]
    critic_init = critic_from_command_line = None
    root = cli_value(cli_argv, "--load") if "load" in given else (load if resumes else None)  # the resume root
    if critic is not None:
        critic_init, critic_from_command_line = _critic_start(reader, run, critic, load, root, resumes, put,
                                                              flags, given)
    reward = roles.get("reward_config", (None, None))[0]
    reward_load = (reward.slot("load"), reward.origin("load")) if reward is not None and "load" in reward.slots else None
    if reward is not None:
        for name in ("save", "finetune", "no_load_optim", "no_load_rng"):
            if name in reward.slots:
                reader.ignored.append((reward.origin(name), "the reward model is frozen: weights only, never saved"))
    if "reward_model" in given:
        if critic_from_command_line and rule_verifiers and reward_load is None and "reward_model_weight" not in given:
            put("--reward-model-weight", 0.0, critic_from_command_line)  # it only starts the critic; verifiers score
        return
    if critic_init and reward_load and stage == "trl_ppo" and not same_path(critic_init[0], reward_load[0]):
        raise reader.error(critic_init[1], f"{critic_init[0]!r} differs from {reward_load[1]} {reward_load[0]!r}: "
                                           "this program starts the critic from the reward model (--reward-model); "
                                           "make them equal, or drop reward_config to score with rule verifiers only")
    chosen = reward_load or critic_init
    if chosen is not None:
        put("--reward-model", chosen[0], chosen[1])
    elif stage == "trl_ppo" and critic is not None and same_path(critic.slot("load"), root) and rule_verifiers:
        start = os.path.join(root, "critic")  # the reward is the verifiers': this model only starts the critic
        put("--reward-model", start, critic.origin("load"))
        reader.notes.append(f"the critic starts from {start} (its own latest weights; no reward_config.load)")
    elif stage == "trl_ppo" and (critic is not None or reward is not None):
        raise ConfigError(f"--config {reader.path}: trl_ppo needs the critic's initial weights, a value-head "
                          "checkpoint (convert_ckpt.py --orm), which this program also scores with unless rule "
                          "verifiers do: set reward_config.load (or critic_config.load to the critic's initial "
                          "weights)")
    if stage == "trl_ppo" and rule_verifiers and reward_load is None and "reward_model" in flags \
            and "reward_model_weight" not in flags:
        put("--reward-model-weight", 0.0, flags["reward_model"].origin)  # it only starts the critic


def _reference(reader, run, roles):
    """(the reference's checkpoint, where the file gives it) or (None, None): rl_config.integrated_mode_config.
    ref_model_load_path and ref_config.load, which must agree."""
    ref_paths = [(run.slot("ref_model_load_path"), run.origin("ref_model_load_path"))]
    if "ref_config" in roles:
        ref_role = roles["ref_config"][0]
        ref_paths.append((ref_role.slot("load"), ref_role.origin("load")))
        for name in ("save", "finetune", "no_load_optim", "no_load_rng"):
            if name in ref_role.slots:
                reader.ignored.append((ref_role.origin(name), "the reference model is frozen: weights only, never saved"))
    ref_paths = [(p, w) for p, w in ref_paths if p is not None]
    if len(ref_paths) == 2 and not same_path(ref_paths[0][0], ref_paths[1][0]):
        raise reader.error(ref_paths[1][1], f"{ref_paths[1][0]!r} differs from {ref_paths[0][1]} "
                                            f"{ref_paths[0][0]!r}: the reference has one checkpoint; make them equal")
    return ref_paths[0] if ref_paths else (None, None)


def _critic_start(reader, run, critic, load, root, resumes: bool, put, flags, given):
    """The critic's `save` and `load` (trl_ppo): (its initial weights and where the file gives them, or None;
    where the file's critic load gave way to the command line's --reward-model, or None)."""
    critic_init = critic_from_command_line = None
    save = critic.slot("save")
    if save is not None and "save" not in given:
        if "save" in flags and not same_path(save, flags["save"].value):
            raise reader.error(critic.origin("save"), f"{save!r} differs from {run.origin('save')} "
                                                      f"{flags['save'].value!r}: this program saves actor and critic "
                                                      "under one --save (DIR/actor, DIR/critic); set both to the same "
                                                      "directory")
        put("--save", save, critic.origin("save"))
    c_load, where = critic.slot("load"), critic.origin("load")
    if c_load is not None:
        if same_path(c_load, root):  # the critic resumes with the actor
            for name in ("finetune", "no_load_optim", "no_load_rng"):
                mine, actors = critic.slot(name), bool(run.slot(name, False))
                if resumes and mine is not None and mine != actors:
                    raise reader.error(critic.origin(name), f"{mine} differs from the actor's {actors}: this "
                                                            "program resumes actor and critic together from one "
                                                            "--load, with one setting; make them equal")
        elif checkpoint_kind(c_load) == "save":
            actor_side = f"resumes from {root!r}" if root else "starts from its initial weights"
            raise reader.error(where, f"{c_load!r} is a --save directory of this program, but the actor "
                                      f"{actor_side}: this program saves and resumes actor and critic under one "
                                      "directory (DIR/actor, DIR/critic); set actor_config.load and "
                                      "critic_config.load to the same directory")
        elif same_path(c_load, load) and "reward_model" in given:
            reader.notes.append(f"{where} {c_load!r} is the policy's checkpoint; the critic starts from the "
                                "command line's --reward-model (a value-head checkpoint)")
            critic_from_command_line = where
        elif same_path(c_load, load):
            raise reader.error(where, f"{c_load!r} is the policy's checkpoint, but the critic starts from a "
                                      "value-head checkpoint here (--reward-model): convert one with "
                                      "convert_ckpt.py --orm (e.g. the policy with a zero value head) and set "
                                      "critic_config.load to it")
        elif resumes and critic.slot("finetune") is True:
            raise reader.error(critic.origin("finetune"), "the critic would start afresh while the actor "
                                                          f"resumes from {load!r}: this program resumes both "
                                                          "together; set critic_config.finetune: false")
        else:
            critic_init = (c_load, where)
    return critic_init, critic_from_command_line
