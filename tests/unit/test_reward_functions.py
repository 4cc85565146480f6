"""Rewards that see the trajectory (issue 37, item 4): verifiers and a user's reward function get the dataset row and
the multi-turn trajectory by parameter name (`rl/verifiers/calling.py`), a user's function is loaded from a file
outside the package (`--custom-reward-function PATH:NAME`, `rl/reward_functions.py`, verl's
``custom_reward_function`` in a run config), and the tools' own rewards are added to the score (`rl/scoring.py`).
Every score below is worked out by hand in its comment."""

import contextlib
import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.rl.experience import SampleData
from mindspeed_llm.rl.reward_functions import load_reward_function, parse_spec
from mindspeed_llm.rl.scoring import Scorer, sample_rows
from mindspeed_llm.rl.verifiers import (
    SignatureError, as_score, call_plan, check_trajectory, register_verifier, score_batch,
)
from mindspeed_llm.rl.verifiers.registry import _REGISTRY
from tests.helpers.mindspeed_rl_configs import grpo_file, parsed, write

ROOT = Path(__file__).resolve().parents[2]
USER = ROOT / "tests" / "fixtures" / "user_rewards" / "my_rewards.py"
FAILING = ROOT / "tests" / "fixtures" / "user_rewards" / "failing_rewards.py"
BASE = ["--data-path", "d", "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r", "--stage", "grpo"]


def _trajectory(calls: int, tool_reward: float = 0.0) -> dict:
    turns = [{"role": "assistant", "text": "let me compute",
              "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}] * calls}]
    turns += [{"role": "tool", "text": "42", "name": "calculator", "reward": tool_reward / calls, "error": False}
              for _ in range(calls)]
    turns.append({"role": "assistant", "text": "The answer is 42", "tool_calls": []})
    return {"turns": turns, "num_turns": 2, "tool_calls": calls, "tool_reward": tool_reward}


# three samples: right / wrong / right, the last a single-turn answer to a hard row
TEXTS = ["The answer is 42", "I think 41", "42"]
LABELS = ["42", "42", "42"]
COLUMNS = {"difficulty": ["hard", "easy", "hard"], "data_source": ["strict", "lenient", "strict"],
           "extra_info": [{"bonus": 0.5}, {}, {"split": "train"}]}
TRAJECTORIES = [_trajectory(2, tool_reward=0.5), _trajectory(1, tool_reward=-0.25), None]


def _timers(name):
    return contextlib.nullcontext()


def _experience(trajectories=TRAJECTORIES):
    data = SampleData(texts=list(TEXTS), labels=list(LABELS), indices=[10, 11, 12],
                      columns={k: list(v) for k, v in COLUMNS.items()}, trajectories=trajectories)
    n = len(TEXTS)
    return SimpleNamespace(tokens=torch.zeros(n, 1, dtype=torch.long), batch_size=n, sample_data=data, scores=None,
                           ended_with_eos=torch.ones(n, dtype=torch.bool), response_lengths=torch.full((n,), 4))


@pytest.fixture(scope="module", autouse=True)
def verifiers():
    # the old style, unchanged: (text, label)
    register_verifier("ends_with_label", override=True)(lambda text, label: float(text.endswith(label)))

    # the new style: the row and the trajectory by name
    def hard_tool_calls(text, label, *, row, trajectory):
        return float(row["difficulty"] == "hard") * (0 if trajectory is None else trajectory["tool_calls"])

    register_verifier("hard_tool_calls", override=True)(hard_tool_calls)

    def only_row(row):  # no text / label parameter: gets none
        return float(row["index"]) + len(row["data_source"])

    register_verifier("only_row", override=True)(only_row)
    yield
    for name in ("ends_with_label", "hard_tool_calls", "only_row", "custom", "needs_tokenizer"):
        _REGISTRY.pop(name, None)  # the registry is the process's: leave it as found


# ------------------------------------------------------------------------------------------ the call plans
def test_the_signature_decides_what_a_function_gets():
    assert call_plan(lambda text, label: 0).style == "verifier"
    assert call_plan(lambda resp, lb: 0).positional == 2  # any names: the first two positional parameters
    plan = call_plan(lambda text, label, *, row, trajectory: 0)
    assert (plan.style, plan.context, plan.text_label) == ("keyword", ("row", "trajectory"), ("text", "label"))
    assert call_plan(lambda row, text, label=None: 0).call(lambda row, text, label=None: (row, text, label),
                                                           "t", "l", {"a": 1}) == ({"a": 1}, "t", "l")
    assert call_plan(len).style == "verifier"  # a builtin without a signature: the verifier convention
    verl = call_plan(lambda data_source, solution_str, ground_truth, extra_info=None, **kw: 0)
    assert verl.style == "verl" and verl.needs_row
    seen = verl.call(lambda data_source, solution_str, ground_truth, extra_info=None, **kw:
                     (data_source, solution_str, ground_truth, extra_info, kw),
                     "t", "l", {"data_source": "gsm8k", "extra_info": {"k": 1}}, {"num_turns": 3})
    # num_turns in verl's count (3 assistant turns, 2 tool answers, + 1), the model turns as assistant_turns
    assert seen == ("gsm8k", "t", "l", {"k": 1, "num_turns": 6, "assistant_turns": 3}, {})  # **kwargs: nothing more
    # without an extra_info column verl's extra_info is the row
    info = lambda solution_str, ground_truth, extra_info: extra_info  # noqa: E731
    assert call_plan(info).call(info, "t", "l", {"index": 4}) == {"index": 4}


def test_a_parameter_nothing_fills_is_refused_when_registered():
    with pytest.raises(SignatureError, match="parameter 'tokenizer' has no default"):
        register_verifier("needs_tokenizer", override=True)(lambda text, label, tokenizer: 0.0)
    with pytest.raises(SignatureError, match="declare trajectory keyword-only"):
        call_plan(lambda trajectory, *args: 0)


def test_as_score_takes_numbers_and_verls_mappings():
    assert as_score(True) == (1.0, {})
    assert as_score({"score": 0.5, "acc": 1, "pred": "x"}) == (0.5, {"acc": 1.0})
    for bad in ({"acc": 1.0}, float("nan"), "1.0", None):
        with pytest.raises((ValueError, TypeError)):
            as_score(bad)


# ------------------------------------------------------------------------------------------ old and new verifiers
def test_old_and_new_verifiers_on_rows_with_columns_and_trajectories():
    exp = _experience()
    scorer = Scorer(["ends_with_label", "hard_tool_calls", "only_row"], [1.0, 2.0, 0.5])
    scores, metrics = scorer(exp, plan=None, timers=_timers)
    # ends_with_label: 1, 0, 1; hard_tool_calls: hard with 2 calls -> 2, easy -> 0, hard single-turn -> 0;
    # only_row: index + len(data_source): 10 + 6, 11 + 7, 12 + 6; tools' rewards: 0.5, -0.25, 0 (single-turn)
    expected = [1 + 2 * 2 + 0.5 * 16 + 0.5, 0 + 0 + 0.5 * 18 - 0.25, 1 + 0 + 0.5 * 18 + 0]
    torch.testing.assert_close(scores, torch.tensor(expected))
    assert metrics["hard_tool_calls_rewards/mean"] == pytest.approx(2 / 3)
    assert metrics["tool/reward/mean"] == pytest.approx(0.25 / 3)
    assert metrics["ends_with_label_rewards/failures"] == 0


def test_single_turn_rollouts_get_no_trajectory_and_no_tool_reward():
    scores, metrics = Scorer(["hard_tool_calls", "ends_with_label"], [1.0, 1.0])(
        _experience(trajectories=None), plan=None, timers=_timers)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 1.0]))
    assert "tool/reward/mean" not in metrics


def test_score_batch_keeps_its_old_form():
    per, failures = score_batch(["a 42", "b"], ["42", None], ["ends_with_label", "only_row"])
    assert per["ends_with_label"] == [1.0, 0.0] and failures == {"ends_with_label": 1, "only_row": 2}
    # only_row reads row["index"] and row["data_source"]: without rows it gets {"labels": label} and fails (0)


def test_the_rows_are_every_column_with_labels_and_index():
    assert sample_rows(_experience().sample_data)[1] == {"difficulty": "easy", "data_source": "lenient",
                                                         "extra_info": {}, "labels": "42", "index": 11}


# ------------------------------------------------------------------------------------------ a user's function
def test_verls_compute_score_loaded_by_path_scores_by_hand():
    fn = load_reward_function(str(USER))  # NAME defaults to compute_score
    assert "my_rewards" not in sys.modules and fn.plan.style == "verl"
    scorer = Scorer([], [], custom_reward_function=fn, custom_reward_weight=2.0)
    scores, metrics = scorer(_experience(trajectories=None), plan=None, timers=_timers)
    # row 0: right, bonus 0.5 -> 1.5; row 1: wrong, lenient -> 0.5; row 2: right (last number 42), no bonus -> 1
    torch.testing.assert_close(scores, 2.0 * torch.tensor([1.5, 0.5, 1.0]))
    assert metrics["custom_rewards/mean"] == pytest.approx(1.0)


def test_a_mapping_return_gives_the_score_and_metrics():
    scorer = Scorer(["ends_with_label"], [1.0], custom_reward_function=f"{USER}:with_metrics")
    scores, metrics = scorer(_experience(trajectories=None), plan=None, timers=_timers)
    # with_metrics: 2 acc - 1 = 1, -1, 1; ends_with_label: 1, 0, 1
    torch.testing.assert_close(scores, torch.tensor([2.0, -1.0, 2.0]))
    assert metrics["reward/acc/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/words/mean"] == pytest.approx((4 + 3 + 1) / 3)
    assert not any("note" in key for key in metrics)  # not a number: not a metric


def test_the_keyword_style_gets_row_and_trajectory():
    scores, _ = Scorer([], [], custom_reward_function=f"{USER}:tool_use")(_experience(), plan=None, timers=_timers)
    # tool_use: right + 0.25 x 2 calls (hard) = 1.5; wrong, easy = 0; right, hard single-turn = 0; tools: 0.5, -0.25
    torch.testing.assert_close(scores, torch.tensor([1.5 + 0.5, 0.0 - 0.25, 0.0]))


@pytest.mark.parametrize("spec,needle", [
    ("tests/fixtures/user_rewards/missing.py", "there is no file 'tests/fixtures/user_rewards/missing.py'"),
    ("tests/fixtures/user_rewards", "is a directory; give the .py file"),
    ("tests/fixtures/data/README.md", "is not a Python source file (.py)"),
    ("tests/fixtures/user_rewards/my_rewards.py:nope", "defines no 'nope' (its functions: compute_score, needs_more, "
                                                       "tool_use, with_metrics)"),
    ("tests/fixtures/user_rewards/my_rewards.py:not_a_function",
     "'not_a_function' in tests/fixtures/user_rewards/my_rewards.py is a int, not a function; name a function"),
    ("tests/fixtures/user_rewards/my_rewards.py:needs_more", "parameter 'tokenizer' has no default"),
    ("tests/fixtures/user_rewards/my_rewards.py:", "the function name after ':' is empty"),
])
def test_each_error_names_the_file_and_the_fix(spec, needle, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ArgumentError) as err:
        load_reward_function(spec)
    assert str(err.value).startswith(f"--custom-reward-function {spec}: ") and needle in str(err.value)


def test_a_file_that_does_not_load_is_refused(tmp_path):
    (tmp_path / "broken.py").write_text("def compute_score(solution_str, ground_truth):\n    return (\n")
    with pytest.raises(ArgumentError, match=r"broken.py has a syntax error at line \d+: .*fix the file"):
        load_reward_function(str(tmp_path / "broken.py"))
    (tmp_path / "imports.py").write_text("import no_such_package_here\n")
    with pytest.raises(ArgumentError, match="raised ModuleNotFoundError: No module named 'no_such_package_here'"):
        load_reward_function(str(tmp_path / "imports.py"))


def test_parse_spec():
    assert parse_spec("a/b.py") == ("a/b.py", "compute_score")
    assert parse_spec("a/b.py:score_fn") == ("a/b.py", "score_fn")


# ------------------------------------------------------------------------------------------ the flags
def test_the_flag_reaches_the_scorer_through_the_settings():
    settings = parse_args(BASE + ["--custom-reward-function", f"{USER}:with_metrics"]).settings
    assert settings.reward.custom_reward_function == f"{USER}:with_metrics"  # grpo's reward: the function alone
    assert settings.reward.custom_reward_weight == 1.0
    scorer = Scorer.from_settings(settings.reward)
    assert scorer.functions["custom"].fn.__name__ == "with_metrics" and scorer.function_weights == {"custom": 1.0}
    weighted = parse_args(BASE + ["--verifier-function", "format", "--custom-reward-function", str(USER),
                                  "--custom-reward-weight", "0.5"]).settings.reward
    assert (weighted.custom_reward_weight, weighted.verifier_function) == (0.5, ("format",))


@pytest.mark.parametrize("extra,needle", [
    (["--verifier-function", "format", "--custom-reward-weight", "2"],
     "--custom-reward-weight has no effect without --custom-reward-function"),
    (["--custom-reward-function", "tests/fixtures/user_rewards/missing.py"], "there is no file"),
    (["--custom-reward-function", f"{USER}:nope"], "defines no 'nope'"),
])
def test_the_flags_are_checked_before_any_model(extra, needle, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ArgumentError, match=needle):
        parse_args(BASE + extra)


def test_a_verifier_named_custom_clashes():
    register_verifier("custom", override=True)(lambda text, label: 0.0)
    with pytest.raises(ArgumentError, match="both score under the name 'custom'"):
        parse_args(BASE + ["--verifier-function", "custom", "--custom-reward-function", str(USER)])


# ------------------------------------------------------------------------------------------ the run config
def test_verls_custom_reward_function_in_a_run_config(tmp_path):
    data = grpo_file()
    data["rl_config"]["custom_reward_function"] = {"path": str(USER), "name": "tool_use"}
    assert parsed(["--config", write(tmp_path, data)], 16)["custom_reward_function"] == f"{USER}:tool_use"
    data = grpo_file()
    data["custom_reward_function"] = {"path": str(USER), "reward_kwargs": {}}  # verl's place; NAME: compute_score
    assert parsed(["--config", write(tmp_path, data)], 16)["custom_reward_function"] == str(USER)
    data["custom_reward_function"] = {"path": None, "name": "compute_score"}  # verl's default: no function
    assert parsed(["--config", write(tmp_path, data)], 16)["custom_reward_function"] is None


@pytest.mark.parametrize("where,value,needle", [
    ("section", {"path": "x.py", "reward_kwargs": {"alpha": 1}}, "extra keyword arguments are not passed"),
    ("both", {"path": "x.py"}, "is given twice, as a section and in rl_config"),
    ("rl_config", {"path": "x.py", "nam": "f"}, "unknown key 'nam'"),
    ("rl_config", {"path": 3}, "3 is not a path"),
])
def test_run_config_custom_reward_function_problems(tmp_path, where, value, needle):
    data = grpo_file()
    if where in ("section", "both"):
        data["custom_reward_function"] = value
    if where in ("rl_config", "both"):
        data["rl_config"]["custom_reward_function"] = value
    with pytest.raises(ArgumentError, match=needle):
        parsed(["--config", write(tmp_path, data)], 16)


# ------------------------------------------------------------------------------------------ the trajectory type
def test_trajectories_are_plain_data_carried_by_select_and_concat():
    for trajectory in TRAJECTORIES[:2]:
        check_trajectory(trajectory)
        assert pickle.loads(pickle.dumps(trajectory)) == trajectory == json.loads(json.dumps(trajectory))
    with pytest.raises(ValueError, match="lacks tool_reward"):
        check_trajectory({"turns": [], "num_turns": 0, "tool_calls": 0})
    with pytest.raises(ValueError, match="a tool call is"):
        check_trajectory({**TRAJECTORIES[0], "turns": [{"role": "assistant", "text": "", "tool_calls": ["f"]}]})
    data = _experience().sample_data
    picked = SampleData.concat([data.select([2]), data.select([0])])
    assert picked.trajectories == [None, TRAJECTORIES[0]] and picked.columns["difficulty"] == ["hard", "hard"]


def test_a_tool_reward_that_is_not_a_number_counts_as_zero():
    bad = [{**_trajectory(1), "tool_reward": float("nan")}, _trajectory(1, 1.0), None]
    scores, metrics = Scorer(["ends_with_label"], [0.0])(_experience(bad), plan=None, timers=_timers)
    torch.testing.assert_close(scores, torch.tensor([0.0, 1.0, 0.0]))


# ------------------------------------------------------------------------------------------ functions that fail
def test_a_reward_function_that_exits_is_named_with_its_row():
    from mindspeed_llm.errors import UserError

    scorer = Scorer([], [], custom_reward_function=f"{FAILING}:exits")
    with pytest.raises(UserError) as err:  # not SystemExit(4): the run says who ended it
        scorer(_experience(trajectories=None), plan=None, timers=_timers)
    message = str(err.value)
    assert "'exits'" in message and str(FAILING) in message and "sys.exit(4)" in message
    assert "row 1 of the batch (prompt 11 of the dataset)" in message


def test_a_keyboard_interrupt_from_a_reward_function_is_named():
    from mindspeed_llm.errors import UserError

    with pytest.raises(UserError, match="'interrupts'.*raised KeyboardInterrupt.*row 0"):
        Scorer([], [], custom_reward_function=f"{FAILING}:interrupts")(_experience(None), plan=None, timers=_timers)


def test_a_function_failing_on_every_row_stops_the_run_by_name():
    from mindspeed_llm.rl.scoring import RewardFailureError

    with pytest.raises(RewardFailureError) as err:
        Scorer([], [], custom_reward_function=f"{FAILING}:always_fails")(_experience(None), plan=None, timers=_timers)
    message = str(err.value)
    assert f"--custom-reward-function {FAILING}:always_fails failed on every one of the 3 rows" in message
    assert "row 0: ValueError: returned a mapping without a 'score' key" in message
    # a registered verifier is named by its flag
    register_verifier("always_raises", override=True)(lambda text, label: 1 / 0)
    try:
        with pytest.raises(RewardFailureError, match="--verifier-function always_raises failed on every one of the 3 "
                                                     "rows .*ZeroDivisionError"):
            Scorer(["always_raises"], [1.0])(_experience(None), plan=None, timers=_timers)
    finally:
        _REGISTRY.pop("always_raises", None)


def test_a_function_failing_on_some_rows_scores_zero_there_and_is_counted():
    scores, metrics = Scorer([], [], custom_reward_function=f"{FAILING}:fails_on_41")(_experience(None), plan=None,
                                                                                    timers=_timers)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 1.0]))
    assert metrics["custom_rewards/failures"] == 1.0
