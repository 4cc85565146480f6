"""Megatron-core models built from a framework-neutral `ArchitectureSpec`."""

from mindspeed_llm.models.architecture import SUPPORTED_FAMILIES, ArchitectureSpec, UnsupportedModelError
from mindspeed_llm.models.builder import ValueHead, build_model, explicit_groups, parse_dtype, transformer_config
from mindspeed_llm.models.forward_layout import forward_layout

__all__ = [
    "ArchitectureSpec", "UnsupportedModelError", "SUPPORTED_FAMILIES", "ValueHead", "build_model", "explicit_groups", "forward_layout",
    "parse_dtype", "transformer_config",
]
