"""--use-fused-rmsnorm on the built model: its torch `RMSNorm`s (every norm of megatron's local spec: the layers',
the q / k norms, the final norm) run `mindspeed_llm.device.rms_norm`, the device's fused RMSNorm.

A class change of each norm module, not a patch of megatron: the parameters (and their `sequence_parallel`
marking, `patches/sequence_parallel.py`) and the state dict stay the same objects and keys. --use-fused-swiglu and
--use-fused-rotary-pos-emb are megatron config switches whose kernels `patches/fused_ops.py` provides."""

from __future__ import annotations

import torch

from mindspeed_llm import device


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch's `RMSNorm` over the last dimension, computed by the device's fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # torch's default
        return device.rms_norm(x, self.weight, eps)


def use_fused_norms(model: torch.nn.Module) -> int:
    """Every torch `RMSNorm` of `model` over one dimension with a weight becomes a `FusedRMSNorm`; the count."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm and module.weight is not None and len(module.normalized_shape) == 1:
            module.__class__ = FusedRMSNorm
            count += 1
    return count
