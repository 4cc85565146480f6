"""Packed prompt groups and the logits window (`rl/update/batch_plan.py`, `models/forward_layout.py`) compute what the
plain per-sample layout computes.

A grpo-like Experience (4 prompts of different lengths x 4 samples with ragged responses, one of them empty and
one at the full width) is read four ways on a tiny Qwen2 converted from Hugging Face:

* plain: one row per sample, outputs for every position (`logits_from` forced to 0, megatron's own forward);
* windowed: one row per sample, outputs only from the micro-batch's first response-predicting position;
* packed: one row per prompt `[prompt | r1 | r2 | r3 | r4]` with the group attention mask and RoPE positions;
* packed with the micro-batch of a single group.

Compared: response log-probs (policy), critic values and reward scores (value head), at TP=1, TP=2 and PP=2
through the real passes (`rl/update/passes.py`, megatron's schedule), and the gradients of a log-prob loss (TP=1, TP=2).
The plain layout itself equals `transformers` (tests/dist/test_models_parity.py), so this is parity by transitivity.
"""

import os

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

N = 4
PROMPT_LENGTHS = (5, 9, 3, 6)
RESPONSE_LENGTHS = ((3, 7, 1, 7), (2, 2, 5, 0), (6, 4, 4, 1), (7, 2, 3, 5))  # width 7; group 1 has an empty response
VOCAB = 256


def _experience():
    from mindspeed_llm.inference.results import Rollout
    from mindspeed_llm.rl.experience import Experience

    g = torch.Generator().manual_seed(0)
    width, prompt_width = max(map(max, RESPONSE_LENGTHS)), max(PROMPT_LENGTHS)
    prompts, responses, lengths, plens = [], [], [], []
    for P, group in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS):
        prompt = torch.randint(4, VOCAB, (P,), generator=g)
        for r in group:
            row = torch.zeros(prompt_width, dtype=torch.long)
            row[:P] = prompt
            prompts.append(row)
            resp = torch.zeros(width, dtype=torch.long)
            resp[:r] = torch.randint(4, VOCAB, (r,), generator=g)
            responses.append(resp)
            lengths.append(r)
            plens.append(P)
    lengths = torch.tensor(lengths)
    rollout = Rollout(
        prompts=torch.stack(prompts), prompt_lengths=torch.tensor(plens), responses=torch.stack(responses),
        response_mask=(torch.arange(width)[None] < lengths[:, None]).long(), response_lengths=lengths,
        ended_with_eos=torch.zeros(len(lengths), dtype=torch.bool), finish_reasons=["length"] * len(lengths),
        log_probs=None, pad_token_id=0,
    )
    return Experience.from_rollout(rollout)


def _worker(rank, world_size, tp, pp, roots):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import batch_plan, passes
    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
    from mindspeed_llm.rl.update.engine import _model_forward

    distributed.initialize(tp, pp, rank=rank, world_size=world_size)

    def load(root, value_head):
        model = build_model(load_spec(root), value_head=value_head)
        load_megatron_weights(model, root)
        return model

    policy, value = load(roots["policy"], False), load(roots["value"], True)
    exp = _experience()
    plans = {"plain": MicroBatchPlan.build(exp, 8), "packed": MicroBatchPlan.build(exp, 8, group_size=N),
             "packed_mb4": MicroBatchPlan.build(exp, 4, group_size=N)}
    assert plans["packed"].packed and plans["packed_mb4"].packed and not plans["plain"].packed
    assert not MicroBatchPlan.build(exp, 2, group_size=N).packed  # a micro-batch of half a group: rows

    def unwindowed(plan):
        mbs_list = plan.micro_batches(exp)
        for mb in mbs_list:
            mb["logits_from"] = torch.zeros((), dtype=torch.long)
        return mbs_list

    out = {}
    layouts = {"plain": ("plain", True), "windowed": ("plain", False), "packed": ("packed", False),
               "packed_mb4": ("packed_mb4", False)}
    width = exp.responses.shape[1]
    for name, (plan_name, no_window) in layouts.items():
        plan = plans[plan_name]
        batches = unwindowed(plan) if no_window else plan.micro_batches(exp)
        logp = passes.forward_only(
            [policy], batches, lambda o, mb: passes.response_logprobs(o, mb) * mb["response_mask"], (width,))
        values = passes.forward_only(
            [value], batches, lambda o, mb: passes.response_values(o, mb) * mb["response_mask"], (width,))
        scores = passes.forward_only([value], batches,
                                     lambda o, mb: batch_plan.gather_last_token(o, mb).reshape(-1), ())
        out[name] = {"logp": logp, "values": values, "scores": scores}
        if no_window and name == "plain":
            out["rows_logits_from"] = [int(mb["logits_from"]) for mb in plan.micro_batches(exp)]
        if name == "packed":
            out["packed_rows"] = [tuple(mb["tokens"].shape) for mb in batches]
        if pp == 1:  # gradients of sum(logp * mask) through the layout
            policy.zero_grad(set_to_none=True)
            for mb in batches:
                logits = _model_forward(policy, mb)
                (passes.response_logprobs(logits, mb) * mb["response_mask"]).sum().backward()
            out[name]["grads"] = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.helpers.hf_tiny import save_tiny

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    root = tmp_path_factory.mktemp("packed")
    policy = save_tiny("qwen2", root / "hf_policy", seed=1, vocab_size=VOCAB)
    value = save_tiny("qwen2", root / "hf_value", seq_cls=True, seed=2, vocab_size=VOCAB)
    roots = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        for name, hf, orm in (("policy", policy, False), ("value", value, True)):
            dst = root / f"{name}_tp{tp}pp{pp}"
            convert_hf_to_mg(hf, str(dst), tp, pp, value_head=orm, progress=False)
            roots[(tp, pp, name)] = str(dst)
    return roots


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_packed_groups_and_window_equal_plain_rows(converted, tp, pp):
    roots = {"policy": converted[(tp, pp, "policy")], "value": converted[(tp, pp, "value")]}
    world = tp * pp
    results = run_distributed(_worker, world, tp, pp, roots)
    res = results[0]
    # The layouts really differ: the window starts past 0, packing makes one row per prompt.
    assert res["rows_logits_from"] == [min(PROMPT_LENGTHS[:2]) - 1, min(PROMPT_LENGTHS[2:]) - 1]
    longest = [P + N * max(max(g), 1) for P, g in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    # each micro-batch (two groups) at its own longest row
    assert res["packed_rows"] == [(2, max(longest[:2])), (2, max(longest[2:]))]
    mask = _experience().response_mask.bool()
    ref = res["plain"]
    assert ref["logp"][mask].abs().min() > 0  # real log-probs, not zeros
    for name in ("windowed", "packed", "packed_mb4"):
        for key in ("logp", "values", "scores"):
            diff = (res[name][key] - ref[key]).abs().max().item()
            assert diff < 2e-5, f"{name} {key}: max diff {diff}"
        if pp == 1:
            for rank_result in results:
                for param, grad in rank_result["plain"]["grads"].items():
                    other = rank_result[name]["grads"][param]
                    scale = grad.abs().max().item()
                    assert scale > 0, param
                    assert (other - grad).abs().max().item() <= 1e-4 * scale + 1e-7, f"{name} grad {param}"
