"""Rollout generation (`mindspeed_llm.inference.generate`) against `transformers` generate.

A tiny random Llama (2 layers, hidden 64, vocab 256, grouped-query attention) is built with `transformers`
in the pytest process and saved as a Hugging Face folder. Each spawn of 2 gloo processes converts it with
the project's converter (`mindspeed_llm.checkpoint.convert_hf_to_mg`, rank 0, once per layout) and loads
its shards with `load_megatron_weights` into Megatron GPTModels in three layouts (TP=1 x DP=2 in one spawn;
TP=2 then PP=2 in a second), every case of a layout in its one spawn. The spawned bodies return `Rollout`s;
all comparisons with `transformers` happen here in the parent. The rollouts run with the speed patches of
`mindspeed_llm/patches/inference.py`; each layout also generates once with megatron's own code in their place,
which must give the same rollouts. The models run the default fused core attention (`models/attention.py`); each
layout also loads the weights into a model with megatron's local attention, which must generate the same greedy
tokens (batched, stepwise, shared prefill), patched and unpatched. Both engines run: the continuous-batching engine
(the default) and megatron's static KV cache (`engine="static"`, and every stepwise prefill); the continuous engine
is also compared with the static one at a bounded number of rows in flight, chunked prefills, GRPO groups, per-row
budgets, pipeline micro-batching and a decode budget followed by a continuation (`_continuous_cases`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402

from mindspeed_llm.inference import Rollout, SamplingConfig, filter_logits, sample_uniforms  # noqa: E402
from mindspeed_llm.inference.sampling import choose_tokens, top_k_top_p_candidates  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

HF_CONFIG = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=False, mlp_bias=False,
)
PROMPT_LENGTHS = (5, 9, 3, 12, 7, 4)
MAX_NEW = 12
PAD = 0
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.8, max_new_tokens=MAX_NEW, pad_token_id=PAD)


# ============================================================================ HF reference (parent process)

def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF_CONFIG.items() if k != "model_type"}))
    with torch.no_grad():  # non-trivial norms, so a mis-mapped norm changes the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def _hf_greedy(model, prompt, max_new, eos=None):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    model = _hf_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    free = [_hf_greedy(model, p, MAX_NEW) for p in prompts]
    # EOS: a token that greedy decoding emits mid-response in some rows but not in others.
    best = None
    for tok in sorted({t for row in free for t in row[1:-1]}):
        rows = [row.index(tok) for row in free if tok in row]
        if 1 <= len(rows) < len(prompts) and min(rows) >= 1:
            score = (len(rows), -min(rows))
            best = max(best, (score, tok)) if best else (score, tok)
    assert best is not None, "no usable EOS candidate in the greedy outputs"
    eos = best[1]
    with_eos = [_hf_greedy(model, p, MAX_NEW, eos=eos) for p in prompts]
    # A stop token distinct from the EOS, emitted by at least one row.
    stop = next(t for row in free for t in row[2:] if t != eos)
    hf_dir = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(hf_dir)
    return dict(model=model, prompts=prompts, free=free, eos=eos, with_eos=with_eos, stop=stop, hf_dir=str(hf_dir),
                ckpt_root=str(tmp_path_factory.mktemp("megatron")))


# ============================================================================ spawned ranks

@contextlib.contextmanager
def _megatron_unpatched_inference():
    """Megatron's own code in place of the speed patches of mindspeed_llm/patches/inference.py (registered for
    the CPU); yields how many of them were applied."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    sites = [(Attention, "_adjust_key_value_for_inference"), (DotProductAttention, "forward"),
             (layers, "linear_with_grad_accumulation_and_async_allreduce"),
             (layers, "copy_to_tensor_model_parallel_region"), (layers, "reduce_from_tensor_model_parallel_region")]
    current = [getattr(owner, name) for owner, name in sites]
    try:
        for (owner, name), fn in zip(sites, current):
            setattr(owner, name, getattr(fn, "__wrapped__", fn))
        yield sum(hasattr(fn, "__wrapped__") for fn in current)
    finally:
        for (owner, name), fn in zip(sites, current):
            setattr(owner, name, fn)


def _live_inference_contexts():
    from megatron.core.inference.contexts import StaticInferenceContext

    gc.collect()
    return sum(isinstance(o, StaticInferenceContext) for o in gc.get_objects())


@contextlib.contextmanager
def _record_forward_shapes():
    """Yields a list that collects the [batch, window] token shape of every forward the wrapper runs."""
    from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
        AbstractModelInferenceWrapper as Wrapper,
    )

    shapes, names = [], ("forward_pass_without_pipeline_parallel", "forward_pass_with_pipeline_parallel_small_input_batch")
    originals = [getattr(Wrapper, name) for name in names]

    def recording(fn):
        def run(self, inference_input, *args, **kwargs):
            shapes.append(tuple(inference_input["tokens"].shape))
            return fn(self, inference_input, *args, **kwargs)
        return run

    try:
        for name, fn in zip(names, originals):
            setattr(Wrapper, name, recording(fn))
        yield shapes
    finally:
        for name, fn in zip(names, originals):
            setattr(Wrapper, name, fn)


def _repeated_prompt_cases(model, prompts):
    """Repeated prompts (GRPO's n samples; here also non-adjacent, plus a prompt that shares only its first
    L_min tokens with another) with the shared prefill and with every row prefilled; prefill batch sizes (static
    engine: batched and stepwise prefill; continuous engine: its counters)."""
    from mindspeed_llm.inference import EngineOptions, generate

    rows = [prompts[i] for i in (0, 0, 1, 3, 1, 1, 0, 5)] + [prompts[3][:6]]
    out = {"repeated_rows": rows}
    configs = {"greedy": SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD),
               "sample": SamplingConfig(seed=7, **SAMPLE)}
    for name, sampling in configs.items():
        for mode in ("batched", "stepwise"):
            with _record_forward_shapes() as shapes:
                out[f"dup_{name}_{mode}"] = generate(model, rows, sampling, prefill=mode, iteration=2, engine="static")
            out[f"dup_{name}_{mode}_prefill_shape"] = shapes[0]
            out[f"dup_{name}_{mode}_nodedup"] = generate(model, rows, sampling, prefill=mode, iteration=2,
                                                         engine="static",
                                                         options=EngineOptions(share_prefill=False))
        out[f"dup_{name}_continuous"] = generate(model, rows, sampling, iteration=2)
        out[f"dup_{name}_continuous_nodedup"] = generate(model, rows, sampling, iteration=2,
                                                         options=EngineOptions(share_prefill=False))
    return out


def _continuous_cases(model, prompts, eos):
    """The continuous engine against the static one (the reference: today's all-at-once path) on GRPO groups of 3
    with skewed per-row budgets and an EOS: few rows in flight (slots reused), prefills chunked by the token cap,
    pipeline micro-batching on and off; a decode budget whose unfinished samples a second call continues; the KV
    cache's size at two row counts; the engine's errors."""
    from dataclasses import replace

    from mindspeed_llm.inference import EngineOptions, generate

    rows = [p for p in prompts for _ in range(3)]
    budgets = [(2, 12, 5)[b % 3] if b % 2 else (12, 3, 7)[b % 3] for b in range(len(rows))]
    ids = list(range(100, 100 + len(rows)))
    configs = {"greedy": SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD),
               "sample": SamplingConfig(seed=7, eos_token_id=eos, **SAMPLE)}
    out = {"cb_rows": rows, "cb_budgets": budgets}
    for name, sampling in configs.items():
        common = dict(iteration=5, sample_ids=ids, response_budgets=budgets)
        out[f"cb_{name}_static"] = generate(model, rows, sampling, engine="static", **common)
        bounded = replace(sampling, max_num_seqs=4, max_num_batched_tokens=8)
        out[f"cb_{name}_bounded"] = generate(model, rows, bounded, engine="continuous", **common)
        out[f"cb_{name}_one_group"] = generate(model, rows, bounded, options=EngineOptions(pipeline_groups=1),
                                               **common)
    sampling = replace(configs["sample"], max_num_seqs=4)
    common = dict(iteration=5, sample_ids=ids, response_budgets=budgets)
    whole = out["cb_partial_whole"] = generate(model, rows, sampling, **common)
    first = out["cb_partial_first"] = generate(model, rows, sampling, max_decode_steps=3, **common)
    carried = [b for b, c in enumerate(first.continuations or []) if c is not None]
    out["cb_partial_carried"] = carried
    # the unfinished samples continue in a later call with the same ids; fresh samples there would draw from
    # iteration 9, the carried ones keep their own (iteration 5) streams
    out["cb_partial_rest"] = generate(model, [rows[b] for b in carried], sampling, iteration=9,
                                      sample_ids=[ids[b] for b in carried],
                                      response_budgets=[budgets[b] for b in carried],
                                      continuations=[first.continuations[b] for b in carried])
    out["cb_kv_bytes"] = {n: generate(model, rows, replace(sampling, max_num_seqs=n), **common).stats
                          for n in (3, 6)}
    assert whole.response_token_lists()  # a rollout, not an error
    errors = []
    for kwargs in (dict(engine="static", sampling=replace(sampling, max_num_seqs=2)), dict(engine="fast"),
                   dict(max_decode_steps=0), dict(prefill="stepwise", max_decode_steps=2),
                   dict(continuations=[None]), dict(response_budgets=[1, -1])):
        kwargs.setdefault("sampling", sampling)
        try:
            generate(model, rows[:2], **kwargs)
        except ValueError as e:
            errors.append(str(e))
    out["cb_errors"] = errors
    return out


def _local_attention_cases(spec, root, prompts):
    """The same weights with megatron's local core attention (`build_model(attention="local")`, the reference of
    the default fused one): greedy rollouts batched, stepwise and with GRPO's shared prefill, run patched (the
    grouped decode step of patches/inference.py acts on this attention only) and unpatched."""
    from mindspeed_llm.checkpoint import load_megatron_weights
    from mindspeed_llm.inference import generate
    from mindspeed_llm.models import build_model
    from mindspeed_llm.models.attention import model_attention

    local = build_model(spec, attention="local")
    load_megatron_weights(local, root)
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD)
    rows = [prompts[i] for i in (0, 0, 1, 3, 1, 1, 0, 5)] + [prompts[3][:6]]  # as _repeated_prompt_cases
    out = {"local_attention": model_attention(local)}
    for mode in ("batched", "stepwise"):
        out[f"local_free_{mode}"] = generate(local, prompts, greedy, prefill=mode)
        out[f"local_dup_{mode}"] = generate(local, rows, greedy, prefill=mode, iteration=2)
        with _megatron_unpatched_inference():
            out[f"local_free_{mode}_unpatched"] = generate(local, prompts, greedy, prefill=mode)
    return out


def _layout_cases(tp, pp, root, prompts, eos, stop):
    """Every case of one layout (weights: the Megatron checkpoint under `root`); a dict of Rollouts and flags."""
    from megatron.core import parallel_state

    from mindspeed_llm import device, distributed
    from mindspeed_llm.checkpoint import load_megatron_weights
    from mindspeed_llm.inference import generate
    from mindspeed_llm.models import ArchitectureSpec, build_model

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    distributed.initialize(tp, pp, seed=0)
    spec = ArchitectureSpec.from_hf_config(HF_CONFIG)
    model = build_model(spec)
    load_megatron_weights(model, root)
    model.train()

    out = {}
    out["free"] = generate(model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD))
    out["train_after_greedy"] = model.training
    out["free_stepwise"] = generate(model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD),
                                    prefill="stepwise")
    out["free_static"] = generate(model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD),
                                  engine="static")
    eos_config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD)
    out["eos_stepwise"] = generate(model, prompts, eos_config, prefill="stepwise")
    out["eos_static"] = generate(model, prompts, eos_config, engine="static")
    out["eos"] = generate(model, prompts, eos_config)
    out["stop"] = generate(model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[eos + 1000, eos],
                                                          stop_token_ids=[stop], pad_token_id=PAD))
    out["limits"] = generate(model, prompts, SamplingConfig(max_new_tokens=5, max_length=10, pad_token_id=PAD))
    out["only_max_length"] = generate(model, prompts, SamplingConfig(max_new_tokens=None, max_length=14,
                                                                     pad_token_id=PAD))
    sampling = SamplingConfig(seed=7, **SAMPLE)
    rng_before = torch.get_rng_state()
    out["sample"] = generate(model, prompts, sampling, iteration=3)  # dp_rank: megatron's
    out["global_rng_untouched"] = torch.equal(rng_before, torch.get_rng_state())
    out["sample_again"] = generate(model, prompts, sampling, iteration=3)
    out["sample_next_iteration"] = generate(model, prompts, sampling, iteration=4)
    B = len(prompts)
    out["sample_ids0"] = generate(model, prompts, sampling, iteration=3, sample_ids=range(B))
    out["sample_ids1"] = generate(model, prompts, sampling, iteration=3, sample_ids=range(B, 2 * B))
    # a sample's stream follows its id, not its row: the batch reversed with its ids gives the rows reversed
    out["sample_reversed"] = generate(model, prompts[::-1], sampling, iteration=3, sample_ids=range(B - 1, -1, -1))
    out["train_after_sample"] = model.training
    model.eval()
    generate(model, prompts[:2], SamplingConfig(max_new_tokens=2))
    out["eval_kept"] = not model.training
    with _megatron_unpatched_inference() as n_patched:
        out["free_unpatched"] = generate(model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD))
        out["free_static_unpatched"] = generate(
            model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD), engine="static")
        out["free_stepwise_unpatched"] = generate(
            model, prompts, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=PAD), prefill="stepwise")
    out["inference_patches"] = n_patched
    out.update(_repeated_prompt_cases(model, prompts))
    out.update(_local_attention_cases(spec, root, prompts))
    out.update(_continuous_cases(model, prompts, eos))
    out["device"] = device.accelerator().kind
    errors = []
    for kwargs in (dict(prompt_token_lists=[[5], []]), dict(prompt_token_lists=[[5]], prefill="both")):
        try:
            generate(model, sampling=SamplingConfig(max_new_tokens=2), **kwargs)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    del model
    out["live_contexts"] = _live_inference_contexts()
    return out


def _layouts_body(rank, world_size, layouts, hf_dir, ckpt_root, prompts, eos, stop):
    """All layouts of one spawn, one after the other (parallel state is rebuilt in between).

    Rank 0 converts the HF folder once per layout (megatron is imported here anyway); the others wait.
    """
    import torch.distributed as dist

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    roots = {(tp, pp): os.path.join(ckpt_root, f"tp{tp}_pp{pp}") for tp, pp in layouts}
    if rank == 0:
        for (tp, pp), root in roots.items():
            convert_hf_to_mg(hf_dir, root, tp, pp, progress=False)
    dist.barrier()
    out = [_layout_cases(tp, pp, roots[(tp, pp)], prompts, eos, stop) for tp, pp in layouts]
    # by value: the result queue would otherwise share tensor storage through fds of an exiting process
    return pickle.dumps(out)


def _run_layouts(ref, layouts):
    """{(tp, pp): [rank 0 result, rank 1 result]} from one 2-process spawn."""
    results = run_distributed(_layouts_body, 2, layouts, ref["hf_dir"], ref["ckpt_root"], ref["prompts"], ref["eos"],
                              ref["stop"])
    per_rank = [pickle.loads(r) for r in results]
    return {layout: [per_rank[0][i], per_rank[1][i]] for i, layout in enumerate(layouts)}


@pytest.fixture(scope="module")
def dp2(ref):
    return _run_layouts(ref, [(1, 1)])[(1, 1)]


@pytest.fixture(scope="module")
def model_parallel(ref):
    """TP=2 and PP=2 share one spawn (megatron import is the expensive part)."""
    return _run_layouts(ref, [(2, 1), (1, 2)])


@pytest.fixture(scope="module")
def tp2(model_parallel):
    return model_parallel[(2, 1)]


@pytest.fixture(scope="module")
def pp2(model_parallel):
    return model_parallel[(1, 2)]


# ============================================================================ checks

def _check_consistent(r: Rollout, pad=PAD):
    """Mask, lengths, padding and the training layout agree with each other."""
    B, R = r.responses.shape
    assert r.response_mask.shape == (B, R) and r.log_probs.shape == (B, R)
    assert torch.equal(r.response_mask.sum(1), r.response_lengths)
    for b in range(B):
        n = int(r.response_lengths[b])
        assert r.response_mask[b, :n].all() and not r.response_mask[b, n:].any()
        assert (r.responses[b, n:] == pad).all()
        assert (r.log_probs[b, n:] == 0).all() and (r.log_probs[b, :n] <= 0).all()
    tokens, position_ids, attention_mask = r.sequences()
    for b in range(B):
        L, n = int(r.prompt_lengths[b]), int(r.response_lengths[b])
        assert tokens[b, :L].tolist() == r.prompt_token_lists()[b]
        assert tokens[b, L:L + n].tolist() == r.response_token_lists()[b]
        assert (tokens[b, L + n:] == pad).all()
        assert attention_mask[b].tolist() == [1] * (L + n) + [0] * (tokens.size(1) - L - n)
    assert torch.equal(position_ids, torch.arange(tokens.size(1)).expand_as(tokens))
    # response token j of row b is the next-token target of position L_b - 1 + j
    assert torch.equal(_at_responses(r, _next_tokens(tokens)) * r.response_mask, r.responses * r.response_mask)


def _next_tokens(tokens):
    """The next-token target of every position (the last position repeats its own token)."""
    return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)


def _at_responses(r: Rollout, per_position):
    """[B, T, ...] values of the positions that predict the response tokens -> [B, R, ...] (0 past a response)."""
    B, R = r.responses.shape
    j = torch.arange(R)[None, :]
    index = (r.prompt_lengths[:, None] - 1 + j).clamp(0, per_position.size(1) - 1)
    picked = per_position[torch.arange(B)[:, None], index]
    valid = (j < r.response_lengths[:, None]).view(B, R, *([1] * (per_position.dim() - 2)))
    return picked * valid.to(picked.dtype)


def _hf_log_probs(model, r: Rollout, temperature=1.0):
    """Log-probs (and logits) of the rollout's response tokens under the HF model, in the [B, R] layout."""
    seq = r.sequences()
    with torch.no_grad():
        logits = model(input_ids=seq.tokens, attention_mask=seq.attention_mask).logits.float()
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, _next_tokens(seq.tokens).unsqueeze(-1)).squeeze(-1)
    return _at_responses(r, lp), _at_responses(r, logits)


def _assert_greedy_matches_hf(ref, results):
    for rank_result, mode in [(r, m) for r in results for m in ("", "_stepwise", "_static")]:
        free, eos = rank_result["free" + mode], rank_result["eos" + mode]
        assert free.response_token_lists() == ref["free"]
        assert eos.response_token_lists() == ref["with_eos"]
        hf_lp, _ = _hf_log_probs(ref["model"], free)
        torch.testing.assert_close(free.log_probs, hf_lp * free.response_mask, atol=2e-4, rtol=0)
        # EOS mid-batch: some rows stop on it, some run to the length limit
        reasons = eos.finish_reasons
        assert "eos" in reasons and "length" in reasons
        for b, row in enumerate(ref["with_eos"]):
            stopped = ref["eos"] in row
            assert reasons[b] == ("eos" if stopped else "length")
            assert bool(eos.ended_with_eos[b]) == stopped
            assert row[-1] == ref["eos"] or len(row) == MAX_NEW
        for r in (free, eos):
            _check_consistent(r)


def _assert_limits_and_stops(ref, result):
    prompts, free = ref["prompts"], ref["free"]
    # stop token (eos list given too): cut right after the first of either, stop token included
    stop = result["stop"]
    for b, row in enumerate(free):
        cut = next((i for i, t in enumerate(row) if t in (ref["stop"], ref["eos"])), None)
        expect = row if cut is None else row[:cut + 1]
        assert stop.response_token_lists()[b] == expect
        if cut is None:
            assert stop.finish_reasons[b] == "length"
        else:
            assert stop.finish_reasons[b] == ("eos" if row[cut] == ref["eos"] else "stop")
    assert "stop" in stop.finish_reasons
    # both limits: budget = min(5, 10 - L) (0 for the 12-token prompt)
    limits = result["limits"]
    budgets = [max(0, min(5, 10 - len(p))) for p in prompts]
    assert limits.response_lengths.tolist() == budgets
    assert limits.response_token_lists() == [row[:n] for row, n in zip(free, budgets)]
    assert limits.responses.shape[1] == max(budgets)
    assert all(r == "length" for r in limits.finish_reasons)
    total = limits.prompt_lengths + limits.response_lengths
    assert (total <= limits.prompt_lengths.clamp(min=10)).all()  # a prompt over the cap gets nothing
    only = result["only_max_length"]
    budgets = [14 - len(p) for p in prompts]
    assert only.response_lengths.tolist() == budgets
    for b, (row, n) in enumerate(zip(free, budgets)):
        assert only.response_token_lists()[b][:MAX_NEW] == row[:n]
    for r in (stop, limits, only):
        _check_consistent(r)


def _assert_samples_in_allowed_set(ref, r: Rollout):
    """Every sampled token lies in the top-k/top-p set of the HF logits at its position."""
    cfg = SamplingConfig(**SAMPLE)
    hf_lp, logits = _hf_log_probs(ref["model"], r, cfg.temperature)
    allowed = torch.isfinite(filter_logits(logits / cfg.temperature, cfg.top_k, min(1.0, cfg.top_p + 1e-3)))
    picked = allowed.gather(-1, r.responses.unsqueeze(-1)).squeeze(-1)
    assert (picked | ~r.response_mask.bool()).all()
    # the restriction is real: the kept set is smaller than top-k somewhere
    assert (allowed.sum(-1)[r.response_mask.bool()] < cfg.top_k).any()
    torch.testing.assert_close(r.log_probs, hf_lp * r.response_mask, atol=2e-4, rtol=0)


def _assert_sampling_seeds(result):
    a, again = result["sample"], result["sample_again"]
    assert torch.equal(a.responses, again.responses) and a.seed == again.seed
    assert not torch.equal(a.responses, result["sample_next_iteration"].responses)
    assert not torch.equal(result["sample_ids0"].responses, result["sample_ids1"].responses)
    reversed_ = result["sample_reversed"]
    assert torch.equal(reversed_.responses.flip(0), result["sample_ids0"].responses)
    assert torch.equal(reversed_.response_lengths.flip(0), result["sample_ids0"].response_lengths)
    assert result["global_rng_untouched"]  # sampling uses its own streams, never the global RNG
    _check_consistent(a)


# ----------------------------------------------------------------------------------------- TP=1, DP=2

def test_greedy_matches_transformers_tp1(ref, dp2):
    _assert_greedy_matches_hf(ref, dp2)


def test_stop_tokens_and_length_limits_tp1(ref, dp2):
    _assert_limits_and_stops(ref, dp2[0])


def test_sampling_seeds_tp1_dp2(ref, dp2):
    r0, r1 = dp2
    for result in dp2:
        _assert_sampling_seeds(result)
    # by default a row's sample id is dp_rank * B + row: the two replicas sample different responses, and
    # explicit ids reproduce them on either rank (the stream follows the id, not the rank)
    assert r0["sample"].seed == r1["sample"].seed == 7
    assert not torch.equal(r0["sample"].responses, r1["sample"].responses)
    for result in (r0, r1):
        assert torch.equal(r0["sample"].responses, result["sample_ids0"].responses)
        assert torch.equal(r1["sample"].responses, result["sample_ids1"].responses)


def test_top_k_top_p_respected_tp1(ref, dp2):
    for result in dp2:
        _assert_samples_in_allowed_set(ref, result["sample"])


def test_train_mode_restored_and_kv_freed(dp2, tp2, pp2):
    for result in dp2 + tp2 + pp2:
        assert result["train_after_greedy"] and result["train_after_sample"] and result["eval_kept"]
        assert result["live_contexts"] == 0
        assert len(result["errors"]) == 2
        assert "empty prompt" in result["errors"][0] and "prefill='both'" in result["errors"][1]


def test_inference_speed_patches_are_exact(dp2, tp2, pp2):
    """mindspeed_llm/patches/inference.py changes how a decode step is computed, not its result: the same
    tokens and (to float rounding) log-probs as megatron's own code, both engines (static: batched and stepwise),
    in every layout."""
    for result in dp2 + tp2 + pp2:
        assert result["inference_patches"] == 5  # the rollouts above ran patched (on every device now)
        for mode in ("free", "free_static", "free_stepwise"):
            patched, unpatched = result[mode], result[mode + "_unpatched"]
            assert torch.equal(patched.responses, unpatched.responses), mode
            torch.testing.assert_close(patched.log_probs, unpatched.log_probs, atol=1e-5, rtol=0)


def test_fused_and_local_attention_generate_the_same(dp2, tp2, pp2):
    """The default fused core attention (models/attention.py) and megatron's local one generate the same greedy
    tokens, batched and stepwise and with the shared prefill of repeated prompts, in every layout (log-probs to
    fp32 rounding); the local attention's rollouts also equal megatron's unpatched code (the grouped decode patch
    of patches/inference.py acts on it)."""
    for result in dp2 + tp2 + pp2:
        assert result["local_attention"] == "local"
        for mode in ("batched", "stepwise"):
            fused, local = result["free" if mode == "batched" else "free_stepwise"], result[f"local_free_{mode}"]
            assert torch.equal(fused.responses, local.responses), mode
            torch.testing.assert_close(fused.log_probs, local.log_probs, atol=1e-5, rtol=0)
            assert torch.equal(result[f"dup_greedy_{mode}"].responses, result[f"local_dup_{mode}"].responses), mode
            unpatched = result[f"local_free_{mode}_unpatched"]
            assert torch.equal(local.responses, unpatched.responses), mode
            torch.testing.assert_close(local.log_probs, unpatched.log_probs, atol=1e-5, rtol=0)


def test_repeated_prompts_prefilled_once(ref, dp2, tp2, pp2):
    """Repeated prompts are prefilled once and their KV-cache rows and logits copied: the same rollouts as
    prefilling every row (greedy and sampled, batched and stepwise), in every layout."""
    for result in dp2 + tp2 + pp2:
        rows = result["repeated_rows"]
        lengths = [len(p) for p in rows]
        for name in ("greedy", "sample"):
            for mode in ("batched", "stepwise"):
                key = f"dup_{name}_{mode}"
                shared, every_row = result[key], result[key + "_nodedup"]
                assert torch.equal(shared.responses, every_row.responses), key
                assert torch.equal(shared.response_mask, every_row.response_mask), key
                torch.testing.assert_close(shared.log_probs, every_row.log_probs, atol=1e-5, rtol=0)
                _check_consistent(shared)
                # batched: 5 distinct prompts; stepwise: 4 distinct first-L_min windows (the last row's prefix)
                window = max(lengths) if mode == "batched" else min(lengths)
                assert result[key + "_prefill_shape"] == (5 if mode == "batched" else 4, window), key
            key = f"dup_{name}_continuous"
            shared, every_row = result[key], result[key + "_nodedup"]
            assert torch.equal(shared.responses, every_row.responses), key
            torch.testing.assert_close(shared.log_probs, every_row.log_probs, atol=1e-5, rtol=0)
            assert torch.equal(shared.responses, result[f"dup_{name}_batched"].responses), key  # = the static engine
            # the continuous engine copies the KV rows of a sibling in flight: 5 distinct prompts, 4 rows copied
            assert shared.stats["prefill_shared_rows"] == 4 and every_row.stats["prefill_shared_rows"] == 0
            assert shared.stats["prefill_tokens"] < every_row.stats["prefill_tokens"]
        greedy = result["dup_greedy_batched"].response_token_lists()
        free = {tuple(p): row for p, row in zip(ref["prompts"], ref["free"])}
        assert [greedy[b] for b in range(8)] == [free[tuple(p)] for p in rows[:8]]
        sampled = result["dup_sample_batched"].responses
        assert not torch.equal(sampled[0], sampled[1])  # repeated prompts still draw their own samples


# ----------------------------------------------------------------------------------------- TP=2

def test_greedy_matches_transformers_tp2(ref, tp2):
    _assert_greedy_matches_hf(ref, tp2)


def test_tp2_ranks_agree_and_sampling(ref, tp2):
    r0, r1 = tp2
    for key in r0:
        if isinstance(r0[key], Rollout):
            assert torch.equal(r0[key].responses, r1[key].responses), key
    _assert_sampling_seeds(r0)
    _assert_samples_in_allowed_set(ref, r0["sample"])
    _assert_limits_and_stops(ref, r0)


# ----------------------------------------------------------------------------------------- PP=2

def test_greedy_matches_transformers_pp2(ref, pp2):
    _assert_greedy_matches_hf(ref, pp2)


def test_pp2_stages_agree_and_sampling(ref, pp2):
    r0, r1 = pp2
    for key in r0:
        if isinstance(r0[key], Rollout):
            assert torch.equal(r0[key].responses, r1[key].responses), key
            torch.testing.assert_close(r0[key].log_probs, r1[key].log_probs)
    _assert_sampling_seeds(r0)
    _assert_samples_in_allowed_set(ref, r0["sample"])
    _assert_limits_and_stops(ref, r0)


# ----------------------------------------------------------------------------------------- continuous batching

def _assert_same_rollout(got: Rollout, want: Rollout, what, atol=2e-5):
    """Equal tokens, lengths and finish reasons; log-probs to float rounding (another batch shape)."""
    assert got.response_token_lists() == want.response_token_lists(), what
    assert got.finish_reasons == want.finish_reasons, what
    assert torch.equal(got.response_mask, want.response_mask), what
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=atol, rtol=0, msg=what)


def test_continuous_engine_equals_the_static_engine(dp2, tp2, pp2):
    """Few rows in flight (4 of 18: finished rows' slots take the pending samples), prefills chunked by an 8-token
    cap, GRPO groups of 3 sharing their prefill, skewed per-row budgets, an EOS: every sample's tokens equal the
    static engine's (greedy and sampled), log-probs within 2e-5; pipeline micro-batching changes nothing."""
    for result in dp2 + tp2 + pp2:
        budgets = result["cb_budgets"]
        for name in ("greedy", "sample"):
            static, bounded = result[f"cb_{name}_static"], result[f"cb_{name}_bounded"]
            _assert_same_rollout(bounded, static, name)
            _assert_same_rollout(result[f"cb_{name}_one_group"], bounded, name + " one group", atol=1e-5)
            assert bounded.response_lengths.tolist() != budgets  # the EOS stops some rows early ...
            assert (bounded.response_lengths <= torch.tensor(budgets)).all()  # ... and the budgets bind others
            assert "eos" in bounded.finish_reasons and "length" in bounded.finish_reasons
            stats = bounded.stats
            assert stats["kv_rows"] == 4 and stats["max_rows_in_flight"] == 4
            assert stats["finished_row_steps"] == 0 < static.stats["finished_row_steps"]
            # every response token comes from one decode row-step; the static engine ran every row every step
            assert stats["decode_row_steps"] == int(bounded.response_lengths.sum())
            assert stats["prefill_shared_rows"] > 0 and stats["prefill_forwards"] > 1
            _check_consistent(bounded)
    a, b = pp2  # both stages return the same rollouts
    assert torch.equal(a["cb_sample_bounded"].responses, b["cb_sample_bounded"].responses)
    assert pp2[0]["cb_sample_bounded"].stats["pipeline_groups"] == 2
    assert pp2[0]["cb_sample_one_group"].stats["pipeline_groups"] == 1


def test_decode_budget_and_continuation(dp2, tp2, pp2):
    """max_decode_steps stops some samples ("unfinished", with their tokens and log-probs so far); continuing them in
    a second call (other iteration for fresh samples, their own stream kept) gives one uninterrupted generation's
    tokens, and the carried tokens keep their recorded log-probs."""
    for result in dp2 + tp2 + pp2:
        whole, first, rest = result["cb_partial_whole"], result["cb_partial_first"], result["cb_partial_rest"]
        carried = result["cb_partial_carried"]
        assert carried and len(carried) < len(result["cb_rows"])  # some samples finished within the budget
        assert [first.finish_reasons[b] for b in carried] == ["unfinished"] * len(carried)
        assert bool(first.unfinished[carried].all()) and not bool(first.stopped[carried].any())
        finished = [b for b in range(len(result["cb_rows"])) if b not in carried]
        for b in finished:
            assert first.response_token_lists()[b] == whole.response_token_lists()[b]
            assert first.finish_reasons[b] == whole.finish_reasons[b]
        assert rest.continuations is None  # everything finished in the second call
        # samples stopped mid-response, and samples still pending (no tokens yet) when the budget was spent
        started = [int(first.response_lengths[b]) > 0 for b in carried]
        assert any(started) and not all(started)
        for i, b in enumerate(carried):
            assert rest.response_token_lists()[i] == whole.response_token_lists()[b], b
            assert rest.finish_reasons[i] == whole.finish_reasons[b]
            n_old = int(first.response_lengths[b])
            assert n_old < int(rest.response_lengths[i])
            assert len(first.continuations[b].response) == n_old
            assert torch.equal(rest.log_probs[i, :n_old], first.log_probs[b, :n_old])  # kept as recorded
            torch.testing.assert_close(rest.log_probs[i], whole.log_probs[b], atol=2e-5, rtol=0)
        _check_consistent(first)
        _check_consistent(rest)


def test_kv_cache_scales_with_rows_in_flight_and_engine_errors(dp2, tp2, pp2):
    for result in dp2 + tp2 + pp2:
        stats = result["cb_kv_bytes"]
        assert stats[3]["kv_rows"] == 3 and stats[6]["kv_rows"] == 6
        assert stats[6]["kv_cache_bytes"] == 2 * stats[3]["kv_cache_bytes"] > 0
        # slots: the longest prompt + budget of any row (the static engine: longest prompt + largest budget)
        slots = max(len(p) + n for p, n in zip(result["cb_rows"], result["cb_budgets"]))
        assert stats[3]["kv_slots"] == stats[6]["kv_slots"] == slots < max(map(len, result["cb_rows"])) + MAX_NEW
        errors = result["cb_errors"]
        assert len(errors) == 6, errors
        assert "sampling.max_num_seqs need the continuous engine, but engine='static'" in errors[0]
        assert "engine='fast'" in errors[1] and "max_decode_steps=0" in errors[2]
        assert "max_decode_steps, sampling.max_num_seqs need the continuous engine, but the static engine runs " \
               "here: prefill='stepwise'" in errors[3]
        assert "1 continuations for 2 prompts" in errors[4] and "response_budgets" in errors[5]


# ============================================================================ pure-python pieces

def test_decode_speed_patches_are_registered_for_every_device():
    """The exact decode patches of mindspeed_llm/patches/inference.py (plain torch, exact everywhere: its docstring)
    apply on CUDA and NPU too, not only on the CPU where the tests above compare them with megatron's code."""
    from mindspeed_llm.patches import inference, registry

    mine = [p for p in registry() if p.make.__module__ == inference.__name__]
    assert len(mine) == 5 and all(set(p.devices) == {"cpu", "cuda", "npu"} for p in mine), mine


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    for k, p in [(5, None), (None, 0.7), (10, 0.5), (3, 0.99), (0, 1.0)]:
        expect = logits.clone()
        if k:
            expect = TopKLogitsWarper(k)(None, expect)
        if p is not None and p < 1.0:
            expect = TopPLogitsWarper(p)(None, expect)
        got = filter_logits(logits, k, p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(expect)), (k, p)


def test_candidates_equal_filter_logits():
    """The sampler's short candidate list keeps exactly the tokens of the full-vocabulary filter."""
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 3.0):  # flat logits make top-p-only grow its candidate list
        logits = torch.randn(6, 1000, generator=g) * scale
        for k, p in [(7, None), (None, 0.3), (None, 0.95), (40, 0.6), (None, None)]:
            kept = torch.isfinite(filter_logits(logits, k, p))
            values, ids = top_k_top_p_candidates(logits, k, p)
            if ids is None:
                assert kept.all()
                continue
            got = torch.zeros_like(kept).scatter(1, ids, torch.isfinite(values))
            assert torch.equal(got, kept), (scale, k, p)


def _uniforms(rows, seed):
    return torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sampler_distribution_and_uniforms():
    """The inverse-CDF draw follows the (tempered, truncated) distribution and only its uniforms; with a
    padded vocabulary the padding ids are never drawn but stay in the log-probs' normaliser."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])).repeat(20000, 1)
    cfg = SamplingConfig(do_sample=True, top_k=3)
    rng = torch.get_rng_state()
    tokens, lp = choose_tokens(logits, cfg, _uniforms(20000, 0))
    assert torch.equal(rng, torch.get_rng_state())
    # top-3 cumulative probabilities 0.5 / 0.9, 0.75 / 0.9, 1: u = 0.7 lies in the second candidate's interval
    assert choose_tokens(logits[:1], cfg, torch.tensor([0.7]))[0].item() == 1
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9, atol=0.015, rtol=0)
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.25, 0.15]))[tokens])
    hot_tokens, hot_lp = choose_tokens(logits[:50], SamplingConfig(do_sample=True, temperature=0.5),
                                       _uniforms(50, 1))
    expect = torch.log_softmax(logits[:50] / 0.5, -1).gather(1, hot_tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(hot_lp, expect)  # log-probs are tempered
    again = choose_tokens(logits, cfg, _uniforms(20000, 0))[0]
    assert torch.equal(tokens, again)
    padded = torch.cat([logits[:4000], torch.full((4000, 3), 2.0)], dim=1)  # 3 padding ids, the likeliest
    for sample in (True, False):
        pad_tokens, pad_lp = choose_tokens(padded, SamplingConfig(do_sample=sample), _uniforms(4000, 2),
                                           sample_below=5)
        assert int(pad_tokens.max()) < 5
        torch.testing.assert_close(pad_lp, torch.log_softmax(padded, -1).gather(1, pad_tokens[:, None]).squeeze(1))
    freq = torch.bincount(choose_tokens(padded, SamplingConfig(do_sample=True), _uniforms(4000, 3),
                                        sample_below=5)[0], minlength=5).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]), atol=0.025, rtol=0)


def test_sampling_config_validation_and_budgets():
    cfg = SamplingConfig(max_new_tokens=4, max_length=10)
    assert cfg.response_budgets([3, 7, 10, 12]) == [4, 3, 0, 0]
    assert SamplingConfig(max_new_tokens=None, max_length=6).response_budgets([2, 6]) == [4, 0]
    assert SamplingConfig(eos_token_id=[5, 6]).eos_ids == (5, 6) and SamplingConfig(eos_token_id=5).pad_id == 5
    for bad in (dict(max_new_tokens=None), dict(temperature=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(max_num_seqs=0), dict(max_num_batched_tokens=2.5), dict(max_num_seqs=True)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    # one stream per (seed, iteration, sample id); a longer table extends a stream, never changes its start
    table = sample_uniforms(1, 2, [0, 1, 5], 6)
    assert table.shape == (3, 6) and ((0 <= table) & (table < 1)).all()
    assert len({tuple(r) for r in table}) == 3 and (sample_uniforms(1, 2, [5, 0], 3) == table[[2, 0], :3]).all()
    assert not (sample_uniforms(1, 3, [0], 6) == table[:1]).any() and not (sample_uniforms(2, 2, [0], 6) == table[:1]).any()


def test_rollout_decode_with_a_transformers_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "foo": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    r = Rollout(prompts=torch.tensor([[1, 3]]), prompt_lengths=torch.tensor([2]), responses=torch.tensor([[4, 2, 0]]),
                response_mask=torch.tensor([[1, 1, 0]]), response_lengths=torch.tensor([2]),
                ended_with_eos=torch.tensor([True]), finish_reasons=["eos"], log_probs=None, pad_token_id=0)
    assert r.decode(hf) == ["world"] and r.decode(hf, skip_special_tokens=False) == ["world </s>"]
