"""Multi-turn rollouts with a slow tool: what parking buys (issue 37's benchmark).

One process, TP=1, a random Megatron Llama (`--layers/--hidden`, built in place), `--batch` prompts generated greedily
with the continuous engine and a scripted tool loop (`inference/turns.py`): a turn ends on a stop id (`--stop-share` of
the vocabulary; greedy, so every mode produces the same tokens), each ended turn before the `--turns`-th calls the
tool, which answers `--answer-tokens` ids after `--tool-seconds` (a thread pool of `--workers`). Modes:

* `parked, auto` (the default, `--parked-kv auto`): a sample waiting on its tool keeps its slot and KV until a
  waiting sample needs the slot; the others decode meanwhile;
* `parked, KV kept` (`--parked-kv keep`): it keeps them; only the answer is prefilled;
* `parked, KV freed` (`--parked-kv free`): its slot goes to another sample at once, its prefix is prefilled again;
* `blocking`: the tool runs inside the engine's step (every sample waits for each call: no parking);
* `single turn`: no tools (the decode work alone).

Reported per mode: wall seconds (best of `--repeats`), the engine's time blocked on tools, decode forwards and
row-steps, prefill tokens, and whether the tokens equal the kept-KV mode's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multi_turn.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8, help="rows in flight")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--turn-tokens", type=int, default=32, help="the most tokens of one model turn")
    p.add_argument("--stop-share", type=float, default=0.04, help="share of the ids that end a turn")
    p.add_argument("--turns", type=int, default=3, help="model turns per trajectory at most")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--tool-seconds", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class SlowTool:
    """The scripted tool loop: every ended turn but the last calls a tool that sleeps, then answers fixed ids."""

    def __init__(self, args, blocking: bool):
        self.args, self.blocking = args, blocking
        self.turn_token_limit = args.turn_tokens
        self.turns, self.done, self.lock, self.event = {}, [], threading.Lock(), threading.Event()
        self.pool = ThreadPoolExecutor(args.workers)

    def trajectory_budget(self, sample):
        return None  # the call's budget is the whole one

    def wants_observation(self, sample, known, prompt_length, turn_start):
        self.turns[sample] = self.turns.get(sample, 0) + 1
        return self.turns[sample] < self.args.turns

    def _answer(self, sample):
        time.sleep(self.args.tool_seconds)
        with self.lock:
            self.done.append((sample, [5 + (sample + k) % 50 for k in range(self.args.answer_tokens)], None))
        self.event.set()

    def begin(self, sample, known, prompt_length, turn_start):
        if self.blocking:
            self._answer(sample)
        else:
            self.pool.submit(self._answer, sample)

    def ready(self, wait):
        if wait:
            self.event.wait()
        with self.lock:
            out, self.done = self.done, []
            self.event.clear()
        return out

    def observed(self, sample, note):
        pass  # nothing to record


def build_model(args):
    from mindspeed_llm import distributed
    from mindspeed_llm.models import build_model as build
    from mindspeed_llm.models.architecture import ArchitectureSpec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    distributed.initialize(1, 1, seed=1)
    heads = max(args.hidden // 64, 1)
    spec = ArchitectureSpec(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                            ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64, num_attention_heads=heads,
                            num_query_groups=heads, kv_channels=64, vocab_size=args.vocab)
    return build(spec, init_method_std=0.3).eval()


PARKED_KV = {"parked, auto": "auto", "parked, KV kept": "keep", "parked, KV freed": "free"}


def run_mode(model, args, prompts, mode):
    from mindspeed_llm.inference import EngineOptions, SamplingConfig, generate

    stops = tuple(range(3, 3 + int(args.stop_share * args.vocab)))
    sampling = SamplingConfig(max_new_tokens=args.turn_tokens, pad_token_id=0, stop_token_ids=stops,
                              max_num_seqs=args.max_num_seqs)
    budget = args.turns * args.turn_tokens + (args.turns - 1) * args.answer_tokens
    tool = None if mode == "single turn" else SlowTool(args, blocking=mode == "blocking")
    start = time.perf_counter()
    out = generate(model, prompts, sampling, response_budgets=[budget] * len(prompts), turns=tool,
                   options=EngineOptions(parked_kv=PARKED_KV.get(mode, "auto")))
    seconds = time.perf_counter() - start
    if tool is not None:
        tool.pool.shutdown()
    return seconds, out


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = build_model(args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, args.vocab, (args.prompt_length,), generator=g).tolist() for _ in range(args.batch)]
    modes = ("parked, auto", "parked, KV kept", "parked, KV freed", "blocking", "single turn")
    best, outs = {}, {}
    for _ in range(args.repeats):
        for mode in modes:
            seconds, out = run_mode(model, args, prompts, mode)
            if mode not in best or seconds < best[mode]:
                best[mode], outs[mode] = seconds, out
    reference = outs[modes[0]].response_token_lists()
    rows = []
    for mode in modes:
        stats = outs[mode].stats
        rows.append(dict(mode=mode, seconds=best[mode], tool_wait_seconds=stats.get("observation_wait_seconds", 0.0),
                         decode_forwards=stats["decode_forwards"], decode_row_steps=stats["decode_row_steps"],
                         prefill_tokens=stats["prefill_tokens"] + stats.get("delta_prefill_tokens", 0),
                         tool_calls=stats.get("parked_turns", 0),
                         same_tokens=mode == "single turn" or outs[mode].response_token_lists() == reference))
    print(f"{'mode':<18} {'wall s':>7} {'blocked s':>9} {'calls':>5} {'decode fw':>9} {'row-steps':>9} "
          f"{'prefill tok':>11}  same tokens")
    for r in rows:
        print(f"{r['mode']:<18} {r['seconds']:7.2f} {r['tool_wait_seconds']:9.2f} {r['tool_calls']:5d} "
              f"{r['decode_forwards']:9d} {r['decode_row_steps']:9d} {r['prefill_tokens']:11d}  {r['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows, threads=torch.get_num_threads()), f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
