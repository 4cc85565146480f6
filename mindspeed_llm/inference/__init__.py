"""Rollout generation for RL on Megatron-core's inference path (static KV cache), see `generate`.

`generate` is imported lazily: `SamplingConfig` and `Rollout` do not import megatron.
"""

from mindspeed_llm.inference.rollout import Rollout, SequenceBatch
from mindspeed_llm.inference.sampling import SamplingConfig, choose_tokens, filter_logits, sample_uniforms


def __getattr__(name):
    if name == "generate":
        from mindspeed_llm.inference.generation import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "generate", "Rollout", "SequenceBatch", "SamplingConfig", "sample_uniforms", "filter_logits", "choose_tokens",
]
