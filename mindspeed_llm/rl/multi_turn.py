"""The `multi_turn` rollout strategy (`--tool-config`): the model calls tools between its turns, inside one generation.

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
(`scoring.py`). Nothing carries over between iterations.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mindspeed_llm.inference import EngineOptions, SamplingConfig, generate
from mindspeed_llm.inference.engine_inputs import source_rank
from mindspeed_llm.rl import tools as tool_lib
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics import mean_min_max
from mindspeed_llm.rl.rollout import gather_context_parallel
from mindspeed_llm.rl.settings import ToolSettings


class ToolTurns:
    """The `inference.turns.TurnHandler` of one generation: reads each ended turn's calls (every rank, from the tokens
    alone) and, on the token-picking rank, runs them and turns the answers into token ids."""

    def __init__(self, rows: Sequence[dict], tokenizer, settings: ToolSettings, executor, parser, delta):
        self.rows, self.tokenizer, self.settings = list(rows), tokenizer, settings
        self.executor, self.parser, self.delta = executor, parser, delta
        self.turn_token_limit = settings.max_new_tokens
        n = len(self.rows)
        self.turns, self.calls = [0] * n, [0] * n  # model turns ended, tool calls made (every rank)
        self.parsed: Dict[int, object] = {}
        self.futures: Dict[int, concurrent.futures.Future] = {}
        self.started: Dict[int, None] = {}
        self.tool_reward = [0.0] * n
        self.counts = dict(calls=0, failures=0, timeouts=0, seconds=0.0)

    def wants_observation(self, sample: int, known: Sequence[int], prompt_length: int, turn_start: int) -> bool:
        self.turns[sample] += 1
        limits = self.settings
        if limits.max_assistant_turns is not None and self.turns[sample] >= limits.max_assistant_turns:
            return False
        if limits.max_tool_calls is not None and self.calls[sample] >= limits.max_tool_calls:
            return False
        text = self.tokenizer.decode(list(known[prompt_length + turn_start:]), skip_special_tokens=False)
        parsed = self.parser.parse(text)
        if not parsed.calls and not parsed.errors:
            return False
        allowed = len(parsed.calls)
        if limits.max_tool_calls is not None:
            allowed = min(allowed, limits.max_tool_calls - self.calls[sample])
        self.calls[sample] += allowed
        self.parsed[sample] = (parsed, allowed)
        return True

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

    def ready(self, wait: bool) -> List[Tuple[int, List[int]]]:
        if wait and self.futures:
            concurrent.futures.wait([f for f, _ in self.futures.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        out = []
        for sample in [s for s, (f, _) in self.futures.items() if f.done()]:
            future, refusals = self.futures.pop(sample)
            result = future.result()
            self.tool_reward[sample] += float(result.reward or 0.0)
            self.counts["calls"] += len(result.messages) - result.refused
            self.counts["failures"] += result.failures + len(refusals)
            self.counts["timeouts"] += result.timeouts
            self.counts["seconds"] += float(result.seconds)
            out.append((sample, self.delta.delta_ids(list(result.messages) + refusals)))
        return out

    def close(self) -> None:
        for sample in self.started:
            self.executor.finish(sample)

    def summary(self) -> dict:
        """What only the token-picking rank knows, for every rank of the group."""
        return dict(tool_reward=list(self.tool_reward), counts=dict(self.counts))


def _refusals(parsed, allowed: int) -> List[str]:
    """The answers to what cannot run: malformed calls (the parser's errors) and calls past --max-tool-calls."""
    over = ["error: the limit of tool calls for this conversation is reached"] * (len(parsed.calls) - allowed)
    return list(parsed.errors) + over


def _from_picking_rank(value, group, source):
    """`value` of the token-picking rank, on every rank of the model-parallel group."""
    if source is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]


def trajectories(exp: Experience, tokenizer, parser, tool_reward: Sequence[float]) -> List[dict]:
    """Each sample's trajectory (the shape `SampleData.trajectories` documents) from its response and tool mask."""
    out = []
    for b in range(exp.batch_size):
        length = int(exp.response_mask[b].sum())
        ids, tool = exp.responses[b, :length].tolist(), exp.tool_mask[b, :length].tolist()
        turns, start = [], 0
        for j in range(1, length + 1):
            if j == length or tool[j] != tool[start]:
                text = tokenizer.decode(ids[start:j], skip_special_tokens=False)
                if tool[start]:
                    turns.append({"role": "tool", "text": text})
                else:
                    calls = [{"name": c.name, "arguments": c.arguments} for c in parser.parse(text).calls]
                    turns.append({"role": "assistant", "text": text, "tool_calls": calls})
                start = j
        answered = sum(len(t["tool_calls"]) for t, after in zip(turns, turns[1:]) if after["role"] == "tool")
        out.append({"turns": turns, "num_turns": sum(t["role"] == "assistant" for t in turns),
                    "tool_calls": answered, "tool_reward": float(tool_reward[b])})
    return out


class MultiTurnRollouts:
    """The `multi_turn` rollout strategy (`rollout_strategies`; module docstring)."""

    name = "multi_turn"
    flag = "--tool-config"

    def __init__(self, actor_module, tokenizer, sampling: SamplingConfig, settings: ToolSettings,
                 samples_per_prompt: int, max_length: int):
        self.actor_module, self.tokenizer, self.sampling, self.settings = actor_module, tokenizer, sampling, settings
        self.samples_per_prompt, self.max_length = int(samples_per_prompt), int(max_length)
        self.tools = tool_lib.load_tool_config(settings.tool_config)  # a user's module may register a parser
        self.parser = tool_lib.get_parser(settings.tool_parser_format)
        # checks once that the chat template extends its prefix unchanged (token-in / token-out)
        self.delta = tool_lib.ToolDelta(tokenizer, max_tool_response_length=settings.max_tool_response_length,
                                        truncate_side=settings.tool_response_truncate_side)

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling: SamplingConfig) -> "MultiTurnRollouts":
        return cls(actor_module, tokenizer, sampling, settings.tools, settings.algorithm.n_samples_per_prompt,
                   settings.sampling.max_length)

    def collect(self, iteration: int, prompts) -> Tuple[Experience, Dict[str, float]]:
        n, rows = self.samples_per_prompt, prompts.first_batch
        samples = [row for row in rows for _ in range(n)]
        ids = [list(row["input_ids"]) for row in samples]
        sample_ids = [row.get("position", i) * n + k for i, row in enumerate(rows) for k in range(n)]
        budgets = [min(self.settings.max_total_response_length, self.max_length - len(p)) for p in ids]
        executor = tool_lib.ToolExecutor(self.tools, max_workers=self.settings.tool_workers,
                                         timeout=self.settings.tool_timeout,
                                         max_parallel_calls=self.settings.max_parallel_calls)
        turns = ToolTurns(samples, self.tokenizer, self.settings, executor, self.parser, self.delta)
        start = time.perf_counter()
        try:
            result = generate(self.actor_module, ids, self.sampling, iteration=iteration, sample_ids=sample_ids,
                              vocab_size=len(self.tokenizer), response_budgets=budgets, turns=turns,
                              options=EngineOptions(parked_kv=self.settings.parked_kv))
        finally:
            turns.close()
            executor.close()
        seconds = time.perf_counter() - start
        group, source = source_rank()
        told = _from_picking_rank(turns.summary(), group, source)
        exp = Experience.from_rollout(result)
        exp.sample_data = SampleData.of_prompts(samples, finish_reasons=list(result.finish_reasons),
                                                texts=result.decode(self.tokenizer))
        exp.sample_data.trajectories = trajectories(exp, self.tokenizer, self.parser, told["tool_reward"])
        metrics = self._metrics(exp, told["counts"], result.stats.get("observation_wait_seconds", 0.0), seconds)
        return gather_context_parallel(exp), metrics

    @staticmethod
    def _metrics(exp: Experience, counts: dict, wait_seconds: float, seconds: float) -> Dict[str, float]:
        turns = torch.tensor([t["num_turns"] for t in exp.sample_data.trajectories], dtype=torch.float32)
        metrics = mean_min_max("num_turns", turns)
        metrics.update({"tool/calls": float(counts["calls"]), "tool/failures": float(counts["failures"]),
                        "tool/timeouts": float(counts["timeouts"]), "tool/seconds": float(counts["seconds"]),
                        "tool/response_length/mean": float(exp.tool_mask.sum(-1).float().mean()),
                        "tool/wait_share": wait_seconds / seconds if seconds > 0 else 0.0})
        return metrics

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> Optional[str]:
        return None

    @classmethod
    def saved_work(cls, state: dict) -> Optional[str]:
        return None
