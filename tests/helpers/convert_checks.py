"""convert_ckpt.py's command line in this process (`convert_cli`) and what its round-trip tests compare: every tensor
of a Hugging Face folder (`hf_tensors`) and two such sets, bit for bit (`assert_identical`)."""

import json
import os

import torch
from safetensors.torch import load_file

import convert_ckpt


def convert_cli(*argv) -> int:
    return convert_ckpt.main([str(a) for a in argv] + ["--no-progress"])


def hf_tensors(path):
    out = {}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out


def assert_identical(a, b):
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name


def _frozen_module(state, dtype):
    """A module whose frozen parameters are a shard's tensors under its names (what a built model holds)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        if tensor is None or name.endswith("_extra_state"):
            continue
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.to(dtype), requires_grad=False))
    return root


def write_adapter_checkpoint(hf_base, out, tp: int = 1, pp: int = 1, r: int = 2, dtype=torch.float32, seed: int = 0,
                             target: str = "linear_qkv", value_head: bool = False):
    """A LoRA run's adapter checkpoint (`<save>/actor` at TP `tp` x PP `pp`, trained in `dtype`; with `value_head`,
    `<save>/critic` of a value model `hf_base`, converted with --orm: its trained head saved beside the adapters and
    left out of the frozen base) for the Hugging Face model `hf_base`: random adapters on every `target`, and each
    shard's base fingerprint as training records it (`rl.update.lora.base_fingerprint` on a module holding that rank's
    shard of the base, converted at this layout). Returns the folder."""
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.checkpoint import megatron_layout as layout
    from mindspeed_llm.checkpoint import megatron_names
    from mindspeed_llm.models.lora import LoRAConfig
    from mindspeed_llm.rl.update.lora import base_fingerprint

    out = str(out)
    base_mg = out + "_base_mg"
    assert convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf_base,
                       "--save-dir", base_mg, "--target-tensor-parallel-size", tp,
                       "--target-pipeline-parallel-size", pp, *(["--orm"] if value_head else [])) == 0
    info = layout.checkpoint_info(base_mg)
    spec = info["spec"]
    config = LoRAConfig(r=r, alpha=2.0 * r, target_modules=(target,))
    folder = layout.checkpoint_dir(out, 1)
    per = spec.num_layers // pp
    for t, p, e in layout.expected_shards(tp, pp):
        base_shard = layout.load_file(layout.shard_path(info["dir"], t, p, pp))["model"]
        state = {}
        for name, weight in base_shard.items():
            if weight is None or not name.endswith(f".{target}.weight"):
                continue
            module = name[:-len(".weight")]
            width_in = weight.shape[1] * (tp if lora_files.split_rule(module) == "row" else 1)
            rows = weight.shape[0] * (1 if lora_files.split_rule(module) == "row" else tp)
            g = torch.Generator().manual_seed(seed + 1000 * (p * per + int(module.split(".")[2])))
            a, b = torch.randn(r, width_in, generator=g), torch.randn(rows, r, generator=g)
            a, b = lora_files.split_for_rank(module, a, b, tp, t)
            state[module + lora_files.A_SUFFIX], state[module + lora_files.B_SUFFIX] = a.to(dtype), b.to(dtype)
        frozen = dict(base_shard)
        if value_head and frozen.get(megatron_names.OUTPUT) is not None:  # the critic's head trains: saved, not frozen
            head = frozen.pop(megatron_names.OUTPUT)
            noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(seed + 7))
            state[megatron_names.OUTPUT] = (head + 0.5 * noise).to(dtype)
        meta = {"config": config.to_dict(), "value_head": value_head, "initial_adapter": None,
                "base": {"path": os.path.abspath(base_mg),
                         "fingerprint": base_fingerprint(_frozen_module(frozen, dtype))}}
        payload = layout.make_payload(state, spec, tp, pp, t, p, dtype, value_head, 1, lora=meta)
        layout.save_file(payload, layout.shard_path(folder, t, p, pp))
    layout.write_latest(out, 1)
    return out
