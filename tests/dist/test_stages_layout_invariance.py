"""Layout invariance: one update of each stage gives the same result at any TP, PP, DP and micro-batch size.

A Megatron user expects the parallel layout to change speed and memory, never the training result
(docs/parallelism.md, "Layout invariance"). Each case runs ONE iteration of the real stage (`trainer.run`, sampled
rollout of the same prompts, then one update) and saves the trained weights:

* trl_ppo: 8 prompts, two mini-batches of 4 (the second step's ratios are not 1), `--whiten-rewards`;
* trl_ppo_n2: 4 prompts x 2 samples (groups packed at mbs 4, one GAE per sample);
* grpo with `--dynamic-sampling` (refill from further generation batches; the ranks exchange their groups);
* grpo with each `--loss-agg-mode`: 8 prompts x 2 samples, two mini-batches of 8, `--filter-groups` (a coin-flip
  rule reward, so some groups have no spread and leave the loss while others stay), KL loss and entropy bonus;
  `token-mean` with `--adv-scale batch` (a batch statistic over the DP ranks);
* on-policy distillation from a teacher of another size (`--teacher-load`, `word_task.build(teacher=True)`, loaded
  at each layout's TP / PP): grpo with k3 as a loss beside the verifier, the top-k forward KL (k 8) as the only
  signal (under TP2 the top-k of the vocab-parallel logits, also with sequence parallelism and at CP2), k1 as a
  per-token reward in grpo and in trl_ppo (`stage_layouts.distill_cases`).

The models and prompts are the tiny word-level task of `word_task.py` (256-word vocabulary), so that the 35 runs
take minutes.

Both stages train with plain SGD (no momentum; gradient clipping at 1 on): a weight's change is the learning rate
times its gradient, so comparing changes compares gradients. Adam would normalise each element and hide a wrong
loss scale.

Layouts: TP1/PP1/DP1 with micro-batch sizes 1 (the reference) and 4 (packed prompt groups), in one
process; TP2, PP2 and DP2 on 2 gloo processes; token-budget micro-batches (`--max-tokens-per-micro-batch`, rows and
packed groups in one process, and DP2) for four of the cases. Every micro-batch is cut to its own length, so PP2
also exchanges shapes that differ from one micro-batch to the next. The PP2 and DP2 runs also bound the generation
engine (`--rollout-max-num-seqs`, `--rollout-max-num-batched-tokens`: few samples in flight, chunked prefills), which
must change nothing either. Against the reference, each layout must give:

* every logged metric (losses, clip fractions, KL, entropy, scores, lengths, grad norms; not timings and
  throughputs) within rtol 1e-5, atol 1e-6;
* every weight after the step within 1e-5 of its norm, and every weight CHANGE within 1e-3 of the change's norm
  (trl_ppo's second step starts from weights that already differ by float rounding).
On an AMD EPYC (Zen 3) the largest differences were a third of the metric tolerance, 1/40 of the weight
tolerance and 1/10 of the change tolerance (each run prints its share of the tolerances).

What makes this hold, and the mutation run (2026-11-30) that reverted each one alone and watched this test fail:

| reverted to per-micro-batch / per-rank                              | first failure                            |
|---------------------------------------------------------------------|------------------------------------------|
| loss totals per micro-batch (`ppo_loop.loss_totals`)                 | mbs4 trl_ppo actor/abs_pg_loss           |
| loss totals not summed over DP                                       | dp2 trl_ppo actor/abs_pg_loss            |
| metric shares not summed over DP (`TrainableModel.train_step`)       | dp2 trl_ppo actor/abs_pg_loss            |
| GAE whitening per rank (`core_algos` `sum_across`)                   | dp2 trl_ppo actor/abs_pg_loss            |
| `--whiten-rewards` per rank                                          | dp2 trl_ppo actor/abs_pg_loss            |
| `--adv-scale batch` std per rank                                     | dp2 grpo_token-mean actor/pg_loss        |
| sample streams keyed by the local row (`sampling.sample_uniforms`)   | dp2 trl_ppo actor/abs_pg_loss            |
| mini-batches dealt per rank (`ppo_loop.mini_batch_units`)            | dp2 trl_ppo actor/abs_pg_loss (seed 4;   |
|                                                                      | seed 11 happened to deal both ranks alike, which `test_cases_are_not_trivial` now rules out) |
| the loss scale without its DP factor (`engine.schedule_loss_scale`)  | dp2 trl_ppo actor/grad_norm              |
| loss totals per token-budget micro-batch (2026-12-01)                | every budget, budget_packed and          |
|                                                                      | dp2_budget case (12 of 12)               |

The group filter acting through the response mask instead of a loss mask changes no number here (filtered rows
leave every loss either way); `test_cases_are_not_trivial` checks that filtered responses keep their lengths.
"""

import math
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402
from tests.helpers.stage_layouts import (ATOL, BUDGETS, KEY_ATOL, LAYOUTS, RTOL, SEED, WEIGHT_RTOL, full_weights,
                                         layout_argv, metrics_row, relative, run_cases, update_cases)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

CHANGE_RTOL = 1e-3  # per tensor, relative to its change's norm
# the cases of the newer layouts (None: all): a row and a packed layout of each stage, a sequence-level loss mode,
# the refill (its groups exchanged over DP while the CP ranks generate their own)
LAYOUT_CASES = {"tp2_sp": ("trl_ppo", "trl_ppo_n2", "grpo_token-mean", "grpo_dynamic_sampling", "grpo_distill_topk"),
                "cp2": ("trl_ppo", "trl_ppo_n2", "grpo_token-mean", "grpo_seq-mean-token-sum", "grpo_dynamic_sampling",
                        "grpo_distill_topk"),
                "cp2_budget": ("trl_ppo_n2", "grpo_seq-mean-token-sum-norm"),
                "cp2_tp2_sp": ("trl_ppo", "grpo_token-mean")}
BUDGET_CASES = ("trl_ppo", "trl_ppo_n2", "grpo_token-mean", "grpo_seq-mean-token-sum-norm")


def _layout_cases(layout, cases):
    if layout in LAYOUT_CASES:
        return {k: v for k, v in cases.items() if k in LAYOUT_CASES[layout]}
    return {k: v for k, v in cases.items() if layout not in BUDGETS or k in BUDGET_CASES}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("word_task"), layouts=((1, 1), (2, 1), (1, 2)), reward=True,
                           teacher=True)


def _selected_runs(request):
    """{layout: cases} that the selected tests of this module read, the reference's (mbs1) included; None (all)
    where a test other than the per-layout comparison is selected. `-k "cp"` then runs the CP layouts only."""
    items = [item for item in request.session.items if item.module is request.module]
    if any(item.originalname != "test_one_update_is_layout_invariant" for item in items):
        return None
    wanted = {}
    for item in items:
        layout, case = item.callspec.params["layout"], item.callspec.params["case"]
        for name in (layout, "mbs1"):
            wanted.setdefault(name, set()).add(case)
    return wanted


@pytest.fixture(scope="module")
def layout_runs(task, tmp_path_factory, request):
    """{layout: {case: directory}} after running every case on every layout (those the selected tests read)."""
    root = tmp_path_factory.mktemp("layouts")
    cases = update_cases()
    wanted = _selected_runs(request)
    dirs = {layout: {case: root / layout / case for case in _layout_cases(layout, cases)
                     if wanted is None or case in wanted.get(layout, ())} for layout in LAYOUTS}
    by_world = {}
    for layout, (_, _, world, _, _) in LAYOUTS.items():
        if not dirs[layout]:
            continue
        by_world.setdefault(world, []).extend(
            layout_argv(task, stage, layout, extra, dirs[layout][case])
            for case, (stage, extra) in _layout_cases(layout, cases).items() if case in dirs[layout]
        )
    recorded = {}  # world size -> rank 0's (group filter records, token-budget step sizes)
    for world, runs in by_world.items():
        recorded[world] = run_distributed(run_cases, world, runs)[0]
    return dirs, recorded


@pytest.mark.parametrize("layout,case", [(layout, case) for layout in LAYOUTS if layout != "mbs1"
                                         for case in _layout_cases(layout, update_cases())])
def test_one_update_is_layout_invariant(layout_runs, task, layout, case):
    dirs, _ = layout_runs
    reference, other = dirs["mbs1"][case], dirs[layout][case]
    ref_metrics, metrics = metrics_row(reference), metrics_row(other)
    assert sorted(metrics) == sorted(ref_metrics)
    worst = 0.0  # the largest difference as a share of its tolerance
    for key, expected in ref_metrics.items():
        got = metrics[key]
        assert math.isfinite(expected), (key, expected)
        atol = KEY_ATOL.get(key, ATOL)
        worst = max(worst, abs(got - expected) / (atol + RTOL * abs(expected)))
        assert abs(got - expected) <= atol + RTOL * abs(expected), f"{layout} {case} {key}: {got!r} != {expected!r}"

    roles = ["actor", "critic"] if case.startswith("trl_ppo") else ["actor"]
    worst_weight = worst_change = 0.0
    for role in roles:
        initial = full_weights(Path(task[f"mg_{'reward' if role == 'critic' else 'actor'}_tp1pp1"]), "")
        ref, got = full_weights(reference / "save", role), full_weights(other / "save", role)
        assert sorted(ref) == sorted(got) == sorted(initial)
        for name in ref:
            weight, change = relative(got[name], ref[name]), relative(got[name] - initial[name], ref[name] - initial[name])
            worst_weight, worst_change = max(worst_weight, weight / WEIGHT_RTOL), max(worst_change, change / CHANGE_RTOL)
            assert weight <= WEIGHT_RTOL, f"{layout} {case} {role}/{name}: weights differ by {weight:.2e} of their norm"
            assert change <= CHANGE_RTOL, f"{layout} {case} {role}/{name}: the update differs by {change:.2e}"
    print(f"{layout} {case}: largest difference / tolerance: metrics {worst:.2f}, weights {worst_weight:.2f}, "
          f"changes {worst_change:.2f}")


def test_cases_are_not_trivial(layout_runs):
    """The invariance above is about real updates: every case has a loss, a gradient and a moved model, the group
    filter both removes and keeps groups (through the loss mask: a filtered response keeps its length, read
    positions and packing), and the DP ranks draw different mini-batch orders."""
    from mindspeed_llm.rl.update.ppo_loop import mini_batch_units

    dirs, runs = layout_runs
    filtered = {world: run[0] for world, run in runs.items()}
    assert filtered[1] and all(out > 0 and with_response == out for out, with_response in filtered[1]), filtered
    # token budgets cut steps into several micro-batches, some of several samples (on one rank, on DP2's and CP2's)
    for world, (_, steps) in runs.items():
        if world in (1, 2):
            assert any(len(step) > 1 for step in steps) and any(max(step) > 1 for step in steps), (world, steps)
    # DP2's 2 chunks per rank: ranks 0 and 1 must not deal their mini-batches alike by chance (as seed 11 did)
    rank0, rank1 = (mini_batch_units(4, r, 2, SEED, 1, 0) for r in (0, 1))
    assert any(not torch.equal(a, b) for a, b in zip(rank0, rank1))
    for case, directory in dirs["mbs1"].items():
        metrics = metrics_row(directory)
        norm = metrics["actor/grad_norm" if case.startswith("trl_ppo") else "grad_norm"]
        assert norm > 1e-3, (case, norm)
        if "_distill_" in case:  # the teacher scored every response token (log-probs of a real distribution)
            assert metrics["distill/kl_mean"] != 0 and metrics["distill/teacher_logp_mean"] < 0, (case, metrics)
            if case == "grpo_distill_topk":  # the only signal: no verifier, so every score is 0
                assert 0 < metrics["distill/topk_mass"] < 1 and metrics["grpo/score/max"] == 0, metrics
        elif case.startswith("trl_ppo"):
            assert metrics["n_samples_per_prompt"] == (2 if case == "trl_ppo_n2" else 1)
        elif case == "grpo_dynamic_sampling":  # a refill happened, and the kept groups all have spread
            assert metrics["dynamic_sampling/num_gen_batches"] > 1 and metrics["dynamic_sampling/filtered_fraction"] > 0
            assert metrics["grpo/advantages/max"] > 0.5 and metrics["actor/kl_loss"] > 0
        else:
            assert 0 < metrics["grpo/filtered_groups"] < 1, (case, metrics["grpo/filtered_groups"])
            assert metrics["actor/kl_loss"] > 0 and metrics["actor/entropy"] > 0
