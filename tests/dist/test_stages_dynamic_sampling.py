"""Dynamic sampling with refill (`rl/rollouts/dynamic_sampling.py`): the kept groups are the first informative ones in the
global order at any DP size, every rank ends with its share, and a too-small `--max-num-gen-batches` is an error
naming it. The generation batches are synthetic (rows whose scores say which groups are informative)."""

import pytest
import torch

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import full_weights, run_stages

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

N, LOCAL = 2, 2  # samples per prompt; prompts per rank and generation batch (DP2) / twice that at DP1
# Per generation batch, the global groups' scores (4 groups of 2): informative where the two differ.
SCORES = [
    [[1, 1], [0, 1], [0, 0], [1, 1]],  # 1 informative (global group 1)
    [[0, 0], [1, 0], [0, 1], [1, 1]],  # 2 informative (groups 1, 2)
    [[1, 0], [1, 0], [1, 0], [1, 0]],  # 4 informative: the batch is full after 1 of them
]


def _batch(j, rank, dp):
    """Generation batch j on `rank`: its share of the global groups, scored as SCORES says. Each row's response
    is a different length and its token ids name (batch, global group, sample), to track rows."""
    per_rank = 4 // dp
    groups = range(rank * per_rank, (rank + 1) * per_rank)
    from mindspeed_llm.rl.experience import Experience, SampleData

    rows = [(g, k) for g in groups for k in range(N)]
    prompt, resp = 3, [1 + (g + k + j) % 3 for g, k in rows]
    width = max(resp)
    tokens = torch.zeros(len(rows), prompt + width, dtype=torch.long)
    responses = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, ((g, k), r) in enumerate(zip(rows, resp)):
        ident = 100 * j + 10 * g + k
        tokens[i, :prompt + r] = ident
        responses[i, :r] = ident
        mask[i, :r] = 1
    exp = Experience(tokens=tokens, position_ids=torch.arange(prompt + width).expand_as(tokens),
                     prompt_lengths=torch.full((len(rows),), prompt), responses=responses, response_mask=mask,
                     ended_with_eos=torch.ones(len(rows), dtype=torch.bool))
    exp.scores = torch.tensor([float(SCORES[j][g][k]) for g, k in rows])
    exp.sample_data = SampleData(labels=[f"{j}/{g}/{k}" for g, k in rows], indices=[10 * j + g for g, k in rows],
                                 finish_reasons=["eos"] * len(rows), texts=[str(100 * j + 10 * g + k) for g, k in rows])
    return exp


def _run(rank, world_size, max_batches):
    from mindspeed_llm import distributed
    from mindspeed_llm.rl.rollouts.dynamic_sampling import GenerationBudgetError, refill

    distributed.initialize(1, 1, seed=1)
    local = 4 // world_size  # prompts per rank in a generation batch (the global batch is 4 prompts)
    try:
        exp, metrics = refill(_batch(0, rank, world_size), lambda j: _batch(j, rank, world_size), N, local,
                              max_batches)
    except GenerationBudgetError as exc:
        return str(exc)
    return exp.sample_data.labels, exp.responses.tolist(), exp.tokens.shape, exp.prompt_lengths.tolist(), metrics


# the global kept order: batch 0 group 1, batch 1 groups 1 and 2, batch 2 group 0
KEPT = ["0/1/0", "0/1/1", "1/1/0", "1/1/1", "1/2/0", "1/2/1", "2/0/0", "2/0/1"]


@pytest.mark.parametrize("dp", [1, 2])
def test_refill_keeps_the_first_informative_groups_at_any_dp_size(dp):
    results = run_distributed(_run, dp, 5)
    share = len(KEPT) // dp
    for rank, (labels, responses, shape, prompts, metrics) in enumerate(results):
        assert labels == KEPT[rank * share:(rank + 1) * share]
        # each row kept its own tokens, and the batch is no wider than its rows need
        for label, row in zip(labels, responses):
            j, g, k = map(int, label.split("/"))
            length = 1 + (g + k + j) % 3
            assert row[:length] == [100 * j + 10 * g + k] * length and not any(row[length:])
        assert shape[1] == 3 + max(1 + (int(l.split("/")[1]) + int(l.split("/")[2]) + int(l.split("/")[0])) % 3
                                   for l in labels)
        assert prompts == [3] * share
        # 3 generation batches of 4 groups; 7 of the 12 were informative, the last batch's surplus included
        assert metrics == {"dynamic_sampling/num_gen_batches": 3.0,
                           "dynamic_sampling/filtered_fraction": pytest.approx(1 - 7 / 12)}


def test_refill_budget_is_named():
    for message in run_distributed(_run, 2, 2):
        assert message.startswith("--max-num-gen-batches 2: 2 generation batches gave 3 groups with reward variance")


def _run_metric(rank, world_size, metric, max_batches):
    """refill on SCORES as a verifier's own scores ("acc" in each row's score parts), each row's reward that score
    plus a penalty of its response length (so every group's rewards differ)."""
    from mindspeed_llm import distributed
    from mindspeed_llm.rl.rollouts.dynamic_sampling import GenerationBudgetError, refill

    distributed.initialize(1, 1, seed=1)

    def scored(j):
        exp = _batch(j, rank, world_size)
        exp.sample_data.score_parts = [{"acc": float(s)} for s in exp.scores.tolist()]
        exp.scores = exp.scores - 0.1 * exp.response_mask.sum(dim=1)
        return exp

    try:
        exp, metrics = refill(scored(0), scored, N, 4 // world_size, max_batches, metric)
    except GenerationBudgetError as exc:
        return str(exc)
    return exp.sample_data.labels, metrics["dynamic_sampling/num_gen_batches"]


def test_refill_on_a_verifiers_scores_and_without_a_limit():
    """--dynamic-sampling-metric NAME (MindSpeed-RL's filter_groups_metric) keeps the groups whose verifier scores
    differ, whatever the rewards do; on the rewards the first batch is kept whole. --max-num-gen-batches 0 (its -1):
    no limit, where 2 batches are too few."""
    (by_acc,) = run_distributed(_run_metric, 1, "acc", 0)
    assert by_acc == (KEPT, 3.0)
    (by_reward,) = run_distributed(_run_metric, 1, "reward", 5)
    assert by_reward == ([f"0/{g}/{k}" for g in range(4) for k in range(N)], 1.0)
    (short,) = run_distributed(_run_metric, 1, "acc", 2)
    assert short.startswith("--max-num-gen-batches 2: 2 generation batches gave 3 groups")


# ---------------------------------------------------------------------------------------------- the grpo stage


@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly_at_dp2(tmp_path):
    """Two iterations in one go equal one iteration, a save, and a resume: the sampler's position (advanced by
    every generation batch) and the random streams are restored, on 2 DP ranks."""
    import json

    from tests.helpers import word_task

    task = word_task.build(tmp_path / "task")
    base = ["--stage", "grpo", "--micro-batch-size", "2", "--global-batch-size", "4", "--n-samples-per-prompt", "2",
            "--seed", "5", "--data-path", task["data"], "--tokenizer-name-or-path", task["tokenizer"],
            "--max-length", "64", "--max-new-tokens", "8", "--do-sample", "--ref-model", task["mg_actor_tp1pp1"],
            "--dynamic-sampling", "--max-num-gen-batches", "8", "--verifier-function", "odd_first_word",
            "--kl-coef", "0.05", "--lr", "0.1", "--log-interval", "1",
            "--no-check-for-divergence"]  # lr 0.1 moves the tiny model's weights far on purpose
    whole, split = tmp_path / "whole", tmp_path / "split"

    def run(out, iters, *extra):
        return base + ["--train-iters", str(iters), "--save", str(out), "--metrics-jsonl", str(out / "m.jsonl"), *extra]

    run_distributed(run_stages, 2, [run(whole, 2, "--save-interval", "1"), run(split, 1),
                                     run(split, 2, "--load", str(split))])
    rows = {name: [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
            for name, out in (("whole", whole), ("split", split))}
    assert [r["iteration"] for r in rows["split"]] == [1, 2]
    for a, b in zip(rows["whole"], rows["split"]):
        assert {k: v for k, v in a.items() if not k.startswith("timing/") and not k.endswith("_tps")} == \
            {k: v for k, v in b.items() if not k.startswith("timing/") and not k.endswith("_tps")}
    assert sum(r["dynamic_sampling/num_gen_batches"] for r in rows["whole"]) > 2  # some iteration refilled
    a, b = full_weights(whole, "actor"), full_weights(split, "actor")
    assert all(torch.equal(a[k], b[k]) for k in a)
