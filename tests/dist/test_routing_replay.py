"""Rollout routing replay (`mindspeed_llm/models/routing.py`): the rollout records each token's top-k experts, the
training forwards route by them.

* a tiny bf16 mixture of experts (in memory, seeded): without replay the training forward routes some response
  tokens differently from the KV-cache rollout; with replay it routes every one of them as the rollout did, in the
  row and the packed layout, and `moe/routing_mismatch` equals a hand count;
* the same forward recorded then replayed gives bit-identical log-probs, and the router keeps its gradient;
* a hand-built routing reaches the routers at exactly the right tokens in both layouts (and the layout map agrees
  with `MicroBatchPlan`'s own tokens);
* the mismatch count against a hand count.
Under activation recompute, replay is tested in `test_recompute.py`.
"""

import pytest
import torch

from mindspeed_llm.models import routing
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.experience import Experience
from tests.helpers.multiproc import run_distributed
from tests.helpers.routing_batches import MOE_SPEC, groups_share_prompts, synthetic_experience

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


# ---------------------------------------------------------------------------------------------- layout maps
@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_token_sources_agree_with_the_plan_tokens(group_size):
    """Every model position the map assigns to (sample, position) holds that sample's token there, every real token
    of a micro-batch is assigned once per row it appears in, and padding is unassigned."""
    n = group_size
    prompts = [L for L in (3, 5) for _ in range(n)] if n > 1 else [3, 6, 2, 4]
    responses = [4, 1, 6, 2, 5, 3][: 2 * n] if n > 1 else [5, 1, 3, 4]
    exp = synthetic_experience(prompts, responses)
    if n > 1:
        groups_share_prompts(exp, n)
    plan = MicroBatchPlan.build(exp, micro_batch_size=len(prompts) if n > 1 else 2, group_size=n)
    assert plan.packed == (n > 1)
    for mb, first in zip(plan.micro_batches(exp), range(0, exp.batch_size, plan.micro_batch_size)):
        sample, position = routing.token_sources(mb)
        known = sample >= 0
        got = exp.tokens[first + sample[known], position[known]]
        assert torch.equal(got, mb["tokens"][known])
        # each sample's response tokens appear exactly once; the prompt once per model row
        for k in range(mb["responses"].shape[0]):
            P, r = int(mb["prompt_lengths"][k]), int(mb["response_mask"][k].sum())
            at = position[sample == k]
            assert sorted(at[at >= P].tolist()) == list(range(P, P + r))
        assert int(known.sum()) == sum(
            int(mb["response_mask"][k].sum()) for k in range(mb["responses"].shape[0])) + sum(
            int(mb["prompt_lengths"][k]) for k in range(0, mb["responses"].shape[0], n))


def test_replay_targets_put_each_token_in_router_order():
    """Router order is sequence-first (token s * rows + r); unknown and padding are -1."""
    exp = synthetic_experience([2, 3], [2, 1])
    L, k = 2, 3
    T = exp.tokens.shape[1]
    code = torch.arange(2 * L * T * k, dtype=torch.int16).view(2, L, T, k)
    code[0, :, 1] = -1  # the rollout did not record sample 0's position 1
    mb = MicroBatchPlan.build(exp, 2).micro_batches(exp)[0]
    mb["routing"] = code
    targets = routing.replay_targets(mb, code)
    assert [t.shape for t in targets] == [(T * 2, k)] * L
    for layer in range(L):
        for s in range(T):
            for r in range(2):
                want = code[r, layer, s] if s < int(exp.prompt_lengths[r] + exp.response_mask[r].sum()) else -1
                assert torch.equal(targets[layer][s * 2 + r], torch.as_tensor(want).expand(k).to(torch.int16))


def test_count_mismatch_against_a_hand_count():
    observed = [torch.tensor([[0, 1], [2, 3], [1, 0], [4, 5]]), torch.tensor([[0, 2], [3, 2], [5, 6], [7, 1]])]
    targets = [torch.tensor([[1, 0], [2, 4], [0, 1], [4, 5]]), torch.tensor([[0, 1], [2, 3], [-1, -1], [7, 0]])]
    scope = torch.tensor([True, True, True, False])
    # layer 0: tokens 0-2 in scope: {0,1}={0,1}, {2,3}!={2,4}, {0,1}={0,1} -> 1 of 3
    # layer 1: token 0 {0,2}!={0,1}, token 1 {2,3}={2,3}, token 2 unknown -> 1 of 2
    assert routing.count_mismatch(observed, targets, scope).tolist() == [2.0, 5.0]


def test_response_scope_is_every_response_token_but_the_last():
    exp = synthetic_experience([2, 3], [3, 1])
    mb = MicroBatchPlan.build(exp, 2).micro_batches(exp)[0]
    scope = routing.response_scope(mb).view(-1, 2).t()  # [rows, S]
    assert scope[0].nonzero().flatten().tolist() == [2, 3]
    assert scope[1].nonzero().flatten().tolist() == []


# ---------------------------------------------------------------------------------------------- with a model
def _forward_routing(model, exp, plan):
    """Each micro-batch's routing in the training forward (router order), via the engine's forward."""
    from mindspeed_llm.rl.update import engine

    seen = []
    with torch.no_grad(), routing.capture_routing(model) as cap:
        for mb in plan.micro_batches(exp):
            engine._model_forward(model, mb)
            seen.append((mb, cap.last()))
            cap.clear()
    return seen


def _hand_mismatch(exp, plan, seen, every_token=False):
    """Mismatched and compared (response token but the last; `every_token`: every recorded token) x layer pairs, by
    walking the samples."""
    mismatched = compared = 0
    start = 0
    for mb, layers in seen:
        sample, position = routing.token_sources(mb)
        rows, S = sample.shape
        for row in range(rows):
            for s in range(S):
                k = int(sample[row, s])
                if k < 0:
                    continue
                b, t = start + k, int(position[row, s])
                P, r = int(exp.prompt_lengths[b]), int(exp.response_mask[b].sum())
                if not (every_token or P <= t < P + r - 1):
                    continue
                for layer, ids in enumerate(layers):
                    want = exp.routing[b, layer, t]
                    if bool((want < 0).any()):
                        continue
                    compared += 1
                    mismatched += set(ids[s * rows + row].tolist()) != set(want.tolist())
        start += mb["responses"].shape[0]
    return mismatched, compared


def _replay_body(rank, world_size, ep, dtype, pp=1, prefill="auto", dispatcher="allgather", attention="sdpa",
                 engine="auto"):
    """Generate with recording, then the old-log-prob pass and direct forwards with and without replay. At PP > 1
    only the pass (megatron's schedule) runs; each stage records and replays its own layers. The DP ranks of EP2
    hold other prompts. `attention`: the models' core attention (build_model's). `engine`: generate's (the bf16
    cases that need live mismatches use the static engine: its left-padded slots round differently from the training
    forward, while the continuous engine, at true positions, routed every token of this tiny model as the training
    forward does)."""
    from megatron.core import parallel_state

    from mindspeed_llm import distributed
    from mindspeed_llm.inference import SamplingConfig, generate
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update.passes import policy_logprobs

    distributed.initialize(1, pp, seed=3, expert_model_parallel_size=ep)
    model = build_model(MOE_SPEC, params_dtype=dtype, moe_token_dispatcher_type=dispatcher, attention=attention)
    out = {}
    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(11 + dp_rank)
    n = 2
    prompts = [torch.randint(1, 120, (int(L),), generator=g).tolist() for L in (5, 9, 3, 7)]
    prompts = [p for p in prompts for _ in range(n)]  # prompt groups of n, as grpo
    sampling = SamplingConfig(do_sample=True, max_new_tokens=12 + 4 * dp_rank, seed=5, temperature=1.0)
    rollout = generate(model, prompts, sampling, record_routing=True, prefill=prefill, engine=engine,
                       sample_ids=[dp_rank * 100 + i for i in range(len(prompts))])
    exp = Experience.from_rollout(rollout)
    out["response_width"] = exp.responses.shape[1]
    if pp > 1:
        out["layers_here"] = exp.routing.shape[1]
        for name, plan in (("rows", MicroBatchPlan.build(exp, 4)), ("packed", MicroBatchPlan.build(exp, 4, n))):
            for replay in (False, True):
                model.config.moe_enable_routing_replay = replay
                _, out[f"{name}_{'replay' if replay else 'live'}_metric"] = policy_logprobs(
                    [model], exp, plan, compare_routing=True)
        return out
    L, T = len(routing.moe_routers(model)), exp.tokens.shape[1]
    out["routing_shape"] = tuple(exp.routing.shape), (len(prompts), L, T, MOE_SPEC.moe_router_topk)
    # every prompt and response token but possibly the last was recorded; padding was not
    total = exp.prompt_lengths + exp.response_lengths
    pos = torch.arange(T)[None, :]
    known = (exp.routing >= 0).all(-1).all(1)  # [B, T]
    out["recorded_all_but_last"] = bool(known[pos < (total - 1)[:, None]].all())
    out["no_padding_recorded"] = not bool(known[pos >= total[:, None]].any())
    for name, plan in (("rows", MicroBatchPlan.build(exp, 4)), ("packed", MicroBatchPlan.build(exp, 4, n))):
        core = model
        core.config.moe_enable_routing_replay = False
        live = _forward_routing(model, exp, plan)
        out[f"{name}_live_hand"] = _hand_mismatch(exp, plan, live)
        out[f"{name}_live_every_token"] = _hand_mismatch(exp, plan, live, every_token=True)
        logp_live, out[f"{name}_live_metric"] = policy_logprobs([model], exp, plan, compare_routing=True)
        core.config.moe_enable_routing_replay = True
        replayed = _forward_routing(model, exp, plan)
        out[f"{name}_replay_hand"] = _hand_mismatch(exp, plan, replayed)
        logp_replay, out[f"{name}_replay_metric"] = policy_logprobs([model], exp, plan, compare_routing=True)
        # the replayed routing is exactly the recorded one wherever it was recorded (prompts included)
        exact = True
        for mb, layers in replayed:
            for ids, want in zip(layers, routing.replay_targets(mb, mb["routing"])):
                rows_known = (want >= 0).all(1)
                exact &= torch.equal(ids[rows_known].long(), want[rows_known].long().sort(dim=1).values)
        out[f"{name}_replay_exact"] = bool(exact)
        mask = exp.response_mask.bool()
        out[f"{name}_logp_vs_rollout"] = (float((logp_live - exp.rollout_logp)[mask].abs().max()),
                                          float((logp_replay - exp.rollout_logp)[mask].abs().max()))
    core.config.moe_enable_routing_replay = False
    return out


@pytest.fixture(scope="module")
def bf16_ep1():
    return run_distributed(_replay_body, 1, 1, "bf16", 1, "auto", "allgather", "sdpa", "static")[0]


def test_rollout_records_every_token(bf16_ep1):
    r = bf16_ep1
    assert r["routing_shape"][0] == r["routing_shape"][1]
    assert r["recorded_all_but_last"] and r["no_padding_recorded"]


@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_replay_routes_as_the_rollout_bf16(bf16_ep1, layout):
    r = bf16_ep1
    mismatched, compared = r[f"{layout}_live_hand"]
    assert compared > 100
    # without replay the bf16 training forward routes some response tokens differently from the rollout ...
    assert mismatched > 0, r
    # ... and the metric of the old-log-prob pass is that hand count
    assert r[f"{layout}_live_metric"] == pytest.approx(mismatched / compared, abs=1e-12)
    # with replay, every response token (and every recorded prompt token) routes as in the rollout
    assert r[f"{layout}_replay_hand"] == (0, compared)
    assert r[f"{layout}_replay_metric"] == 0.0
    assert r[f"{layout}_replay_exact"]


@pytest.mark.parametrize("prefill", ["batched", "stepwise"])
def test_replay_log_probs_match_the_rollout_fp32(prefill):
    """fp32 (no rounding flips at this size): the replayed training forward's log-probs are the rollout's, to
    float rounding of a KV-cache decode against a full forward; both prefill schemes record every token."""
    r = run_distributed(_replay_body, 1, 1, "fp32", 1, prefill)[0]
    for layout in ("rows", "packed"):
        assert r[f"{layout}_replay_hand"][0] == 0 and r[f"{layout}_replay_exact"]
        # at fp32 the training forward routes every recorded token (prompts included) as the rollout recorded it
        mismatched, compared = r[f"{layout}_live_every_token"]
        assert mismatched == 0 and compared > r[f"{layout}_replay_hand"][1], r
        assert r[f"{layout}_logp_vs_rollout"][1] < 1e-5, r


def _routing_from_forward(exp, seen, L, k):
    """The training forward's own routing, mapped back to [B, layers, T, topk] (inverse of replay_targets)."""
    out = torch.full((exp.batch_size, L, exp.tokens.shape[1], k), -1, dtype=torch.int16)
    start = 0
    for mb, layers in seen:
        sample, position = routing.token_sources(mb)
        rows, S = sample.shape
        for layer, ids in enumerate(layers):
            per_pos = ids.view(S, rows, k).transpose(0, 1)  # [rows, S, k]
            known = sample >= 0
            out[start + sample[known], layer, position[known]] = per_pos[known].to(torch.int16)
        start += mb["responses"].shape[0]
    return out


def _exactness_body(rank, world_size, ep):
    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model
    from mindspeed_llm.rl.update import engine

    distributed.initialize(1, 1, seed=4, expert_model_parallel_size=ep)
    model = build_model(MOE_SPEC, params_dtype="bf16", moe_enable_routing_replay=True)
    routers = routing.moe_routers(model)
    L, k, E = len(routers), MOE_SPEC.moe_router_topk, MOE_SPEC.num_experts
    n = 2
    exp = synthetic_experience([4, 4, 6, 6], [5, 2, 3, 7], vocab=120, seed=rank)
    groups_share_prompts(exp, n)
    out = {}
    for name, plan in (("rows", MicroBatchPlan.build(exp, 2)), ("packed", MicroBatchPlan.build(exp, 4, n))):
        exp.routing = None
        live = _forward_routing(model, exp, plan)
        # 1. the forward's own routing, replayed: bit-identical logits and router gradients
        exp.routing = _routing_from_forward(exp, live, L, k)
        results = {}
        for mode in ("live", "replay"):
            model.zero_grad()
            for p in model.parameters():
                p.grad = None
            mbs = plan.micro_batches(exp)
            logits = []
            for mb in mbs:
                if mode == "live":
                    mb.pop("routing")
                with torch.enable_grad():
                    y = engine._model_forward(model, mb)
                    y.float().square().mean().backward()
                logits.append(y.detach())
            results[mode] = (logits, [r.weight.grad.clone() for r in routers])
        out[f"{name}_logits_equal"] = all(torch.equal(a, b) for a, b in zip(results["live"][0], results["replay"][0]))
        out[f"{name}_router_grad_equal"] = all(torch.equal(a, b) for a, b in zip(results["live"][1],
                                                                                  results["replay"][1]))
        out[f"{name}_router_grad_nonzero"] = all(bool(g.abs().sum() > 0) for g in results["replay"][1])
        # 2. an arbitrary routing (not the model's): every router gets exactly those experts at every token
        g = torch.Generator().manual_seed(7)
        forced = torch.rand(exp.batch_size, L, exp.tokens.shape[1], E, generator=g).argsort(-1)[..., :k]
        exp.routing = forced.to(torch.int16)
        seen = _forward_routing(model, exp, plan)
        exact, differs_from_live, start = True, False, 0
        for (mb, layers), (_, live_layers) in zip(seen, live):
            sample, position = routing.token_sources(mb)
            rows, S = sample.shape
            for layer in range(L):
                per_pos = layers[layer].view(S, rows, k).transpose(0, 1)
                known = sample >= 0
                want = forced[start + sample[known], layer, position[known]].sort(dim=1).values
                exact &= torch.equal(per_pos[known].long(), want)
                differs_from_live |= not torch.equal(layers[layer], live_layers[layer])
            start += mb["responses"].shape[0]
        out[f"{name}_forced_exact"] = bool(exact)
        out[f"{name}_forced_differs_from_live"] = differs_from_live
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_replay_is_exact_and_forces_any_routing(ep):
    """Replaying a forward's own routing changes nothing (logits and router gradients bit-identical: the gate
    probabilities are the router's own scores of the replayed experts); an arbitrary routing reaches every router at
    exactly its tokens, in the row and the packed layout; at EP2 on 2 processes as well."""
    for r in run_distributed(_exactness_body, ep, ep):
        for layout in ("rows", "packed"):
            assert r[f"{layout}_logits_equal"] and r[f"{layout}_router_grad_equal"], r
            assert r[f"{layout}_router_grad_nonzero"], r
            assert r[f"{layout}_forced_exact"] and r[f"{layout}_forced_differs_from_live"], r


# ---------------------------------------------------------------------------------------------- the stage flag
def _save_moe_release(rank, world_size, root, vocab):
    from dataclasses import replace

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import megatron_layout as layout
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, seed=2)
    spec = replace(MOE_SPEC, vocab_size=vocab, hidden_size=32, kv_channels=8, ffn_hidden_size=48,
                   moe_ffn_hidden_size=16, max_position_embeddings=128)
    state = {k: v for k, v in build_model(spec).state_dict().items() if v is not None}
    layout.save_file(layout.make_payload(state, spec, 1, 1, 0, 0, torch.float32, False),
                     layout.shard_path(root + "/release", 0, 0, 1))
    layout.write_latest(root, "release")


@pytest.mark.parametrize("stage,replay", [("grpo", True), ("grpo", False), ("trl_ppo", True)],
                         ids=["grpo_replay", "grpo_no_replay", "trl_ppo_replay"])
def test_stage_with_moe_routing_replay(stage_paths, tmp_path, stage, replay):
    """`--moe-routing-replay` end to end: a tiny bf16 Qwen3-MoE actor trains two iterations (old-log-prob pass
    recomputed; trl_ppo with a dense critic), and the logged moe/routing_mismatch is 0 with replay, a fraction in
    [0, 1] without. (This model routed every compared token alike without replay too, 0 of 112 per iteration: that
    replay changes the routing is shown by the tests above, this one checks the flag's wiring.)"""
    import json

    from tests.helpers.multiproc import posttrain_in_process
    from tests.helpers.stage_assets import VOCAB

    ckpt = str(tmp_path / "moe")
    run_distributed(_save_moe_release, 1, ckpt, VOCAB)
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--stage", stage, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
            "--lr", "1e-3", "--seed", "7", "--data-path", stage_paths["data_train"], "--tokenizer-name-or-path",
            stage_paths["tokenizer"], "--max-length", "64", "--max-new-tokens", "8", "--log-interval", "1",
            "--do-sample", "--recompute-old-logprobs", "--bf16", "--metrics-jsonl", str(metrics)]
    if stage == "grpo":
        argv += ["--load", ckpt, "--n-samples-per-prompt", "2", "--verifier-function", "math_acc", "--kl-coef", "0.01",
                 "--ppo-mini-batch-size", "4", "--ppo-epochs", "1"]
    else:
        argv += ["--ref-model", ckpt, "--reward-model", stage_paths["mg_reward_tp1pp1"], "--temperature", "1.0"]
    argv += ["--moe-routing-replay"] if replay else []
    # posttrain_gpt.main on the warm world-size-1 rank (what torchrun --nproc_per_node=1 runs, without the launch)
    ((code, stdout, stderr),) = posttrain_in_process([argv])
    assert code == 0, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        value = row["moe/routing_mismatch"]
        assert value == 0.0 if replay else 0.0 <= value <= 1.0, row
        assert all(v == v for v in row.values() if isinstance(v, float)), row  # no NaN


def test_mismatch_metric_sums_over_dp_ranks_at_ep2():
    """EP2 on 2 processes (all-to-all dispatcher), the DP ranks with other prompts and response budgets (12 and 16
    tokens: the ranks decode in lock-step until both are done): each rank's rollout has its own lengths, replay is
    exact on both, and the metric is the two ranks' hand counts pooled."""
    results = run_distributed(_replay_body, 2, 2, "bf16", 1, "auto", "alltoall")
    assert [r["response_width"] for r in results] == [12, 16]
    for layout in ("rows", "packed"):
        mismatched = sum(r[f"{layout}_live_hand"][0] for r in results)
        compared = sum(r[f"{layout}_live_hand"][1] for r in results)
        assert results[0][f"{layout}_live_hand"] != results[1][f"{layout}_live_hand"]  # the ranks' data differ
        for r in results:
            assert r[f"{layout}_live_metric"] == pytest.approx(mismatched / compared, abs=1e-12)
            assert r[f"{layout}_replay_metric"] == 0.0 and r[f"{layout}_replay_exact"]


def test_each_pipeline_stage_replays_its_own_layers():
    """PP2: every stage records its one MoE layer; the pass replays on both (0) and all ranks log the same value.
    Megatron's local attention and static engine: its bf16 probabilities and left-padded slots make the decode step
    and the training forward differ in their last bits, so some routing flips without replay (with the fused
    attention or the continuous engine this tiny case flips none)."""
    results = run_distributed(_replay_body, 2, 1, "bf16", 2, "auto", "allgather", "local", "static")
    assert [r["layers_here"] for r in results] == [1, 1]
    for layout in ("rows", "packed"):
        assert results[0][f"{layout}_live_metric"] == results[1][f"{layout}_live_metric"]
        assert results[0][f"{layout}_live_metric"] > 0, results  # bf16 flips some routing without replay
        assert results[0][f"{layout}_replay_metric"] == results[1][f"{layout}_replay_metric"] == 0.0


def _allgather_uneven_body(rank, world_size):
    from mindspeed_llm import distributed
    from mindspeed_llm.inference import SamplingConfig, generate
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, seed=3, expert_model_parallel_size=2)
    model = build_model(MOE_SPEC, moe_token_dispatcher_type="allgather")
    prompts = [[5, 6, 7], [8, 9] + [3] * (2 * rank)]  # rank 1's longest prompt is longer: another prefill size
    try:
        generate(model, prompts, SamplingConfig(max_new_tokens=2))
    except ValueError as exc:
        return str(exc)
    return None


def test_allgather_dispatcher_refuses_uneven_expert_parallel_rollouts():
    """At EP2 the all-gather dispatcher needs equal token counts: uneven prompt widths are refused on both ranks,
    naming the flag, instead of a hang or a gloo error."""
    for message in run_distributed(_allgather_uneven_body, 2):
        assert message is not None and "--moe-token-dispatcher-type alltoall" in message, message
        assert "prefill tokens 6..8" in message, message


def test_dynamic_sampling_concat_pads_routing_as_unknown():
    """grpo's refill joins rows of generation batches of other widths: the routing is padded with -1 (unknown)
    along the positions and cut to the joined sequence width, each row's recorded values kept."""
    from mindspeed_llm.rl.experience import Experience

    short, wide = synthetic_experience([2, 2], [1, 2]), synthetic_experience([3, 3], [4, 1])
    for exp, fill in ((short, 5), (wide, 9)):
        T = exp.tokens.shape[1]
        exp.routing = torch.full((2, 2, T, 3), fill, dtype=torch.int16)
        exp.routing[:, :, T - 1] = -1
        exp.routing_recorded = True  # the generating policy's routing: the old-log-prob pass still compares
    parts = [short.select(torch.tensor([1]), device="cpu"), wide.select(torch.tensor([0]), device="cpu")]
    joined = Experience.concat(parts, "cpu")
    assert joined.routing_recorded
    single = synthetic_experience([2], [1]).select(torch.tensor([0]), device="cpu")
    assert not Experience.concat([single], "cpu").routing_recorded
    T = joined.tokens.shape[1]
    assert T == 7 and joined.routing.shape == (2, 2, T, 3)
    assert torch.equal(joined.routing[0, :, :3], short.routing[1, :, :3])
    assert bool((joined.routing[0, :, 4:] == -1).all()) and bool((joined.routing[0, :, 3] == -1).all())
    assert torch.equal(joined.routing[1], wide.routing[0])
