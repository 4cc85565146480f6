"""The methods of issue 16 in the real stages: one iteration of each case on the tiny word task
(`test_layout_invariance`'s runner, models and tolerances), where

* the metrics the methods add are logged: `rollout_mismatch/*` whenever the old log-probs come from a training
  forward, `overlong/*`, `truncated_masked_fraction`, `actor/rollout_is_*`;
* --mask-truncated-completions takes the truncated responses (and only them) out of the losses;
* the update is layout invariant: micro-batch size 1 (the reference) vs 4 (packed groups) in one process, and DP2
  on 2 gloo processes -- REINFORCE++'s whitening is a batch statistic over the DP ranks.

Stop tokens (a tenth of the vocabulary) end some responses early, so that some are truncated and some not.
"""

import math
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import ATOL, LAYOUTS, RTOL, full_weights, layout_argv, metrics_row, run_cases

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

STOPS = ["--stop-token-ids", " ".join(str(i) for i in range(40, 66))]
GRPO = ["--global-batch-size", "8", "--n-samples-per-prompt", "2", "--verifier-function", "odd_first_word",
        "--kl-coef", "0.05", "--lr", "0.5"] + STOPS
CASES = {
    # KL in the reward, discounted returns whitened over the batch; TIS; overlong penalty; truncated masked
    "grpo_rpp": ("grpo", GRPO + ["--adv-estimator", "reinforce_plus_plus", "--gamma", "0.9", "--rollout-is", "tis",
                                 "--mask-truncated-completions", "--overlong-buffer-len", "4",
                                 "--ppo-mini-batch-size", "8"]),
    # GSPO on the group-baseline estimator, two optimizer steps (the second step's ratios are not 1); MIS
    "grpo_gspo": ("grpo", GRPO + ["--adv-estimator", "reinforce_plus_plus_baseline", "--policy-loss", "gspo",
                                  "--gspo-clip-ratio", "0.01", "--gspo-clip-ratio-high", "0.01",
                                  "--rollout-is", "mis", "--ppo-mini-batch-size", "8"]),
    # with the group filter too: both take rows out of the same loss mask
    "grpo_dr": ("grpo", GRPO + ["--adv-estimator", "dr_grpo", "--loss-agg-mode", "seq-mean-token-sum-norm",
                                "--recompute-old-logprobs", "--mask-truncated-completions", "--filter-groups"]),
    # one optimizer step, where trl_ppo would take the sampler's log-probs: the training forward's instead
    "trl_ppo_recompute": ("trl_ppo", ["--global-batch-size", "4", "--kl-coef", "0.05", "--lr", "0.2",
                                      "--recompute-old-logprobs", "--mask-truncated-completions",
                                      "--overlong-buffer-len", "4"] + STOPS),
}
RUN_LAYOUTS = ("mbs1", "mbs4", "dp2")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("word_task"), reward=True)


def _run_recorded(rank, world_size, runs):
    """`run_cases`, recording for every update of every run: which rows were truncated, which rows have an empty
    loss mask, and which groups of 2 the group filter would take out (all scores equal)."""
    import torch

    from mindspeed_llm.rl.stages import grpo, trl_ppo

    records = []

    def recorder(update):
        def recording(model, exp, *args, **kwargs):
            n = kwargs.get("group_size", 1)
            same = exp.scores.view(-1, n).std(dim=1, unbiased=False) == 0 if n > 1 else torch.zeros(len(exp.scores))
            records.append({"truncated": [r == "length" for r in exp.sample_data.finish_reasons],
                            "out": (exp.loss_mask.sum(-1) == 0).tolist(),
                            "flat_group": same.bool().repeat_interleave(n).tolist()})
            return update(model, exp, *args, **kwargs)
        return recording

    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        for stage in (grpo, trl_ppo):
            patch.setattr(stage, "ppo_update", recorder(stage.ppo_update))
        run_cases(rank, world_size, runs)
    return records


@pytest.fixture(scope="module")
def runs(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    dirs = {layout: {case: root / layout / case for case in CASES} for layout in RUN_LAYOUTS}
    by_world = {}
    for layout in RUN_LAYOUTS:
        world = LAYOUTS[layout][2]
        by_world.setdefault(world, []).extend(
            layout_argv(task, stage, layout, extra, dirs[layout][case]) for case, (stage, extra) in CASES.items())
    records = {}
    for world, argvs in by_world.items():
        records[world] = run_distributed(_run_recorded, world, argvs)[0]
    return dirs, records


def test_the_loss_mask_leaves_out_exactly_the_truncated_responses(runs):
    """On the one-process layouts: per update, the rows out of the loss are the truncated ones (with
    --mask-truncated-completions), plus the flat groups (with --filter-groups), nothing else."""
    _, records = runs
    updates = iter(records[1])
    for layout in ("mbs1", "mbs4"):
        for case, (stage, extra) in CASES.items():
            for _ in range(2 if stage == "trl_ppo" else 1):  # trl_ppo updates its actor, then its critic
                record = next(updates)
                expected = [("--mask-truncated-completions" in extra and cut) or ("--filter-groups" in extra and flat)
                            for cut, flat in zip(record["truncated"], record["flat_group"])]
                assert record["out"] == expected, (layout, case, record)
                if "--mask-truncated-completions" in extra:
                    assert any(record["truncated"]) and not all(record["truncated"])
    assert next(updates, None) is None


def test_the_methods_log_their_metrics(runs):
    runs, _ = runs
    for case, (stage, extra) in CASES.items():
        metrics = metrics_row(runs["mbs1"][case], skipped=())  # every logged key
        names = set(metrics)
        # the old log-probs came from a training forward: the sampler's are compared with them
        assert {"rollout_mismatch/abs_diff_mean", "rollout_mismatch/abs_diff_max", "rollout_mismatch/k3_kl"} <= names
        # same weights, two code paths (decode with a KV cache vs the training forward): rounding apart
        assert 0 <= metrics["rollout_mismatch/abs_diff_mean"] <= metrics["rollout_mismatch/abs_diff_max"] < 1e-3
        assert abs(metrics["rollout_mismatch/k3_kl"]) < 1e-6
        if "--overlong-buffer-len" in extra:
            assert metrics["overlong/penalty_mean"] < 0 and 0 < metrics["overlong/penalised_fraction"] < 1
        else:
            assert not any(k.startswith("overlong/") for k in names)
        if "--mask-truncated-completions" in extra:
            # some responses were cut by --max-new-tokens and left the loss, the others ended on a stop token
            assert metrics["truncated_masked_fraction"] == pytest.approx(metrics["response_clip_ratio"])
            assert 0 < metrics["truncated_masked_fraction"] < 1
        if "--rollout-is" in extra:
            assert metrics["actor/rollout_is_weight"] == pytest.approx(1.0, abs=1e-3)  # on-policy up to rounding
            assert metrics["actor/rollout_is_clipfrac"] == 0
        norm = metrics["actor/grad_norm" if stage == "trl_ppo" else "grad_norm"]
        assert norm > 1e-3, (case, norm)
    assert metrics_row(runs["mbs1"]["grpo_rpp"])["actor/kl_loss"] == 0  # REINFORCE++: the KL is in the reward


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["mbs4", "dp2"])
def test_the_methods_are_layout_invariant(runs, task, layout, case):
    runs, _ = runs
    reference, other = metrics_row(runs["mbs1"][case]), metrics_row(runs[layout][case])
    assert sorted(other) == sorted(reference)
    for key, expected in reference.items():
        assert math.isfinite(expected), (key, expected)
        assert abs(other[key] - expected) <= ATOL + RTOL * abs(expected), f"{layout} {case} {key}: {other[key]!r} " \
                                                                           f"!= {expected!r}"
    for role in (["actor", "critic"] if CASES[case][0] == "trl_ppo" else ["actor"]):
        ref = full_weights(Path(runs["mbs1"][case]) / "save", role)
        got = full_weights(Path(runs[layout][case]) / "save", role)
        for name in ref:
            scale = float(ref[name].norm()) or 1.0
            assert float((got[name] - ref[name]).norm()) / scale <= 1e-5, f"{layout} {case} {role}/{name}"
