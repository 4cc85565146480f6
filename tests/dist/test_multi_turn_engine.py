"""Multi-turn generation in the continuous engine (`inference/turns.py`, `continuous_plan.Scheduler`'s parking) on a
tiny random Llama, 2 gloo processes at DP2 (each rank its own prompts and tool delays, rank 1 with no tool calls at
all next to rank 0 with many), TP2 and PP2.

A scripted handler answers the first turn of every even sample with fixed observation ids after a per-sample delay
(on the token-picking rank, in threads). The reference is the static engine, single-turn, greedy: turn 1 is
`generate(prompt)` and turn 2 is `generate(prompt + turn 1 + observation)`, cut at the per-turn limit. The engine's
response must be exactly turn 1 + observation + turn 2 (token-in / token-out), the observation marked in `tool_mask`
with zero log-probs, the model tokens' log-probs within 2e-5 of the reference's; with the parked KV kept, freed or
kept until a waiting sample needs the slot (auto) the same tokens; keeping the KV prefills fewer tokens; generated in
rounds of 5 tokens per sample that continue the cut samples (partial rollouts' way, a cut falling inside turns, on
parked samples and on tool answers), the same trajectories, tool masks and log-probs. Each answer's note for the
handler's record reaches every rank's handler with its ids (TP2 / PP2: the ranks that ran no tool too).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mindspeed_llm.models.architecture import ArchitectureSpec
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")

SPEC = ArchitectureSpec(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, kv_channels=16, vocab_size=128)
STOPS = tuple(range(3, 40))  # ~30% of the ids end a turn: turns of a few tokens
TURN_LIMIT = 6
MODES = ("keep", "free", "auto")  # EngineOptions.parked_kv
BUDGET = 24


def observation_of(sample):
    return [100 + sample % 7, 101, 102, 60 + sample]


def note_of(sample):
    """What sample's observation brings for the handler's record (a tool's reward, its own metrics)."""
    return {"reward": 0.25 * sample, "metrics": {"echo/words": float(sample)}}


class ScriptedTools:
    """Even samples (of rank 0 only, at DP2) call one tool after their first turn; its answer arrives after
    a delay that differs per sample."""

    turn_token_limit = TURN_LIMIT

    def __init__(self, calls_tools):
        self.calls_tools = calls_tools
        self.done, self.lock, self.event = [], threading.Lock(), threading.Event()
        self.begun, self.notes = [], {}

    def trajectory_budget(self, sample):
        return None  # this call's budget is the whole one

    def wants_observation(self, sample, known, prompt_length, turn_start):
        return self.calls_tools and turn_start == 0 and sample % 2 == 0

    def begin(self, sample, known, prompt_length, turn_start):
        self.begun.append(sample)

        def answer():
            time.sleep(0.02 * (sample % 3))
            with self.lock:
                self.done.append((sample, observation_of(sample), note_of(sample)))
            self.event.set()

        threading.Thread(target=answer, daemon=True).start()

    def ready(self, wait):
        if wait:
            self.event.wait(timeout=30)
        with self.lock:
            out, self.done = self.done, []
            self.event.clear()
        return out

    def observed(self, sample, note):
        self.notes[sample] = note  # every rank: the notes came with the ids


class RoundTools(ScriptedTools):
    """ScriptedTools for one round of a partial rollout: row r of the call is sample `ids[r]`; every trajectory's
    whole budget is BUDGET (this call's budgets are shares of it)."""

    def __init__(self, calls_tools, ids):
        super().__init__(calls_tools)
        self.ids = ids

    def trajectory_budget(self, row):
        return BUDGET

    def wants_observation(self, row, known, prompt_length, turn_start):
        return super().wants_observation(self.ids[row], known, prompt_length, turn_start)

    def begin(self, row, known, prompt_length, turn_start):
        super().begin(self.ids[row], known, prompt_length, turn_start)

    def ready(self, wait):
        back = {s: r for r, s in enumerate(self.ids)}
        return [(back[s], ids, note) for s, ids, note in super().ready(wait)]


def _in_rounds(model, prompts, sampling, calls_tools, share):
    """The multi-turn generation of `prompts` in rounds of `share` more tokens per sample (partial rollouts' way),
    each round continuing the unfinished samples: (responses, tool masks, log-probs, finish reasons, rounds)."""
    from mindspeed_llm.inference import Continuation, generate

    n = len(prompts)
    carried = {b: Continuation([], [], 0) for b in range(n)}
    done, rounds = {}, 0
    while carried:
        ids = sorted(carried)
        conts = [carried[b] for b in ids]
        budgets = [min(BUDGET, len(c.response) + share) for c in conts]
        r = generate(model, [prompts[b] for b in ids], sampling, response_budgets=budgets, continuations=conts,
                     turns=RoundTools(calls_tools, ids))
        rounds += 1
        carried = {}
        for row, b in enumerate(ids):
            length = int(r.response_lengths[row])
            entry = (r.responses[row, :length].tolist(), r.tool_mask[row, :length].tolist(),
                     r.log_probs[row, :length], r.finish_reasons[row])
            if r.finish_reasons[row] == "unfinished":
                carried[b] = r.continuations[row]
            else:
                done[b] = entry
    return [done[b] for b in range(n)], rounds


def _body(rank, world_size, tp, pp):
    from dataclasses import replace

    from mindspeed_llm import distributed
    from mindspeed_llm.inference import EngineOptions, SamplingConfig, generate
    from mindspeed_llm.models import build_model

    distributed.initialize(tp, pp, seed=3)
    model = build_model(SPEC, init_method_std=0.3)
    dp_rank = rank if tp == pp == 1 else 0
    g = torch.Generator().manual_seed(21 + dp_rank)
    prompts = [torch.randint(40, 120, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4, 6)]
    sampling = SamplingConfig(max_new_tokens=TURN_LIMIT, pad_token_id=0, stop_token_ids=STOPS, max_num_seqs=3)
    out = {}
    for mode in MODES:
        tools = ScriptedTools(calls_tools=dp_rank == 0)
        out[mode] = generate(model, prompts, sampling, response_budgets=[BUDGET] * len(prompts), turns=tools,
                             options=EngineOptions(parked_kv=mode))
        out[f"begun {mode}"] = sorted(tools.begun)
        out[f"notes {mode}"] = dict(tools.notes)  # as the engine returns: nothing crosses the ranks afterwards
    single = replace(sampling, max_num_seqs=None)
    first = generate(model, prompts, single, engine="static")
    seconds = {}
    for b, turn in enumerate(first.response_token_lists()):
        if dp_rank == 0 and b % 2 == 0 and first.finish_reasons[b] == "stop":
            seconds[b] = generate(model, [prompts[b] + turn + observation_of(b)], single, engine="static")
    out["rounds"] = _in_rounds(model, prompts, sampling, dp_rank == 0, share=5)
    picks = tp == pp == 1 or rank == (world_size - 1 if pp > 1 else 0)  # the last stage's TP rank 0 runs the tools
    return dict(out, first=first, seconds=seconds, dp_rank=dp_rank, picks=picks)


def _check(result):
    first, seconds = result["first"], result["seconds"]
    for keep in MODES:
        r = result[keep]
        responses, mask = r.response_token_lists(), r.tool_mask
        for b, turn1 in enumerate(first.response_token_lists()):
            n = len(turn1)
            if b not in seconds:  # no tool: the single-turn response, nothing marked
                assert responses[b] == turn1, (keep, b)
                assert r.finish_reasons[b] == first.finish_reasons[b]
                assert int(mask[b].sum()) == 0
                continue
            obs = observation_of(b)
            turn2 = seconds[b].response_token_lists()[0]
            assert responses[b] == turn1 + obs + turn2, (keep, b)  # token-in / token-out
            marked = mask[b, :len(responses[b])].tolist()
            assert marked == [0] * n + [1] * len(obs) + [0] * len(turn2)
            assert float(r.log_probs[b, n:n + len(obs)].abs().sum()) == 0.0
            torch.testing.assert_close(r.log_probs[b, :n], first.log_probs[b, :n], atol=2e-5, rtol=0)
            at = n + len(obs)
            torch.testing.assert_close(r.log_probs[b, at:at + len(turn2)], seconds[b].log_probs[0, :len(turn2)],
                                       atol=2e-5, rtol=0)
        assert result[f"begun {keep}"] == (sorted(seconds) if result["picks"] else [])
        # the tools ran on the picking rank only; every rank's handler has each observation's note
        assert result[f"notes {keep}"] == {b: note_of(b) for b in seconds}, keep
        assert r.stats["parked_turns"] == len(seconds)
    for mode in MODES[1:]:
        assert result[mode].response_token_lists() == result["keep"].response_token_lists(), mode
    # in rounds of 5 tokens (partial rollouts), each continuing the cut samples: the same trajectories
    whole = result["auto"]
    per_sample, rounds = result["rounds"]
    assert rounds >= 2
    for b, (tokens, tool_mask, log_probs, reason) in enumerate(per_sample):
        length = int(whole.response_lengths[b])
        assert tokens == whole.responses[b, :length].tolist() and reason == whole.finish_reasons[b], b
        assert tool_mask == whole.tool_mask[b, :length].tolist()
        torch.testing.assert_close(log_probs, whole.log_probs[b, :length], atol=2e-5, rtol=0)
    if result["seconds"]:
        assert result["keep"].stats["delta_prefill_tokens"] > 0
        assert result["keep"].stats["prefill_tokens"] < result["free"].stats["prefill_tokens"]
        assert result["auto"].stats["parked_evictions"] > 0  # 3 rows in flight for 6 samples: slots are wanted


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_multi_turn_is_token_in_token_out_and_equals_single_turn_generations(tp, pp):
    results = run_distributed(_body, 2, tp, pp)
    assert any(r["seconds"] for r in results), "no sample ended its first turn on a stop token"
    for result in results:
        _check(result)
    if tp == pp == 1:  # a DP rank without tool calls next to one with many finished (no hang)
        assert not results[1]["seconds"]
    else:  # the model-parallel ranks hold the same rollout
        assert results[0]["auto"].response_token_lists() == results[1]["auto"].response_token_lists()
