"""Numeric flags out of range, or non-finite, are refused by name before anything is built
(`mindspeed_llm/argument_ranges.py`), and so are the combinations that would train nothing or silently differ from
what was asked: each case below went through to a run (or a torch traceback) before the table existed."""

import math

import pytest

from mindspeed_llm.argument_ranges import RANGES, Bound
from mindspeed_llm.arguments import ArgumentError, build_parser, parse_args

BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "4",
        "--global-batch-size", "4", "--ref-model", "r"]


def _parse(*extra, base=BASE):
    return parse_args(list(base) + list(extra), world_size=1)


@pytest.mark.parametrize("extra,needle", [
    (["--temperature", "nan"], "--temperature nan must be a finite number"),
    (["--temperature", "0"], "--temperature 0.0 must be > 0"),
    (["--adam-beta1", "1.5"], "--adam-beta1 1.5 must be in [0, 1)"),
    (["--adam-beta2", "nan"], "--adam-beta2 nan must be a finite number"),
    (["--adam-eps=-1"], "--adam-eps -1.0 must be > 0"),
    (["--lr", "1e-3", "--min-lr", "1", "--lr-decay-style", "cosine"], "--min-lr 1 is above --lr 0.001"),
    (["--lr", "0"], "--lr 0.0 must be > 0"),
    (["--kl-coef=-1"], "--kl-coef -1.0 must be >= 0"),
    (["--gamma", "2"], "--gamma 2.0 must be in [0, 1]"),
    (["--lam=-1"], "--lam -1.0 must be in [0, 1]"),
    (["--clip-ratio=-0.2"], "--clip-ratio -0.2 must be > 0"),
    (["--cliprange-value=-1"], "--cliprange-value -1.0 must be > 0"),
    (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction 2.0 must be in [0, 1]"),
    (["--lr-warmup-iters=-5"], "--lr-warmup-iters -5 must be >= 0"),
    (["--optimizer", "sgd", "--sgd-momentum", "nan"], "--sgd-momentum nan must be a finite number"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--verifier-weight", "inf"], "--verifier-weight inf must be a finite number"),
    (["--n-samples-per-prompt", "1"], "--adv-estimator grpo compares the samples of a prompt with each other: with "
                                      "--n-samples-per-prompt 1 every advantage is 0"),
    (["--n-samples-per-prompt", "1", "--adv-estimator", "rloo"], "--adv-estimator rloo compares the samples"),
])
def test_out_of_range_values_are_refused_by_name(extra, needle):
    with pytest.raises(ArgumentError) as err:
        _parse(*extra)
    assert needle in str(err.value)


def test_every_float_flag_refuses_nan_and_inf():
    parser = build_parser()
    floats = [a.option_strings[0] for a in parser._actions if a.option_strings and a.type is float]
    assert "--lr" in floats and "--gamma" in floats and len(floats) > 30
    for flag in floats:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ArgumentError, match="must be a finite number"):
                _parse(f"{flag}={bad}")


def test_the_table_names_parser_flags_and_sources():
    actions = build_parser()._option_string_actions
    for flag, bound in RANGES.items():
        assert flag in actions, flag
        assert bound.source and (bound.low is not None or bound.high is not None), flag
    assert Bound(low=0, high=1, high_open=True).describe() == "in [0, 1)"
    assert Bound(low=0, low_open=True).describe() == "> 0" and not Bound(low=0, low_open=True).holds(0.0)


def test_the_defaults_are_in_range():
    args = _parse()
    for flag, bound in RANGES.items():
        value = getattr(args, build_parser()._option_string_actions[flag].dest)
        if value is not None and not isinstance(value, bool):
            assert bound.holds(float(value)), (flag, value)


def test_gspo_averages_per_sequence_unless_told_otherwise():
    args = _parse("--policy-loss", "gspo")
    assert args.settings.loss.loss_agg_mode == "seq-mean-token-mean"
    notes = args.settings.startup.startup_notes
    assert any("--policy-loss gspo: losses averaged per sequence" in note for note in notes)
    assert _parse("--policy-loss", "gspo", "--loss-agg-mode", "token-mean").settings.loss.loss_agg_mode == "token-mean"
    assert _parse().settings.loss.loss_agg_mode == "token-mean"


def test_stop_ids_outside_the_tokenizer_are_refused():
    from mindspeed_llm.rl.rollouts.plain import sampling_config

    tokenizer = type("Tokenizer", (), {"eos_token_id": 1, "pad_token_id": 0, "__len__": lambda self: 256})()
    args = _parse("--stop-token-ids", "7 999999 -3")
    with pytest.raises(ArgumentError, match=r"--stop-token-ids 999999 -3: outside the tokenizer's ids 0..255"):
        sampling_config(args, tokenizer)
    assert sampling_config(_parse("--stop-token-ids", "7 255"), tokenizer).stop_token_ids == (7, 255)


def test_entropy_guard():
    from mindspeed_llm.checkpoint.errors import DivergenceError
    from mindspeed_llm.rl.trainer import EntropyGuard

    uniform = math.log(256)
    guard = EntropyGuard(256)
    guard.check(0.5 * uniform)
    guard.check(0.95 * uniform)  # high, not yet uniform
    with pytest.raises(DivergenceError, match="the policy went uniform"):
        guard.check(0.995 * uniform)
    random_start = EntropyGuard(256)  # a random-weight model starts uniform: nothing learnt to forget
    for _ in range(3):
        random_start.check(0.999 * uniform)
    EntropyGuard(256).check(None)  # no entropy on this pipeline stage
