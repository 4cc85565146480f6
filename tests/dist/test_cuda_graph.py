"""Fixed-shape decode steps and their CUDA-graph capture (mindspeed_llm.inference.cuda_graph) against the
ordinary decode path of `generate`'s static engine: the same greedy and sampled tokens, log-probs within fp32
rounding (with the speed patches of mindspeed_llm/patches/inference.py applied, as on every device).

On CPU the fixed-shape step runs eagerly (what the graph records: the slot as a tensor, the whole cache read
under a mask); the captured graph itself needs CUDA and is skipped without it. Run on a GPU machine with
``pytest tests/dist/test_cuda_graph.py`` (the CUDA case moves the model to the GPU in its own process).
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

HF_CONFIG = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
)
MAX_NEW = 10


def _prompts():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    return prompts + [prompts[1], prompts[1]]  # repeated prompts: the shared prefill copies cache rows


def _replay_engine_class():
    """The engine with a stand-in for the CUDA graph (CPU): `_capture` runs the step once under the capture's
    RNG-fork bypass and keeps its output tensor; `replay` recomputes the step from the fixed input buffers into
    that same tensor. Checks the graph branch's bookkeeping (inputs only through the buffers, the output buffer
    reused) where no GPU is available."""
    from types import SimpleNamespace

    from mindspeed_llm.inference import cuda_graph

    class ReplayEngine(cuda_graph.StaticDecodeKVCacheModel):
        def __init__(self, model, plan, record_routing=False, graph=None):
            super().__init__(model, plan, record_routing, graph=False)
            self.graph, self.outputs = True, set()

        def _capture(self):
            with cuda_graph._no_rng_fork():
                self._graph_logits = self._static_forward()
            self._graph = SimpleNamespace(replay=lambda: self._graph_logits.copy_(self._static_forward()))

        def decode_step(self, tokens, pos):
            logits = super().decode_step(tokens, pos)
            self.outputs.add(id(logits))
            return logits

    return ReplayEngine


def _cases(rank, world_size, tp, graph, replay=False):
    """[(case, ordinary Rollout, fixed-shape Rollout, engine facts)] for greedy / sampled, batched / stepwise.
    On the CPU unless `graph` (then on CUDA: one GPU, so TP1)."""
    os.environ["MINDSPEED_DEVICE"] = "cuda" if graph else "cpu"
    from megatron.core import parallel_state

    from mindspeed_llm import device as _device
    from mindspeed_llm import distributed
    from mindspeed_llm.inference import EngineOptions, SamplingConfig, generate
    from mindspeed_llm.inference.cuda_graph import StaticDecodeKVCacheModel
    from mindspeed_llm.models import ArchitectureSpec, build_model

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    distributed.initialize(tp, 1, seed=0)
    torch.manual_seed(0)
    # Large init: well-separated logits, so a greedy choice is not a near tie that rounding could flip.
    model = build_model(ArchitectureSpec.from_hf_config(HF_CONFIG), init_method_std=0.3)
    model = model.to(_device.current_device())
    prompts = _prompts()
    out = []
    for name, sampling, prefill in (
        ("greedy batched", SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=0), "batched"),
        ("greedy stepwise", SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=0), "stepwise"),
        ("sampled batched", SamplingConfig(do_sample=True, temperature=0.8, top_k=50, max_new_tokens=MAX_NEW,
                                           pad_token_id=0, seed=5), "batched"),
    ):
        # the static engine (megatron's KV cache), where the fixed-shape / CUDA-graph step lives
        plain = generate(model, prompts, sampling, iteration=2, prefill=prefill, engine="static")
        engines = []
        engine_cls = _replay_engine_class() if replay else StaticDecodeKVCacheModel

        def static_engine(model, plan, record_routing=False):  # the fixed-shape engine, kept for its facts
            engines.append(engine_cls(model, plan, record_routing, graph=graph))
            return engines[-1]

        static = generate(model, prompts, sampling, iteration=2, prefill=prefill, engine="static",
                          options=EngineOptions(static_kv_cache_model=static_engine))
        again = generate(model, prompts, sampling, iteration=2, prefill=prefill,
                         engine="static")  # the default engine again
        facts = [(e.static_reason, e.static_steps, e.graph) + ((len(e.outputs),) if replay else ()) for e in engines]
        out.append((name, _rollout_dict(plain),
                    _rollout_dict(static), _rollout_dict(again), facts))
    return out


def _rollout_dict(r):
    return {"responses": r.responses.cpu(), "response_lengths": r.response_lengths.cpu(),
            "log_probs": r.log_probs.cpu()}


def _check(results):
    for name, plain, static, again, facts in results:
        assert facts and all(reason is None and steps > 0 for reason, steps, *_ in facts), (name, facts)
        assert torch.equal(static["responses"], plain["responses"]), (name, static["responses"], plain["responses"])
        assert torch.equal(static["response_lengths"], plain["response_lengths"]), name
        torch.testing.assert_close(static["log_probs"], plain["log_probs"], atol=1e-5, rtol=1e-5)
        assert torch.equal(again["responses"], plain["responses"]), name
        assert torch.equal(again["log_probs"], plain["log_probs"]), name  # the wrapper is inert off the engine


def test_fixed_shape_decode_matches_ordinary_steps_tp1():
    (results,) = run_distributed(_cases, 1, 1, False)
    _check(results)


def test_fixed_shape_decode_matches_ordinary_steps_tp2():
    results = run_distributed(_cases, 2, 2, False)
    for r in results:
        _check(r)
    assert all(torch.equal(a[2]["responses"], b[2]["responses"]) for a, b in zip(*results))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph capture needs a CUDA device")
def test_cuda_graph_decode_matches_ordinary_steps():
    (results,) = run_distributed(_cases, 1, 1, True)
    _check(results)
    assert all(f[2] for *_, facts in results for f in facts)


def test_graph_branch_with_a_stand_in_replay_tp1():
    (results,) = run_distributed(_cases, 1, 1, False, True)
    _check(results)
    # every step returned the one captured output tensor, through the graph branch
    assert all(f[2] and f[3] == 1 for *_, facts in results for f in facts), [r[-1] for r in results]


def test_switch(monkeypatch):
    from mindspeed_llm.inference import cuda_graph, kv_cache

    monkeypatch.delenv("MINDSPEED_DECODE_CUDA_GRAPH", raising=False)
    assert cuda_graph.engine_class(torch.device("cuda", 0)) is kv_cache.KVCacheModel
    monkeypatch.setenv("MINDSPEED_DECODE_CUDA_GRAPH", "1")
    assert cuda_graph.engine_class(torch.device("cpu")) is kv_cache.KVCacheModel  # never on CPU
    assert cuda_graph.engine_class(torch.device("cuda", 0)).graph_default is True
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    fork = tracker.fork
    with cuda_graph._no_rng_fork():
        assert tracker.fork("model-parallel-rng") is not None  # a no-op context, even for an unknown state
        with tracker.fork("not-added"):
            pass
    assert tracker.fork == fork and "fork" not in vars(tracker)
    monkeypatch.setenv("MINDSPEED_DECODE_CUDA_GRAPH", "yes please")
    with pytest.raises(ValueError, match="MINDSPEED_DECODE_CUDA_GRAPH='yes please': use 1"):
        cuda_graph.engine_class(torch.device("cuda", 0))
