"""Sampled held-out evaluation: the pass@k estimator and the other per-prompt statistics against hand-computed
cases (`rl/metrics/pass_at_k.py`), the per-set and per-source metric names (`rl/evaluation.set_metrics`), which
iterations evaluate and the CSV across a resume (`evaluation.Evaluator`, `EvalTable`), and the flags
(`arguments/evaluation.py`: parsing, ranges, refusals by name)."""

import csv
import math

import pytest

from mindspeed_llm.arguments import parse_args
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.evaluation import EvalTable, Evaluator, answer_extractor, eval_sampling_settings, set_metrics
from mindspeed_llm.rl.metrics.pass_at_k import PromptResult, majority, pass_at_k, pass_ks, summarize
from mindspeed_llm.rl.settings import LoopSettings, SamplingSettings

BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "4",
        "--global-batch-size", "4", "--ref-model", "r"]


# ------------------------------------------------------------------------------------------------- pass@k math

@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0), (4, 0, 4, 0.0),  # c = 0: never
    (4, 4, 1, 1.0), (4, 4, 4, 1.0),  # c = n: always
    (4, 1, 1, 1 / 4), (4, 1, 2, 1 - 3 / 6),  # C(3,2)/C(4,2) = 3/6
    (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2) = 1/6
    (4, 1, 4, 1.0), (4, 3, 2, 1.0),  # k = n with c > 0; n - c < k
    (5, 2, 3, 1 - 1 / 10),  # C(3,3)/C(5,3) = 1/10
    (10, 3, 4, 1 - 35 / 210),  # C(7,4)/C(10,4)
    (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_1_is_the_share_correct_and_bad_arguments_are_refused():
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_pass_ks_and_majority():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4] and pass_ks(8) == [1, 2, 4, 8]
    assert majority([None, None]) is None
    assert majority(["3", None, "5", "5"]) == 2
    assert majority(["3", "5", "5", "3"]) == 0  # a tie: the answer that came first
    assert majority([None, "7"]) == 1


def _result(position, scores, answers=None, source=None, sums=()):
    return PromptResult(position, source, tuple(scores), tuple(answers or [None] * len(scores)), tuple(sums))


def test_summarize_hand_case():
    results = [_result(1, [1, 0, 0, 0], ["2", "3", "3", None], sums=[("response_length/mean", 8.0)]),  # c=1
               _result(0, [1, 1, 0, 1], ["4", "4", "5", "4"], sums=[("response_length/mean", 4.0)]),  # c=3
               _result(2, [0, 0, 0, 0], [None] * 4, sums=[("response_length/mean", 12.0)])]  # c=0: no answer
    out = summarize(results, threshold=1.0)
    assert out["score/mean"] == pytest.approx(4 / 12)
    assert out["mean@4"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert out["best@4"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert out["pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0 + 0) / 3)  # c=3: n-c=1 < 2
    assert out["pass@4"] == pytest.approx(2 / 3)
    # prompt 1 votes "3" (two of three answers), which scored 0; prompt 0 votes "4" (1); prompt 2 has none (0)
    assert out["maj@4"] == pytest.approx(1 / 3)
    assert out["response_length/mean"] == pytest.approx(24 / 12)
    assert set(out) == {"score/mean", "mean@4", "best@4", "pass@1", "pass@2", "pass@4", "maj@4",
                        "response_length/mean"}


def test_summarize_threshold_order_and_no_answers():
    a = [_result(0, [0.5, 1.5]), _result(1, [0.2, 0.9])]
    out = summarize(a, threshold=0.5)
    assert out["pass@1"] == pytest.approx((1.0 + 0.5) / 2) and "maj@2" not in out  # no answers: no maj@N
    assert out["best@2"] == pytest.approx((1.5 + 0.9) / 2)
    assert summarize(list(reversed(a)), 0.5) == out  # the order the parts came in changes nothing
    assert summarize([], 1.0) == {}
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([_result(0, [1]), _result(1, [1, 0])], 1.0)


def test_set_metrics_names_per_set_and_source():
    results = [_result(0, [1, 0], source="gsm8k"), _result(1, [0, 0], source="math"), _result(2, [1, 1],
                                                                                             source="gsm8k")]
    out = set_metrics("eval", results, 1.0)
    assert out["eval/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert out["eval/gsm8k/pass@2"] == pytest.approx(1.0) and out["eval/math/pass@2"] == 0.0
    assert out["eval/gsm8k/mean@2"] == pytest.approx(0.75)
    named = set_metrics("eval/hard", results[:2], 1.0)
    assert named["eval/hard/best@2"] == pytest.approx(0.5) and "eval/hard/gsm8k/best@2" in named
    assert not any(k.startswith("eval/None") for k in set_metrics("eval", [_result(0, [1])], 1.0))


def test_answer_extractor_only_for_answer_checkers():
    assert answer_extractor(["format"]) is None and answer_extractor([]) is None
    boxed = answer_extractor(["math_acc", "format"])
    assert boxed("so \\boxed{ 4 2 }") == "42" and boxed("no answer") is None
    assert answer_extractor(["first_line_answer"])("7\nbecause") == "7"


def test_eval_sampling_settings():
    sampling = SamplingSettings(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    greedy = eval_sampling_settings(sampling, LoopSettings())
    assert not greedy.do_sample
    sampled = eval_sampling_settings(sampling, LoopSettings(eval_n_samples=4, eval_top_p=0.8))
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.top_k) == (True, 1.0, 0.8, 0)
    once = eval_sampling_settings(sampling, LoopSettings(eval_temperature=0.6))
    assert (once.do_sample, once.temperature) == (True, 0.6)


# -------------------------------------------------------------------------------------- evaluator and eval.csv

def test_due_iterations_and_baseline():
    sets = [(None, [])]
    ev = Evaluator(None, sets, LoopSettings(train_iters=7, eval_interval=3, eval_before_train=True))
    assert [i for i in range(1, 8) if ev.due(i)] == [3, 6, 7]  # and the last one
    assert ev.before_train()
    resumed = Evaluator(None, sets, LoopSettings(train_iters=7, eval_interval=3, eval_before_train=True), start=3)
    assert not resumed.before_train() and [i for i in range(4, 8) if resumed.due(i)] == [6, 7]
    assert not Evaluator(None, [], LoopSettings(train_iters=7, eval_interval=3)).due(3)


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_eval_table_keeps_rows_through_the_resumed_iteration(tmp_path):
    path = tmp_path / "eval.csv"
    table = EvalTable(str(path))
    for it in (0, 2, 4):
        table.write(it, [("eval", "pass@1", it / 10)])
    table.close()
    table = EvalTable(str(path), keep_through=2)  # resumed from iteration 2: iteration 4 is evaluated again
    table.write(4, [("eval", "pass@1", 0.5)])
    table.close()
    rows = _csv(path)
    assert rows[0] == ["iteration", "set", "metric", "value"]
    assert [(r[0], float(r[3])) for r in rows[1:]] == [("0", 0.0), ("2", 0.2), ("4", 0.5)]
    EvalTable(str(path)).close()  # a fresh start rewrites it
    assert _csv(path) == [["iteration", "set", "metric", "value"]]


def test_evaluator_records_its_own_metrics(tmp_path, monkeypatch):
    from mindspeed_llm.rl import evaluation

    monkeypatch.setattr(evaluation, "_set_results", lambda stage, dataset, count: [_result(0, dataset)])
    loop = LoopSettings(train_iters=2, eval_interval=1, metrics_jsonl=str(tmp_path / "m" / "metrics.jsonl"))
    ev = Evaluator(None, [("a", [1, 0]), ("b", [0, 0])], loop)
    metrics = ev.evaluate()
    assert metrics["eval/a/pass@1"] == 0.5 and metrics["eval/b/best@2"] == 0.0
    ev.record(1, {**metrics, "actor/pg_loss": 3.0})
    ev.close()
    rows = _csv(tmp_path / "m" / "eval.csv")
    assert ["1", "a", "pass@1", "0.5"] in rows and not any(r[2] == "actor/pg_loss" for r in rows)


# ------------------------------------------------------------------------------------------------------- flags

def test_eval_flags_parse():
    s = parse_args(BASE + ["--eval-data-path", "gsm=data/g", "math=data/m", "--eval-interval", "2",
                           "--eval-n-samples", "8", "--eval-temperature", "0.6", "--eval-top-p", "0.95",
                           "--eval-pass-threshold", "0.5", "--eval-before-train"], 1).settings
    assert s.data.eval_sets == (("gsm", "data/g"), ("math", "data/m"))
    assert (s.loop.eval_n_samples, s.loop.eval_temperature, s.loop.eval_top_p, s.loop.eval_pass_threshold,
            s.loop.eval_before_train) == (8, 0.6, 0.95, 0.5, True)
    plain = parse_args(BASE + ["--eval-data-path", "data/e", "--eval-interval", "2"], 1).settings
    assert plain.data.eval_sets == ((None, "data/e"),) and plain.loop.eval_n_samples == 1
    assert plain.loop.eval_temperature is None and not plain.loop.eval_before_train


@pytest.mark.parametrize("flags,message", [
    (["--eval-n-samples", "0"], "--eval-n-samples 0"),
    (["--eval-temperature", "0"], "--eval-temperature 0"),
    (["--eval-top-p", "0"], "--eval-top-p 0"),
    (["--eval-top-p", "1.5"], "--eval-top-p 1.5"),
    (["--eval-top-p", "0.9"], "--eval-top-p 0.9 has no effect on greedy evaluation"),
    (["--eval-data-path", "a=x", "y"], "with several held-out sets, name each one"),
    (["--eval-data-path", "a=x", "a=y"], "names a more than once"),
    (["--eval-data-path", "score=x"], "expected NAME=PREFIX"),
    (["--eval-data-path", "a b=x"], "expected NAME=PREFIX"),
    (["--eval-data-path", "a="], "expected NAME=PREFIX"),
])
def test_eval_flags_refused_by_name(flags, message):
    extra = [] if "--eval-data-path" in flags else ["--eval-data-path", "e"]
    with pytest.raises(ArgumentError, match=message):
        parse_args(BASE + ["--eval-interval", "2"] + extra + flags, 1)


def test_eval_before_train_needs_an_interval():
    with pytest.raises(ArgumentError, match="--eval-before-train .* give --eval-interval"):
        parse_args(BASE + ["--eval-data-path", "e", "--eval-before-train"], 1)


@pytest.mark.parametrize("interval,given", [(["--eval-interval", "0"], "--eval-interval 0"), ([], "no --eval-interval")])
def test_held_out_prompts_never_evaluated_are_said_at_startup(interval, given):
    notes = parse_args(BASE + ["--eval-data-path", "e"] + interval, 1).settings.startup.startup_notes
    assert f"evaluation is off ({given}): the held-out prompts of --eval-data-path e are never evaluated; give " \
           "--eval-interval N (N >= 1) to evaluate them every N iterations" in notes
    notes = parse_args(BASE + ["--eval-data-path", "e", "--eval-interval", "2"], 1).settings.startup.startup_notes
    assert not any("evaluation is off" in note for note in notes)


def test_a_missing_eval_prefix_names_the_flag(tmp_path):
    from mindspeed_llm.data.errors import DatasetNotFoundError
    from mindspeed_llm.rl.preflight import eval_sets

    data = parse_args(BASE + ["--eval-data-path", f"gsm={tmp_path}/nope", "--eval-interval", "2"], 1).settings.data
    with pytest.raises(DatasetNotFoundError, match=f"--eval-data-path gsm={tmp_path}/nope: the prompt dataset at "
                                                   "prefix .* does not exist"):
        eval_sets(data)
