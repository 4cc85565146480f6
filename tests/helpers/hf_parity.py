"""Outputs of a Megatron model against transformers' on the same token ids, shared by the parity tests of the dense,
MoE and DeepSeek-V3 families and LoRA: random ids (`token_ids`), transformers' logits or values
(`hf_reference`), the full Megatron output on the last pipeline stage (`megatron_forward`, gathered over TP)
and their largest difference (`case_diff`)."""

import torch

from tests.helpers.hf_tiny import PAD_TOKEN_ID


TOL = 1e-5
BATCH, SEQ = 2, 11


def token_ids(vocab, seed, pad_tail=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=gen)
    if pad_tail:
        ids[1, -pad_tail:] = PAD_TOKEN_ID  # right padding on the second row
    return ids


@torch.no_grad()
def hf_reference(model, ids, value):
    if not value:
        return {"logits": model(input_ids=ids).logits.float()}
    hidden = model.model(input_ids=ids).last_hidden_state
    values = model.score(hidden).float()
    pooled = model(input_ids=ids).logits.float()  # [b, 1] at the last non-pad token
    return {"values": values, "pooled": pooled}


def megatron_forward(model, ids, tp, pp):
    """Full output of the model on the last stage (every TP rank); None on other stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        if pp > 1:
            if ps.is_pipeline_first_stage():
                hidden = model(ids, pos, None)  # [s, b, h] when not the last stage
                dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
                return None
            buf = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)
            dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(buf)
        out = model(ids, pos, None)  # [b, s, vocab/tp] or [b, s, 1]
    if tp > 1 and not getattr(model, "is_value_model", False):
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out


def case_diff(model, case, tp, pp):
    """max |output - transformers| of one case (logits, or per-token and pooled values) on the last stage;
    None on other stages."""
    out = megatron_forward(model, case["ids"], tp, pp)
    if out is None:
        return None
    ref = case["ref"]
    if not case["value"]:
        return (out - ref["logits"]).abs().max().item()
    diff = (out - ref["values"]).abs().max().item()
    last = (case["ids"] != PAD_TOKEN_ID).long().cumsum(-1).argmax(-1)  # last non-pad position
    pooled = out[torch.arange(out.shape[0]), last]
    return max(diff, (pooled - ref["pooled"]).abs().max().item())
