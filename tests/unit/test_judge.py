"""The LLM judge without its model (issue 48, item 2): the default verdict parser on hand-written verdicts, a user's
parser by PATH:NAME, the template's placeholders, the Scorer mixing the judge's score by --judge-weight (a stand-in
judge that writes fixed verdicts; every sum worked out by hand), and the flags' refusals before any model is built.
The judge generating for real: tests/dist/test_stages_judge.py."""

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.arguments import ArgumentError, parse_args
from mindspeed_llm.rl import judge_verdicts
from mindspeed_llm.rl.experience import SampleData
from mindspeed_llm.rl.judge import Judge
from mindspeed_llm.rl.judge_verdicts import load_parser, parse_score, read_template, score_verdicts
from mindspeed_llm.rl.metrics.samples import rollout_rows
from mindspeed_llm.rl.scoring import Scorer
from mindspeed_llm.rl.verifiers import register_verifier

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "judge"
PARSERS, TEMPLATE = FIXTURES / "parsers.py", FIXTURES / "template.txt"
BASE = ["--data-path", "d", "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r", "--stage", "grpo"]


# ------------------------------------------------------------------------------------------ the default parser
@pytest.mark.parametrize("verdict,expected", [
    ("Score: 7", 7.0),
    ("The answer is right.\nScore: 8/10", 8.0),  # the number right after the marker; the scale is the template's
    ("**Score:** 4.5", 4.5),  # markdown emphasis between marker and number
    ("final score: [0.5]", 0.5),  # any case, a bracket
    ("SCORE:\n-1", -1.0),
    ("Score: 1e-1", 0.1),
    ("Score: .25", 0.25),
    ("Score: 3 at first; on reflection, Score: 9", 9.0),  # the last marker wins
    ("Score: 6. Looking back at the Score: it stands", 6.0),  # ... the last one followed by a number
    ("Score: 10\n\nThe response is correct and well argued.", 10.0),
])
def test_the_default_parser_reads_the_number_after_the_last_marker(verdict, expected):
    assert parse_score(verdict) == pytest.approx(expected)


@pytest.mark.parametrize("verdict", [
    "", "I cannot decide.", "Score: high", "The score is 7", "Rating: 7", "Score - 7", "Score:", "Scores 7",
])
def test_a_verdict_without_a_marked_number_does_not_parse(verdict):
    assert parse_score(verdict) is None


def test_unparsed_verdicts_get_the_unparsed_score_and_are_counted():
    scores, parsed = score_verdicts(parse_score, ["Score: 2", "no idea", "Score: nan", "score: 0"], -1.0)
    assert scores == [2.0, -1.0, -1.0, 0.0] and parsed == [True, False, False, True]


# ------------------------------------------------------------------------------------------ a user's parser
def test_a_users_parser_by_path_and_name():
    default = load_parser(str(PARSERS))  # NAME defaults to parse_verdict
    assert [default(v) for v in ("PASS", "it fails: FAIL", "maybe")] == [1.0, 0.0, None]
    tenths = load_parser(f"{PARSERS}:length_tenths")
    assert tenths("abcde") == 0.5
    assert load_parser(None) is parse_score


def test_what_a_users_parser_gets_wrong_is_an_unparsed_verdict_never_a_crash():
    for name in ("broken", "not_a_number"):
        scores, parsed = score_verdicts(load_parser(f"{PARSERS}:{name}"), ["PASS", "FAIL"], 0.25)
        assert scores == [0.25, 0.25] and parsed == [False, False]
    scores, parsed = score_verdicts(lambda v: float("inf") if v else True, ["x", ""], 0.0)  # inf, a bool
    assert parsed == [False, False]


@pytest.mark.parametrize("spec,needle", [
    ("tests/fixtures/judge/missing.py", "there is no file 'tests/fixtures/judge/missing.py'"),
    ("tests/fixtures/judge/parsers.py:nope", "defines no 'nope' (its functions: broken, length_tenths, not_a_number, "
                                             "parse_verdict, two_arguments)"),
    ("tests/fixtures/judge/parsers.py:two_arguments", "cannot be called with the verdict text alone"),
    ("tests/fixtures/judge/template.txt", "is not a Python source file (.py)"),
])
def test_a_bad_parser_is_refused_by_flag_and_file(spec, needle, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ArgumentError) as err:
        load_parser(spec)
    assert str(err.value).startswith(f"--judge-parser {spec}: ") and needle in str(err.value)


# ------------------------------------------------------------------------------------------ the template
def test_the_template_renders_its_placeholders_and_literal_braces():
    template = read_template(str(TEMPLATE))
    assert template.uses == ("prompt", "label", "response")
    text = template.render("What is {x}?", "It is 4", None)  # the values go in verbatim, braces and all
    assert "Question: What is {x}?\nReference answer: \nAnswer to grade: It is 4\n" in text
    assert "(Braces are written {like this}.)" in text


@pytest.mark.parametrize("text,needle", [
    ("{prompt} {response} {answer}", "unknown placeholder {answer}; the placeholders are {prompt}, {response}, "
                                     "{label}"),
    ("{prompt} {response} {label[0]}", "unknown placeholder {label[0]}"),
    ("{prompt} {response} {}", "unknown placeholder {}"),
    ("{prompt} only", "the template has no {response}"),
    ("nothing", "the template has no {prompt} and no {response}"),
    ("{prompt} {response:>10}", "the placeholder {response} has a format spec or conversion (:>10)"),
    ("{prompt} {response} {", "write a literal brace as {{ or }}"),
])
def test_a_bad_template_is_refused_naming_the_file_and_placeholder(tmp_path, text, needle):
    path = tmp_path / "judge.txt"
    path.write_text(text)
    with pytest.raises(ArgumentError) as err:
        read_template(str(path))
    assert str(err.value).startswith(f"--judge-template {path}: ") and needle in str(err.value)


# ------------------------------------------------------------------------------------------ the Scorer
class CharTokenizer:
    """One token a character (ids = code points); no chat template, no special tokens."""

    chat_template = None
    eos_token_id, pad_token_id = 0, 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def __len__(self):
        return 0x110000


class FixedVerdicts(Judge):
    """A judge whose verdicts are given: `write` returns them in order, and records the prompts it was asked."""

    def __init__(self, verdicts, template, parser=parse_score, **options):
        super().__init__(None, CharTokenizer(), template, parser, CharTokenizer(), **options)
        self.verdicts, self.asked = list(verdicts), []

    def write(self, prompts):
        self.asked += ["".join(map(chr, p)) for p in prompts]
        return self.verdicts[: len(prompts)]


@pytest.fixture(scope="module", autouse=True)
def verifiers():
    register_verifier("starts_with_yes", override=True)(lambda text, label: float(text.startswith("yes")))


def _timers(name):
    return contextlib.nullcontext()


def _experience(prompts, texts, labels):
    width = max(map(len, prompts))
    tokens = torch.tensor([[ord(c) for c in p.ljust(width)] for p in prompts])
    n = len(texts)
    return SimpleNamespace(tokens=tokens, prompt_lengths=torch.tensor([len(p) for p in prompts]), batch_size=n,
                           scores=None, sample_data=SampleData(texts=texts, labels=labels, indices=list(range(n))),
                           ended_with_eos=torch.ones(n, dtype=torch.bool), response_lengths=torch.ones(n),
                           action_lengths=torch.ones(n, dtype=torch.long))


def test_the_scorer_mixes_the_judges_score_by_its_weight(tmp_path):
    template = tmp_path / "t.txt"
    template.write_text("Q: {prompt}\nA: {response}\nRef: {label}")
    judge = FixedVerdicts(["Good. Score: 8", "Score: 2 ... Score: 3", "I refuse to grade this."],
                          read_template(str(template)), weight=0.5, unparsed_score=-1.0)
    exp = _experience(["2+2?", "3+3?", "1+1?"], ["yes 4", "no 6", "yes 2"], ["4", "6", None])
    scores, metrics = Scorer(["starts_with_yes"], [2.0], judge=judge)(exp, plan=None, timers=_timers)
    # starts_with_yes x 2: 2, 0, 2; the judge x 0.5: 8 -> 4, 3 -> 1.5, unparsed -> -1 x 0.5 = -0.5
    torch.testing.assert_close(scores, torch.tensor([2.0 + 4.0, 0.0 + 1.5, 2.0 - 0.5]))
    assert judge.asked == ["Q: 2+2?\nA: yes 4\nRef: 4", "Q: 3+3?\nA: no 6\nRef: 6", "Q: 1+1?\nA: yes 2\nRef: "]
    assert metrics["judge/score_mean"] == pytest.approx((8 + 3 - 1) / 3)
    assert metrics["judge/unparsed"] == pytest.approx(1 / 3) and metrics["judge/too_long"] == 0.0
    parts = exp.sample_data.score_parts
    assert [p["judge"] for p in parts] == [8.0, 3.0, -1.0]
    assert parts[2]["judge_verdict"] == "I refuse to grade this."
    assert all(p["judge"] == parse_score(p["judge_verdict"]) for p in parts[:2])
    # the sample table carries the verdict with the parts
    exp.scores = scores
    row = rollout_rows(exp, CharTokenizer(), 1)[0]
    assert row["score_parts"]["judge_verdict"] == "Good. Score: 8" and row["score"] == 6.0


def test_the_judge_alone_with_a_users_parser_and_a_prompt_past_its_context(tmp_path):
    """A judge prompt that leaves no room for --judge-max-new-tokens in the judge's context is not generated: its
    verdict is empty, unparsed (even for a parser that reads anything) and counted as too long."""
    template = tmp_path / "t.txt"
    template.write_text("{prompt}|{response}")
    judge = FixedVerdicts(["PASS"], read_template(str(template)), load_parser(str(PARSERS)), max_new_tokens=4)
    judge.model = SimpleNamespace(model_spec=SimpleNamespace(max_position_embeddings=12))
    exp = _experience(["ab", "abcdef"], ["cde", "ghi"], [None, None])  # 6 + 4 <= 12; 10 + 4 > 12
    scores, metrics = Scorer([], [], judge=judge)(exp, plan=None, timers=_timers)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0]))
    assert judge.asked == ["ab|cde"]
    assert [p["judge_verdict"] for p in exp.sample_data.score_parts] == ["PASS", ""]
    assert metrics["judge/unparsed"] == 0.5 and metrics["judge/too_long"] == 0.5


# ------------------------------------------------------------------------------------------ the flags
def test_the_flags_reach_the_settings(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    settings = parse_args(BASE + ["--judge-load", str(tmp_path), "--judge-template", str(TEMPLATE),
                                  "--judge-parser", f"{PARSERS}:length_tenths", "--judge-weight", "0.5",
                                  "--judge-max-new-tokens", "32", "--judge-unparsed-score", "-1"]).settings
    judge = settings.judge
    assert (judge.judge_load, judge.judge_template, judge.judge_parser) == (
        str(tmp_path), str(TEMPLATE), f"{PARSERS}:length_tenths")
    assert (judge.judge_weight, judge.judge_max_new_tokens, judge.judge_unparsed_score) == (0.5, 32, -1.0)
    assert judge.judge_tokenizer_name_or_path is None  # the run's tokenizer


@pytest.mark.parametrize("extra,needle", [
    (["--judge-template", str(TEMPLATE)], "--judge-template has no effect without --judge-load PATH"),
    (["--judge-load", "{tmp}"], "--judge-load needs --judge-template FILE"),
    (["--judge-load", "{tmp}/missing", "--judge-template", str(TEMPLATE)], "--judge-load {tmp}/missing: there is no "
                                                                          "such folder"),
    (["--judge-load", "{tmp}", "--judge-template", "{tmp}/missing.txt"], "--judge-template {tmp}/missing.txt: there "
                                                                         "is no such file"),
    (["--judge-load", "{tmp}", "--judge-template", "{tmp}/bad.txt"], "--judge-template {tmp}/bad.txt: unknown "
                                                                     "placeholder {answer}"),
    (["--judge-load", "{tmp}", "--judge-template", str(TEMPLATE), "--judge-parser", "tests/fixtures/judge/nope.py"],
     "--judge-parser tests/fixtures/judge/nope.py: there is no file"),
    (["--judge-load", "{tmp}", "--judge-template", str(TEMPLATE), "--judge-tokenizer-name-or-path", "{tmp}/none"],
     "--judge-tokenizer-name-or-path {tmp}/none: there is no such folder"),
    (["--judge-load", "{tmp}", "--judge-template", str(TEMPLATE), "--judge-max-new-tokens", "0"],
     "--judge-max-new-tokens 0 must be >= 1"),
])
def test_the_judges_flags_are_refused_before_any_model(extra, needle, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    (tmp_path / "bad.txt").write_text("{prompt} {response} {answer}")
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + ["--verifier-function", "format"] + [e.replace("{tmp}", str(tmp_path)) for e in extra])
    assert needle.replace("{tmp}", str(tmp_path)) in str(err.value)


def test_the_judge_alone_is_a_reward_for_grpo(tmp_path):
    settings = parse_args(BASE + ["--judge-load", str(tmp_path), "--judge-template", str(TEMPLATE)]).settings
    assert settings.judge.judge_load == str(tmp_path) and not settings.reward.verifier_function
    assert judge_verdicts.MARKER == "Score:"  # the documented marker (docs/algorithms.md), said at startup
    assert "--judge-load: each verdict scores the number after its last 'Score:' (the default parser; --judge-parser " \
           "PATH:NAME for your own), else --judge-unparsed-score 0" in settings.startup.startup_notes


def test_with_offload_the_judge_comes_to_the_device_for_its_verdicts_only(tmp_path):
    """--offload-ref-reward: the judge's weights are brought in around its generation (`roles.on_device`, timed as
    ref_onload / ref_offload inside timing/judge) and wait in host memory otherwise."""
    template = tmp_path / "t.txt"
    template.write_text("{prompt}|{response}")
    timed = []

    @contextlib.contextmanager
    def timers(name):
        timed.append(name)
        yield

    judge = FixedVerdicts(["Score: 1"], read_template(str(template)), offload=True)
    judge.model = torch.nn.Linear(2, 2)
    Scorer([], [], judge=judge)(_experience(["ab"], ["cd"], [None]), plan=None, timers=timers)
    assert timed == ["judge", "ref_onload", "ref_offload"]
    assert judge.model.weight.device.type == "cpu"


def test_a_tokenizer_the_judge_cannot_read_is_refused_by_flag(monkeypatch, tmp_path):
    """The judge's tokenizer must fit its vocabulary (the run's tokenizer by default), and a folder that holds no
    tokenizer is named by its flag: both before the judge generates anything."""
    from mindspeed_llm.rl.update import roles

    monkeypatch.chdir(ROOT)
    small = SimpleNamespace(model_spec=SimpleNamespace(vocab_size=10))
    monkeypatch.setattr(roles, "load_judge", lambda settings: small)
    settings = parse_args(BASE + ["--judge-load", str(tmp_path), "--judge-template", str(TEMPLATE)]).settings
    with pytest.raises(ArgumentError, match=r"the run's tokenizer \(--tokenizer-name-or-path\) has 1114112 tokens but "
                                            r"the judge's vocabulary \(--judge-load .*\) has 10: give the judge's own "
                                            "tokenizer with --judge-tokenizer-name-or-path"):
        Judge.from_settings(settings, CharTokenizer())
    settings = parse_args(BASE + ["--judge-load", str(tmp_path), "--judge-template", str(TEMPLATE),
                                  "--judge-tokenizer-name-or-path", str(tmp_path)]).settings
    with pytest.raises(ArgumentError, match=f"--judge-tokenizer-name-or-path {tmp_path}: cannot load a tokenizer"):
        Judge.from_settings(settings, CharTokenizer())
