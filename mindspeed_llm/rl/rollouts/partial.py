"""Partial rollouts (`--partial-rollout`, `--partial-rollout-max-split N`): a long response is generated over several
generation batches, so that an iteration's rollout does not wait for its longest samples.

Names: the switch is slime's (`--partial-rollout`); the budget is MindSpeed-RL's `rl_config.partial_rollout_max_split`
N (`run_config.py` maps the key): a generation batch adds at most k = ceil(--max-new-tokens / N) tokens to a sample,
so the longest response completes within N generation batches. The scheme is MindSpeed-RL's synchronous one: when at
least a global batch of prompt groups has finished, train; otherwise take more prompts and generate again, the
samples cut before first.

One iteration (`PartialRollouts.collect`), on every DP rank:

1. A generation batch ("round") runs one `generate` call over this rank's carried samples (oldest first) and one
   fresh batch of the sampler (its prompts x `--n-samples-per-prompt`), each sample with the response budget
   min(its whole budget, its tokens so far + k). A sample that stops (EOS, stop token, its whole budget) is
   finished; one that reaches the round's budget is cut and carried, with its tokens and their behaviour
   log-probs (`inference.Continuation`), into the next round, which continues it under the weights of then.
2. A prompt's group of n samples is finished when all n are (trl_ppo: n is 1 by default). Every rank's newly
   finished groups are exchanged over the DP group (host memory), so every rank holds the same list of finished
   groups ("ready") in the global order of their key: (the iteration their generation started, the prompt's
   position in that iteration's generation order, `base.PromptSource`).
3. Rounds run while fewer than --global-batch-size groups are ready (every rank decides alike: the list is the
   same everywhere, and expert-parallel peers generate in lock-step), none when the earlier rounds finished a
   global batch already (MindSpeed-RL's check comes before generating): the sampler's batch of the iteration then
   joins the carried groups, not started, and waits its turn. --max-num-gen-batches rounds without a global batch
   is an error naming it.
4. The iteration trains on the first --global-batch-size ready groups, rank r on [r L, (r + 1) L) of them (L its
   prompts per batch); the rest wait for the next iteration. The training batch keeps its size, so the DP,
   mini-batch and micro-batch arithmetic (`arguments.validate_args`, `ppo_loop`) is unchanged. The ready list
   stays below a global batch plus one round's groups, which bounds how long a finished group waits.

The budget is per sample (`generate`'s `response_budgets`), not `generate`'s `max_decode_steps`, which bounds the
engine's decode steps: with fewer rows in flight than samples (--rollout-max-num-seqs) a late sample would get fewer
tokens, depending on the batch it shares a call with. Per sample, every sample gets min(tokens left, k) tokens in
every round whatever the engine limits and the DP size, so the trained groups (and their tokens, to float rounding)
are the same at any layout, and the longest response completes within N rounds. With every sample in flight (the
default) a round decodes at most k steps.

Random streams: a sample draws its tokens from the stream of its sample id in the iteration its group started
(`Continuation.iteration`, passed for every sample, with no tokens yet or some), so a carried sample, a group that
waited unstarted, and a resumed run draw the same tokens.

Old log-probs: the carried tokens' log-probs are an earlier policy's, so the update's old log-probs come from a
training forward (--partial-rollout implies --recompute-old-logprobs), and `--rollout-is tis|mis` weighs each token by
exp(old_logp - rollout_logp) against the sampler's.

Routing replay (mixtures of experts): a continuation's old tokens are prefilled again in the continuing call, so the
routing recorded for them is that of the continuing weights; only the tokens generated in the last round were
routed by the weights that chose them.

Checkpoint (`state_dict`, a collective over the DP group): the ready groups (the same on every rank) and every DP
rank's carried groups, with the sampler's position in the trainer's loop state; `load_state_dict` gives each rank its
own, or, at another DP size, deals the carried groups over the ranks in key order (a carried sample may continue on
any rank: its tokens follow from its own tokens and stream, to float rounding).

Any sample generator (`base.SampleGenerator`): the schedule asks it for a sample's whole budget and its flag, whether
a stop was a cut, and its metrics. With tools (`--tool-config`, `tool_turns.py`) a sample is a trajectory, its
budget --max-total-response-length and a round's share ceil(that / N); a cut may fall inside a model turn, while a
tool runs (its answer is appended first) or after a tool answer. A carried sample keeps its observation spans (token
positions, the engine's: its current turn began after the last) and the generator's record of it
(`Rollout.trajectories`: its turns' calls, turn and tool reward counts), in the checkpoint too (keys `observed`,
`tool_state`), so that it continues as one uninterrupted trajectory. A tool's per-trajectory state (`create` /
`release`) lasts one round.

Metrics: `partial_rollout/rounds` (0 when a global batch had finished already), `partial_rollout/carried`
(unfinished samples carried out of the iteration, not started ones included, all ranks), `partial_rollout/max_staleness`
(max over the trained samples of the iteration minus the iteration their group started), `partial_rollout/waiting`
(finished groups left for later iterations).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mindspeed_llm import device, distributed
from mindspeed_llm.errors import ArgumentError, UserError
from mindspeed_llm.inference import Continuation, Rollout
from mindspeed_llm.inference.results import observation_mask
from mindspeed_llm.rl.experience import Experience


class PartialRolloutBudgetError(UserError):
    """--max-num-gen-batches rounds did not finish a global batch of prompt groups."""


@dataclass
class _Sample:
    sample_id: int  # its random stream (with its group's `started`)
    response: List[int] = field(default_factory=list)
    log_probs: Optional[List[float]] = None  # the behaviour log-probs of `response`
    reason: Optional[str] = None  # "eos" | "stop" | "length" once finished; None: unfinished
    routing: Optional[torch.Tensor] = None  # host [MoE layers of this rank, prompt + response, topk], when finished
    # the response spans [a, b) of observations (tool answers: its tool mask, token positions; where its current turn
    # began follows, `Continuation.turn_start`) and the generator's record of the trajectory (what the turns mean)
    observed: List[Tuple[int, int]] = field(default_factory=list)
    tool_state: Dict[str, object] = field(default_factory=dict)


@dataclass
class _Group:
    started: int  # the iteration its generation started in
    position: int  # its prompt's position in that iteration's generation order
    row: dict  # the prompt's dataset row (input_ids, labels, index, ...)
    samples: List[_Sample]

    @property
    def key(self) -> Tuple[int, int]:
        return self.started, self.position

    @property
    def finished(self) -> bool:
        return all(s.reason is not None for s in self.samples)


def _group_state(g: _Group) -> dict:
    return {"started": g.started, "position": g.position, "row": g.row,
            "samples": [{"sample_id": s.sample_id, "response": list(s.response), "log_probs": s.log_probs,
                         "reason": s.reason, "routing": s.routing, "observed": [list(a) for a in s.observed],
                         "tool_state": dict(s.tool_state)} for s in g.samples]}


def _group_from_state(state: dict) -> _Group:
    return _Group(int(state["started"]), int(state["position"]), dict(state["row"]),
                  [_Sample(int(s["sample_id"]), list(s["response"]), s["log_probs"], s["reason"], s["routing"],
                           [tuple(a) for a in s.get("observed", [])],  # an older state's turn_start: the last end
                           dict(s.get("tool_state", {}))) for s in state["samples"]])


def pending(state: Optional[dict]) -> Tuple[int, int]:
    """(unfinished samples, finished groups) a saved `PartialRollouts.state_dict()` holds; (0, 0) for None."""
    if not state:
        return 0, 0
    unfinished = sum(s["reason"] is None for rank in state["carried"] for g in rank for s in g["samples"])
    return unfinished, len(state["ready"])


class PartialRollouts:
    """This DP rank's carried groups and every rank's finished ones, and the rounds of one iteration (module doc): the
    `partial` schedule (`base.Schedule`) over the run's `generator`. `gather(obj)` is every DP rank's `obj` in rank
    order."""

    name = "partial"
    flag = "--partial-rollout"
    state_key = "partial_rollout"  # its state's key in the checkpoint's loop state (the key of older checkpoints)
    replaces_generation = False
    scored = False

    def __init__(self, generator, *, local_groups: int, max_split: int, max_rounds: int, dp_rank: int = 0,
                 dp_size: int = 1, gather: Callable[[object], list] = distributed.gather_over_data_parallel):
        self.generator, self.sampling = generator, generator.sampling
        self.group_size, self.local_groups = int(generator.samples_per_prompt), int(local_groups)
        self.max_split, self.max_rounds = int(max_split), int(max_rounds)
        self.step_tokens = math.ceil(generator.whole_budget / self.max_split)  # k, a round's tokens per sample
        self.round_stats: List[dict] = []  # the `Rollout.stats` of this iteration's rounds
        self.dp_rank, self.dp_size, self.gather = int(dp_rank), int(dp_size), gather
        self.carried: List[_Group] = []  # this rank's unfinished groups, in key order
        self.ready: List[_Group] = []  # every rank's finished groups, the same on every rank, in key order

    @classmethod
    def refuses(cls, generator: type) -> Optional[str]:
        if not generator.continues:
            return f"the {generator.name} generator cannot continue a sample carried from an earlier round"
        return None

    @classmethod
    def selected(cls, settings) -> bool:
        return bool(settings.algorithm.partial_rollout)

    @classmethod
    def from_settings(cls, settings, generator) -> "PartialRollouts":
        """The stage's partial rollouts over `generator`; refuses a model the continuous engine cannot run."""
        from mindspeed_llm.inference.generation import continuous_engine_blockers

        blockers = continuous_engine_blockers(generator.actor_module)
        if blockers:
            raise ArgumentError("--partial-rollout continues carried samples in the continuous generation engine, "
                                f"which cannot run this actor: {'; '.join(blockers)}; drop --partial-rollout or "
                                "remove the cause")
        dp_rank, dp_size = distributed.data_parallel_info()
        algorithm = settings.algorithm
        return cls(generator, local_groups=settings.batch.global_batch_size // dp_size,
                   max_split=algorithm.partial_rollout_max_split, max_rounds=algorithm.max_num_gen_batches,
                   dp_rank=dp_rank, dp_size=dp_size)

    # ------------------------------------------------------------------ one iteration
    def collect(self, iteration: int, prompts) -> Tuple[Experience, Dict[str, float]]:
        """This rank's training batch of iteration `iteration` (its share of the oldest --global-batch-size finished
        groups, a group's samples consecutive) and the `partial_rollout/*` metrics. `prompts.first_batch` are this
        rank's prompts of the sampler's batch for this iteration, `prompts.more(j)` those of the j-th further one
        (`base.PromptSource`)."""
        rows = prompts.first_batch
        rounds = 0
        wanted = self.local_groups * self.dp_size
        self.round_stats, started_at = [], time.perf_counter()
        while len(self.ready) < wanted:  # the same list on every rank: every rank decides alike
            if rounds >= self.max_rounds:
                raise PartialRolloutBudgetError(
                    f"--max-num-gen-batches {self.max_rounds}: iteration {iteration} generated {rounds} batches and "
                    f"finished {len(self.ready)} of the {wanted} prompt groups of a --global-batch-size with "
                    f"--partial-rollout-max-split {self.max_split} ({self.step_tokens} tokens per sample and batch); "
                    "raise --max-num-gen-batches or lower --partial-rollout-max-split")
            fresh = rows if rounds == 0 else prompts.more(rounds)
            groups = self.carried + [self._new_group(iteration, row) for row in fresh]
            self._generate(iteration, groups)
            self.carried = [g for g in groups if not g.finished]
            shares = self.gather([g for g in groups if g.finished])
            self.ready = sorted(self.ready + [g for finished in shares for g in finished], key=lambda g: g.key)
            rounds += 1
        if rounds == 0:  # a global batch had finished already: the sampler's batch waits, not started, behind the
            self.carried += [self._new_group(iteration, row) for row in rows]  # carried groups
        carried_out = sum(self.gather(sum(s.reason is None for g in self.carried for s in g.samples)))
        batch, self.ready = self.ready[:wanted], self.ready[wanted:]
        mine = batch[self.dp_rank * self.local_groups:(self.dp_rank + 1) * self.local_groups]
        metrics = {
            "partial_rollout/rounds": float(rounds),
            "partial_rollout/carried": float(carried_out),
            "partial_rollout/max_staleness": float(max(iteration - g.started for g in batch)),
            "partial_rollout/waiting": float(len(self.ready)),
        }
        exp = self._experience(mine)
        metrics.update(self.generator.metrics(exp, self.round_stats, time.perf_counter() - started_at))
        return exp, metrics

    def _new_group(self, iteration: int, row: dict) -> _Group:
        position = int(row["position"])  # sample k draws from stream position * n + k, as `rollout.rollout`
        return _Group(iteration, position, dict(row),
                      [_Sample(position * self.group_size + k) for k in range(self.group_size)])

    def _generate(self, iteration: int, groups: List[_Group]) -> None:
        """One round over the unfinished samples of `groups` (in order); updates them in place. Every sample draws
        from the stream of the iteration its group started in (`Continuation.iteration`), tokens or none yet."""
        todo = [(g, s) for g in groups for s in g.samples if s.reason is None]
        rows = [g.row for g, _ in todo]
        prompt_lengths = [len(g.row["input_ids"]) for g, _ in todo]
        whole = self.generator.response_budgets(prompt_lengths)
        budgets = [min(w, len(s.response) + self.step_tokens) for w, (_, s) in zip(whole, todo)]
        continuations = [Continuation(list(s.response), s.log_probs if s.response else [], g.started,
                                      observed=tuple(s.observed), state=dict(s.tool_state))
                         for g, s in todo]
        result = self.generator.generate(iteration, rows, [s.sample_id for _, s in todo], continuations, budgets)
        self.round_stats.append(dict(result.stats))
        lengths = result.response_lengths.tolist()
        for b, ((g, s), length, reason) in enumerate(zip(todo, lengths, result.finish_reasons)):
            s.response = result.responses[b, :length].tolist()
            s.log_probs = result.log_probs[b, :length].tolist() if result.log_probs is not None else None
            cut = self.generator.carried(reason, length, whole[b])
            s.reason = None if cut else reason
            if result.tool_mask is not None:
                s.observed = _spans(result.tool_mask[b, :length].tolist())
            if result.trajectories is not None:
                s.tool_state = dict(result.trajectories[b])
            if not cut and result.routing is not None:
                s.routing = result.routing[b, :, :prompt_lengths[b] + length].cpu()

    def _experience(self, groups: List[_Group]) -> Experience:
        """The finished `groups` as an Experience (the layout of `Rollout.sequences()`), with `rollout.rollout`'s
        sample data and each sample's `sample_ids` and `started` iteration."""
        pairs = [(g, s) for g in groups for s in g.samples]
        dev, pad = device.current_device(), self.sampling.pad_id
        observes = self.generator.observes
        prompts = [[int(t) for t in g.row["input_ids"]] for g, _ in pairs]
        B, P = len(pairs), max(len(p) for p in prompts)
        R = max(1, max(len(s.response) for _, s in pairs))
        prompt_tokens = torch.full((B, P), pad, dtype=torch.long)
        responses = torch.full((B, R), pad, dtype=torch.long)
        for b, (prompt, (_, s)) in enumerate(zip(prompts, pairs)):
            prompt_tokens[b, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            responses[b, :len(s.response)] = torch.tensor(s.response, dtype=torch.long)
        lengths = torch.tensor([len(s.response) for _, s in pairs], dtype=torch.long)
        mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
        log_probs = None
        if all(s.log_probs is not None for _, s in pairs):
            log_probs = torch.zeros((B, R), dtype=torch.float32)
            for b, (_, s) in enumerate(pairs):
                log_probs[b, :len(s.log_probs)] = torch.tensor(s.log_probs, dtype=torch.float32)
        routing = None
        if all(s.routing is not None for _, s in pairs):  # [B, layers, T, topk], -1 past each sample's tokens
            width = max(s.routing.shape[1] for _, s in pairs)
            routing = torch.stack([torch.nn.functional.pad(s.routing, (0, 0, 0, width - s.routing.shape[1]), value=-1)
                                   for _, s in pairs]).to(dev)
        reasons = [s.reason for _, s in pairs]
        result = Rollout(
            prompts=prompt_tokens.to(dev), prompt_lengths=torch.tensor([len(p) for p in prompts]).to(dev),
            responses=responses.to(dev), response_mask=mask.to(dev), response_lengths=lengths.to(dev),
            ended_with_eos=torch.tensor([r == "eos" for r in reasons], dtype=torch.bool).to(dev),
            finish_reasons=reasons, log_probs=None if log_probs is None else log_probs.to(dev), pad_token_id=pad,
            seed=self.sampling.seed if self.sampling.do_sample else None, routing=routing,
            tool_mask=observation_mask([s.observed for _, s in pairs], R).to(dev) if observes else None,
            trajectories=[dict(s.tool_state) for _, s in pairs] if observes else None,
        )
        return self.generator.experience(result, [g.row for g, _ in pairs], sample_ids=[s.sample_id for _, s in pairs],
                                         started=[g.started for g, _ in pairs])

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """What a resume needs (a collective over the DP group: call it on every rank): the finished groups and every
        DP rank's carried ones, as plain lists (and the finished samples' host routing tensors)."""
        return {"group_size": self.group_size, "ready": [_group_state(g) for g in self.ready],
                "carried": self.gather([_group_state(g) for g in self.carried]),
                "budget": {"flag": self.generator.budget_flag, "tokens": self._whole_budget(0)}}

    def _whole_budget(self, prompt_length: int) -> int:
        return self.generator.response_budgets([prompt_length])[0]

    def _check_budgets(self, state: dict) -> None:
        """Every saved response (carried or finished, of every rank: all ranks decide alike) must fit its budget in
        this run: a smaller --max-new-tokens than the responses already generated is refused naming both values
        (continuing such a sample would ask the engine for fewer tokens than it holds)."""
        groups = list(state["ready"]) + [g for rank in state["carried"] for g in rank]
        over = []
        for g in groups:
            budget = self._whole_budget(len(g["row"]["input_ids"]))
            over += [(len(s["response"]), budget) for s in g["samples"] if len(s["response"]) > budget]
        if not over:
            return
        longest = max(n for n, _ in over)
        saved = state.get("budget") or {}
        was = f", generated under {saved['flag']} {saved['tokens']}" if saved.get("tokens") else ""
        flag = self.generator.budget_flag
        raise ArgumentError(
            f"{flag} {self._whole_budget(0)}: the checkpoint's partial rollouts hold {len(over)} responses "
            f"longer than this run's budget for them (up to {longest} tokens{was}); resume with {flag} "
            f"{saved.get('tokens') or longest} (at least {longest}, within --max-length)")

    def load_state_dict(self, state: dict) -> Optional[str]:
        """Restores `state_dict()`'s buffers: this rank's carried groups at the saved DP size, or, at another one,
        the saved ranks' carried groups dealt over the ranks in key order (then returns a note saying so)."""
        if int(state["group_size"]) != self.group_size:
            raise ArgumentError(f"--n-samples-per-prompt {self.group_size}: the checkpoint's partial rollouts hold "
                                f"groups of {state['group_size']} samples; resume with --n-samples-per-prompt "
                                f"{state['group_size']}")
        self._check_budgets(state)
        self.ready = [_group_from_state(g) for g in state["ready"]]
        saved = state["carried"]
        if len(saved) == self.dp_size:
            self.carried = [_group_from_state(g) for g in saved[self.dp_rank]]
            return None
        everything = sorted((_group_from_state(g) for rank in saved for g in rank), key=lambda g: g.key)
        self.carried = everything[self.dp_rank::self.dp_size]
        return (f"--partial-rollout: the checkpoint's {len(everything)} carried prompt groups of {len(saved)} DP ranks "
                f"are dealt over this run's {self.dp_size}")

    def prompts_drawn(self, iteration: int) -> Optional[int]:
        return None  # the rounds draw what they need

    @classmethod
    def saved_work(cls, state: dict) -> Optional[str]:
        """What a saved state holds that a run without --partial-rollout would drop, or None."""
        unfinished, finished = pending(state)
        if not (unfinished or finished):
            return None
        return f"{unfinished} unfinished samples and {finished} finished prompt groups of --partial-rollout"


def _spans(mask: List[int]) -> List[Tuple[int, int]]:
    """The runs [a, b) of 1s in a 0/1 list (a response's tool answers)."""
    spans, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


__all__ = ["PartialRollouts", "PartialRolloutBudgetError", "pending"]
