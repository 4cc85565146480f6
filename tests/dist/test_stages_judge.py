"""The LLM judge in real runs (issue 48, item 2): a tiny random Llama judge of another family, size and tokenizer
than the actor (a character tokenizer with a chat template) writes its verdicts with the continuous engine: at TP2 in
a grpo iteration (beside a rule verifier, by --judge-weight, with a user's parser); at DP2 in trl_ppo, beside the
reward model offloaded with --offload-ref-reward (the default parser, whose marker the random judge never writes),
and alone with held-out evaluation; at PP2 and CP2 in grpo; and on multi-turn tool trajectories (beside a reward
function and the tools' rewards). Each sample's judge score is the parser applied to the verdict it wrote (the sample
tables' score parts, and the rollout dump's), each verdict is what transformers' greedy generation of the same judge
writes on the same prompt, and the score is the weighted sum of its parts. The parser, the template and the mixing
by hand: tests/unit/test_judge.py."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.stage_layouts import odd_first_word
from tests.helpers.word_task import TOOLS_DIR

pytestmark = [pytest.mark.usefixtures("warm_ranks"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PARSERS = ROOT / "tests" / "fixtures" / "judge" / "parsers.py"
TEMPLATE = "Grade this answer.\nQ: {prompt}\nA: {response}\nReference: {label}\nScore:"
VERDICT_TOKENS = 6


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task
    from tests.helpers.hf_tiny import save_tiny, write_char_tokenizer

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    root = tmp_path_factory.mktemp("judge_task")
    paths = word_task.build(root, layouts=((1, 1), (2, 1), (1, 2)), reward=True)
    paths["judge_tokenizer"] = write_char_tokenizer(root / "judge_tokenizer")
    paths["hf_judge"] = save_tiny("llama", root / "hf_judge", seed=11, vocab_size=128)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        out = root / f"mg_judge_tp{tp}pp{pp}"
        convert_hf_to_mg(paths["hf_judge"], str(out), tp, pp, tokenizer_dir=paths["judge_tokenizer"], progress=False)
        paths[f"mg_judge_tp{tp}pp{pp}"] = str(out)
    (root / "judge.txt").write_text(TEMPLATE)
    paths["template"] = str(root / "judge.txt")
    sys.path.insert(0, str(TOOLS_DIR))  # the tools run's tool and reward function (the warm ranks take sys.path)
    yield dict(paths, **word_task.write_chat_tools(root, paths["tokenizer"]))
    sys.path.remove(str(TOOLS_DIR))


def _argv(task, out, stage, tp, *extra, pp=1, tokenizer="tokenizer",
          lengths=("--max-length", "32", "--max-new-tokens", "8")):
    layout = f"tp{tp}pp{pp}"
    argv = ["--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--ref-model", task[f"mg_actor_{layout}"], "--tokenizer-name-or-path", task[tokenizer], "--data-path",
            task["data"], "--train-iters", "1", "--global-batch-size", "4", *lengths, "--do-sample", "--seed", "3",
            "--lr", "1e-3", "--metrics-jsonl", str(out / "metrics.jsonl"), "--log-samples", "8",
            "--judge-load", task[f"mg_judge_{layout}"], "--judge-tokenizer-name-or-path", task["judge_tokenizer"],
            "--judge-template", task["template"], "--judge-max-new-tokens", str(VERDICT_TOKENS)]
    return argv + list(extra)


def _hf_verdicts(task, samples, tokenizer="tokenizer"):
    """transformers' greedy verdicts of the judge on each sample's judge prompt (the template rendered from the
    sample's prompt without special tokens, its response and label; the judge's chat template's user turn), ids past
    the tokenizer never chosen (the model's vocabulary has 128 ids, the tokenizer 103: the engine's rule)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_tok, judge_tok = AutoTokenizer.from_pretrained(task[tokenizer]), AutoTokenizer.from_pretrained(
        task["judge_tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(task["hf_judge"]).eval()
    out = []
    for s in samples:
        prompt = run_tok.decode(run_tok(s["prompt"], add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        text = TEMPLATE.format(prompt=prompt, response=s["response"], label="" if s["label"] is None else s["label"])
        ids = judge_tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=VERDICT_TOKENS, do_sample=False,
                                       eos_token_id=judge_tok.eos_token_id, pad_token_id=judge_tok.pad_token_id,
                                       suppress_tokens=list(range(len(judge_tok), model.config.vocab_size)))
        out.append(judge_tok.decode(generated[0, len(ids):].tolist(), skip_special_tokens=True))
    return out


def _read(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return rows, samples


def _check(task, out, samples_expected, score_of, tokenizer="tokenizer"):
    """The run's one metrics row and its samples: `judge/*` and `timing/judge` logged, each verdict the one
    transformers writes, each score `score_of(sample's parts)`; returns (row, samples)."""
    rows, samples = _read(out)
    assert len(rows) == 1 and len(samples) == samples_expected
    row = rows[0]
    for key in ("judge/score_mean", "judge/unparsed", "judge/too_long", "timing/judge"):
        assert key in row, key
    assert row["judge/too_long"] == 0.0
    assert [s["score_parts"]["judge_verdict"] for s in samples] == _hf_verdicts(task, samples, tokenizer)
    for s in samples:
        assert s["score"] == pytest.approx(score_of(s["score_parts"]), abs=1e-5)
    return row, samples


def test_the_judge_scores_grpo_and_trl_ppo_at_tp2_pp2_dp2_cp2_and_with_tools(task, tmp_path):
    from tests.helpers.multiproc import run_distributed
    from tests.helpers.stage_layouts import run_stages

    tools = ["--n-samples-per-prompt", "2", "--micro-batch-size", "2", "--stop-token-ids",
             ",".join(map(str, range(100, 140))), "--tool-config", task["tools"], "--tool-parser-format",
             "first_word_even", "--max-assistant-turns", "3", "--max-total-response-length", "14",
             "--max-tool-response-length", "3", "--custom-reward-function",
             f"{TOOLS_DIR / 'word_tools.py'}:turns_reward", "--judge-weight", "0.5", "--judge-parser",
             f"{PARSERS}:length_tenths"]
    run_distributed(run_stages, 2, [
        _argv(task, tmp_path / "grpo_tp2", "grpo", 2, "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
              "--verifier-function", "odd_first_word", "--verifier-weight", "2", "--judge-weight", "0.5",
              "--judge-parser", f"{PARSERS}:length_tenths", "--rollout-dump-dir", str(tmp_path / "dump")),
        _argv(task, tmp_path / "ppo_dp2", "trl_ppo", 1, "--micro-batch-size", "2", "--reward-model",
              task["mg_reward_tp1pp1"], "--offload-ref-reward", "--judge-unparsed-score", "-0.5"),
        _argv(task, tmp_path / "ppo_judge_only", "trl_ppo", 1, "--micro-batch-size", "2", "--reward-model",
              task["mg_reward_tp1pp1"], "--reward-model-weight", "0", "--judge-parser", f"{PARSERS}:length_tenths",
              "--eval-data-path", task["data"], "--eval-interval", "1", "--eval-samples", "2"),
        _argv(task, tmp_path / "grpo_pp2", "grpo", 1, "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
              "--verifier-function", "odd_first_word", pp=2),
        _argv(task, tmp_path / "grpo_cp2", "grpo", 1, "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
              "--context-parallel-size", "2", "--verifier-function", "odd_first_word"),
        _argv(task, tmp_path / "tools", "grpo", 1, *tools, tokenizer="chat_tokenizer",
              lengths=("--max-length", "24", "--max-prompt-length", "8", "--max-new-tokens", "4")),
    ])

    # TP2: a rule verifier x 2 beside the judge x 0.5, whose user's parser reads every verdict (a tenth of its length)
    row, samples = _check(task, tmp_path / "grpo_tp2", 8,
                          lambda parts: 2 * parts["odd_first_word"] + 0.5 * parts["judge"])
    assert row["judge/unparsed"] == 0.0 and any(s["score_parts"]["judge_verdict"] for s in samples)
    for s in samples:
        parts = s["score_parts"]
        assert parts["judge"] == pytest.approx(len(parts["judge_verdict"]) / 10)  # the parser on the verdict
        assert parts["odd_first_word"] == odd_first_word(s["response"], None)
    assert row["judge/score_mean"] == pytest.approx(sum(s["score_parts"]["judge"] for s in samples) / 8, abs=1e-6)
    assert row["grpo/score/mean"] == pytest.approx(sum(s["score"] for s in samples) / 8, abs=1e-5)
    dumped = json.loads((tmp_path / "dump" / "iteration_0000001" / "batch_0_dp_rank_00.json").read_text())
    assert dumped["sample_data"]["score_parts"] == [s["score_parts"] for s in samples]  # the dump keeps the verdicts

    # DP2, trl_ppo: the reward model beside the judge (weight 1), offloaded between uses; the default parser finds no
    # "Score:" in a random verdict: every one unparsed, at --judge-unparsed-score
    row, samples = _check(task, tmp_path / "ppo_dp2", 4, lambda parts: parts["reward_model"] + parts["judge"])
    assert "timing/ref_onload" in row
    assert row["judge/unparsed"] == 1.0 and row["judge/score_mean"] == -0.5
    assert all(s["score_parts"]["judge"] == -0.5 for s in samples)

    # trl_ppo with --reward-model-weight 0: the judge alone scores (the reward model is not loaded), held-out
    # evaluation included
    row, samples = _check(task, tmp_path / "ppo_judge_only", 4, lambda parts: parts["judge"])
    assert all("reward_model" not in s["score_parts"] for s in samples) and "timing/reward_model" not in row
    assert "eval/score/mean" in row

    # PP2: the judge's layers split over the pipeline stages, the verdicts transformers writes
    row, _ = _check(task, tmp_path / "grpo_pp2", 8, lambda parts: parts["odd_first_word"] + parts["judge"])
    assert row["judge/unparsed"] == 1.0

    # CP2: each CP rank judges its DP rank's whole batch, the verdicts transformers writes
    row, _ = _check(task, tmp_path / "grpo_cp2", 8, lambda parts: parts["odd_first_word"] + parts["judge"])
    assert row["judge/unparsed"] == 1.0

    # tools: the judge reads the trajectory's text as the reward function does; the tools' rewards add on
    row, samples = _check(task, tmp_path / "tools", 8, lambda parts: parts["custom"] + parts["tool"] + 0.5 * parts[
        "judge"], tokenizer="chat_tokenizer")
    assert any(s["tool_calls"] > 0 for s in samples)
    assert all(s["score_parts"]["judge"] == pytest.approx(len(s["score_parts"]["judge_verdict"]) / 10)
               for s in samples)
