"""Rollout generation throughput: our static engine (megatron's KV cache, the whole batch in lock-step) vs our
continuous-batching engine vs `transformers` (`generate_batch`'s continuous batching, and `generate`) vs a no-cache
loop.

One process, TP=1, random Llama weights shared by all paths (built with `transformers`, converted into a Megatron
GPTModel with `mindspeed_llm.checkpoint`). The same batch of mixed-length prompts for every path (`--batch` distinct
prompts, each repeated `--samples-per-prompt` times in a row: GRPO's layout), each row with its own response budget:

* `--length-mix uniform`: every row generates exactly `--new-tokens`;
* `--length-mix skewed`: every 10th row runs to the cap (`--new-tokens`), the others stop at 10-50% of it (seeded):
  RL's long tail. Our engines get the budgets as `generate(..., response_budgets=...)`, `transformers`' continuous
  batching as each request's `max_new_tokens`, `transformers.generate` through a logits processor that plants EOS
  at each row's budget (its rows then stop and pad, as ours do at EOS).

No EOS otherwise: every path generates exactly the budgets' tokens, and tokens/s counts generated tokens. Reported
per path: wall seconds (best of `--repeats`, round-robin over the paths), tokens/s, decode row-steps (a row in a
decode forward; ours count them, `transformers` does not say), the share of those spent on rows that had already
finished, and the KV cache's bytes (ours: the cache tensors; `transformers` CB: its paged cache as allocated).
`--max-num-seqs N` bounds our continuous engine's rows in flight (and `transformers` CB's requests per batch);
default: the whole batch. The no-cache loop (greedy, uniform only, `--no-cache`) is a full forward over the prefix
at every step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generate.py --length-mix skewed [--json out.json]
    # SmolLM2-135M's shape, GRPO-like (8 prompts x 4 samples):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generate.py --layers 30 --hidden 576 --ffn 1536 --heads 9 \
        --kv-heads 3 --vocab 49152 --batch 8 --samples-per-prompt 4 --min-prompt 45 --max-prompt 55 --new-tokens 24
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EOS = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=None, help="default: 8/3 hidden rounded to 64")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=16, help="distinct prompts")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="rows per prompt, contiguous (GRPO's n)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=64, help="the response budget (the cap of the skewed mix)")
    p.add_argument("--length-mix", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="rows in flight of our continuous engine and transformers' CB (default: the whole batch)")
    p.add_argument("--sampled", action="store_true", help="also time sampling (temperature / top-k / top-p)")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per path, round-robin over the paths (best wall time is reported)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--no-cache", action="store_true", help="also time the no-cache loop (uniform mix only)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- models

def build_hf(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    ffn = args.ffn or ((args.hidden * 8 // 3 + 63) // 64) * 64
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=0, initializer_range=0.1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def load_hf_weights(megatron_model, hf_model):
    """HF Llama -> Megatron GPTModel (TP=1 PP=1) through the project's converter: the HF model is saved to a
    temporary folder, converted with `convert_hf_to_mg` and loaded with `load_megatron_weights`."""
    import tempfile

    from mindspeed_llm.checkpoint import convert_hf_to_mg, load_megatron_weights

    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        hf_dir, mg_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "mg")
        hf_model.save_pretrained(hf_dir)
        convert_hf_to_mg(hf_dir, mg_dir, 1, 1, progress=False)
        load_megatron_weights(megatron_model, mg_dir)


def init_megatron():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, seed=0)


def response_budgets(mix: str, rows: int, cap: int, seed: int = 2):
    """Per-row budgets: `cap` everywhere (uniform), or every 10th row at the cap and the others at 10-50% of it."""
    if mix == "uniform":
        return [cap] * rows
    g = torch.Generator().manual_seed(seed)
    short = (cap * (0.1 + 0.4 * torch.rand(rows, generator=g))).round().clamp(min=1).long().tolist()
    return [cap if b % 10 == 0 else short[b] for b in range(rows)]


# --------------------------------------------------------------------------------------------- paths

def run_ours(model, prompts, sampling, budgets, engine):
    from mindspeed_llm.inference import generate

    rollout = generate(model, prompts, sampling, iteration=0, sample_ids=range(len(prompts)),
                       response_budgets=budgets, engine=engine)
    return rollout.response_token_lists(), rollout.stats


class _PlantedStop:
    """A `transformers` logits processor that forces EOS at each row's budget (its step counted from the prompt)."""

    def __init__(self, prompt_width, budgets):
        self.prompt_width, self.budgets = prompt_width, torch.tensor(budgets)

    def __call__(self, input_ids, scores):
        step = input_ids.size(1) - self.prompt_width
        stop = self.budgets - 1 == step
        if bool(stop.any()):
            scores = scores.clone()
            scores[stop] = float("-inf")
            scores[stop, EOS] = 0.0
        scores[~stop, EOS] = float("-inf")  # no EOS before the budget
        return scores


def run_hf_generate(model, prompts, args, budgets, do_sample):
    """Batched `transformers.generate`: left-padded prompts with an attention mask (its required layout); each row
    stops at its budget through a planted EOS (`_PlantedStop`)."""
    from transformers import LogitsProcessorList

    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((B, P), dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    kwargs = dict(max_new_tokens=max(budgets), eos_token_id=EOS, pad_token_id=0, use_cache=True,
                  logits_processor=LogitsProcessorList([_PlantedStop(P, budgets)]))
    if do_sample:
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    else:
        kwargs.update(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    rows = out[:, P:].tolist()
    return [row[:n] for row, n in zip(rows, budgets)], {}


def run_hf_continuous(model, prompts, args, budgets, do_sample, max_num_seqs):
    """`transformers`' continuous batching (the manager behind `generate_batch`), one request per row with its own
    `max_new_tokens`; its paged KV cache sized for the longest row of every request in flight at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    rows = max_num_seqs or len(prompts)
    page = 32
    longest = max(len(p) for p in prompts) + max(budgets)
    blocks = rows * -(-longest // page) + 2
    gen = GenerationConfig(max_new_tokens=max(budgets), eos_token_id=-1, pad_token_id=0, do_sample=do_sample,
                           **(dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) if do_sample
                              else {}))
    config = ContinuousBatchingConfig(max_requests_per_batch=rows, num_blocks=blocks, page_size=page,
                                      max_batch_tokens=max(512, rows), allow_block_sharing=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
        results, deadline = {}, time.monotonic() + 3600
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is None and (time.monotonic() > deadline or not manager.is_running()):
                raise RuntimeError("transformers continuous batching: no result (stopped, or an hour passed)")
            if r is not None and r.is_finished():
                results[r.request_id] = r
        cache_bytes = _hf_cache_bytes(manager)  # before stop() drops the batch processor
    finally:
        manager.stop(block=True)
    return [list(results[i].generated_tokens) for i in ids], {"kv_cache_bytes": cache_bytes}


def _hf_cache_bytes(manager):
    """Bytes of `transformers`' paged cache (one uint8 tensor in 5.24; None where it cannot be found)."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    tensor = getattr(cache, "cache_tensor", None)
    return tensor.nbytes if isinstance(tensor, torch.Tensor) else None


def run_no_cache(model, prompts, args):
    """Greedy without a KV cache: at every step a full forward over the whole (left-padded) prefix.

    Same schedule, masks and kernels as the static path (a fresh, throw-away static context per step only
    makes Megatron compute the last position's logits), so the ratio isolates what the cache saves.
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    lengths = [len(p) for p in prompts]
    B, P = len(prompts), max(lengths)
    T = P + args.new_tokens
    tokens = torch.zeros((B, T), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p): P] = torch.tensor(p)
    offsets = torch.tensor([P - n for n in lengths])
    slots = torch.arange(T)
    position_ids = (slots.unsqueeze(0) - offsets.unsqueeze(1)).clamp(min=0)
    key_is_pad = (slots.unsqueeze(0) < offsets.unsqueeze(1)).view(B, 1, 1, T)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for pos in range(P, T):
            mask = key_is_pad[..., :pos] | torch.ones((pos, pos), dtype=torch.bool).triu(1).view(1, 1, pos, pos)
            context = StaticInferenceContext(max_batch_size=B, max_sequence_length=pos)
            logits = model(tokens[:, :pos], position_ids[:, :pos], mask, inference_context=context,
                           runtime_gather_output=True)[:, -1, :]
            tokens[:, pos] = logits.argmax(-1)
    model.train(was_training)
    return tokens[:, P:].tolist(), {}


def timed(fns, repeats):
    """[(best wall seconds, CPU seconds of that run, result)] per function. The repeats go round-robin over
    the functions, so a change in machine load (it may be shared) hits every path alike; the process CPU
    time is reported next to the wall clock."""
    best = [(float("inf"), None, None)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = fn()
            wall = time.perf_counter() - start
            if wall < best[i][0]:
                best[i] = (wall, time.process_time() - start_cpu, result)
    return best


def main(argv=None):
    args = parse_args(argv)
    from mindspeed_llm.inference import SamplingConfig
    from mindspeed_llm.models import ArchitectureSpec, build_model

    load_start = os.getloadavg()
    init_megatron()
    hf = build_hf(args)
    spec = ArchitectureSpec.from_hf_config(hf.config)
    megatron_model = build_model(spec)
    load_hf_weights(megatron_model, hf)
    megatron_model.eval()

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch,), generator=g).tolist()
    distinct = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lengths]
    prompts = [p for p in distinct for _ in range(args.samples_per_prompt)]
    rows_total = len(prompts)
    budgets = response_budgets(args.length_mix, rows_total, args.new_tokens)
    n_tokens = sum(budgets)
    greedy = SamplingConfig(max_new_tokens=args.new_tokens, pad_token_id=0)
    bounded = SamplingConfig(max_new_tokens=args.new_tokens, pad_token_id=0, max_num_seqs=args.max_num_seqs)
    sampled = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   max_new_tokens=args.new_tokens, pad_token_id=0, seed=0)

    # warm-up (first-call allocations, lru caches), not timed
    for engine in ("static", "continuous"):
        run_ours(megatron_model, prompts[:2], SamplingConfig(max_new_tokens=4, pad_token_id=0), [4, 4], engine)
    if not args.skip_transformers:
        run_hf_generate(hf, prompts[:2], args, [4, 4], False)
        run_hf_continuous(hf, prompts[:2], args, [4, 4], False, None)

    paths = [("static greedy", lambda: run_ours(megatron_model, prompts, greedy, budgets, "static")),
             ("continuous greedy", lambda: run_ours(megatron_model, prompts, bounded, budgets, "continuous"))]
    if args.sampled:
        paths += [("static sampled", lambda: run_ours(megatron_model, prompts, SamplingConfig(**sampled), budgets,
                                                      "static")),
                  ("continuous sampled", lambda: run_ours(
                      megatron_model, prompts, SamplingConfig(**sampled, max_num_seqs=args.max_num_seqs), budgets,
                      "continuous"))]
    if not args.skip_transformers:
        paths += [("transformers CB greedy", lambda: run_hf_continuous(hf, prompts, args, budgets, False,
                                                                       args.max_num_seqs)),
                  ("transformers generate greedy", lambda: run_hf_generate(hf, prompts, args, budgets, False))]
    if args.no_cache and args.length_mix == "uniform":
        paths.append(("megatron no-cache greedy", lambda: run_no_cache(megatron_model, prompts, args)))
    timings = timed([fn for _, fn in paths], args.repeats)
    load_end = os.getloadavg()

    reference = dict(zip([name for name, _ in paths], timings))["static greedy"][2][0]
    rows = []
    for (name, _), (seconds, cpu, (tokens, stats)) in zip(paths, timings):
        row_steps = stats.get("decode_row_steps")
        finished = stats.get("finished_row_steps")
        # all but each row's last token (transformers.generate's is the planted EOS)
        agree = sum(a[:-1] == b[:-1] for a, b in zip(tokens, reference)) if "greedy" in name else None
        rows.append(dict(path=name, seconds=seconds, cpu_seconds=cpu, tokens=sum(len(t) for t in tokens),
                         tokens_per_s=n_tokens / seconds, decode_row_steps=row_steps,
                         finished_share=(finished / row_steps) if row_steps else None,
                         kv_cache_bytes=stats.get("kv_cache_bytes"), kv_rows=stats.get("kv_rows"),
                         rows_equal_to_static_greedy=agree))
    base = {r["path"].split()[1]: r["tokens_per_s"] for r in rows if r["path"].startswith("static")}
    for r in rows:
        mode = r["path"].split()[-1]
        r["vs_static"] = r["tokens_per_s"] / base[mode] if mode in base else None

    header = (f"layers={args.layers} hidden={args.hidden} vocab={args.vocab} batch={args.batch}"
              f"x{args.samples_per_prompt} prompts={min(lengths)}-{max(lengths)} new_tokens={args.new_tokens} "
              f"mix={args.length_mix} (budgets {min(budgets)}-{max(budgets)}, {n_tokens} tokens) "
              f"max_num_seqs={args.max_num_seqs or rows_total} threads={torch.get_num_threads()} "
              f"torch={torch.__version__} load {load_start[0]:.2f}/{load_start[1]:.2f} -> "
              f"{load_end[0]:.2f}/{load_end[1]:.2f}")
    print(header)
    print(f"{'path':<29} {'wall s':>7} {'tok/s':>7} {'vs static':>9} {'row-steps':>9} {'finished':>8} "
          f"{'KV MiB':>7} {'cpu s':>6}  rows = static greedy")
    for r in rows:
        share = f"{100 * r['finished_share']:.0f}%" if r["finished_share"] is not None else "-"
        kv = f"{r['kv_cache_bytes'] / 2**20:.2f}" if r["kv_cache_bytes"] else "-"
        vs = f"{r['vs_static']:.2f}x" if r["vs_static"] is not None else "-"
        steps = r["decode_row_steps"] if r["decode_row_steps"] is not None else "-"
        agree = f"{r['rows_equal_to_static_greedy']}/{rows_total}" if r["rows_equal_to_static_greedy"] is not None \
            else "-"
        print(f"{r['path']:<29} {r['seconds']:>7.2f} {r['tokens_per_s']:>7.1f} {vs:>9} {steps:>9} {share:>8} "
              f"{kv:>7} {r['cpu_seconds']:>6.2f}  {agree}")
    print("(rows = static greedy: rows whose tokens but the last equal the static engine's greedy ones)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), prompt_lengths=lengths, budgets=budgets, load=[load_start, load_end],
                           threads=torch.get_num_threads(), results=rows), f, indent=2)
    from mindspeed_llm import distributed

    distributed.destroy()
    return rows


if __name__ == "__main__":
    main()
