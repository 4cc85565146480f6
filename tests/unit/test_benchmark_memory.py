"""benchmarks/memory.py: the projection, the model-state table and the micro-batch padding analysis against hand
computations, and the token-budget analysis against the real `MicroBatchPlan`. The benchmark itself at a toy size:
tests/dist/test_benchmark_memory_dist.py."""

import os
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import step_memory as memory  # noqa: E402

TINY = memory.Shape(hidden=8, ffn=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=32, qkv_bias=False)
PARAMS = 1704  # see test_projection_of_a_tiny_launch_equals_a_hand_computation


def _tiny_launch(stage="grpo", **overrides):
    roles = [memory.Role("actor", TINY, True, False, False), memory.Role("reference", TINY, False, False, True)]
    if stage == "trl_ppo":
        roles.append(memory.Role("critic", TINY, True, True, False))
    fields = dict(name="tiny", stage=stage, world=2, tp=1, pp=1, ep=1, dp=2, expert_dp=2, micro_batch_size=1,
                  global_batch_size=2, n_samples=2, prompt_cap=6, response_cap=4, max_length=10, mini_batch=4,
                  roles=roles)
    fields.update(overrides)
    return memory.Launch(**fields)


# Coefficients chosen by hand: 10 B per hidden unit per token per layer saved, a layer's backward working set of
# 1 B per token per hidden unit, the head's saved logits 2 B per read logit, its backward 1 B per read logit (+ the
# log-prob work buffer), a no-grad forward's working set 2 B per token per hidden unit; the same for both attentions.
HAND_COEF = {
    "saved.none.norms": {"h": 10.0},
    "working_set.train": {"tokens*h": 1.0},
    "working_set.forward": {"tokens*h": 2.0},
    "head_saved": {"read*V": 2.0},
    "head_backward.train": {"read*V": 1.0},
    "head_forward.train": {},
    "head_forward.forward": {},
}
COEFS = {"sdpa": HAND_COEF, "local": HAND_COEF}
RULE = memory.StateBytes.rule()


def test_projection_of_a_tiny_launch_equals_a_hand_computation():
    launch = _tiny_launch()
    p = memory.project(launch, COEFS, memory.Levers(attention="local", distributed_optimizer=True), RULE)
    phases = p["stages"][0]["phases"]
    # parameters: a layer has q, k, v, o = 8x8 + 8x4 + 8x4 + 8x8 = 192, two norms 16, fc1 + fc2 = 3 x 8 x 16 = 384;
    # embedding and output layer 32 x 8 each, the final norm 8: 2 x 592 + 256 + 256 + 8 = 1704
    assert memory.param_counts(TINY)["total"] == PARAMS
    # the actor: 2 (bf16) + 4 (fp32 grads) + 12 / DP (main weights and Adam, distributed over DP 2); the reference 2
    states = PARAMS * (6 + 12 / 2) + PARAMS * 2
    assert phases["train"]["states"] == states
    # one micro-batch of one row at the cap, 6 + 4 = 10 tokens: 2 layers x 10 tokens x 80 B; shared: the rotary
    # table 10 x 4 x 4 B, the local attention's causal mask 10 x 10 B, the token ids 10 x 8 B; the head's logits
    # 4 read x 32 x 2 B
    saved = 2 * 10 * 80 + (160 + 100 + 80) + 4 * 32 * 2
    assert phases["train"]["activations_in_flight"] == saved
    # transient: the head's backward 4 x 32 x 1 B + the log-prob work buffer 2 x 4 rows x 32 x 4 B, more than a
    # layer's 10 x 8 B; the global buffer [1 x 2 heads, 10, 10] bf16 (the prefill's [1 x 2, 6, 6] is smaller)
    transient = 4 * 32 + 2 * 4 * 32 * 4
    assert phases["train"]["working_set"] == transient
    assert phases["train"]["global_buffer"] == 2 * 10 * 10 * 2
    assert p["train"] == states + saved + transient + 400
    # the fused attention: no mask, no global buffer
    sdpa = memory.project(launch, COEFS, memory.Levers(distributed_optimizer=True), RULE)["stages"][0]["phases"]
    assert sdpa["train"]["activations_in_flight"] == saved - 100 and sdpa["train"]["global_buffer"] == 0
    # the rollout: 2 x 2 / DP 2 = 2 rows, KV cache 2 (K, V) x 2 layers x 10 slots x 2 rows x 1 kv head x 4 x 2 B;
    # with 1 row in flight (--rollout-max-num-seqs 1) half of it
    assert phases["rollout"]["kv_cache"] == 2 * 2 * 10 * 2 * 1 * 4 * 2
    one_row = memory.project(launch, COEFS, memory.Levers(rollout_max_num_seqs=1), RULE)
    assert one_row["stages"][0]["phases"]["rollout"]["kv_cache"] == 2 * 2 * 10 * 1 * 1 * 4 * 2
    # recompute full: each layer keeps nothing of its own in these coefficients (no saved.full entry)
    assert memory.project(launch, COEFS, memory.Levers(attention="local", recompute="full"), RULE)["stages"][0][
        "phases"]["train"]["activations_in_flight"] == (160 + 100 + 80) + 4 * 32 * 2
    # a token budget of 20 tokens: 2 rows of the cap, every token read (an upper bound)
    budget = memory.project(launch, COEFS, memory.Levers(micro_batch_tokens=20), RULE)["stages"][0]
    assert budget["micro_batch"] == dict(rows=2.0, length=10, read=20.0)
    assert budget["phases"]["train"]["activations_in_flight"] == 2 * 20 * 80 + 2 * (160 + 80) + 20 * 32 * 2
    # --offload-ref-reward: the reference leaves the update's device memory
    offloaded = memory.project(launch, COEFS, memory.Levers(distributed_optimizer=True, offload_ref_reward=True), RULE)
    assert offloaded["stages"][0]["phases"]["train"]["states"] == PARAMS * (6 + 12 / 2)


def test_offload_flags_and_the_distributed_optimizer_in_each_phase():
    launch = _tiny_launch("trl_ppo")
    states = memory.model_states(launch, memory.Levers(offload_param=True), RULE, 0)
    critic = PARAMS - 32 * 8 + 8  # a value head (h weights) instead of the output layer
    assert memory.param_counts(TINY, value_head=True)["total"] == critic
    # --offload-train-param: the actor's fp32 main weights (4 B) and the critic's main weights and weights (6 B) are
    # in host memory during the rollout; the critic's weights come back for its values pass and stay for the actor's
    # update; each role holds all of it in its own update
    assert states["rollout"] == dict(actor=14 * PARAMS, reference=2 * PARAMS, critic=12 * critic)
    assert states["passes"]["critic"] == states["update.actor"]["critic"] == 14 * critic
    assert states["update.actor"]["actor"] == 18 * PARAMS and states["update.critic"]["critic"] == 18 * critic
    assert states["update.critic"]["actor"] == 14 * PARAMS
    everything = memory.Levers(offload_optimizer=True, offload_grad=True, offload_param=True, offload_ref_reward=True)
    states = memory.model_states(launch, everything, RULE, 0)
    assert states["rollout"] == dict(actor=2 * PARAMS, reference=0.0, critic=0.0)
    assert states["passes"]["on-loaded for its pass"] == 2 * PARAMS  # the reference, for its own pass only
    # the distributed optimizer: main weights and moments over DP 2; a measured table with a part left behind
    table = memory.StateBytes(plain=dict(memory.RULE_BYTES), distributed=dict(weights=2.0, grads=4.0, masters=4.0,
                                                                               moments=8.0),
                              sharded=dict(weights=False, grads=False, masters=True, moments=True),
                              left={"actor": {"moments": 0.25}}, frozen=2.0, source="hand")
    states = memory.model_states(launch, memory.Levers(distributed_optimizer=True, offload_optimizer=True), table, 0)
    assert states["rollout"]["actor"] == PARAMS * (2 + 4 + 2 + 0.25 * 4)
    assert states["update.actor"]["actor"] == PARAMS * (2 + 4 + 2 + 4)


def test_the_model_state_table_is_read_from_the_measurements():
    per_part = dict(weights=2.0, grads=4.0, masters=4.0, moments=8.0)
    data = {"model_state": dict(bytes_per_param=dict(per_part, total=18.0), frozen_bytes_per_param=2.0, offloaded={
        "actor: all": dict(role="actor", parts=["moments", "grads"],
                           on_device_during_rollout=dict(per_part, moments=0.0, grads=1.0), after_onload=per_part)}),
        "tp2": {"model_state": {"distributed_optimizer_dp2": dict(
            data_parallel=2, bytes_per_param=dict(weights=2.01, grads=4.01, masters=2.0, moments=4.0))}}}
    table = memory.StateBytes.measured(data)
    assert table.sharded == dict(weights=False, grads=False, masters=True, moments=True)
    assert table.per_param("masters", True, 8) == 0.5 and table.per_param("weights", True, 8) == 2.01
    assert table.per_param("moments", False, 8) == 8.0
    assert table.left == {"actor": {"moments": 0.0, "grads": 0.25}}
    assert memory.StateBytes.measured({}).source.startswith("DP1 by megatron's rule")


def test_pipeline_stage_zero_holds_pp_micro_batches():
    launch = _tiny_launch(pp=2, dp=1, world=2, mini_batch=4)
    p = memory.project(launch, COEFS, memory.Levers(attention="local"), RULE)
    first, last = p["stages"][0]["phases"]["train"], p["stages"][1]["phases"]["train"]
    assert first["in_flight"] == 2 and last["in_flight"] == 1
    # stage 0: one layer and the embedding; 2 micro-batches of 10 tokens x 80 B + shared
    assert first["activations_in_flight"] == 2 * (10 * 80 + 340)


def test_sequence_parallel_divides_the_hidden_sized_part_and_cp2_halves_a_ranks_tokens():
    launch = _tiny_launch(tp=2, world=4, dp=2)
    dist = dict(attention="sdpa", distributed_optimizer=True)

    def train(levers):
        p = memory.project(launch, COEFS, memory.Levers(**dist, **levers), RULE)
        return p, p["stages"][0]["phases"]["train"]

    p0, t0 = train({})
    psp, tsp = train(dict(sequence_parallel=True))
    # the hand coefficients' only saved per-layer term is hidden-sized (10 B x h): replicated over TP 2 without SP,
    # divided with it; 2 layers x 10 tokens (one row at the cap); shared bytes and the head's read logits unchanged
    assert memory.predict_layer_saved(HAND_COEF, TINY, "none", 10, tp=2)["norms"] == 80
    assert memory.predict_layer_saved(HAND_COEF, TINY, "none", 10, tp=2, sp=True)["norms"] == 40
    assert t0["activations_in_flight"] - tsp["activations_in_flight"] == 2 * 10 * 40
    assert psp["rollout"] == p0["rollout"]  # generation runs without SP
    # CP 2 at the same world: DP 2 -> 1; every saved term is linear in a rank's tokens, which halve, plus each
    # layer's all-gathered keys and values of the whole row (10 positions x 2 x kv heads / TP 1 x 4 x 2 B)
    pcp, tcp = train(dict(context_parallel=2))
    assert pcp["layout"]["dp"] == 1 and pcp["layout"]["cp"] == 2 and pcp["layout"]["world"] == 4
    gathered = pcp["stages"][0]["kv_gathered"]
    assert gathered == dict(per_layer=10 * 2 * 4 * 2, kept_layers=2)
    assert tcp["activations_in_flight"] - 2 * gathered["per_layer"] == t0["activations_in_flight"] / 2
    # the distributed optimizer shards over DP x CP (2 either way), and the rollout's rows a rank are dealt over it
    assert tcp["states"] == t0["states"] and pcp["stages"][0]["rollout_rows"] == p0["stages"][0]["rollout_rows"]
    # full recompute keeps the layer input only: the gather is redone in the backward, nothing gathered is kept
    assert train(dict(context_parallel=2, recompute="full"))[0]["stages"][0]["kv_gathered"]["kept_layers"] == 0
    # at DP 1 already, CP 2 needs twice the devices; the rows a rank halve and the dist-opt state shards over CP
    one = _tiny_launch(tp=2, world=2, dp=1)
    alone = memory.project(one, COEFS, memory.Levers(**dist), RULE)
    doubled = memory.project(one, COEFS, memory.Levers(**dist, context_parallel=2), RULE)
    assert doubled["layout"]["world"] == 4 and doubled["layout"]["dp"] == 1
    assert doubled["stages"][0]["rollout_rows"] == alone["stages"][0]["rollout_rows"] // 2
    assert doubled["train_states"] < alone["train_states"]
    assert memory.lever_flags(one, memory.Levers(context_parallel=2))[-2:] == ["--context-parallel-size 2",
                                                                              "4 devices"]


def test_parameter_counts_of_the_models_match_their_model_cards():
    for name, info in memory.MODELS.items():
        assert abs(memory.param_counts(memory.model_shape(name))["total"] / info["published_params"] - 1) < 0.01, name
    # DeepSeek-V3 at EP64: 4 of the 256 experts of each of the 58 MoE layers, the rest (about 17B) on every rank
    counts = memory.param_counts(memory.model_shape("DeepSeek-V3"), ep=64)
    assert counts["expert"] == 58 * 4 * 3 * 7168 * 2048 and 16.5e9 < counts["dense"] < 17.5e9


def test_micro_batch_costs_of_a_hand_case_and_of_the_real_plan():
    from mindspeed_llm.rl.update.batch_plan import token_budget_groups

    prompts, responses = [2, 2, 2, 2], [6, 1, 1, 1]  # lengths 8, 3, 3, 3: 17 real tokens, 64 + 27 = 91 s^2
    assert token_budget_groups([8, 3, 3, 3], 8) == [[0], [1, 2], [3]]
    assert token_budget_groups([8, 3, 3, 3], 9) == [[0], [1, 2, 3]]  # 3 rows x 3 = 9 tokens: within the budget
    costs = memory.micro_batch_costs(prompts, responses, group=1, micro_batch_size=2, budget=8)
    assert costs["real_tokens"] == 17 and costs["real_attention_work"] == 91
    assert costs["padded"]["processed_tokens"] == 32 and costs["padded"]["attention_work"] == 4 * 64
    assert costs["token_budget"]["processed_tokens"] == 8 + 6 + 3
    assert costs["token_budget"]["attention_work"] == 64 + 2 * 9 + 9
    assert 17 <= costs["by_count"]["processed_tokens"] <= 32
    # MicroBatchPlan cuts the same micro-batches: the widths of its model rows give the same tokens
    for budget, mode in ((None, "by_count"), (8, "token_budget")):
        plan = memory.plan_micro_batch_tokens(prompts, responses, 1, 2, budget)
        assert plan["processed_tokens"] == costs[mode]["processed_tokens"], mode
        assert plan["attention_work"] == costs[mode]["attention_work"], mode
    # by count, in ppo_loop's drawn order of the units (here [2, 0, 1, 3]): each 8 pairs with a 3, 2 x 2 x 8 tokens
    prompts, responses = [2, 2, 2, 2], [6, 6, 1, 1]
    costs = memory.micro_batch_costs(prompts, responses, group=1, micro_batch_size=2, budget=16)
    assert costs["by_count"]["processed_tokens"] == 32 and costs["token_budget"]["processed_tokens"] == 16 + 6
    for budget, mode in ((None, "by_count"), (16, "token_budget")):
        assert memory.plan_micro_batch_tokens(prompts, responses, 1, 2, budget)["processed_tokens"] == \
            costs[mode]["processed_tokens"], mode
    prompts, responses = memory.skewed_mix(100, 4, 200, 1000)
    assert sum(r == 1000 for r in responses) == 10 and all(100 <= r <= 500 for r in responses if r != 1000)
    assert all(prompts[i] == prompts[i - i % 4] for i in range(100))  # a group shares its prompt
    # packed prompt groups of 4 (micro-batches of 4 samples = one group): as computed, on the real plan
    costs = memory.micro_batch_costs(prompts, responses, group=4, micro_batch_size=4, budget=10 ** 6)
    plan = memory.plan_micro_batch_tokens(prompts, responses, 4, 4, None)
    assert plan["packed"] and plan["processed_tokens"] == costs["packed_by_count"]["processed_tokens"]


def test_recommendation_fits_the_limit_with_the_fewest_levers():
    launch = _tiny_launch(levers=memory.Levers(distributed_optimizer=True))
    limit_gb = 1e-9 * (PARAMS * (6 + 12 / 2) + 5000)  # the actor's state with the distributed optimizer, little else
    rec = memory.recommend(launch, COEFS, RULE, limit_gb=limit_gb)
    p = memory.project(launch, COEFS, memory.Levers(**rec["levers"]), RULE)
    assert not rec["notes"]  # it fits at the launcher's layout
    for phase in ("rollout", "passes", "train"):  # the fit's headroom on what is not model state
        assert p[phase] + memory.FIT_MARGIN * (p[phase] - p[f"{phase}_states"]) <= limit_gb * memory.GB
    assert rec["levers"]["offload_ref_reward"] and rec["levers"]["distributed_optimizer"]
    assert "--offload-ref-reward" in rec["flags"]
