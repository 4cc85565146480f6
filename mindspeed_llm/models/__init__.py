"""Megatron-core models built from a framework-neutral `ModelSpec`."""

from mindspeed_llm.models.builder import ValueHead, build_model, parse_dtype, transformer_config
from mindspeed_llm.models.forward_layout import forward_layout
from mindspeed_llm.models.spec import SUPPORTED_FAMILIES, ModelSpec, UnsupportedModelError

__all__ = [
    "ModelSpec", "UnsupportedModelError", "SUPPORTED_FAMILIES", "ValueHead", "build_model", "forward_layout",
    "parse_dtype", "transformer_config",
]
