r"""Tool-use conversations in ``transformers``: the demo's evaluation with a tool, and an independent reference for the
engine's multi-turn rollouts (``rl/rollouts/tool_turns.py``).

:func:`run_conversations` plays every prompt's conversation turn by turn: the model writes a turn (until the end-of-turn
token ``<|im_end|>`` or the turn's ``max_new_tokens``), the Hermes parser reads its ``<tool_call>`` blocks, the tools
run (``ToolExecutor``), and their answers are appended as the chat template's tool-role delta
(``ToolDelta.delta_ids``) to the sample's own ids (token-in / token-out, as the engine does); the next turn follows,
within ``max_assistant_turns``, ``max_tool_calls`` and ``max_total_response_length`` (model + tool tokens). The
generation is a function ``generate(inputs, max_new_tokens) -> new ids`` (:func:`hf_generator` for a Hugging Face
model; the tests script one), so the loop itself needs no model.

:func:`evaluate_tools_hf` scores the conversations of held-out rows with :func:`~mindspeed_llm.demo.tool_task.final_answer`
and counts the tool use: ``tool_call_rate`` (share of conversations whose first turn holds a well-formed call, to any tool name),
``clean_call_rate`` (such a call and no failed call: a known tool with good arguments),
``calls`` / ``failures`` per conversation, ``num_turns``.

    python -m mindspeed_llm.demo.tool_eval MODEL_DIR --problems test.json --tool-config tools.yaml
    python -m mindspeed_llm.demo.tool_eval MODEL_DIR --measure mul3x2 mul3x2_hint --n 32 --output m.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

__all__ = ["ToolLoopSettings", "run_conversations", "hf_generator", "common_prefix_length", "render_tool_prompts",
           "evaluate_tools_hf", "tool_metrics"]

Generate = Callable[[List[List[int]], int], List[List[int]]]


@dataclass(frozen=True)
class ToolLoopSettings:
    """The limits of a conversation, with the stage's flag names."""

    max_assistant_turns: int = 3
    max_tool_calls: int = 2
    max_new_tokens: int = 48  # one model turn
    max_total_response_length: int = 192  # model + tool tokens after the prompt
    max_tool_response_length: int = 64


def _end_of_turn(ids: Sequence[int], eos_ids: Sequence[int]):
    """(ids up to and including the first end-of-turn id, whether one was found)."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return list(ids[:i + 1]), True
    return list(ids), False


class _Conversation:
    def __init__(self, index: int, prompt: List[int]):
        self.index, self.prompt = index, list(prompt)
        self.response: List[int] = []
        self.tool_mask: List[int] = []
        self.turns: List[dict] = []
        self.calls = 0
        self.failures = 0
        self.finish = ""

    def add(self, ids: List[int], tool: bool) -> None:
        self.response += ids
        self.tool_mask += [int(tool)] * len(ids)


def _tool_turn(conv, parsed, executor, delta, settings: ToolLoopSettings, row) -> Optional[List[int]]:
    """The delta ids answering ``parsed``'s calls (None: the conversation stops at a limit)."""
    allowed = min(len(parsed.calls), settings.max_tool_calls - conv.calls)
    result = executor.run(conv.index, parsed.calls[:allowed]) if allowed > 0 else None
    messages = list(result.messages) if result else []
    messages += list(parsed.errors)
    messages += ["error: the limit of tool calls for this conversation is reached"] * (len(parsed.calls) - allowed)
    conv.calls += allowed + len(parsed.errors)
    conv.failures += (result.failures + result.timeouts if result else 0) + len(parsed.errors)
    ids = delta.delta_ids(messages)
    conv.turns.append({"role": "tool", "text": "\n".join(messages)})
    if len(conv.response) + len(ids) > settings.max_total_response_length:
        conv.finish = "length"
        return None
    return ids


def run_conversations(generate: Generate, prompts: Sequence[Sequence[int]], rows: Sequence[Mapping], tools,
                      tokenizer, settings: ToolLoopSettings = ToolLoopSettings(), *, parser: str = "hermes",
                      eos_ids: Sequence[int] = (2,)) -> List[dict]:
    """Each prompt's conversation as ``{"response_ids", "tool_mask", "finish", "trajectory"}`` (the trajectory in the
    shape the rollout records: ``turns``, ``num_turns``, ``tool_calls``, ``tool_reward``); see the module docstring."""
    from mindspeed_llm.rl.tools import TOOL_PARSERS, ToolDelta, ToolExecutor

    parse = TOOL_PARSERS[parser]()
    delta = ToolDelta(tokenizer, max_tool_response_length=settings.max_tool_response_length)
    executor = ToolExecutor(tools, max_workers=4)
    convs = [_Conversation(i, p) for i, p in enumerate(prompts)]
    for conv, row in zip(convs, rows):
        executor.start(conv.index, dict(row))
    active = list(convs)
    try:
        while active:
            budgets = [min(settings.max_new_tokens, settings.max_total_response_length - len(c.response))
                       for c in active]
            outputs = generate([c.prompt + c.response for c in active], max(budgets))
            still = []
            for conv, budget, new in zip(active, budgets, outputs):
                ids, ended = _end_of_turn(list(new)[:budget], eos_ids)
                conv.add(ids, tool=False)
                text = tokenizer.decode(ids, skip_special_tokens=False)
                parsed = parse.parse(text)
                conv.turns.append({"role": "assistant", "text": text,
                                   "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]})
                n_turns = sum(t["role"] == "assistant" for t in conv.turns)
                if not ended:
                    conv.finish = "length"
                elif not parsed.has_calls:
                    conv.finish = "stop"
                elif n_turns >= settings.max_assistant_turns or conv.calls >= settings.max_tool_calls:
                    conv.finish = "turns"
                else:
                    ids = _tool_turn(conv, parsed, executor, delta, settings, rows[conv.index])
                    if ids is not None:
                        conv.add(ids, tool=True)
                        still.append(conv)
            active = still
    finally:
        for conv in convs:
            executor.finish(conv.index)
        executor.close()
    return [{"response_ids": c.response, "tool_mask": c.tool_mask, "finish": c.finish,
             "trajectory": {"turns": c.turns, "num_turns": sum(t["role"] == "assistant" for t in c.turns),
                            "tool_calls": c.calls, "tool_reward": 0.0, "failures": c.failures}}
            for c in convs]


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix all of ``seqs`` share."""
    if not seqs:
        return 0
    n = min(len(x) for x in seqs)
    first = seqs[0]
    for i in range(n):
        t = first[i]
        if any(x[i] != t for x in seqs):
            return i
    return n


def hf_generator(model, pad_id: int, eos_ids: Sequence[int], *, do_sample: bool = False, temperature: float = 1.0,
                 batch_size: int = 16, seed: int = 0, share_prefix: bool = True, min_shared: int = 32) -> Generate:
    """A `Generate` for a Hugging Face causal LM: batches padded on the left, greedy or pure temperature sampling
    (top_k 0, top_p 1), each turn ending at an id of ``eos_ids``.

    ``share_prefix``: where a batch's inputs share a prefix of ``min_shared`` tokens or more (the tools' block and
    the worked examples: about 380 of the demo's 393 prompt tokens), that prefix is prefilled once and its KV cache
    repeated over the batch; the rows' own tokens follow it with the padding between the two (masked; the positions
    come from the attention mask, so every row sees the positions of its unpadded sequence). Per row it is the same
    computation as without sharing, up to the floating-point order of the attention's sums."""
    import torch

    gen = dict(pad_token_id=int(pad_id), eos_token_id=[int(t) for t in eos_ids])
    if do_sample:
        gen.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        gen.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    import inspect

    # transformers 5.x names the KV cache argument `cache` (`past_key_values` before, deprecated since)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def shared_cache(prefix: List[int], rows: int):
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([prefix]), use_cache=True, **{cache_arg: cache})
        cache.batch_repeat_interleave(rows)
        return cache

    def generate(inputs: List[List[int]], max_new_tokens: int) -> List[List[int]]:
        out: List[List[int]] = [[] for _ in inputs]
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))  # similar lengths share a batch
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            shared = 0
            if share_prefix:
                shared = min(common_prefix_length([inputs[i] for i in chunk]),
                             min(len(inputs[i]) for i in chunk) - 1)  # every row keeps a token of its own
                shared = shared if shared >= min_shared else 0
            width = max(len(inputs[i]) for i in chunk) - shared
            ids = torch.full((len(chunk), shared + width), int(pad_id), dtype=torch.long)
            mask = torch.zeros((len(chunk), shared + width), dtype=torch.long)
            if shared:
                ids[:, :shared] = torch.tensor(inputs[chunk[0]][:shared])
                mask[:, :shared] = 1
            for r, i in enumerate(chunk):
                own = inputs[i][shared:]
                ids[r, shared + width - len(own):] = torch.tensor(own)
                mask[r, shared + width - len(own):] = 1
            extra = {cache_arg: shared_cache(inputs[chunk[0]][:shared], len(chunk))} if shared else {}
            with torch.no_grad():
                res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=int(max_new_tokens), **gen,
                                     **extra)
            for r, i in enumerate(chunk):
                out[i] = res[r, shared + width:].tolist()
        return out

    return generate


def render_tool_prompts(tokenizer, rows: Sequence[Mapping], schemas: Sequence[Mapping]) -> List[str]:
    """The prompt of each row as the stage offers it (``--prompt-type chatml`` data, ``--tool-config``): the row's
    ``system`` text followed by the tools' Hermes block in the system message, then the user's problem."""
    from mindspeed_llm.rl.tools import tools_prompt

    out = []
    for row in rows:
        messages = [dict(m) for m in row.get("messages") or [{"role": "user", "content": row["problem"]}]]
        if str(row.get("system") or "").strip():
            messages.insert(0, {"role": "system", "content": str(row["system"])})
        out.append(tools_prompt(tokenizer, messages, list(schemas)))
    return out


def tool_metrics(convs: Sequence[dict], scores: Sequence[float]) -> dict:
    """Accuracy and tool use of conversations (see the module docstring)."""
    n = len(convs)
    if not n:
        return {"accuracy": 0.0, "n": 0}
    first_call = [bool(c["trajectory"]["turns"][0].get("tool_calls")) for c in convs]
    lengths = [len(c["response_ids"]) for c in convs]
    model_tokens = [len(c["tool_mask"]) - sum(c["tool_mask"]) for c in convs]
    return {
        "accuracy": sum(scores) / n,
        "tool_call_rate": sum(first_call) / n,
        # a first-turn call and no failed call in the conversation (a known tool, good arguments)
        "clean_call_rate": sum(f and not c["trajectory"]["failures"] for f, c in zip(first_call, convs)) / n,
        "accuracy_with_call": (sum(s for s, f in zip(scores, first_call) if f) / max(1, sum(first_call))),
        "calls": sum(c["trajectory"]["tool_calls"] for c in convs) / n,
        "failures": sum(c["trajectory"]["failures"] for c in convs) / n,
        "num_turns": sum(c["trajectory"]["num_turns"] for c in convs) / n,
        "response_length": sum(lengths) / n,
        "model_tokens": sum(model_tokens) / n,
        "truncated": sum(c["finish"] == "length" for c in convs) / n,
        "n": n,
    }


def evaluate_tools_hf(model_dir, rows: Sequence[Mapping], tools, settings: ToolLoopSettings = ToolLoopSettings(), *,
                      do_sample: bool = False, temperature: float = 1.0, n_samples: int = 1, batch_size: int = 16,
                      seed: int = 0) -> dict:
    """Accuracy and tool use of a model on ``rows`` with ``tools`` offered (greedy, or ``n_samples`` samples per row
    at ``temperature``). ``model_dir``: a folder or a loaded ``(model, tokenizer)``; ``tools``: a tool config path or
    a list of tools. Returns `tool_metrics` plus ``mixed`` (share of rows whose samples got both a 0 and a 1) when
    sampling, ``seconds`` and ``samples``."""
    from mindspeed_llm.demo.evaluate import _resolve
    from mindspeed_llm.demo.tool_task import final_answer
    from mindspeed_llm.rl.tools import load_tool_config

    model, tok = _resolve(model_dir)
    if isinstance(tools, (str, Path)):
        tools = load_tool_config(str(tools))
    t0 = time.time()
    rows = [dict(r) for r in rows for _ in range(n_samples if do_sample else 1)]
    prompts = render_tool_prompts(tok, rows, [t.tool_schema for t in tools])
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    eos = [tok.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tok.get_vocab() else [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    generate = hf_generator(model, pad, eos, do_sample=do_sample, temperature=temperature, batch_size=batch_size,
                            seed=seed)
    convs = run_conversations(generate, ids, rows, tools, tok, settings, eos_ids=eos)
    texts = [tok.decode(c["response_ids"], skip_special_tokens=False) for c in convs]
    scores = [final_answer(t, r["answer"], trajectory=c["trajectory"]) for t, r, c in zip(texts, rows, convs)]
    out = tool_metrics(convs, scores)
    if do_sample:
        groups = [scores[i:i + n_samples] for i in range(0, len(scores), n_samples)]
        out["mixed"] = sum(1 for g in groups if min(g) != max(g)) / len(groups)
    out["seconds"] = time.time() - t0
    out["samples"] = [{"problem": r["problem"], "answer": r["answer"], "score": s, "finish": c["finish"],
                       "turns": [t["text"] for t in c["trajectory"]["turns"]]}
                      for r, s, c in zip(rows, scores, convs)]
    return out


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Accuracy and tool use of a HF model with a calculator offered.")
    parser.add_argument("model_dir")
    parser.add_argument("--problems", help="a JSON / JSONL file of rows (problem, answer, system)")
    parser.add_argument("--tool-config", default=None, help="default: the demo's calculator")
    parser.add_argument("--measure", nargs="*", metavar="VARIANT", help="measure these tool task variants")
    parser.add_argument("--n", type=int, default=32, help="held-out problems per variant (--measure)")
    parser.add_argument("--n-sampled", type=int, default=0, help="problems sampled 4x at --temperature (--measure)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-assistant-turns", type=int, default=3)
    parser.add_argument("--output", help="write the results JSON here")
    args = parser.parse_args(argv)
    import torch

    from mindspeed_llm.demo.evaluate import load_hf
    from mindspeed_llm.demo.task import load_problems
    from mindspeed_llm.demo.tool_task import make_tool_splits
    from mindspeed_llm.rl.tools import CalculatorTool, load_tool_config

    torch.set_num_threads(1)
    tools = load_tool_config(args.tool_config) if args.tool_config else [CalculatorTool()]
    settings = ToolLoopSettings(max_assistant_turns=args.max_assistant_turns, max_new_tokens=args.max_new_tokens)
    model_tok = load_hf(args.model_dir)
    jobs = [(name, make_tool_splits(name, n_train=0, n_test=args.n)[1]) for name in (args.measure or [])]
    if args.problems:
        jobs.append((args.problems, load_problems(args.problems)))
    results = []
    for name, rows in jobs:
        res = {"variant": name, "greedy": evaluate_tools_hf(model_tok, rows, tools, settings)}
        if args.n_sampled:
            res["sampled"] = evaluate_tools_hf(model_tok, rows[:args.n_sampled], tools, settings, do_sample=True,
                                               temperature=args.temperature, n_samples=4)
        for key in ("greedy", "sampled"):
            if key in res:
                print(json.dumps({"variant": name, key: {k: v for k, v in res[key].items() if k != "samples"}}),
                      flush=True)
        results.append(res)
        if args.output:
            Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
