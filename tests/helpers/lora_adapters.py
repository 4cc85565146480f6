"""LoRA adapters in the spawned ranks of the adapter tests (test_lora.py, test_lora_sequence_parallel.py): random
non-zero B matrices that are the same at any layout, and the adapters' gradients merged over the TP ranks."""

from __future__ import annotations

import zlib

import torch


def randomise_b(model, seed):
    """Every adapter's B drawn from its global name (the same at any layout), so the adapters act."""
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.models import lora

    with torch.no_grad():
        for name, (a, b) in lora.adapter_tensors(model).items():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            adapter = next(m for m in lora.adapters(model).values() if m.B is b)
            if lora_files.split_rule(name) == "row":
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            else:  # the full B, then this rank's rows
                full_rows = b.shape[0] * adapter.tp_size
                full = torch.randn(full_rows, b.shape[1], generator=g) * 0.3
                rank = adapter.tp_group.rank() if adapter.tp_size > 1 else 0
                b.copy_(lora_files.split_for_rank(name, a.detach(), full, adapter.tp_size, rank)[1])


def sum_sequence_parallel_grads(model) -> None:
    """What megatron's finalize_model_grads does for a sequence-parallel model's parameters marked
    `sequence_parallel` (the norms, a row-parallel adapter's B): their gradients summed over the TP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not getattr(model.config, "sequence_parallel", False):
        return
    for param in model.parameters():
        if param.grad is not None and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())


def adapter_grads(model):
    """{global module: (dA, dB)} merged over each adapter's TP group (after `sum_sequence_parallel_grads`; a routed
    expert's adapter at expert TP 1 stays whole), and whether every replicated tensor's gradient was the same on
    every TP rank: {global module: bool}."""
    import torch.distributed as dist

    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.models import lora

    sum_sequence_parallel_grads(model)
    global_names = lora._core(model).lora_global_names
    grads, same = {}, {}
    for local, adapter in lora.adapters(model).items():
        name = global_names[local]
        ga, gb = adapter.A.grad.detach().clone(), adapter.B.grad.detach().clone()
        if adapter.tp_size > 1:
            gathered = []
            for g in (ga, gb):
                parts = [torch.empty_like(g) for _ in range(adapter.tp_size)]
                dist.all_gather(parts, g.contiguous(), group=adapter.tp_group)
                gathered.append(parts)
            replicated = gathered[0] if lora_files.split_rule(name) != "row" else gathered[1]
            same[name] = all(torch.equal(replicated[0], p) for p in replicated)
            ga, gb = lora_files.merge_ranks(name, list(zip(*gathered)))
        grads[name] = (ga, gb)
    return grads, same
