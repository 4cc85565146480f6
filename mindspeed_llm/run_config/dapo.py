"""MindSpeed-RL's DAPO (``stage: ray_dapo``) on this program's grpo stage, and its twelve ``rl_config`` keys.

MindSpeed-RL's ray_dapo trainer is its grpo trainer without a reference model (its DAPO loss has no KL term) and
with DAPO's loss and batch: the keys below are read where MindSpeed-RL reads them.

* Under ray_dapo only (its DAPO loss and trainer; under another stage they are listed as ignored):
  ``token_level_loss`` (true: --loss-agg-mode token-mean, false: seq-mean-token-mean); ``clip_higher_enable: true``
  with ``clip_ratio_low`` / ``clip_ratio_high`` (MindSpeed-RL's defaults 0.1 / 0.1) -> --clip-ratio /
  --clip-ratio-high (without it the loss clips at ``clip_ratio`` on both sides and the two are ignored);
  ``filter_groups_enable: true`` -> --dynamic-sampling, keeping the groups whose ``filter_groups_metric`` (a verifier
  of ``verifier_function``, its own score before weights) differs -> --dynamic-sampling-metric,
  ``filter_groups_max_batches`` -> --max-num-gen-batches (-1 / 0, MindSpeed-RL's "no limit": 0),
  ``filter_groups_train_batch_size`` must be ``global_batch_size`` (one batch size generates and trains here).
* In every stage (MindSpeed-RL applies it to the rule rewards): ``overlong_buffer_enable: true`` with
  ``overlong_buffer`` / ``overlong_buffer_penalty_factor`` -> --overlong-buffer-len / --overlong-penalty-factor;
  ``rollout_max_tokens`` must be the response limit (``sampling_config.max_tokens``, --max-new-tokens), as
  MindSpeed-RL checks. Without the switch the four keys are ignored.

ray_dapo sets --kl-coef 0 (no reference model is built); an ``init_kl_coef`` other than 0 is refused.
"""

from __future__ import annotations

from typing import List

_LOSS_KEYS = ("token_level_loss", "clip_higher_enable", "clip_ratio_low", "clip_ratio_high")
_FILTER_KEYS = ("filter_groups_enable", "filter_groups_metric", "filter_groups_max_batches",
                "filter_groups_train_batch_size")
_OVERLONG_KEYS = ("overlong_buffer_enable", "rollout_max_tokens", "overlong_buffer", "overlong_buffer_penalty_factor")
# MindSpeed-RL's defaults (its rl_config.py) for keys a file leaves out
_DEFAULTS = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "overlong_buffer_penalty_factor": 1.0,
             "filter_groups_metric": "acc", "filter_groups_max_batches": 1, "filter_groups_train_batch_size": 1}


def resolve_dapo(reader, run, put, flags, effective, stage: str, dapo: bool) -> None:
    """The flags of DAPO's keys (module doc); `dapo`: the file's stage is ray_dapo and the run's is grpo."""
    features: List[str] = []
    if dapo:
        _no_kl(reader, put, flags, run)
        features.append("no reference model or KL loss (--kl-coef 0)")
        features += _loss(reader, run, put, flags)
        features += _filter(reader, run, put, effective)
    else:
        why = f"read by MindSpeed-RL's DAPO loss and trainer only (stage: ray_dapo); this run's stage is {stage}"
        for name in _LOSS_KEYS + _FILTER_KEYS:
            if name in run.slots:
                reader.ignored.append((run.origin(name), why))
    features += _overlong(reader, run, put, effective)
    if dapo:
        reader.notes.append(f"{run.origin('stage')}: ray_dapo runs as --stage grpo with DAPO's features: "
                            + "; ".join(features))


def _value(run, name):
    return run.slot(name, _DEFAULTS.get(name))


def _integer(reader, run, name, minimum=None) -> int:
    value = _value(run, name)
    if value != int(value) or (minimum is not None and value < minimum):
        raise reader.error(run.origin(name), f"{value} must be an integer" +
                           (f" >= {minimum}" if minimum is not None else ""))
    return int(value)


def _no_kl(reader, put, flags, run) -> None:
    where = run.origin("stage")
    if "kl_coef" in flags and flags["kl_coef"].value != 0:
        raise reader.error(flags["kl_coef"].origin, f"{flags['kl_coef'].value} cannot be honoured with stage "
                                                    "ray_dapo: MindSpeed-RL's DAPO trains without a reference model "
                                                    "(its loss has no KL term); set init_kl_coef: 0, or stage: "
                                                    "ray_grpo for a KL loss")
    put("--kl-coef", 0.0, flags["kl_coef"].origin if "kl_coef" in flags else where)


def _loss(reader, run, put, flags) -> List[str]:
    features = []
    if "token_level_loss" in run.slots:
        mode = "token-mean" if run.slot("token_level_loss") else "seq-mean-token-mean"
        put("--loss-agg-mode", mode, run.origin("token_level_loss"))
        features.append(f"the loss averaged per {'token' if mode == 'token-mean' else 'sequence'} "
                        f"(--loss-agg-mode {mode})")
    if run.slot("clip_higher_enable"):
        low, high = _value(run, "clip_ratio_low"), _value(run, "clip_ratio_high")
        where = run.origin("clip_higher_enable")
        if "clip_ratio" in flags and flags["clip_ratio"].value != low:
            reader.ignored.append((flags["clip_ratio"].origin, "clip_higher_enable: DAPO's loss clips at "
                                                               "1 - clip_ratio_low and 1 + clip_ratio_high"))
        put("--clip-ratio", low, run.origin("clip_ratio_low") if "clip_ratio_low" in run.slots else where)
        put("--clip-ratio-high", high, run.origin("clip_ratio_high") if "clip_ratio_high" in run.slots else where)
        features.append(f"clip-higher (--clip-ratio {low} --clip-ratio-high {high})")
    else:
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if name in run.slots:
                reader.ignored.append((run.origin(name), "clip_higher_enable is not true: the loss clips at "
                                                         "clip_ratio on both sides"))
    return features


def _filter(reader, run, put, effective) -> List[str]:
    if not run.slot("filter_groups_enable"):
        for name in _FILTER_KEYS[1:]:
            if name in run.slots:
                reader.ignored.append((run.origin(name), "filter_groups_enable is not true"))
        return []
    where = run.origin("filter_groups_enable")
    metric = _value(run, "filter_groups_metric")
    verifiers = run.slot("verifier_function") or []
    if metric not in verifiers:
        raise reader.error(run.origin("filter_groups_metric") if "filter_groups_metric" in run.slots else where,
                           f"{metric!r} is not one of rl_config.verifier_function {verifiers}: dynamic sampling "
                           "keeps the groups whose scores by that verifier differ; name one of them")
    train = _integer(reader, run, "filter_groups_train_batch_size", 1)
    batch = effective("global_batch_size")
    if train != batch:
        raise reader.error(run.origin("filter_groups_train_batch_size") if "filter_groups_train_batch_size"
                           in run.slots else where,
                           f"{train} differs from global_batch_size {batch}: here a generation batch and the batch "
                           "trained on are both --global-batch-size prompt groups (more are generated until that "
                           "many differ); make them equal")
    batches = _integer(reader, run, "filter_groups_max_batches")
    batches = max(batches, 0)  # MindSpeed-RL's -1 (or 0): no limit
    put("--dynamic-sampling", True, where)
    put("--dynamic-sampling-metric", metric, run.origin("filter_groups_metric") if "filter_groups_metric" in run.slots
        else where)
    put("--max-num-gen-batches", batches, run.origin("filter_groups_max_batches")
        if "filter_groups_max_batches" in run.slots else where)
    limit = f"at most {batches} generation batches" if batches else "no limit on generation batches"
    return [f"dynamic sampling on {metric}'s scores ({limit})"]


def _overlong(reader, run, put, effective) -> List[str]:
    if not run.slot("overlong_buffer_enable"):
        for name in _OVERLONG_KEYS[1:]:
            if name in run.slots:
                reader.ignored.append((run.origin(name), "overlong_buffer_enable is not true"))
        return []
    where = run.origin("overlong_buffer_enable")
    if "overlong_buffer" not in run.slots:
        raise reader.error(where, "true needs rl_config.overlong_buffer (the length of the penalised zone)")
    buffer = _integer(reader, run, "overlong_buffer", 1)
    limit = effective("max_new_tokens")
    if "rollout_max_tokens" in run.slots and run.slot("rollout_max_tokens") != limit:
        raise reader.error(run.origin("rollout_max_tokens"), f"{run.slot('rollout_max_tokens')} differs from the "
                                                             f"response limit {limit} (sampling_config.max_tokens, "
                                                             "--max-new-tokens): the penalty counts from it; make "
                                                             "them equal, as MindSpeed-RL requires")
    factor = _value(run, "overlong_buffer_penalty_factor")
    put("--overlong-buffer-len", buffer, run.origin("overlong_buffer"))
    put("--overlong-penalty-factor", factor, run.origin("overlong_buffer_penalty_factor")
        if "overlong_buffer_penalty_factor" in run.slots else where)
    return [f"the overlong penalty (--overlong-buffer-len {buffer} --overlong-penalty-factor {factor})"]
