"""Tests of mindspeed_llm.rl.verifiers (answer extraction, math_acc against real label forms, format
verifiers, crash safety, missing labels, validation of a selection) and of the weighted mix in
mindspeed_llm.rl.scoring.

The labels in LABEL_TABLE are copied from /work/shared/data (see its README): DeepScaleR-Preview
``answer`` fields (deepscaler_sample.json, row index given) and DAPO-Math-17k
``reward_model.ground_truth`` fields (dapo_math_17k_sample.parquet). Several "right" responses reuse
the exact boxed text of the row's own ``solution`` field. The test does not read /work/shared.
"""

import math
import threading

import pytest

from mindspeed_llm.rl import verifiers as R
from mindspeed_llm.rl.verifiers import math as verifier_math
from mindspeed_llm.rl.verifiers import registry, worker


def boxed(x):
    return f"Putting it together, the answer is $\\boxed{{{x}}}$."


# (source, label, right responses, wrong responses)
LABEL_TABLE = [
    # DeepScaleR `answer` fields
    ("deepscaler[0]", r"-\frac{2}{3}", [boxed(r"-\dfrac{2}{3}"), boxed(r"-\frac23")], [boxed(r"\frac{2}{3}")]),
    ("deepscaler[1]", "26", [boxed(r"\textbf{(A)}\ 26")], [boxed(r"\textbf{(B)}\ 27")]),
    ("deepscaler[3]", r"\frac{\sqrt{2}}{2}", [boxed(r"\text{(D) } \frac{\sqrt{2}}{2}"), boxed(r"\frac{1}{\sqrt{2}}")],
     [boxed(r"\sqrt{2}")]),
    ("deepscaler[7]", r"\frac{5}{3}", [boxed(r"(D) \frac{5}{3}")], [boxed(r"\frac{3}{5}")]),
    ("deepscaler[8]", r"80\%", [boxed("80"), boxed(r"80\%")], [boxed(r"75\%"), boxed("81")]),
    ("deepscaler[9]", r"10^{-x}", [boxed(r"10^{-x}"), boxed(r"\frac{1}{10^{x}}")], [boxed(r"10^{x}")]),
    ("deepscaler[10]", "7", [boxed(r"\textbf{(B)}\ 7"), boxed("7")], [boxed(r"\textbf{(C)}\ 8")]),
    ("deepscaler[15]", r"\frac{9}{10}", [boxed("0.9"), boxed(r"\textbf{(D) }\frac{9}{10}")], [boxed("0.09")]),
    ("deepscaler[20]", r"\frac{1+\sqrt{5}}{2}", [boxed(r"\dfrac{\sqrt5+1}{2}")], [boxed(r"\frac{1-\sqrt{5}}{2}")]),
    ("deepscaler[22]", "$a+4$", [boxed(r"\textbf{(B)}\ a+4"), boxed("4+a")], [boxed("a+3")]),
    ("deepscaler[25]", "40", [boxed(r"40\textbf{ (B)}")], [boxed("44")]),
    ("deepscaler[29]", "14238", [boxed(r"\textbf{(D)} ~14{,}238"), boxed("14238")], [boxed("14328")]),
    ("deepscaler[32]", r"-13\frac{1}{2}", [boxed("-13.5"), boxed(r"-\frac{27}{2}")], [boxed(r"-12\frac{1}{2}")]),
    ("deepscaler[33]", r"22\frac {1}{2}^{\circ}", [boxed(r"22\frac{1}{2}^\circ"), boxed("22.5^{\\circ}")],
     [boxed(r"22^\circ")]),
    ("deepscaler[35]", r"\frac{25}{32}", [boxed(r"\frac{25}{32} \ \mathbf{(B)}")], [boxed(r"\frac{32}{25}")]),
    # DAPO-Math-17k `reward_model.ground_truth` fields
    ("dapo[0]", "34", [boxed("34"), "Adding up, a + b + c = 34.\nAnswer: 34"], [boxed("43"), "so\nAnswer: 35"]),
    ("dapo[2]", "-3", [boxed("-3"), "<think>...</think> <answer>-3</answer>"], [boxed("3")]),
    ("dapo[10]", "1007", [boxed("1007"), "**Answer:** $1007$"], [boxed("1008")]),
    ("dapo[25]", "8556", [boxed("8{,}556"), boxed("8556")], [boxed("8565")]),
    # forms from the brief that the two samples do not contain
    ("form", r"\frac{1}{2}", [boxed(r"\dfrac12"), boxed("0.5"), boxed("1/2")], [boxed(r"\frac{1}{3}")]),
    ("form", r"-\frac{1}{3}", [boxed(r"-\tfrac{1}{3}"), boxed("-1/3")], [boxed(r"\frac{1}{3}")]),
    ("form", r"2\sqrt{2}", [boxed(r"\sqrt{8}"), boxed(r"2 \sqrt 2")], [boxed(r"\sqrt{2}")]),
    ("form", "(1, 2)", [boxed("(1,2)")], [boxed("(2, 1)"), boxed("(1, 3)")]),
    ("form", r"\pi", [boxed(r"\pi")], [boxed("3.14")]),
    ("form", "5", [boxed(r"5\text{ cm}"), boxed("x=5")], [boxed(r"6\text{ cm}")]),
    ("form", r"[1, 2)", [boxed(r"[1,2)")], [boxed("(1,2]")]),
    ("form", "1267650600228229401496703205376", [boxed("2^{100}")], [boxed("1267650600228229401496703205377")]),
    ("form", "B", [boxed(r"\textbf{(B)}\ 7"), boxed("B")], [boxed(r"\textbf{(C)}\ 7")]),
]

RIGHT = [(src, label, resp) for src, label, rights, _ in LABEL_TABLE for resp in rights]
WRONG = [(src, label, resp) for src, label, _, wrongs in LABEL_TABLE for resp in wrongs]


# The label table checks the judgement, not the time limit: math_verify's 2 s default fired on a machine at load
# average 30 (VerifierTimeout), so these comparisons get a budget no load reaches.
UNHURRIED = verifier_math.MathAccConfig(timeout_seconds=60)


@pytest.mark.parametrize("src,label,response", RIGHT)
def test_math_acc_right(src, label, response):
    assert R.math_acc(response, label, UNHURRIED) == 1.0, (src, label, response)


@pytest.mark.parametrize("src,label,response", WRONG)
def test_math_acc_wrong(src, label, response):
    assert R.math_acc(response, label, UNHURRIED) == 0.0, (src, label, response)


def test_extraction_rules():
    assert R.last_boxed_content(r"a \boxed{1} b \fbox{\{1,2\}} c") == r"\{1,2\}"
    assert R.last_boxed_content(r"\boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert R.last_boxed_content(r"\boxed 5$") == "5"
    # the last box is never closed (truncated): no answer, the earlier box is not used
    assert R.last_boxed_content(r"\boxed{1} then \boxed{2") is None
    assert R.last_boxed_content("no box here") is None
    # box wins over the answer tag, the last box wins over earlier ones
    assert R.math_acc(r"<answer>3</answer> \boxed{4}", "4") == 1.0
    assert R.math_acc(r"\boxed{3} wait, no: \boxed{4}", "4") == 1.0
    assert R.math_acc(r"\boxed{4} wait, no: \boxed{3}", "4") == 0.0
    # empty box
    assert R.math_acc(r"\boxed{}", "4") == 0.0


def test_unanchored_is_off_by_default():
    rambling = "We try 3, then 4, then 5; the answer is 0.9 I think"
    assert R.math_acc(rambling, r"\frac{9}{10}") == 0.0
    assert R.math_acc(rambling, r"\frac{9}{10}", R.MathAccConfig(allow_unanchored=True)) == 1.0
    assert R.math_acc("x\nAnswer: 34", "34", R.MathAccConfig(answer_line=False)) == 0.0


@pytest.mark.parametrize("response,expected", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("  <think>\nreasoning\n</think>\n\n<answer> 4 </answer>\n", 1.0),
    ("<think></think><answer>4</answer>", 1.0),
    ("<answer>4</answer>", 0.0),                                        # no think
    ("<think>a</think>", 0.0),                                          # no answer
    ("<answer>4</answer><think>a</think>", 0.0),                        # wrong order
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),      # two answers
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0),        # two thinks
    ("<think>a</think> text <answer>4</answer>", 0.0),                  # text between
    ("<think>a</think><answer>4</answer> trailing", 0.0),               # text after
    ("<think>a</think><answer>  </answer>", 0.0),                       # empty answer
    ("<think>a<answer>4</answer></think>", 0.0),                        # nested
])
def test_format(response, expected):
    assert R.get_verifier("format")(response, None) == expected


@pytest.mark.parametrize("response,expected", [
    (r"so $\boxed{4}$", 1.0),
    (r"so $\fbox{x+1}$", 1.0),
    (r"\boxed{4} and \boxed{5}", 0.0),
    (r"\boxed{ }", 0.0),
    (r"\boxed{4", 0.0),
    ("4", 0.0),
])
def test_boxed_format(response, expected):
    assert R.get_verifier("boxed_format")(response, None) == expected


def test_registry():
    assert {"math_acc", "format", "boxed_format"} <= set(R.available_verifiers())
    assert R.get_verifier("math_acc") is R.math_acc
    assert R.verifier_requires_label("math_acc") and not R.verifier_requires_label("format")
    with pytest.raises(ValueError) as err:
        R.get_verifier("acc_typo")
    assert "acc_typo" in str(err.value) and "math_acc" in str(err.value) and "boxed_format" in str(err.value)
    with pytest.raises(ValueError):
        R.register_verifier("format")(lambda r, l: 0.0)


def _experience(texts, labels, ended_with_eos):
    import torch

    from mindspeed_llm.rl.experience import Experience, SampleData

    n = len(texts)
    exp = Experience(tokens=torch.zeros(n, 3, dtype=torch.long), position_ids=torch.zeros(n, 3, dtype=torch.long),
                     prompt_lengths=torch.ones(n, dtype=torch.long), responses=torch.zeros(n, 2, dtype=torch.long),
                     response_mask=torch.ones(n, 2), ended_with_eos=torch.tensor(ended_with_eos))
    exp.sample_data = SampleData(texts=texts, labels=labels, indices=list(range(n)))
    return exp


def test_weighted_mix_by_hand():
    from mindspeed_llm.rl.metrics import Timers
    from mindspeed_llm.rl.scoring import Scorer

    responses = [
        "<think>t</think><answer>\\boxed{34}</answer>",  # right, formatted:   acc 1, format 1
        "<think>t</think><answer>35</answer>",           # wrong, formatted:   acc 0, format 1
        "\\boxed{34}",                                   # right, unformatted: acc 1, format 0
    ]
    labels = ["34", "34", "34"]
    per, failures = R.score_batch(responses, labels, ["math_acc", "format"])
    assert per == {"math_acc": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]}
    assert failures == {"math_acc": 0, "format": 0}
    exp = _experience(responses, labels, [True, False, True])
    total, metrics = Scorer(["math_acc", "format"], [1.0, 0.5])(exp, 1, Timers())
    assert total.tolist() == [1.5, 0.5, 1.0]
    assert metrics["math_acc_rewards/mean"] == pytest.approx(2 / 3) and metrics["format_rewards/failures"] == 0
    # TRL's missing_eos_penalty: 0.25 off the response that did not end in EOS
    total, _ = Scorer(["math_acc", "format"], [1.0, 0.5], missing_eos_penalty=0.25)(exp, 1, Timers())
    assert total.tolist() == [1.5, 0.25, 1.0]


def test_names_and_weights_are_validated_once():
    from mindspeed_llm.arguments import ArgumentError
    from mindspeed_llm.rl.scoring import Scorer

    with pytest.raises(ValueError) as err:
        R.check_verifiers(["math_acc", "format"], [1.0])
    msg = str(err.value)
    assert "--verifier-function" in msg and "--verifier-weight" in msg
    for names, weights, needle in ((["nope"], [1.0], "valid names"), (["format", "format"], [1, 1], "more than once"),
                                   (["format"], [float("nan")], "finite")):
        with pytest.raises(ValueError, match=needle):
            R.check_verifiers(names, weights)
    with pytest.raises(ArgumentError, match="--verifier-function: unknown verifier function 'nope'"):
        Scorer(["nope"], [1.0])
    with pytest.raises(ValueError, match="valid names"):
        R.score_batch(["x"], ["1"], ["nope"])
    with pytest.raises(ValueError, match="labels"):
        R.score_batch(["x", "y"], ["1"], ["format"])


def test_missing_label_names_the_row():
    with pytest.raises(R.MissingLabelError) as err:
        R.score_batch(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], ["1", None, "3"], ["format", "math_acc"])
    assert err.value.row_index == 1 and err.value.verifier == "math_acc"
    assert "row 1" in str(err.value)
    with pytest.raises(R.MissingLabelError) as err:
        R.score_batch(["a", "b"], ["1", "  "], ["math_acc"])
    assert err.value.row_index == 1
    with pytest.raises(R.MissingLabelError):
        R.math_acc("\\boxed{1}", None)
    # a verifier that does not need labels is fine without them
    per, _ = R.score_batch(["<think>a</think><answer>1</answer>"], None, ["format"])
    assert per == {"format": [1.0]}


def test_crashing_verifier_scores_zero_and_is_counted(monkeypatch):
    calls = []

    def flaky(response, label):
        calls.append(response)
        if "boom" in response:
            raise RuntimeError("weird string")
        if "nan" in response:
            return float("nan")
        return 1.0

    monkeypatch.setitem(registry._REGISTRY, "format", registry._VerifierSpec(fn=flaky, requires_label=False))
    per, failures = R.score_batch(["ok", "boom", "nan", "ok"], None, ["format"])
    assert per["format"] == [1.0, 0.0, 0.0, 1.0]
    assert failures == {"format": 2}
    assert len(calls) == 4


def test_timeout_is_bounded_and_counted():
    # a power tower makes sympy's comparison run far past the 1 s budget
    tower = boxed("2^{2^{2^{2^{2^{2}}}}}")
    cfg = R.set_math_acc_config(timeout_seconds=1)
    try:
        per, failures = R.score_batch([tower, boxed("90")], ["90", "90"], ["math_acc"])
    finally:
        R.set_math_acc_config(R.MathAccConfig())
    assert cfg.timeout_seconds == 1
    assert per["math_acc"] == [0.0, 1.0]
    assert failures == {"math_acc": 1}


def test_off_main_thread_uses_worker_process():
    results = {}

    def run():
        try:
            results["right"] = R.math_acc(boxed("0.9"), r"\frac{9}{10}")
            results["wrong"] = R.math_acc(boxed("0.8"), r"\frac{9}{10}")
        except BaseException as exc:  # noqa: BLE001
            results["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert results == {"right": 1.0, "wrong": 0.0}
    # a worker that overruns its budget is killed and replaced
    tower_args = (verifier_math._pred_text(R.ExtractedAnswer("2^{2^{2^{2^{2^{2}}}}}", "boxed")), False,
                  "\\boxed{90}", 1, 6)
    with pytest.raises(R.VerifierTimeout):
        worker.WORKER.run(tower_args, budget=0.3)
    assert worker.WORKER._proc is None
    worker.WORKER.close()


def test_label_types():
    assert R.math_acc(boxed("34"), 34) == 1.0  # a numeric label (some datasets store ints)
    with pytest.raises(R.MissingLabelError):
        R.score_batch(["a"], [math.nan], ["math_acc"])


from mindspeed_llm.rl.verifiers import first_line_answer, parse_first_line_answer  # noqa: E402

VERIFIER_NAME = "first_line_answer"


# ----------------------------------------------------------------------------------------------
# first_line_answer (the demo's task reward)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response,label,score", [
    ("7", "7", 1.0),
    ("7.", "7", 1.0),
    ("5 + 2 = 7", "7", 1.0),
    ("5 + 2 = 7\n\nThis is a classic example of addition.", "7", 1.0),
    ("\n  7 + 7 is 14.  \nmore text 3", "14", 1.0),
    ("The answer is 5.", "5", 1.0),
    ("**Answer:** 12", "12", 1.0),
    ("3 - 5 = -2", "-2", 1.0),
    ("The equation 8 + 7 is 15 and the result is 15.", "15", 1.0),
    ("5 + 2 = 8", "7", 0.0),
    ("To solve this, find the difference between 8 and 4.", "4", 0.0),  # restating operands
    ("8 + 5 = 13, which is odd", "13", 0.0),  # the line must end with the answer
    ("1, 2, 13", "13", 0.0),  # listing candidates
    ("To solve this problem, we add.\n13", "13", 0.0),  # the answer must come first
    ("", "1", 0.0),
    ("   \n \n", "1", 0.0),
])
def test_first_line_answer(response, label, score):
    assert first_line_answer(response, label) == score


def test_first_line_answer_registered_and_batch_scoring():
    assert VERIFIER_NAME in R.available_verifiers()
    assert R.verifier_requires_label(VERIFIER_NAME)
    assert R.get_verifier(VERIFIER_NAME) is first_line_answer
    per, failures = R.score_batch(["2 + 2 = 4", "5", "four"], ["4", "4", "4"], [VERIFIER_NAME])
    assert per == {VERIFIER_NAME: [1.0, 0.0, 0.0]} and failures == {VERIFIER_NAME: 0}
    with pytest.raises(R.MissingLabelError):
        R.score_batch(["4"], [None], [VERIFIER_NAME])
    assert parse_first_line_answer("x = \u22123") == "-3"


# DAPO-Math-17k rows (dapo[0]: ground truth 34) as a model answers them: the last "Answer:" line decides.
@pytest.mark.parametrize("response,label,score", [
    ("First I guessed $\\boxed{12}$, but that double counts.\nAdding up, a + b + c = 34.\nAnswer: 34", "34", 1.0),
    ("The sum is $\\boxed{34}$.\nAnswer: 12", "34", 0.0),  # math_acc would take the box
    ("Answer: $\\frac{1}{2}$", "0.5", 1.0),
    ("**Answer:** $1007$", "1007", 1.0),
    ("the answer is $\\boxed{-3}$", "-3", 1.0),  # no Answer line: math_acc's rules
    ("I am not sure.", "34", 0.0),
])
def test_math_17k_acc(response, label, score):
    assert R.math_17k_acc(response, label) == score


def test_mindspeed_verifier_names():
    # base_acc is math_acc under MindSpeed-RL's name; math_17k_acc prefers the Answer line
    both = "The sum is $\\boxed{34}$.\nAnswer: 12"
    assert R.get_verifier("base_acc") is R.math_acc
    assert (R.get_verifier("base_acc")(both, "34"), R.get_verifier("math_17k_acc")(both, "34")) == (1.0, 0.0)
    assert registry.verifier_requires_label("math_17k_acc") and registry.verifier_requires_label("base_acc")
    with pytest.raises(R.MissingLabelError, match="math_17k_acc"):
        R.math_17k_acc("Answer: 3", None)


def test_retool_reward_by_hand():
    """MindSpeed-RL's retool_reward (its rule_verifier.py): compute_score with strict_box_verify (the last box only)
    gives +1 / -1; a wrong answer gains 0.1 per tool call of the trajectory, up to 0. Its trajectory comes by name
    through score_rows."""
    from mindspeed_llm.rl.verifiers import score_rows

    def traj(calls):
        return {"turns": [], "num_turns": 1, "tool_calls": calls, "tool_reward": 0.0}

    right, wrong = "so $\\boxed{12}$ then $\\boxed{42}$", "so $\\boxed{42}$ then $\\boxed{12}$"
    responses = [right, wrong, wrong, wrong, "Answer: 42"]
    trajectories = [traj(3), traj(0), traj(3), traj(15), traj(1)]
    scores = score_rows(responses, ["42"] * 5, ["retool_reward"], trajectories=trajectories)
    assert scores.per_verifier["retool_reward"] == pytest.approx([1.0, -1.0, -0.7, 0.0, -0.9])
    assert R.get_verifier("retool_reward")(wrong, "42") == -1.0  # single-turn: no tool calls
    with pytest.raises(R.MissingLabelError, match="retool_reward"):
        R.get_verifier("retool_reward")(right, None)
