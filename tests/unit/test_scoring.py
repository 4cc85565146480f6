"""`rl/scoring.py`'s Scorer, without a reward model: the weighted sum of the rule verifiers, less TRL's missing-EOS
penalty for responses that did not end in EOS, plus DAPO's overlong penalty, with their metrics; hand-computed."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.experience import SampleData
from mindspeed_llm.rl.scoring import Scorer
from mindspeed_llm.rl.verifiers import register_verifier


@pytest.fixture(scope="module", autouse=True)
def verifiers():
    """Two rule rewards whose scores a reader can work out: the response starts with `yes`; its word count / 4."""
    register_verifier("starts_with_yes", override=True)(lambda text, label: float(text.startswith("yes")))
    register_verifier("quarter_words", override=True)(lambda text, label: len(text.split()) / 4)


def _timers(name):
    return contextlib.nullcontext()


def _experience(texts, ended_with_eos, response_lengths):
    return SimpleNamespace(tokens=torch.zeros(len(texts), 1, dtype=torch.long), batch_size=len(texts), scores=None,
                           sample_data=SampleData(texts=texts, labels=[None] * len(texts),
                                                  indices=list(range(len(texts)))),
                           ended_with_eos=torch.tensor(ended_with_eos), response_lengths=torch.tensor(response_lengths))


def test_weighted_verifiers_less_the_missing_eos_penalty_plus_the_overlong_penalty():
    exp = _experience(["yes a b c", "no", "yes"], [True, False, True], [3, 8, 6])
    scorer = Scorer(["starts_with_yes", "quarter_words"], [0.5, 2.0], missing_eos_penalty=1.0,
                    overlong_buffer_len=4, overlong_penalty_factor=1.0, max_new_tokens=8)
    scores, metrics = scorer(exp, plan=None, timers=_timers)
    # starts_with_yes: 1, 0, 1; quarter_words: 4/4, 1/4, 1/4 -> 0.5 * . + 2 * . = 2.5, 0.5, 1.0
    # missing EOS (row 1): -1; overlong, min(0, (8 - 4 - n) / 4): n = 3 -> 0, n = 8 -> -1, n = 6 -> -0.5
    torch.testing.assert_close(scores, torch.tensor([2.5, 0.5 - 1.0 - 1.0, 1.0 - 0.5]))
    assert metrics["starts_with_yes_rewards/mean"] == pytest.approx(2 / 3)
    assert metrics["quarter_words_rewards/mean"] == pytest.approx(0.5)
    assert metrics["overlong/penalty_mean"] == pytest.approx(-0.5)
    assert metrics["overlong/penalised_fraction"] == pytest.approx(2 / 3)  # 8 and 6 are over 8 - 4 tokens


def test_without_penalties_the_score_is_the_weighted_sum_alone():
    exp = _experience(["yes", "no no"], [False, False], [8, 8])
    scores, metrics = Scorer(["starts_with_yes"], [3.0])(exp, plan=None, timers=_timers)
    torch.testing.assert_close(scores, torch.tensor([3.0, 0.0]))
    assert not any(key.startswith("overlong/") for key in metrics)


def test_an_unknown_verifier_is_refused_by_flag_and_the_overlong_penalty_needs_its_length():
    with pytest.raises(ArgumentError, match="--verifier-function"):
        Scorer(["no_such_verifier"], [1.0])
    with pytest.raises(ValueError, match="needs max_new_tokens"):
        Scorer(["starts_with_yes"], [1.0], overlong_buffer_len=4)


@pytest.mark.parametrize("mode, expected", [("add", [1.0 + 0.5, -0.25]), ("record", [1.0, 0.0])])
def test_tool_rewards_are_added_or_only_recorded(mode, expected):
    """--tool-rewards: `add` puts a trajectory's tool rewards into its score, `record` (verl's way) only into the
    score parts (`tool_recorded`) and the metrics."""
    exp = _experience(["yes", "no"], [True, True], [1, 1])
    exp.sample_data.trajectories = [{"num_turns": 2, "tool_reward": 0.5}, {"num_turns": 1, "tool_reward": -0.25}]
    scores, metrics = Scorer(["starts_with_yes"], [1.0], tool_rewards=mode)(exp, plan=None, timers=_timers)
    torch.testing.assert_close(scores, torch.tensor(expected))
    assert metrics["tool/reward/mean"] == pytest.approx(0.125)
    key = "tool" if mode == "add" else "tool_recorded"
    assert [p[key] for p in exp.sample_data.score_parts] == [0.5, -0.25]
