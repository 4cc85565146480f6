"""Rollout generation for RL on the training model: a continuous-batching engine with a bounded KV cache (the default)
or Megatron-core's static KV cache, see `generate`.

`generate` and `EngineOptions` are imported lazily: `SamplingConfig` and `Rollout` do not import megatron.
"""

from mindspeed_llm.inference.results import Continuation, Rollout, SequenceBatch
from mindspeed_llm.inference.sampling import SamplingConfig, choose_tokens, filter_logits, sample_uniforms


def __getattr__(name):
    if name in ("generate", "EngineOptions"):
        from mindspeed_llm.inference import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "generate", "EngineOptions", "Rollout", "SequenceBatch", "Continuation", "SamplingConfig", "sample_uniforms",
    "filter_logits", "choose_tokens",
]
