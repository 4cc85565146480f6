"""Sampled held-out evaluation in real grpo runs on the tiny word task (`word_task.py`, the coin-flip verifier
`odd_first_word` of `stage_layouts`): `--eval-n-samples 4 --eval-temperature 1.0` on a named held-out set whose rows
carry a `data_source` column gives the same `eval/*` numbers at DP1, DP2 (5 held-out prompts: the DP2 ranks
evaluate 3 and 2) and PP2, with the baseline at iteration 0 (`--eval-before-train`) and `eval.csv`; and a run of 2
iterations resumed to 4 evaluates each due iteration once (none repeated, none skipped).

The same runs write sample tables (`--log-samples`: samples.jsonl, eval_samples.jsonl, TensorBoard's text tab), the
same rows at every layout and none repeated after a resume, and dump their rollouts (`--rollout-dump-dir`): grpo at
DP1 and DP2 and a trl_ppo run replayed (`--rollout-replay-dir`) give the dumping runs' weights bit for bit and their
metrics; so does a multi-turn grpo run with tool calls at a real model's widths (hidden 256, 32768 words), dumped and
replayed in two processes as a user runs them."""

import csv
import json
from pathlib import Path

import pytest
from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import layout_argv, run_stages

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

SAMPLED = ["--eval-n-samples", "4", "--eval-temperature", "1.0", "--eval-before-train"]
GRPO = ["--global-batch-size", "4", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8",
        "--verifier-function", "odd_first_word", "--kl-coef", "0.05", "--lr", "0.5"]


def _held_out(root: Path, tokenizer: str) -> str:
    """5 prompts of 3..5 words with a `data_source` column ("left" / "right"), preprocessed like the word task's."""
    import random

    from mindspeed_llm.data.preprocess import preprocess

    rng = random.Random(1)
    rows = [{"problem": " ".join(f"w{rng.randint(68, 255)}" for _ in range(rng.randint(3, 5))), "answer": "-",
             "data_source": "left" if i % 2 else "right"} for i in range(5)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "held.json").write_text(json.dumps(rows))
    preprocess(["--input", str(root / "held.json"), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                tokenizer, "--output-prefix", str(root / "held"), "--handler-name", "R1AlpacaStyleInstructionHandler",
                "--prompt-type", "empty", "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}),
                "--dataset-additional-keys", "data_source", "--log-interval", "0"])
    return str(root / "held")


def _argv(task, held, out: Path, layout: str, *extra):
    return layout_argv(task, "grpo", layout, GRPO + ["--eval-data-path", f"held={held}", *extra], out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers import word_task

    root = tmp_path_factory.mktemp("eval_task")
    task = word_task.build(root, layouts=((1, 1), (1, 2)), reward=True)
    held = _held_out(root / "held", task["tokenizer"])
    out = {name: root / name for name in ("dp1", "dp2", "pp2", "resume", "replay_dp1", "replay_dp2", "ppo",
                                          "replay_ppo", "partial", "replay_partial", "dynamic", "replay_dynamic")}
    sampled = ["--train-iters", "2", "--eval-interval", "1", *SAMPLED, "--log-samples", "3"]
    save = str(out["resume"] / "save")
    resume = ["--eval-interval", "3", "--eval-before-train", "--load", save, "--save-interval", "2",
              "--log-samples", "2"]
    # another top-k: a replay that generated instead of reading the dump would train on other rollouts
    replay = ["--train-iters", "2", "--top-k", "3", "--rollout-replay-dir"]
    # trl_ppo; grpo with partial rollouts (8 tokens in rounds of 3, 40 stop ids: groups finish in other iterations
    # than they started, and the sampler draws ahead) and with dynamic sampling (refills: several generation batches)
    dumped = {"ppo": layout_argv(task, "trl_ppo", "mbs1", ["--global-batch-size", "4", "--ppo-mini-batch-size", "4",
                                                           "--kl-coef", "0.05", "--lr", "0.2"], out["ppo"]),
              "partial": _argv(task, held, out["partial"], "mbs1", "--partial-rollout", "--partial-rollout-max-split",
                               "3", "--stop-token-ids", ",".join(map(str, range(100, 140)))),
              "dynamic": _argv(task, held, out["dynamic"], "mbs1", "--dynamic-sampling", "--max-num-gen-batches", "8")}
    replays = []
    for name, argv in dumped.items():
        replays += [argv + ["--train-iters", "2", "--rollout-dump-dir", str(out[name] / "dump")],
                    [str(out[f"replay_{name}"] / "metrics.jsonl") if a == str(out[name] / "metrics.jsonl") else
                     str(out[f"replay_{name}"] / "save") if a == str(out[name] / "save") else a for a in argv]
                    + replay + [str(out[name] / "dump")]]
    run_distributed(run_stages, 1, [
        _argv(task, held, out["dp1"], "mbs1", *sampled, "--tensorboard-dir", str(out["dp1"] / "tb"),
              "--rollout-dump-dir", str(out["dp1"] / "dump")),
        _argv(task, held, out["replay_dp1"], "mbs1", *replay, str(out["dp1"] / "dump")),
        *replays,
        _argv(task, held, out["resume"], "mbs1", "--train-iters", "2", *resume),
        _argv(task, held, out["resume"], "mbs1", "--train-iters", "4", *resume)])
    run_distributed(run_stages, 2, [_argv(task, held, out["dp2"], "dp2", *sampled,
                                          "--rollout-dump-dir", str(out["dp2"] / "dump")),
                                    _argv(task, held, out["replay_dp2"], "dp2", *replay, str(out["dp2"] / "dump")),
                                    _argv(task, held, out["pp2"], "pp2", *sampled)])
    return out


def _rows(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _evals(out: Path):
    return {r["iteration"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in _rows(out)
            if any(k.startswith("eval/") for k in r)}


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_sampled_evaluation_is_the_same_at_dp1_dp2_and_pp2(runs, layout):
    dp1, other = _evals(runs["dp1"]), _evals(runs[layout])
    assert sorted(dp1) == [0, 1, 2] and sorted(other) == [0, 1, 2]  # the baseline, then every iteration
    for it in dp1:
        assert set(dp1[it]) == set(other[it])
        for key, value in dp1[it].items():
            assert other[it][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (layout, it, key)
    first = dp1[0]
    for key in ("pass@1", "pass@2", "pass@4", "mean@4", "best@4", "score/mean", "response_length/mean", "kl/mean"):
        assert f"eval/held/{key}" in first
        if key != "kl/mean":
            assert f"eval/held/left/{key}" in first and f"eval/held/right/{key}" in first
    assert "eval/held/maj@4" not in first  # odd_first_word extracts no answer
    assert first["eval/held/pass@1"] <= first["eval/held/pass@2"] <= first["eval/held/pass@4"]
    assert first["eval/held/mean@4"] == pytest.approx(first["eval/held/pass@1"])  # scores are 0 / 1
    # the evaluation samples: some prompts pass and some fail (the numbers are not trivially 0 or 1)
    assert any(0 < v < 1 for e in dp1.values() for k, v in e.items() if k.endswith("pass@1"))
    with open(runs["dp1"] / "eval.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert {(int(r["iteration"]), r["set"], r["metric"]) for r in table} >= {(0, "held", "pass@4"),
                                                                            (2, "held", "left/best@4")}
    value = next(float(r["value"]) for r in table if (r["iteration"], r["metric"]) == ("1", "pass@2"))
    assert value == dp1[1]["eval/held/pass@2"]


def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(runs):
    rows = _rows(runs["resume"])
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]  # one row per iteration (the baseline's: 0)
    # --eval-interval 3 with --train-iters 2, then 4: the baseline, the first run's last iteration, iteration 3
    # (the interval) and the resumed run's last; the resumed run does not evaluate iteration 0 again
    assert sorted(_evals(runs["resume"])) == [0, 2, 3, 4]
    with open(runs["resume"] / "eval.csv", newline="") as f:
        table = [(int(r["iteration"]), r["metric"]) for r in csv.DictReader(f)]
    assert sorted({it for it, _ in table}) == [0, 2, 3, 4] and len(table) == len(set(table))


def _samples(out: Path, kind: str = "samples"):
    return [json.loads(line) for line in (out / f"{kind}.jsonl").read_text().splitlines()]


def _shown(row):
    """A sample row without what differs between layouts by rounding alone."""
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_sample_tables_hold_the_same_rows_at_every_layout(runs, layout):
    train, evaluation = _samples(runs["dp1"]), _samples(runs["dp1"], "eval_samples")
    # 3 rollout samples at iterations 1 and 2; 3 held-out samples (the first prompt's 4 samples cut to 3) at 0, 1, 2
    assert [(r["iteration"], r["sample"]) for r in train] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert [(r["iteration"], r["position"], r["sample"]) for r in evaluation] == [
        (it, 0, k) for it in (0, 1, 2) for k in range(3)]
    first = train[0]
    assert first["prompt"].strip() and first["response"] and first["finish_reason"] in ("eos", "stop", "length")
    assert first["score_parts"] == {"odd_first_word": first["score"]}  # the one verifier, weight 1
    assert first["score"] == float(first["response"].split()[0][1:].isdigit() and
                                   int(first["response"].split()[0][1:]) % 2 == 1)  # the verifier, by hand
    assert 0 < first["response_length"] <= 8 and first["label"] is not None
    assert {r["set"] for r in evaluation} == {"held"}
    assert all(r["passed"] == (r["score"] >= 1.0) for r in evaluation)
    assert [_shown(r) for r in _samples(runs[layout])] == [_shown(r) for r in train]
    assert [_shown(r) for r in _samples(runs[layout], "eval_samples")] == [_shown(r) for r in evaluation]


def test_sample_tables_go_to_tensorboard_and_continue_on_resume(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["dp1"] / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {tag: [e.step for e in events.Tensors(tag)] for tag in events.Tags()["tensors"]}
    assert texts["samples/text_summary"] == [1, 2] and texts["eval_samples/text_summary"] == [0, 1, 2]
    table = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| sample | prompt_index | score |") and table.count("\n") == 1 + 3  # header, rule, 3 rows
    # the resumed run: each iteration's rows once (1, 2 from the first run, 3, 4 from the resumed one)
    rows = _samples(runs["resume"])
    assert [(r["iteration"], r["sample"]) for r in rows] == [(it, k) for it in (1, 2, 3, 4) for k in (0, 1)]
    assert sorted({r["iteration"] for r in _samples(runs["resume"], "eval_samples")}) == [0, 2, 3, 4]


@pytest.mark.parametrize("dumped,replayed,roles", [("dp1", "replay_dp1", ("actor",)),
                                                   ("dp2", "replay_dp2", ("actor",)),
                                                   ("ppo", "replay_ppo", ("actor", "critic")),
                                                   ("partial", "replay_partial", ("actor",)),
                                                   ("dynamic", "replay_dynamic", ("actor",))])
def test_a_replayed_rollout_dump_gives_the_dumping_runs_update_bit_for_bit(runs, dumped, replayed, roles):
    import torch

    from tests.helpers.stage_layouts import full_weights

    dump = runs[dumped] / "dump"
    assert sorted(p.name for p in dump.iterdir()) == ["iteration_0000001", "iteration_0000002", "manifest.json"]
    files = sorted(p.name for p in (dump / "iteration_0000001").iterdir())
    ranks, batches = 2 if dumped == "dp2" else 1, json.loads((dump / "iteration_0000001" / "done.json").read_text())
    assert files == sorted([f"batch_{b}_dp_rank_{r:02d}.{ext}" for b in range(batches["generation_batches"])
                            for r in range(ranks) for ext in ("json", "pt")] + ["done.json"])
    if dumped == "dynamic":  # refills: more than one generation batch
        assert batches["generation_batches"] == batches["prompts_drawn"] > 1
    if dumped == "partial":  # rounds ahead of the first batch, and groups carried into the next iteration
        assert batches["prompts_drawn"] > 1 and _rows(runs[dumped])[0]["partial_rollout/carried"] > 0
    tensors = torch.load(dump / "iteration_0000001" / "batch_0_dp_rank_00.pt", weights_only=True)
    assert {"tokens", "responses", "response_mask", "scores", "rollout_logp"} <= set(tensors)
    for role in roles:
        original, replay = full_weights(runs[dumped] / "save", role), full_weights(runs[replayed] / "save", role)
        assert original.keys() == replay.keys()
        assert all(torch.equal(original[k], replay[k]) for k in original), role
    skipped = ("timing/", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps", "eval")
    original, replay = ([r for r in _rows(runs[name]) if r["iteration"] >= 1] for name in (dumped, replayed))
    assert [r["iteration"] for r in original] == [r["iteration"] for r in replay] == [1, 2]
    for a, b in zip(original, replay):
        a = {k: v for k, v in a.items() if not k.startswith(skipped)}
        assert a == {k: v for k, v in b.items() if not k.startswith(skipped)}


# A real model's shape (SmolLM2's kind: tied embeddings), 2 layers: hidden 256, 32768 words
REAL_SHAPE = dict(vocab=32768, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  tie=True)


def test_a_replayed_multi_turn_dump_at_a_real_models_shape_gives_its_update_bit_for_bit(tmp_path):
    """The dump and the replay as a user runs them, two processes, at hidden 256 and a 32768-word vocabulary (where
    the matmul kernels block by size) with tool calls: the replay's weights after 2 iterations and its metrics are
    the dumping run's bit for bit."""
    import os
    import subprocess
    import sys

    import torch

    from tests.helpers import word_task
    from tests.helpers.multiproc import single_rank_env
    from tests.helpers.stage_assets import ROOT
    from tests.helpers.stage_layouts import full_weights

    task = word_task.build(tmp_path / "task", **REAL_SHAPE)
    task.update(word_task.write_chat_tools(tmp_path / "task", task["tokenizer"]))
    env = dict(single_rank_env(), PYTHONPATH=os.pathsep.join([str(ROOT), str(word_task.TOOLS_DIR)]))
    # a quarter of the words stop a turn, so turns end and call the tool (a turn of 4 tokens cut there calls nothing)
    argv = ["--stage", "grpo", "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path",
            task["chat_tokenizer"], "--data-path", task["data"], "--global-batch-size", "2", "--micro-batch-size", "2",
            "--n-samples-per-prompt", "2", "--train-iters", "2", "--max-length", "24", "--max-prompt-length", "8",
            "--max-new-tokens", "4", "--do-sample", "--seed", "5", "--lr", "1e-3", "--kl-coef", "0.01",
            "--stop-token-ids", ",".join(map(str, range(100, 8100))), "--tool-config", task["tools"],
            "--tool-parser-format", "first_word_even", "--max-assistant-turns", "3", "--max-total-response-length",
            "14", "--max-tool-response-length", "3", "--custom-reward-function",
            f"{word_task.TOOLS_DIR / 'word_tools.py'}:turns_reward", "--save-interval", "2",
            "--no-check-for-divergence"]
    dump = tmp_path / "dumped" / "rollouts"
    for name, extra in (("dumped", ["--rollout-dump-dir", str(dump)]),
                        ("replayed", ["--rollout-replay-dir", str(dump), "--top-k", "3"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, str(ROOT / "posttrain_gpt.py"), *argv, "--save", str(out),
                               "--metrics-jsonl", str(out / "metrics.jsonl"), *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    original, replay = _rows(tmp_path / "dumped"), _rows(tmp_path / "replayed")
    assert max(r["num_turns/max"] for r in original) >= 2 and sum(r["tool/calls"] for r in original) > 0
    weights = {name: full_weights(tmp_path / name, "actor") for name in ("dumped", "replayed")}
    assert weights["dumped"]["embedding.word_embeddings.weight"].shape[0] >= 32768
    assert weights["dumped"].keys() == weights["replayed"].keys()
    assert [k for k in weights["dumped"] if not torch.equal(weights["dumped"][k], weights["replayed"][k])] == []
    skipped = ("timing/", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps")
    assert [r["iteration"] for r in original] == [r["iteration"] for r in replay] == [1, 2]
    for a, b in zip(original, replay):
        assert {k: v for k, v in a.items() if not k.startswith(skipped)} == \
            {k: v for k, v in b.items() if not k.startswith(skipped)}
