"""Partial rollouts (`--partial-rollout`, `rl/rollouts/partial.py`).

* The buffers, on a scripted generator (each sample's length fixed by its sample id, its tokens naming it): which
  groups train in which iteration (only whole groups, oldest first), what each round asks for (carried samples
  first, as continuations of their own stream, with the round's budget), the metrics, the named error of
  --max-num-gen-batches, a state_dict round trip that continues exactly, and DP2 (two threads, a barrier as the
  collective) giving DP1's groups, rank r the r-th share; a DP2 checkpoint resumed at DP1.
* The flags: refusals by name, MindSpeed-RL's key.
The spawned parts (a real model, the stage runs): tests/dist/test_stages_partial_rollout.py.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.inference import Rollout, SamplingConfig
from mindspeed_llm.rl.rollouts.partial import PartialRolloutBudgetError, PartialRollouts, pending
from mindspeed_llm.rl.rollouts.base import PromptSource
from mindspeed_llm.rl.rollouts.plain import PlainGenerator
from mindspeed_llm.rl.settings import AlgorithmSettings, BatchSettings

N = 2  # samples per prompt
MAX_NEW, SPLIT = 8, 2  # a round adds at most 4 tokens to a sample
LENGTHS = [2, 7, 3, 3, 8, 1, 6, 2]  # sample id s (position p * N + k) stops (EOS) after LENGTHS[s % 8] tokens
EOS = 3


def _token(started, sample_id, j):
    return 1000 + 100 * started + 10 * sample_id + j


def _logp(started, j):
    return -(j + 1) / 4 - started  # exact in float32


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class ScriptedGenerator:
    """`generate_round` of a model whose sample (started iteration i, id s) emits `_token(i, s, j)` for j < its
    length, then EOS is implied (reason "eos" at the length); records each call."""

    def __init__(self, lengths=LENGTHS):
        self.calls, self.lengths = [], lengths

    def __call__(self, iteration, prompts, sample_ids, continuations, budgets):
        rows = []
        for prompt, sid, carry, budget in zip(prompts, sample_ids, continuations, budgets):
            started, old = carry.iteration, list(carry.response)  # every sample comes with its stream
            assert old == [_token(started, sid, j) for j in range(len(old))]  # its own tokens come back
            assert list(carry.log_probs) == [_logp(started, j) for j in range(len(old))]
            end = self.lengths[sid % 8]
            length = min(end, budget)
            rows.append((prompt, [_token(started, sid, j) for j in range(length)],
                         [_logp(started, j) for j in range(length)], "eos" if length == end else "length"))
        self.calls.append(dict(iteration=iteration, sample_ids=list(sample_ids), budgets=list(budgets),
                               started=[c.iteration for c in continuations],
                               tokens=[len(c.response) for c in continuations]))
        B, P, R = len(rows), max(len(r[0]) for r in rows), max(1, max(len(r[1]) for r in rows))
        prompts_t, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
        log_probs = torch.zeros(B, R)
        for b, (prompt, response, lp, _) in enumerate(rows):
            prompts_t[b, :len(prompt)] = torch.tensor(prompt)
            responses[b, :len(response)] = torch.tensor(response, dtype=torch.long)
            log_probs[b, :len(lp)] = torch.tensor(lp)
        lengths = torch.tensor([len(r[1]) for r in rows])
        return Rollout(prompts=prompts_t, prompt_lengths=torch.tensor([len(r[0]) for r in rows]), responses=responses,
                       response_mask=(torch.arange(R)[None] < lengths[:, None]).long(), response_lengths=lengths,
                       ended_with_eos=torch.tensor([r[3] == "eos" for r in rows]), finish_reasons=[r[3] for r in rows],
                       log_probs=log_probs, pad_token_id=0)


def _plain(scripted, sampling, group_size=N, routing_recorded=False):
    """The `plain` generator whose engine call is `scripted`."""
    generator = PlainGenerator(None, _Tokenizer(), sampling, group_size)
    generator.engine = lambda iteration, prompts, sample_ids, continuations, budgets, sampling, **_: scripted(
        iteration, prompts, sample_ids, continuations, budgets)
    generator.routing_recorded = routing_recorded
    return generator


def _buffers(generator, local_groups=2, dp_rank=0, dp_size=1, gather=None, max_rounds=4, routing_recorded=False,
             max_new=MAX_NEW):
    sampling = SamplingConfig(max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0)
    return PartialRollouts(_plain(generator, sampling, routing_recorded=routing_recorded), local_groups=local_groups,
                           max_split=SPLIT, max_rounds=max_rounds, dp_rank=dp_rank, dp_size=dp_size,
                           gather=gather or (lambda obj: [obj]))


def _rows(global_batch=2, dp_rank=0, dp_size=1):
    """`PromptSource.from_sampler`'s draw: this rank's prompts of generation batch j, `position` counting on."""
    local = global_batch // dp_size

    def rows(j):
        first = j * global_batch + dp_rank * local
        return [dict(input_ids=[7, 8, 9][:1 + (first + k) % 3], index=first + k, position=first + k, labels="-")
                for k in range(local)]
    return rows


def _trained(exp):
    """(started, sample id, response) per row of a training batch."""
    return [(st, sid, exp.responses[b, :int(exp.response_mask[b].sum())].tolist())
            for b, (st, sid) in enumerate(zip(exp.sample_data.started, exp.sample_data.sample_ids))]


def _expected(started, sid, lengths=LENGTHS):
    return started, sid, [_token(started, sid, j) for j in range(lengths[sid % 8])]


def test_whole_groups_train_oldest_first_and_carried_samples_continue():
    gen = ScriptedGenerator()
    buffers, rows = _buffers(gen), _rows()
    # iteration 1, round 1: positions 0 (lengths 2, 7: cut at 4) and 1 (3, 3: done); round 2: position 0 finishes,
    # positions 2 (8 cut, 1) and 3 (6 cut, 2) start; it trains positions 0 and 1
    exp, metrics = buffers.collect(1, PromptSource(rows(0), rows))
    assert _trained(exp) == [_expected(1, s) for s in (0, 1, 2, 3)]
    assert metrics == {"partial_rollout/rounds": 2.0, "partial_rollout/carried": 2.0,
                       "partial_rollout/max_staleness": 0.0, "partial_rollout/waiting": 0.0}
    assert gen.calls[1] == dict(iteration=1, sample_ids=[1, 4, 5, 6, 7], budgets=[8, 4, 4, 4, 4],
                                started=[1] * 5, tokens=[4, 0, 0, 0, 0])  # the carried sample first, its whole budget
    # the rollout log-probs of a carried sample: the first round's and the second's, as recorded
    assert exp.rollout_logp[1, :7].tolist() == [_logp(1, j) for j in range(7)]
    assert exp.sample_data.finish_reasons == ["eos"] * 4
    # the samples that finished in round 2 (ids 5 and 7) wait for their group's other sample
    assert pending(buffers.state_dict()) == (2, 0)

    # iteration 2: the carried positions 2 and 3 of iteration 1 finish first and train (staleness 1); of the fresh
    # ones, position 1 finishes and waits, position 0 is carried
    exp, metrics = buffers.collect(2, PromptSource(rows(0), rows))
    assert gen.calls[2]["started"] == [1, 1, 2, 2, 2, 2] and gen.calls[2]["tokens"] == [4, 4, 0, 0, 0, 0]
    assert _trained(exp) == [_expected(1, s) for s in (4, 5, 6, 7)]
    assert metrics == {"partial_rollout/rounds": 1.0, "partial_rollout/carried": 1.0,
                       "partial_rollout/max_staleness": 1.0, "partial_rollout/waiting": 1.0}
    assert [(g.started, g.position) for g in buffers.ready] == [(2, 1)]
    assert [(g.started, g.position) for g in buffers.carried] == [(2, 0)]


def test_a_finished_global_batch_trains_without_a_round():
    """When a global batch has finished already, the iteration generates nothing: the sampler's batch waits, not
    started, behind the carried groups, and a later round starts it from its own iteration's stream."""
    lengths = [8, 1, 1, 1, 1, 1, 1, 1]  # only sample 0 of position 0 needs 2 rounds
    gen = ScriptedGenerator(lengths)
    buffers, rows = _buffers(gen, routing_recorded=True), _rows()  # as for a mixture of experts
    # iteration 1: round 1 finishes position 1; round 2 finishes positions 0, 2 and 3: two groups wait
    exp, metrics = buffers.collect(1, PromptSource(rows(0), rows))
    assert metrics["partial_rollout/rounds"] == 2.0 and metrics["partial_rollout/waiting"] == 2.0
    exp, metrics = buffers.collect(2, PromptSource(rows(0), rows))
    assert len(gen.calls) == 2  # no round
    assert exp.routing_recorded  # the old-log-prob pass still compares routing, though nothing was generated
    assert _trained(exp) == [_expected(1, s, lengths) for s in (4, 5, 6, 7)]
    assert metrics == {"partial_rollout/rounds": 0.0, "partial_rollout/carried": 4.0,
                       "partial_rollout/max_staleness": 1.0, "partial_rollout/waiting": 0.0}
    exp, metrics = buffers.collect(3, PromptSource(rows(0), rows))
    assert gen.calls[2]["started"] == [2, 2, 2, 2, 3, 3, 3, 3] and set(gen.calls[2]["tokens"]) == {0}
    # position 1 of iteration 2 (its tokens drawn from iteration 2's stream), then position 1 of iteration 3
    assert _trained(exp) == [_expected(*key, lengths) for key in ((2, 2), (2, 3), (3, 2), (3, 3))]
    assert metrics["partial_rollout/max_staleness"] == 1.0 and metrics["partial_rollout/rounds"] == 1.0


def test_state_dict_round_trip_continues_exactly_and_pending_counts():
    gen_a, gen_b = ScriptedGenerator(), ScriptedGenerator()
    a, rows = _buffers(gen_a), _rows()
    a.collect(1, PromptSource(rows(0), rows))
    a.collect(2, PromptSource(rows(0), rows))
    blob = io.BytesIO()
    torch.save(a.state_dict(), blob)  # as the checkpoint holds it
    blob.seek(0)
    state = torch.load(blob, weights_only=False)
    assert pending(state) == (1, 1) and pending(None) == (0, 0)
    b = _buffers(gen_b)
    assert b.load_state_dict(state) is None
    for iteration in (3, 4):
        exp_a, metrics_a = a.collect(iteration, PromptSource(rows(0), rows))
        exp_b, metrics_b = b.collect(iteration, PromptSource(rows(0), rows))
        assert _trained(exp_a) == _trained(exp_b) and metrics_a == metrics_b
        assert torch.equal(exp_a.tokens, exp_b.tokens) and torch.equal(exp_a.rollout_logp, exp_b.rollout_logp)
    assert gen_a.calls[-2:] == gen_b.calls
    with pytest.raises(Exception, match="--n-samples-per-prompt 3"):
        PartialRollouts(_plain(gen_b, b.sampling, group_size=3), local_groups=2, max_split=SPLIT,
                        max_rounds=4).load_state_dict(state)


def test_a_carried_trajectory_of_an_older_checkpoint_continues_with_its_spans_and_record():
    """A carried sample of a checkpoint written before the record was the one carrier (its tool spans, its
    `turn_start` and the generator's record `tool_state`, each a key of its own) continues with those spans, its turn
    starting after the last of them, and the record handed back as `Continuation.state`; a new checkpoint keeps the
    spans and the record (the turn's start follows from the spans)."""
    gen_a, rows = ScriptedGenerator(), _rows()
    a = _buffers(gen_a)
    a.collect(1, PromptSource(rows(0), rows))
    state = a.state_dict()
    carried = next(s for rank in state["carried"] for g in rank for s in g["samples"] if s["reason"] is None)
    record = {"turns": 1, "calls": 1, "tool_reward": 0.5}  # an older record: counts only
    carried.update(observed=[[0, 1]], turn_start=1, tool_state=record)
    seen = []
    gen_b = ScriptedGenerator()

    def recording(iteration, prompts, sample_ids, continuations, budgets):
        seen.extend(c for c in continuations if c.response)
        return gen_b(iteration, prompts, sample_ids, continuations, budgets)

    b = _buffers(recording)
    assert b.load_state_dict(state) is None
    saved = b.state_dict()["carried"][0][0]["samples"]
    assert [s["observed"] for s in saved if s["reason"] is None] == [[[0, 1]]]
    assert [s["tool_state"] for s in saved if s["reason"] is None] == [record]
    b.collect(2, PromptSource(rows(0), rows))
    assert [(tuple(c.observed), c.turn_start, c.state) for c in seen if c.state] == [(((0, 1),), 1, record)]


@pytest.mark.parametrize("max_new, fits", [(2, False), (3, False), (4, True), (12, True)])
def test_a_resume_with_a_smaller_response_budget_is_refused_naming_both(max_new, fits):
    """The checkpoint holds a carried sample of 4 tokens and a finished group of 3-token responses (generated under
    --max-new-tokens 8): a resume whose budget is below a saved response is refused naming both values (continuing
    it would ask the engine for fewer tokens than it holds: a traceback in the engine); one where every response
    fits resumes, the carried sample finishing within the new budget."""
    a, rows = _buffers(ScriptedGenerator()), _rows()
    a.collect(1, PromptSource(rows(0), rows))
    a.collect(2, PromptSource(rows(0), rows))
    state = a.state_dict()
    saved = [len(s["response"]) for g in state["ready"] + state["carried"][0] for s in g["samples"]]
    assert sorted(saved) == [2, 3, 3, 4]
    b = _buffers(ScriptedGenerator(), max_new=max_new)
    if fits:
        assert b.load_state_dict(state) is None
        exp, _ = b.collect(3, PromptSource(rows(0), rows))
        assert all(len(s.response) <= max_new for g in b.carried + b.ready for s in g.samples)
        return
    with pytest.raises(ArgumentError) as caught:
        b.load_state_dict(state)
    assert str(caught.value).startswith(
        f"--max-new-tokens {max_new}: the checkpoint's partial rollouts hold ") and \
        "(up to 4 tokens, generated under --max-new-tokens 8); resume with --max-new-tokens 8 (at least 4" in \
        str(caught.value), str(caught.value)


def test_too_few_rounds_is_named():
    buffers, rows = _buffers(ScriptedGenerator(), max_rounds=1), _rows()
    with pytest.raises(PartialRolloutBudgetError, match=r"^--max-num-gen-batches 1: iteration 1 generated 1 batches "
                                                        r"and finished 1 of the 2 prompt groups"):
        buffers.collect(1, PromptSource(rows(0), rows))


def _threads(fn, world):
    """fn(rank, gather) on `world` threads whose `gather` is a collective (a barrier); the results by rank."""
    slots, results, barrier = [None] * world, [None] * world, threading.Barrier(world)

    def gather_for(rank):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return gather

    def body(rank):
        results[rank] = fn(rank, gather_for(rank))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_dp2_trains_the_dp1_groups_and_resumes_at_dp1():
    iterations = (1, 2, 3)
    one, rows = _buffers(ScriptedGenerator(), local_groups=2), _rows()
    single = [one.collect(i, PromptSource(rows(0), rows)) for i in iterations]

    def dp2(rank, gather):
        buffers = _buffers(ScriptedGenerator(), local_groups=1, dp_rank=rank, dp_size=2, gather=gather)
        rank_rows = _rows(dp_rank=rank, dp_size=2)
        out = [buffers.collect(i, PromptSource(rank_rows(0), rank_rows)) for i in iterations[:2]]
        return out, buffers.state_dict()

    ranks = _threads(dp2, 2)
    for i in range(2):
        exp1, metrics1 = single[i]
        assert [row for rank in ranks for row in _trained(rank[0][i][0])] == _trained(exp1)
        assert ranks[0][0][i][1] == ranks[1][0][i][1] == metrics1
    # the DP2 checkpoint of iteration 2 resumed on one rank: its carried groups are dealt over it in key order
    resumed = _buffers(ScriptedGenerator(), local_groups=2)
    assert "carried prompt groups of 2 DP ranks" in resumed.load_state_dict(ranks[0][1])
    exp, metrics = resumed.collect(3, PromptSource(rows(0), rows))
    assert _trained(exp) == _trained(single[2][0]) and metrics == single[2][1]


# ---------------------------------------------------------------------------------------------- flags and refusals
BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "4",
        "--global-batch-size", "4", "--ref-model", "r"]


@pytest.mark.parametrize("extra,needle", [
    (["--partial-rollout-max-split", "3"], "--partial-rollout-max-split 3 has no effect without --partial-rollout"),
    (["--partial-rollout", "--partial-rollout-max-split", "1"], "--partial-rollout-max-split 1 must be >= 2"),
    (["--partial-rollout", "--dynamic-sampling"], "--partial-rollout and --dynamic-sampling both draw further"),
    (["--partial-rollout", "--context-parallel-size", "2"], "--partial-rollout with --context-parallel-size 2 is not"),
    (["--partial-rollout", "--max-num-gen-batches", "0"], "--max-num-gen-batches 0 (no limit) is --dynamic-sampling's"),
    (["--max-num-gen-batches", "-1"], "--max-num-gen-batches -1 must be >= 0"),
    (["--dynamic-sampling-metric", "math_acc"], "--dynamic-sampling-metric math_acc has no effect without "
                                                "--dynamic-sampling"),
    (["--dynamic-sampling", "--dynamic-sampling-metric", "acc_for_dapo"],
     "--dynamic-sampling-metric acc_for_dapo is not one of --verifier-function math_acc"),
])
def test_flags_that_do_not_combine_are_refused_by_name(extra, needle):
    from mindspeed_llm.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + extra, world_size=2)
    assert needle in str(err.value)


def test_dynamic_sampling_on_a_verifier_without_a_limit():
    from mindspeed_llm.arguments import parse_args

    algorithm = parse_args(BASE + ["--dynamic-sampling", "--dynamic-sampling-metric", "math_acc",
                                   "--max-num-gen-batches", "0"], world_size=1).settings.algorithm
    assert (algorithm.dynamic_sampling_metric, algorithm.max_num_gen_batches) == ("math_acc", 0)
    assert parse_args(BASE, world_size=1).settings.algorithm.dynamic_sampling_metric == "reward"


def test_partial_rollout_implies_recomputed_old_logprobs_and_a_default_budget():
    from mindspeed_llm.arguments import parse_args

    args = parse_args(BASE + ["--partial-rollout"], world_size=1)
    algorithm = args.settings.algorithm
    assert algorithm.recompute_old_logprobs and algorithm.partial_rollout_max_split == 2
    assert not parse_args(BASE, world_size=1).settings.algorithm.recompute_old_logprobs


def test_mindspeed_partial_rollout_max_split_maps_to_the_flags(tmp_path):
    from tests.helpers.mindspeed_rl_configs import GRPO_FLAGS, config_error, grpo_file, parsed, write

    data = grpo_file()
    data["rl_config"]["partial_rollout_max_split"] = 4
    assert parsed(["--config", write(tmp_path, data)], 16) == \
        parsed(GRPO_FLAGS + ["--partial-rollout", "--partial-rollout-max-split", "4"], 16)
    data["rl_config"]["partial_rollout_max_split"] = 1  # MindSpeed-RL's default: off
    assert parsed(["--config", write(tmp_path, data)], 16) == parsed(GRPO_FLAGS, 16)
    data["rl_config"]["partial_rollout_max_split"] = 0
    assert "rl_config.partial_rollout_max_split: 0 must be an integer >= 1" in config_error(tmp_path, data)


def test_an_actor_the_continuous_engine_cannot_run_is_refused(monkeypatch):
    from types import SimpleNamespace

    from mindspeed_llm.arguments import ArgumentError
    from mindspeed_llm.inference import generation

    # the reasons `generation._continuous_blockers` gives (sequence parallelism, a CUDA-graph decode, ...)
    monkeypatch.setattr(generation, "continuous_engine_blockers", lambda model: ["sequence parallelism splits ..."])
    settings = SimpleNamespace(algorithm=AlgorithmSettings(n_samples_per_prompt=2, partial_rollout_max_split=2,
                                                           max_num_gen_batches=4),
                               batch=BatchSettings(global_batch_size=2))
    with pytest.raises(ArgumentError, match=r"^--partial-rollout continues carried samples in the continuous "
                                            r"generation engine, which cannot run this actor: sequence parallelism"):
        PartialRollouts.from_settings(settings, PlainGenerator(None, _WordTokenizer(), SamplingConfig(max_new_tokens=8),
                                                               2))


def test_a_checkpoint_with_buffers_is_refused_by_a_run_without_the_flag():
    from types import SimpleNamespace

    from mindspeed_llm.checkpoint.training import CheckpointError
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.rollouts.one_shot import OneShot
    from mindspeed_llm.rl.settings import CheckpointSettings

    buffers, rows = _buffers(ScriptedGenerator()), _rows()
    buffers.collect(1, PromptSource(rows(0), rows))
    args = CheckpointSettings(load="/ckpt")  # the run's checkpoint part
    without_flag = SimpleNamespace(rollouts=OneShot(PlainGenerator(None, _Tokenizer(), buffers.sampling)))
    loop_state = {"sampler": {}, "partial_rollout": buffers.state_dict()}  # the key the checkpoints have
    with pytest.raises(CheckpointError, match=r"^--load /ckpt iteration 1 holds 2 unfinished samples and 0 finished "
                                              r"prompt groups of --partial-rollout, which this run would drop"):
        trainer._resume_rollouts(args, without_flag, loop_state, 1)
    trainer._resume_rollouts(args, without_flag, {"sampler": {}}, 1)  # nothing to drop
    # a run with the flag takes them back
    resumed = _buffers(ScriptedGenerator())
    trainer._resume_rollouts(args, SimpleNamespace(rollouts=resumed), loop_state, 1)
    assert pending(resumed.state_dict()) == (2, 0)


# ---------------------------------------------------------------------------------------------- a real model
class _WordTokenizer(_Tokenizer):
    def __len__(self):
        return 256  # word_task.VOCAB


# ---------------------------------------------------------------------------------------------- the stages
