"""LoRA under `--sequence-parallel` (issue 35): the adapters compute what they compute without it.

Under megatron's sequence parallelism a column-parallel linear's input is this TP rank's shard of the sequence (the
linear all-gathers it), a row-parallel linear's output is reduce-scattered to the shard. The adapter of a column
linear gathers the sequence too, the adapter of a row linear reduce-scatters its rank-r product A x before B; a row
adapter's B then sees this rank's positions only and is marked `sequence_parallel`, so that megatron's
finalize_model_grads sums its gradient over TP (`models/lora.py`).

One 2-process gloo run, a tiny Qwen2 (fp32) with random non-zero adapters on linear_qkv, linear_proj, linear_fc1 and
linear_fc2, the same at every layout:

* logits and the gradient of a fixed linear function of them w.r.t. every adapter tensor (merged over TP, the
  marked gradients summed as finalize_model_grads sums them) at TP2 + SP against TP2 and TP1 (run as DP2), within
  test_lora.py's tolerances (1e-5 absolute on logits, 1e-4 of the norm on gradients); the replicated tensors'
  gradients the same on both TP ranks;
* --lora-dropout 0.1 in train mode at TP2 + SP: the replicated tensors' gradients the same on both TP ranks (one
  mask of a column adapter's whole input on every rank: dropped on the shard, then gathered);
* one SGD step through `LoRATrainableModel.train_step` (megatron's DDP and finalize_model_grads): the adapters after
  the step at TP2 + SP equal TP2's within 1e-6 of their norm; with the B marks removed they do not (the mark is
  needed);
* a Qwen2-MoE (shared expert, routed experts) at TP2 + SP x EP2 with expert TP 1, train mode, against TP1:
  logits and every adapter gradient, the routed experts' included; at expert TP 2 adapters on routed experts are
  refused by name.

peft parity at TP2 + SP is in test_lora.py (its tp2_sp layout), a whole LoRA stage run at TP2 + SP against TP1 in
test_stages_lora.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers.hf_tiny import save_tiny
from tests.helpers.lora_adapters import adapter_grads, randomise_b
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TOL, GRAD_TOL, STEP_TOL = 1e-5, 1e-4, 1e-6
R, ALPHA = 4, 8
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
BATCH, SEQ, VOCAB = 2, 10, 128
# layout -> (tp, sequence parallel, ep)
LAYOUTS = {"tp1": (1, False, 1), "tp2": (2, False, 1), "tp2_sp": (2, True, 1)}
# the MoE reference runs every expert on each rank (TP1 x EP1: DP2, each rank its own copy of the batch); at TP1 x
# EP2 an expert would get the tokens of both data-parallel copies, twice the gradient
MOE_LAYOUTS = {"moe_tp1": (1, False, 1), "moe_tp2_sp": (2, True, 2)}


def _lora_model(root, sp, dropout=0.0):
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model, lora

    model = build_model(load_spec(root), sequence_parallel=sp)
    load_megatron_weights(model, root)
    lora.apply_lora(model, lora.LoRAConfig(r=R, alpha=ALPHA, dropout=dropout, target_modules=TARGETS), seed=3)
    randomise_b(model, seed=5)
    return model


def _forward_backward(model, ids, weights, tp):
    """Full logits; backward of sum(logits * weights) (each TP rank its vocabulary slice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    out = model(ids, torch.arange(s).unsqueeze(0).expand(b, s), None)
    width = out.shape[-1]
    rank = ps.get_tensor_model_parallel_rank()
    (out * weights[..., rank * width:(rank + 1) * width]).sum().backward()
    out = out.detach().contiguous()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out


def _experience():
    from mindspeed_llm.rl.experience import Experience

    g = torch.Generator().manual_seed(0)
    rows, prompt, response = 4, 5, 8  # 13 positions: the SP forward pads to 14
    tokens = torch.randint(4, VOCAB, (rows, prompt + response), generator=g)
    exp = Experience(tokens=tokens, position_ids=torch.arange(prompt + response).expand(rows, -1).clone(),
                     prompt_lengths=torch.full((rows,), prompt), responses=tokens[:, prompt:].clone(),
                     response_mask=torch.ones(rows, response), ended_with_eos=torch.ones(rows, dtype=torch.bool))
    exp.advantages = torch.randn(rows, response, generator=g)
    return exp


def _one_step(model, root, unmark=False):
    """The adapters (merged over TP) before and after one SGD step of a policy loss, and the step's grad norm."""
    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.lora import LoRATrainableModel
    from mindspeed_llm.rl.update.passes import response_logprobs

    from mindspeed_llm.models import lora

    if unmark:  # the row adapters' B: finalize_model_grads then leaves their gradients partial
        for adapter in lora.adapters(model).values():
            if hasattr(adapter.B, "sequence_parallel"):
                del adapter.B.sequence_parallel

    def loss_fn(output, mb):
        loss = -(response_logprobs(output, mb) * mb["advantages"]).sum() / 32
        return loss, {"loss": loss.detach()}

    trained = LoRATrainableModel(model, OptimizerSettings(lr=0.5, optimizer="sgd", sgd_momentum=0.0, clip_grad=0.0),
                                 name="actor", base=root)
    exp = _experience()
    initial = _merged_adapters(model)
    metrics = trained.train_step(MicroBatchPlan.build(exp, 2).micro_batches(exp, update=True), loss_fn)
    return initial, _merged_adapters(model), metrics["grad_norm"]


def _merged_adapters(model):
    import torch.distributed as dist

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.models import lora

    out = {}
    for name, (a, b) in lora.adapter_tensors(model).items():
        adapter = next(m for m in lora.adapters(model).values() if m.A is a)
        parts = [(a.detach().clone(), b.detach().clone())]
        if adapter.tp_size > 1:
            gathered = []
            for t in (a.detach().contiguous(), b.detach().contiguous()):
                pieces = [torch.empty_like(t) for _ in range(adapter.tp_size)]
                dist.all_gather(pieces, t, group=adapter.tp_group)
                gathered.append(pieces)
            parts = list(zip(*gathered))
        out[name] = lora_files.merge_ranks(name, parts)
    return out


def _worker(rank, world_size, task):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed

    ids, weights = task["ids"], task["weights"]
    results = {}
    for layout, (tp, sp, ep) in {**LAYOUTS, **MOE_LAYOUTS}.items():
        moe = layout in MOE_LAYOUTS
        distributed.initialize(tp, 1, rank=rank, world_size=world_size, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=1 if moe else None)
        root = task["moe" if moe else "dense"][tp]
        model = _lora_model(root, sp)
        if moe:
            model.train()  # megatron-core's MoE layer trains at TP > 1 only under sequence parallelism
        else:
            model.eval()
        out = _forward_backward(model, ids, weights, tp)
        grads, same = adapter_grads(model)
        results[layout] = dict(out=out, grads=grads, same=same)
        if not moe and tp > 1:  # dropout in train mode; one optimizer step, and one without the B marks
            model = _lora_model(root, sp, dropout=0.1).train()
            out = _forward_backward(model, ids, weights, tp)
            results[layout]["dropout"] = (out, *adapter_grads(model))
            results[layout]["step"] = _one_step(_lora_model(root, sp), root)
            if sp:
                results[layout]["step_unmarked"] = _one_step(_lora_model(root, sp), root, unmark=True)
        ps.destroy_model_parallel()
    # routed experts at expert TP 2 (the default: TP): refused by name
    distributed.initialize(2, 1, rank=rank, world_size=world_size)
    from mindspeed_llm.checkpoint import load_spec
    from mindspeed_llm.models import build_model, lora

    try:
        lora.apply_lora(build_model(load_spec(task["moe"][2]), sequence_parallel=True),
                        lora.LoRAConfig(r=R, alpha=ALPHA, target_modules=TARGETS))
        results["expert_tp2"] = None
    except ValueError as exc:
        results["expert_tp2"] = str(exc)
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    base = tmp_path_factory.mktemp("lora_sp")
    dense = save_tiny("qwen2", base / "hf", seed=21, vocab_size=VOCAB, num_layers=2)
    moe = save_tiny("qwen2_moe", base / "hf_moe", seed=22, vocab_size=VOCAB)
    task = {"dense": {}, "moe": {}, "ids": torch.randint(3, VOCAB, (BATCH, SEQ),
                                                          generator=torch.Generator().manual_seed(1)),
            "weights": torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(2))}
    for tp in (1, 2):
        task["dense"][tp] = str(base / f"mg_tp{tp}")
        convert_hf_to_mg(dense, task["dense"][tp], tp, 1, progress=False)
        task["moe"][tp] = str(base / f"mg_moe_tp{tp}")
        convert_hf_to_mg(moe, task["moe"][tp], tp, 1, progress=False, ep=tp, etp=1)
    return run_distributed(_worker, 2, task)


def _grad_diff(got, ref):
    """The largest gradient difference relative to the reference's norm, over every adapter tensor."""
    assert sorted(got) == sorted(ref)
    return max(float((g - r).norm() / r.norm()) for name in ref for g, r in zip(got[name], ref[name]))


def _both_ranks(runs, layout, what):
    merged = {}
    for result in runs:
        merged.update(result[layout][what])
    return merged


@pytest.mark.parametrize("reference", ["tp2", "tp1"])
def test_lora_sequence_parallel_equals_tensor_parallel(runs, reference):
    for rank, result in enumerate(runs):
        got, ref = result["tp2_sp"], result[reference]
        out = (got["out"] - ref["out"]).abs().max().item()
        grad = _grad_diff(got["grads"], ref["grads"])
        print(f"rank {rank} tp2_sp vs {reference}: max |logits diff| {out:.2e}, gradients {grad:.2e} of their norm")
        assert out <= TOL and grad <= GRAD_TOL, (rank, out, grad)
        assert got["same"] and all(got["same"].values()), got["same"]


def test_lora_dropout_under_sequence_parallel(runs):
    """Megatron draws its dropouts under SP from the per-rank model-parallel RNG (other masks than without SP), so
    the check is consistency: the replicated A (column) and B (row) get the same gradient on both TP ranks, which
    needs one mask of the column adapters' whole input on every rank."""
    for result in runs:
        out, grads, same = result["tp2_sp"]["dropout"]
        assert (out - result["tp2_sp"]["out"]).abs().max() > 1e-3  # the dropout acts
        assert same and all(same.values()), same
        ref_out, ref_grads, ref_same = result["tp2"]["dropout"]
        assert ref_same and all(ref_same.values()), ref_same
        print(f"dropout 0.1: tp2_sp vs tp2 (other masks) logits {(out - ref_out).abs().max():.2e}; replicated "
              f"gradients equal on both TP ranks")


def test_one_step_and_the_b_mark_is_needed(runs):
    for result in runs:
        (initial, got, norm), (_, ref, ref_norm) = result["tp2_sp"]["step"], result["tp2"]["step"]
        unmarked = result["tp2_sp"]["step_unmarked"][1]
        worst = max(float((got[n][i] - ref[n][i]).norm() / ref[n][i].norm()) for n in ref for i in (0, 1))
        change = max(float((unmarked[n][1] - ref[n][1]).norm() / (ref[n][1] - initial[n][1]).norm())
                     for n in ref if n.endswith(("linear_proj", "linear_fc2")))
        print(f"one step, tp2_sp vs tp2: adapters {worst:.2e}, grad norm {abs(norm - ref_norm):.2e}; unmarked: the "
              f"row adapters' B change off by {change:.2e} of it")
        assert worst <= STEP_TOL and abs(norm - ref_norm) <= STEP_TOL * ref_norm
        assert change > 0.1


def test_moe_lora_sequence_parallel_equals_tp1(runs):
    out = max((r["moe_tp2_sp"]["out"] - r["moe_tp1"]["out"]).abs().max().item() for r in runs)
    got, ref = _both_ranks(runs, "moe_tp2_sp", "grads"), _both_ranks(runs, "moe_tp1", "grads")
    assert any(".local_experts." in n for n in ref) and any("shared_experts" in n for n in ref), sorted(ref)
    grad = _grad_diff(got, ref)
    print(f"MoE tp2_sp x ep2 vs tp1: max |logits diff| {out:.2e}, gradients {grad:.2e} of their norm")
    assert out <= TOL and grad <= GRAD_TOL


def test_routed_expert_adapters_at_expert_tp2_are_refused(runs):
    for result in runs:
        assert "needs expert tensor parallelism 1 (--expert-tensor-parallel-size 1" in result["expert_tp2"]
