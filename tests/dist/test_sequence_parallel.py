"""`--sequence-parallel` on the local layer spec (TP2, 2 gloo processes), against the same TP2 model without it:

* the policy's logits (whole sequence and an output window, a width that TP does not divide, so the forward pads)
  and the value head's values, in eval mode;
* one optimizer step of each (a policy loss and a value loss through `TrainableModel.train_step`, SGD without
  clipping): grad norms and every weight after the step; and the same step with the norms' `sequence_parallel`
  marking removed (megatron then leaves their gradients partial): the weights differ, so the marking is needed;
* sampled generation on both engines (it runs without sequence parallelism): the same tokens and log-probs as the
  plain model's static engine (the continuous one with 2 rows in flight for 3 prompts, so a slot is reused);
* megatron's torch norm refuses sequence parallelism without `patches/sequence_parallel.py`;
* the models built with --use-fused-rmsnorm / --use-fused-swiglu (`build_model(fused_ops=...)`, the CPU's ops) at
  TP2 + SP: the same reads, step and generation as megatron's unfused path (the fused norms keep the marking).

Both stages' whole iterations at TP2 + SP (and CP2 x TP2 + SP) are in tests/dist/test_stages_layout_invariance.py.
"""

from __future__ import annotations


import pytest
import torch
from tests.helpers.multiproc import run_distributed
from tests.helpers.patch_removal import without_patch  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TOL = 1e-6


def _experience(rows, prompt, response, vocab, seed=0):
    from mindspeed_llm.rl.experience import Experience

    g = torch.Generator().manual_seed(seed)
    total = prompt + response
    tokens = torch.randint(4, vocab, (rows, total), generator=g)
    exp = Experience(tokens=tokens, position_ids=torch.arange(total).expand(rows, -1).clone(),
                     prompt_lengths=torch.full((rows,), prompt), responses=tokens[:, prompt:].clone(),
                     response_mask=torch.ones(rows, response), ended_with_eos=torch.ones(rows, dtype=torch.bool))
    exp.advantages = torch.randn(rows, response, generator=g)
    exp.returns = torch.randn(rows, response, generator=g)
    return exp


def _worker(rank, world_size, task):
    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.inference import SamplingConfig, generate
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
    from mindspeed_llm.rl.update.engine import forward_only
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel
    from mindspeed_llm.rl.update.passes import last_token_values, response_logprobs, response_values

    distributed.initialize(2, 1, 1234)
    # 13 positions: not a multiple of TP 2, the forward pads to 14. The policy's prompts of 5 give an output window
    # from position 4 on; the value model's prompts of 1 none (the whole sequence reaches the value head)
    experiences = {"policy": _experience(4, 5, 8, 200), "value": _experience(4, 1, 12, 200)}
    out = {}

    def model(root, sp, value_head=False, fused_ops=()):
        m = build_model(load_spec(root), sequence_parallel=sp, value_head=value_head, fused_ops=fused_ops)
        load_megatron_weights(m, root)
        return m

    def policy_loss(output, mb):
        logp = response_logprobs(output, mb)
        loss = -(logp * mb["advantages"]).sum() / 32
        return loss, {"loss": loss.detach()}

    def value_loss(output, mb):
        loss = ((response_values(output, mb) - mb["returns"]) ** 2).sum() / 48
        return loss, {"loss": loss.detach()}

    # "fused": --use-fused-rmsnorm / --use-fused-swiglu (the CPU's ops) under SP, against megatron's unfused path
    for sp in (False, True, "unmarked", "fused"):
        use_sp = sp is not False
        fused_ops = ("rmsnorm", "swiglu") if sp == "fused" else ()
        results = {}
        for kind, root, loss_fn in (("policy", task["mg_actor_tp2pp1"], policy_loss),
                                    ("value", task["mg_reward_tp2pp1"], value_loss)):
            m = model(root, use_sp, value_head=kind == "value", fused_ops=fused_ops)
            if sp == "unmarked":
                for p in m.parameters():
                    if hasattr(p, "sequence_parallel"):
                        del p.sequence_parallel
            trained = TrainableModel(m, OptimizerSettings(lr=0.1, optimizer="sgd", sgd_momentum=0.0, clip_grad=0.0))
            exp = experiences[kind]
            plan = MicroBatchPlan.build(exp, 2)
            if kind == "policy":
                reads = forward_only(trained.chunks, plan.micro_batches(exp), lambda o, mb: response_logprobs(o, mb),
                                     (8,))
            else:
                reads = forward_only(trained.chunks, plan.micro_batches(exp), lambda o, mb: last_token_values(o, mb))
            metrics = trained.train_step(plan.micro_batches(exp, update=True), loss_fn)
            results[kind] = (reads, metrics["grad_norm"], {n: p.detach().clone() for n, p in m.named_parameters()})
        actor = model(task["mg_actor_tp2pp1"], use_sp, fused_ops=fused_ops)
        for engine, max_num_seqs in (("static", None), ("continuous", 2)):  # continuous: a freed slot is reused
            rollout = generate(actor, [[5, 70, 80, 90], [5, 100, 110], [7, 8, 9, 10, 11]],
                               SamplingConfig(do_sample=True, max_new_tokens=6, max_length=32, seed=3,
                                              max_num_seqs=max_num_seqs), iteration=1, sample_ids=[0, 1, 2],
                               engine=engine)
            results[f"generate_{engine}"] = (rollout.responses, rollout.log_probs)
        out[sp] = results
    plain = out[False]
    for sp in (True, "unmarked", "fused"):
        got = out[sp]
        report = {}
        for kind in ("policy", "value"):
            reads, norm, weights = got[kind]
            report[kind] = {"reads": (reads - plain[kind][0]).abs().max().item(),
                            "grad_norm": abs(norm - plain[kind][1]),
                            "weights": max((weights[n] - plain[kind][2][n]).abs().max().item() for n in weights)}
        for engine in ("static", "continuous"):  # against the plain TP model's static engine
            tokens, log_probs = got[f"generate_{engine}"]
            report[f"generate_{engine}"] = (torch.equal(tokens, plain["generate_static"][0]),
                                            (log_probs - plain["generate_static"][1]).abs().max().item())
        out[f"report_{sp}"] = report
    # megatron's torch norm without the patch (the other patches stay)
    try:
        with without_patch("WrappedTorchNorm.__new__"):
            model(task["mg_actor_tp2pp1"], True)
        refused = None
    except AssertionError as exc:
        refused = str(exc)
    return out["report_True"], out["report_unmarked"], refused, out["report_fused"]


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    from tests.helpers import word_task

    task = word_task.build(tmp_path_factory.mktemp("sp_task"), layouts=((2, 1),), reward=True)
    return run_distributed(_worker, 2, task)


def test_sequence_parallel_equals_tensor_parallel(sp_runs):
    for rank, (report, _, _, _) in enumerate(sp_runs):
        for kind in ("policy", "value"):
            r = report[kind]
            assert r["reads"] <= TOL and r["grad_norm"] <= TOL and r["weights"] <= TOL, (rank, kind, r)
        for engine in ("static", "continuous"):
            tokens_equal, log_probs = report[f"generate_{engine}"]
            assert tokens_equal and log_probs <= TOL, (rank, engine, report)


def test_the_norms_sequence_parallel_marking_is_needed(sp_runs):
    for rank, (_, unmarked, _, _) in enumerate(sp_runs):
        # forward reads do not depend on it; the step does (the norms' gradients stay partial sums)
        assert unmarked["policy"]["reads"] <= TOL
        assert unmarked["policy"]["weights"] > 1e-4 and unmarked["value"]["weights"] > 1e-4, (rank, unmarked)


def test_megatron_torch_norm_refuses_sequence_parallel_without_the_patch(sp_runs):
    for _, _, refused, _ in sp_runs:
        assert refused is not None and "sequence parallel not supported by torch LayerNorm" in refused


def test_fused_rmsnorm_and_swiglu_equal_megatrons_unfused_path(sp_runs):
    """--use-fused-rmsnorm / --use-fused-swiglu (fp32, the CPU's ops: the same forward, a backward of its own) at TP2
    with SP: reads, grad norm and weights after a step as the plain TP2 model (the fused norms keep the marking)."""
    for rank, (_, _, _, fused) in enumerate(sp_runs):
        for kind in ("policy", "value"):
            r = fused[kind]
            assert r["reads"] <= TOL and r["grad_norm"] <= 1e-5 and r["weights"] <= 1e-5, (rank, kind, r)
        for engine in ("static", "continuous"):
            tokens_equal, log_probs = fused[f"generate_{engine}"]
            assert tokens_equal and log_probs <= TOL, (rank, engine, fused)
