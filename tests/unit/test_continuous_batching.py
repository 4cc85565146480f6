"""The continuous-batching engine (`mindspeed_llm/inference/continuous.py`, its plan `continuous_plan.py`).

* its scheduler alone (host-side, no model): admission in batch order into freed slots, rows kept packed (a tail row
  moves into a hole), prefill windows shared with a sample in flight, prefills packed and chunked under the token
  cap, the decode budget;
* a tiny mixture of experts at EP2 on 2 gloo processes: tests/dist/test_continuous_batching_dist.py.

The dense layouts (TP1 x DP2, TP2, PP2) are compared with the static engine and `transformers` in
tests/dist/test_generate.py, in its spawns.
"""

from __future__ import annotations


from mindspeed_llm.inference.continuous_plan import Sample, Scheduler, split_capacity

EOS = 2


def _scheduler(prompts, budgets, capacities, token_cap=None, share=True, max_decode_steps=None):
    samples = [Sample(list(p), len(p), n) for p, n in zip(prompts, budgets)]
    for s in samples:
        if s.budget == 0:
            s.reason = "length"
    return Scheduler(samples, capacities, token_cap=token_cap, share_prefill=share, pad_id=0, eos_ids=[EOS],
                     stop_ids=[], max_decode_steps=max_decode_steps)


def test_split_capacity():
    assert split_capacity(7, 3, None) == [3, 2, 2]
    assert split_capacity(2, 4, None) == [1, 1, 0, 0]
    assert split_capacity(9, 2, 3) == [3, 3]


def test_slots_are_reused_in_order_and_rows_stay_packed():
    s = _scheduler([[5, 6, 7], [8, 9], [10], [11, 12, 13, 14], [15, 16]], [3, 1, 2, 3, 1], [3])
    u = s.decide(0, 0)
    assert u.decode.samples == [0, 1, 2] and u.decode.base == 0
    assert u.decode.positions == [2, 1, 0] and u.decode.tokens == [7, 9, 10] and u.decode.steps == [0, 0, 0]
    # one prefill forward for the two rows with a window (the one-token prompt has none), right-padded
    (p,) = u.prefills
    assert p.samples == [1, 0] and p.slots == [1, 0] and p.start == 0 and p.width == 2 and p.counts == [1, 2]
    assert p.tokens == [[8, 0], [5, 6]]
    s.apply(u, [20, 21, 22])  # sample 1 is at its budget of 1
    assert s.samples[1].reason == "length" and s.samples[1].known == [8, 9, 21]
    u = s.decide(1, 0)
    assert u.decode.samples == [0, 3, 2] and not u.moves  # sample 3 takes the freed slot 1
    assert u.decode.positions == [3, 3, 1] and u.decode.steps == [1, 0, 1]
    s.apply(u, [EOS, 30, 31])  # sample 0 stops on EOS, sample 2 at its budget
    assert [s.samples[b].reason for b in (0, 2)] == ["eos", "length"]
    u = s.decide(2, 0)  # sample 3 keeps slot 1, the new sample 4 takes the hole at slot 0
    assert u.decode.samples == [4, 3] and not u.moves
    s.apply(u, [40, 41])  # sample 4 at its budget
    u = s.decide(3, 0)
    assert u.decode.samples == [3] and u.moves == [(1, 0, 5)]  # the row left in slot 1 moves into the hole
    s.apply(u, [50])
    assert not s.busy() and s.decide(4, 0).decode is None
    assert s.stats["decode_row_steps"] == sum(len(x.known) - x.prompt_length for x in s.samples) == 9


def test_prefill_windows_are_shared_with_samples_in_flight():
    group = [3, 4, 5, 6]
    s = _scheduler([group] * 3 + [[7, 8]] * 2, [4, 1, 2, 3, 3], [2])
    u = s.decide(0, 0)
    assert [p.samples for p in u.prefills] == [[0]]  # one prefill, the sibling copies it
    assert u.copies == [(0, 1, 3, 0, 1)]
    s.apply(u, [9, 9])  # sample 1 done
    u = s.decide(1, 0)  # sample 2 copies sample 0's rows, still in flight
    assert not u.prefills and u.copies == [(0, 1, 3, 0, 2)]
    s.apply(u, [EOS, 9])  # sample 0 done: [7, 8] has no holder, sample 2 still holds `group`
    u = s.decide(2, 0)
    assert [p.samples for p in u.prefills] == [[3]] and u.copies == []
    s.apply(u, [9, 9])  # sample 2 done; sample 4 copies sample 3's one-token window
    u = s.decide(3, 0)
    assert u.decode.samples == [3, 4] and u.copies == [(0, 1, 1, 3, 4)]
    assert s.stats["prefill_shared_rows"] == 3
    unshared = _scheduler([group] * 3, [2] * 3, [3], share=False)
    assert [p.samples for p in unshared.decide(0, 0).prefills] == [[0, 1, 2]]


def test_token_cap_packs_and_chunks_prefills():
    prompts = [[1] * 4, [1, 2, 3], [5] * 11, [6] * 3]
    s = _scheduler(prompts, [1] * 4, [4], token_cap=6)
    u = s.decide(0, 0)
    shapes = [(p.samples, p.start, p.width, p.counts) for p in u.prefills]
    # windows 3, 2, 10, 2 tokens: two rows of <= 3 fit 6 tokens; 10 > 6 is prefilled alone in chunks of 6
    assert shapes == [([1, 3], 0, 2, [2, 2]), ([2], 0, 6, [6]), ([2], 6, 4, [4]), ([0], 0, 3, [3])]
    assert all(len(p.slots) * p.width <= 6 for p in u.prefills)
    assert u.prefills[2].tokens == [[5] * 4]


def test_a_long_window_among_short_ones_is_prefilled_alone():
    """Without a token cap, one forward pads every window to the longest: a long continuation among short prompts
    would multiply their work. A forward's rows x width stays within twice its windows' tokens."""
    prompts = [[1] * 3, [2] * 3, [3] * 3, [4] * 13, [5] * 4]  # windows 2, 2, 2, 12, 3 tokens
    u = _scheduler(prompts, [1] * 5, [5]).decide(0, 0)
    # 2, 2, 2, 3: 4 x 3 = 12 padded <= 2 x 9; adding 12: 5 x 12 = 60 > 2 x 21
    assert [(p.samples, p.width, p.counts) for p in u.prefills] == [([0, 1, 2, 4], 3, [2, 2, 2, 3]), ([3], 12, [12])]
    assert u.prefills[0].tokens == [[1, 1, 0], [2, 2, 0], [3, 3, 0], [5, 5, 5]]
    # two windows pad at most to twice their tokens: one forward
    (p,) = _scheduler([[1] * 2, [2] * 9], [1, 1], [2]).decide(0, 0).prefills
    assert (p.samples, p.width, p.counts) == ([0, 1], 8, [1, 8])


def test_decode_budget_stops_every_group():
    s = _scheduler([[1, 2]] * 3, [5] * 3, [1, 1], max_decode_steps=2, share=False)
    for k in range(4):
        u = s.decide(k, k % 2)
        s.apply(u, [7])
    assert s.decide(4, 0).decode is None and s.decide(5, 1).decode is None and not s.busy()
    assert [x.response_length for x in s.samples] == [2, 2, 0] and not any(x.finished for x in s.samples)


# ---------------------------------------------------------------------------------------------- EP2 mixture


def test_rollout_flags_reach_the_sampling_config():
    """`--rollout-max-num-seqs` / `--rollout-max-num-batched-tokens` ride in the stages' SamplingConfig (rl/rollouts/plain.py),
    which `rollout()` hands to `generate`; left out, there is no limit."""
    from types import SimpleNamespace

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl.rollouts.plain import sampling_config

    base = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
            "--global-batch-size", "4", "--ref-model", "r"]
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    args = parse_args(base + ["--rollout-max-num-seqs", "16", "--rollout-max-num-batched-tokens", "512"])
    for greedy in (None, True):  # the rollout's and the evaluation's settings
        config = sampling_config(args, tokenizer, greedy=greedy)
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (16, 512)
    config = sampling_config(parse_args(base), tokenizer)
    assert config.max_num_seqs is None and config.max_num_batched_tokens is None


# ---------------------------------------------------------------------------------------------- multi-turn parking
def _turns(prompts, budgets, capacity, keep, turn_limit=None, wants=lambda s, sample: sample.turn_start == 0):
    samples = [Sample(list(p), len(p), n) for p, n in zip(prompts, budgets)]
    return Scheduler(samples, [capacity], token_cap=None, share_prefill=False, pad_id=0, eos_ids=[EOS], stop_ids=[],
                     wants_observation=wants, turn_token_limit=turn_limit,
                     parked_kv=keep)


def test_a_parked_row_keeps_its_slot_leaves_the_decode_and_gets_a_delta_prefill():
    s = _turns([[5, 6, 7], [8, 9], [10, 11]], [12, 12, 12], 3, keep="keep")
    u = s.decide(0, 0)
    assert s.apply(u, [EOS, 20, 21]) == [0]  # sample 0's turn ends and its handler wants an observation
    assert 0 in s.parked and s.samples[0].reason is None and s.slot_of[0] == 0
    u = s.decide(1, 0)
    # rows 1 and 2 decode; slot 0 sits between nothing but is skipped: the decode gathers slots 1, 2
    assert u.decode.samples == [1, 2] and u.decode.slots == [1, 2] and not u.prefills
    s.apply(u, [22, 23])
    assert not s.only_parked() and s.busy()
    assert s.resume(0, [40, 41, 42])
    assert s.samples[0].known == [5, 6, 7, EOS, 40, 41, 42] and s.samples[0].observed == [(1, 4)]
    assert s.samples[0].turn_start == 4
    u = s.decide(2, 0)
    (p,) = u.prefills  # only the observation (and the turn's last token, never fed): positions 3 .. 5
    assert p.samples == [0] and p.slots == [0] and p.start == 3 and p.counts == [3] and p.tokens == [[EOS, 40, 41]]
    assert u.decode.samples == [0, 1, 2] and u.decode.slots is None  # all rows decode: a view again
    assert u.decode.positions[0] == 6 and u.decode.tokens[0] == 42 and u.decode.steps[0] == 4
    assert s.stats["delta_prefill_tokens"] == 3 and s.stats["observation_tokens"] == 3


def test_a_parked_row_without_its_kv_frees_the_slot_and_is_prefilled_again():
    s = _turns([[5, 6, 7], [8, 9], [10, 11]], [12, 12, 12], 2, keep="free")
    u = s.decide(0, 0)
    assert u.decode.samples == [0, 1]
    assert s.apply(u, [EOS, 20]) == [0]
    assert 0 not in s.slot_of
    u = s.decide(1, 0)  # sample 2 takes the freed slot
    assert sorted(u.decode.samples) == [1, 2]
    s.apply(u, [EOS, EOS])  # samples 1 and 2 park too: nothing left to decode until an observation comes
    assert s.only_parked() and s.busy() and not any(s.groups[0].rows)
    s.resume(0, [40, 41])
    u = s.decide(2, 0)
    (p,) = u.prefills  # the whole prefix again: prompt, turn, observation (but the last token)
    assert p.samples == [0] and p.start == 0 and p.tokens == [[5, 6, 7, EOS, 40]]


def test_an_observation_past_the_budget_ends_the_trajectory_and_turns_have_their_own_limit():
    s = _turns([[5, 6], [8, 9]], [6, 20], 2, keep="keep", turn_limit=3)
    u = s.decide(0, 0)
    assert s.apply(u, [EOS, 30]) == [0]
    assert not s.resume(0, [1, 2, 3, 4, 5])  # 1 token used, 5 more leave no room for a model token in 6
    assert s.samples[0].reason == "length" and 0 not in s.slot_of
    u = s.decide(1, 0)
    s.apply(u, [31])
    u = s.decide(2, 0)
    s.apply(u, [32])  # the third token of sample 1's turn: the turn limit ends it
    assert s.samples[1].reason == "length" and s.samples[1].response_length == 3 and not s.busy()


def test_auto_keeps_a_parked_rows_kv_until_a_pending_sample_needs_its_slot():
    s = _turns([[5, 6, 7], [8, 9], [10, 11]], [12, 12, 12], 2, keep="auto")
    u = s.decide(0, 0)  # samples 0, 1 in flight; sample 2 waits
    assert s.apply(u, [EOS, 20]) == [0]
    assert s.slot_of[0] == 0  # kept for now
    u = s.decide(1, 0)  # sample 2 is pending and there is no free slot: the parked sample 0 gives its slot up
    assert 0 not in s.slot_of and sorted(u.decode.samples) == [1, 2] and s.stats["parked_evictions"] == 1
    s.resume(0, [40])
    assert list(s.pending) == [0]  # resumed without its KV: queued for a whole prefill
    s2 = _turns([[5, 6, 7], [8, 9]], [12, 12], 2, keep="auto")
    u = s2.decide(0, 0)
    s2.apply(u, [EOS, 20])
    s2.decide(1, 0)
    assert s2.slot_of[0] == 0 and s2.stats["parked_evictions"] == 0  # nobody waits: the KV stays
