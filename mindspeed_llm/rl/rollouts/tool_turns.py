"""The `tools` sample generator (`--tool-config`): the model calls tools between its turns, inside one generation.

Each sample is one trajectory: model turn, tool answers, model turn, ... The continuous engine runs them
(`inference/turns.py`): when a turn ends (EOS / stop) and `ToolTurns.wants_observation` finds tool calls in it (the
`--tool-parser-format` parser, within --max-assistant-turns and --max-tool-calls), the sample is parked, its calls run
in the tool pool on the token-picking rank (`tools.ToolExecutor`: --max-parallel-calls per turn, --tool-timeout per
call, a failure or timeout answered with its error text), and the answers come back as the chat template's tool-role
delta (`tools.ToolDelta`), token ids appended to the sample's own sampled ids: nothing the model wrote is decoded and
re-tokenized. Other samples decode meanwhile. A trajectory ends with a turn without calls, at a limit, or when its
tokens reach --max-total-response-length (each model turn within --max-new-tokens).

The Experience holds the whole trajectory after the prompt; `tool_mask` marks the tool tokens (fed, never trained on:
`Experience.action_mask`). `SampleData.trajectories` holds each one's turns, calls and tool rewards for the rewards
(`scoring.py`).

The turn handler (`ToolTurns`) keeps one record per sample (`ToolTurns.record`): its turn count, its tools' reward
and own metrics, and each model turn's calls, parsed once when the turn ended (its call count, which --max-tool-calls
limits, is made from them); the generator returns it in `Rollout.trajectories`, and a continued sample (a partial
rollout's) hands it back in `Continuation.state`. The tools' counts and own metrics (`tool/<name>/<metric>`) of a
generation ride in `Rollout.stats`. What a tool answer brings (reward, counts, metrics) reaches every rank of the
model-parallel group with the answer's ids (`ToolTurns.observed`, `inference/turns.py`), so nothing crosses the ranks
after generation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mindspeed_llm.inference import Rollout, SamplingConfig
from mindspeed_llm.rl import tools as tool_lib
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.metrics import mean_min_max
from mindspeed_llm.rl.rollouts.plain import PlainGenerator
from mindspeed_llm.rl.settings import ToolSettings


class ToolTurns:
    """The `inference.turns.TurnHandler` of one generation: reads each ended turn's calls (every rank, from the tokens
    alone) and, on the token-picking rank, runs them and turns the answers into token ids."""

    def __init__(self, rows: Sequence[dict], tokenizer, settings: ToolSettings, executor, parser, delta,
                 budgets: Sequence[int], states: Optional[Sequence[dict]] = None):
        self.rows, self.tokenizer, self.settings = list(rows), tokenizer, settings
        self.executor, self.parser, self.delta = executor, parser, delta
        self.turn_token_limit = settings.max_new_tokens
        self.budgets = list(budgets)  # each trajectory's whole budget (a partial rollout's call gets a share of it)
        states = states or [{}] * len(self.rows)  # a continued trajectory's counts so far (partial rollouts)
        # model turns ended, the tools' rewards (every rank: `observed` takes the tools' notes)
        self.turns = [int(st.get("turns", 0)) for st in states]
        self.tool_reward = [float(st.get("tool_reward", 0.0)) for st in states]
        # the tools' own metrics of its calls, summed by `<name>/<metric>` (every rank)
        self.tool_metrics = [{str(k): float(v) for k, v in dict(st.get("tool_metrics", {})).items()} for st in states]
        # each model turn's calls, parsed once when it ended (every rank): response span start -> (its end, calls);
        # the one count of a trajectory's calls (`calls`, --max-tool-calls) is made from them
        self.turn_calls: List[Dict[int, Tuple[int, List[dict]]]] = [
            {int(a): (int(end), list(calls)) for a, (end, calls) in dict(st.get("parsed", {})).items()}
            for st in states]
        # a record saved before it kept its turns' calls (a partial rollout's older checkpoint) brings its count
        self.calls_before = [max(int(st.get("calls", 0)) - _counted_calls(parsed, settings.max_tool_calls), 0)
                             for st, parsed in zip(states, self.turn_calls)]
        self.parsed: Dict[int, object] = {}
        self.futures: Dict[int, concurrent.futures.Future] = {}
        self.started: Dict[int, None] = {}
        # the calls run (every rank, from the notes): `tool/calls`, ... and the tools' own, `tool/<name>/<metric>`
        self.counts: Dict[str, float] = dict(calls=0, failures=0, timeouts=0, seconds=0.0)

    def trajectory_budget(self, sample: int) -> int:
        return self.budgets[sample]

    def wants_observation(self, sample: int, known: Sequence[int], prompt_length: int, turn_start: int) -> bool:
        self.turns[sample] += 1
        limits = self.settings
        if limits.max_assistant_turns is not None and self.turns[sample] >= limits.max_assistant_turns:
            return False
        made = self.calls(sample)
        if limits.max_tool_calls is not None and made >= limits.max_tool_calls:
            return False
        text = self.tokenizer.decode(list(known[prompt_length + turn_start:]), skip_special_tokens=False)
        parsed = self.parser.parse(text)
        self.turn_calls[sample][turn_start] = (len(known) - prompt_length,
                                               [{"name": c.name, "arguments": c.arguments} for c in parsed.calls])
        if not parsed.calls and not parsed.errors:
            return False
        allowed = len(parsed.calls)
        if limits.max_tool_calls is not None:
            allowed = min(allowed, limits.max_tool_calls - made)
        self.parsed[sample] = (parsed, allowed)
        return True

    def calls(self, sample: int) -> int:
        """The tool calls `sample` made (given to the tool pool: run, or refused past --max-parallel-calls), those
        past --max-tool-calls not counted: each parsed turn's calls, within what the limit left."""
        return _counted_calls(self.turn_calls[sample], self.settings.max_tool_calls, self.calls_before[sample])

    def begin(self, sample: int, known, prompt_length: int, turn_start: int) -> None:
        parsed, allowed = self.parsed.pop(sample)
        if sample not in self.started:
            self.started[sample] = None
            self.executor.start(sample, self.rows[sample])
        refusals = _refusals(parsed, allowed)
        if allowed:
            self.futures[sample] = (self.executor.submit(sample, parsed.calls[:allowed]), refusals)
        else:  # nothing to run: the answers are the refusals alone
            done = concurrent.futures.Future()
            done.set_result(tool_lib.TurnResult(messages=[]))
            self.futures[sample] = (done, refusals)

    def ready(self, wait: bool) -> List[Tuple[int, List[int], dict]]:
        if wait and self.futures:
            concurrent.futures.wait([f for f, _ in self.futures.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        out = []
        for sample in [s for s, (f, _) in self.futures.items() if f.done()]:
            future, refusals = self.futures.pop(sample)
            result = future.result()
            # what the record and the counts take from this turn's calls, on every rank (`observed`)
            counts = {"calls": len(result.messages) - result.refused, "failures": result.failures + len(refusals),
                      "timeouts": result.timeouts, "seconds": float(result.seconds)}
            own = {f"{name}/{key}": value for name, metrics in result.metrics.items() for key, value in metrics.items()}
            note = {"reward": float(result.reward or 0.0), "counts": counts, "metrics": own}
            out.append((sample, self.delta.delta_ids(list(result.messages) + refusals), note))
        return out

    def observed(self, sample: int, note: dict) -> None:
        self.tool_reward[sample] += note["reward"]
        for key, value in {**note["counts"], **note["metrics"]}.items():
            self.counts[key] = self.counts.get(key, 0.0) + value
        for key, value in note["metrics"].items():
            self.tool_metrics[sample][key] = self.tool_metrics[sample].get(key, 0.0) + value

    def close(self) -> None:
        for sample in self.started:
            self.executor.finish(sample)

    def record(self, sample: int) -> dict:
        """`sample`'s record of its trajectory so far (`Rollout.trajectories`, handed back as `Continuation.state`):
        its turn count, its tools' reward and own metrics, the calls of each turn parsed when it ended and their count
        (`calls`, made from them)."""
        return {"turns": self.turns[sample], "calls": self.calls(sample),
                "tool_reward": float(self.tool_reward[sample]), "tool_metrics": dict(self.tool_metrics[sample]),
                "parsed": {a: [end, calls] for a, (end, calls) in self.turn_calls[sample].items()}}


def _counted_calls(turn_calls: Dict[int, Tuple[int, List[dict]]], limit: Optional[int], made: int = 0) -> int:
    """`made` plus each parsed turn's calls (span start -> (its end, calls)), in turn order, within `limit`
    (--max-tool-calls; None: no limit)."""
    for _, (_, calls) in sorted(turn_calls.items()):
        made += len(calls) if limit is None else min(len(calls), max(limit - made, 0))
    return made


def _refusals(parsed, allowed: int) -> List[str]:
    """The answers to what cannot run: malformed calls (the parser's errors) and calls past --max-tool-calls."""
    over = ["error: the limit of tool calls for this conversation is reached"] * (len(parsed.calls) - allowed)
    return list(parsed.errors) + over


def trajectories(exp: Experience, tokenizer, parser, tool_reward: Sequence[float],
                 parsed: Optional[Sequence[Optional[dict]]] = None) -> List[dict]:
    """Each sample's trajectory (the shape `SampleData.trajectories` documents) from its response and tool mask; a
    model turn's calls are those parsed when it ended (`parsed[b]`: span start -> [its end, calls], `ToolTurns`),
    only a turn never parsed (the last, cut by a limit) is parsed here."""
    out = []
    for b in range(exp.batch_size):
        known = (parsed[b] if parsed is not None else None) or {}
        length = int(exp.response_mask[b].sum())
        ids, tool = exp.responses[b, :length].tolist(), exp.tool_mask[b, :length].tolist()
        turns, start = [], 0
        for j in range(1, length + 1):
            if j == length or tool[j] != tool[start]:
                text = tokenizer.decode(ids[start:j], skip_special_tokens=False)
                if tool[start]:
                    turns.append({"role": "tool", "text": text})
                else:
                    end, calls = known.get(start, (None, None))
                    if end != j:  # not parsed when it ended (or another span): parsed now
                        calls = [{"name": c.name, "arguments": c.arguments} for c in parser.parse(text).calls]
                    turns.append({"role": "assistant", "text": text, "tool_calls": calls})
                start = j
        answered = sum(len(t["tool_calls"]) for t, after in zip(turns, turns[1:]) if after["role"] == "tool")
        out.append({"turns": turns, "num_turns": sum(t["role"] == "assistant" for t in turns),
                    "tool_calls": answered, "tool_reward": float(tool_reward[b])})
    return out


class ToolBox:
    """The run's tools, call parser and chat-template delta (loaded once, on every rank), and one generation's tool
    loop around them (`session`), for the `tools` generator."""

    def __init__(self, settings: ToolSettings, tokenizer, max_length: int):
        self.settings, self.tokenizer, self.max_length = settings, tokenizer, int(max_length)
        # built by argument validation (taken once; built afresh otherwise); a user's module may register a parser
        self.tools = tool_lib.load_tool_config(settings.tool_config, cache="take")
        self.parser = tool_lib.get_parser(settings.tool_parser_format)
        # checks once that the chat template extends its prefix unchanged (token-in / token-out)
        self.delta = tool_lib.ToolDelta(tokenizer, max_tool_response_length=settings.max_tool_response_length,
                                        truncate_side=settings.tool_response_truncate_side)

    def trajectory_budget(self, prompt_length: int) -> int:
        """A trajectory's tokens after its prompt: --max-total-response-length, within --max-length."""
        return min(self.settings.max_total_response_length, self.max_length - prompt_length)

    @contextlib.contextmanager
    def session(self, rows: Sequence[dict], budgets: Sequence[int], states: Optional[Sequence[dict]] = None):
        """A `ToolTurns` for one generation over `rows` (a sample each), its worker pool closed afterwards."""
        settings = self.settings
        executor = tool_lib.ToolExecutor(self.tools, max_workers=settings.tool_workers, timeout=settings.tool_timeout,
                                         max_parallel_calls=settings.max_parallel_calls)
        turns = ToolTurns(rows, self.tokenizer, settings, executor, self.parser, self.delta, budgets, states)
        try:
            yield turns
        finally:
            turns.close()
            executor.close()

    def trajectories(self, exp: Experience, tool_reward: Sequence[float], parsed=None) -> List[dict]:
        return trajectories(exp, self.tokenizer, self.parser, tool_reward, parsed)


def tool_metrics(exp: Experience, counts: dict, wait_seconds: float, seconds: float) -> Dict[str, float]:
    """`num_turns/*` of the trained trajectories; `tool/*` of the calls made (`counts`); the share of the rollout
    the engine waited on tools with nothing else to decode."""
    turns = torch.tensor([t["num_turns"] for t in exp.sample_data.trajectories], dtype=torch.float32)
    metrics = mean_min_max("num_turns", turns)
    metrics.update({f"tool/{key}": float(value) for key, value in counts.items()})  # the tools' own: tool/NAME/KEY
    metrics.update({"tool/response_length/mean": float(exp.tool_mask.sum(-1).float().mean()),
                    "tool/wait_share": wait_seconds / seconds if seconds > 0 else 0.0})
    return metrics


class ToolTurnsGenerator(PlainGenerator):
    """The `tools` sample generator (`base.SampleGenerator`, `--tool-config`; module docstring): a sample is a
    trajectory of model turns and tool answers within --max-total-response-length; a continued one (a partial
    rollout's carried sample) keeps its turn, call and reward counts (`Continuation.state`)."""

    name = "tools"
    flag = "--tool-config"
    budget_flag = "--max-total-response-length"
    observes = True

    def __init__(self, actor_module, tokenizer, sampling: SamplingConfig, toolbox: ToolBox,
                 samples_per_prompt: int = 1):
        super().__init__(actor_module, tokenizer, sampling, samples_per_prompt)
        self.toolbox = toolbox

    @classmethod
    def selected(cls, settings) -> bool:
        return bool(settings.tools.tool_config)

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling: SamplingConfig) -> "ToolTurnsGenerator":
        toolbox = ToolBox(settings.tools, tokenizer, settings.sampling.max_length)
        return cls(actor_module, tokenizer, sampling, toolbox, settings.algorithm.n_samples_per_prompt)

    @property
    def whole_budget(self) -> int:
        return self.toolbox.settings.max_total_response_length

    def response_budgets(self, prompt_lengths: Sequence[int]) -> List[int]:
        return [self.toolbox.trajectory_budget(n) for n in prompt_lengths]

    def generate(self, iteration: int, samples: Sequence[dict], sample_ids: Sequence[int], continuations=None,
                 budgets=None, sampling: Optional[SamplingConfig] = None) -> Rollout:
        from mindspeed_llm.inference import EngineOptions

        prompts = [list(row["input_ids"]) for row in samples]
        whole = self.response_budgets([len(p) for p in prompts])
        states = None if continuations is None else [(c.state if c is not None else None) or {} for c in continuations]
        with self.toolbox.session(samples, whole, states) as turns:
            result = self.engine(iteration, prompts, sample_ids, continuations, whole if budgets is None else budgets,
                                 sampling or self.sampling, turns=turns,
                                 options=EngineOptions(parked_kv=self.toolbox.settings.parked_kv))
        # every rank's records and counts are whole: the tools' answers brought them with their ids
        result.trajectories = [turns.record(b) for b in range(len(prompts))]
        result.stats = {**result.stats, **{f"tool/{key}": value for key, value in turns.counts.items()}}
        return result

    def carried(self, reason: str, length: int, whole: int) -> bool:
        return reason == "unfinished"  # a "length" ends the trajectory: its turn reached --max-new-tokens

    def experience(self, result: Rollout, samples: Sequence[dict], **sample_data) -> Experience:
        exp = super().experience(result, samples, **sample_data)
        records = result.trajectories or [{}] * exp.batch_size
        exp.sample_data.trajectories = self.toolbox.trajectories(
            exp, [float(r.get("tool_reward", 0.0)) for r in records], [r.get("parsed") for r in records])
        return exp

    def metrics(self, exp: Experience, stats: Sequence[Dict[str, float]], seconds: float) -> Dict[str, float]:
        counts = dict.fromkeys(("calls", "failures", "timeouts", "seconds"), 0.0)
        for s in stats:  # the calls' counts and the tools' own metrics of every generation call
            for key, value in s.items():
                if key.startswith("tool/"):
                    counts[key[5:]] = counts.get(key[5:], 0.0) + float(value)
        waited = sum(float(s.get("observation_wait_seconds", 0.0)) for s in stats)
        return tool_metrics(exp, counts, waited, seconds)
