"""Models loaded from checkpoints are built without megatron's random initialisation (`roles.load_model`,
`roles.from_checkpoint`), and nothing changes for it.

For a Qwen2 policy (fp32 and bf16), a Qwen2 value-head model, a Qwen3-MoE policy and a DeepSeek-V3 policy (MLA,
routing bias), converted from tiny Hugging Face models: every parameter and every buffer (non-persistent ones too)
of the model `load_model` builds equals, bit for bit and in dtype, the model megatron's default path gives (random
initialisation in host memory, the checkpoint loaded over it, then moved), and so does its output on a fixed batch.
A checkpoint that lacks a tensor (the value
head) is still an error naming it.
"""

import pytest
import torch

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

MODELS = [("qwen2", False, "fp32"), ("qwen2", False, "bf16"), ("qwen2", True, "fp32"), ("qwen3_moe", False, "fp32"),
          ("deepseek_v3", False, "fp32")]


# megatron's tensor-parallel attributes of a parameter (set_tensor_model_parallel_attributes, and DDP's allreduce)
TENSOR_PARALLEL_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


def _startup_cases(rank, world_size, root):
    from pathlib import Path

    from tests.helpers import hf_tiny

    from mindspeed_llm import distributed
    from mindspeed_llm.arguments import ArgumentError, parse_args
    from mindspeed_llm.checkpoint import convert_hf_to_mg
    from mindspeed_llm.checkpoint import megatron_layout as layout
    from mindspeed_llm.rl.update import roles

    root = Path(root)
    distributed.initialize(1, 1, seed=11)
    results = {}
    for family, value_head, dtype in MODELS:
        name = f"{family}{'_value' if value_head else ''}"
        mg = root / f"mg_{name}"
        if not mg.exists():
            hf = hf_tiny.save_tiny(family, root / f"hf_{name}", seq_cls=value_head, seed=4)
            convert_hf_to_mg(hf, str(mg), 1, 1, value_head=value_head, progress=False)
        argv = ["--stage", "grpo", "--ref-model", str(mg), "--data-path", "d", "--global-batch-size", "1",
                "--train-iters", "1", "--verifier-function", "math_acc"] + (["--bf16"] if dtype == "bf16" else [])
        args = parse_args(argv)
        built = roles.load_model(str(mg), "--ref-model", args.settings, value_head=value_head)
        planned = roles.from_checkpoint
        roles.from_checkpoint = lambda on_host=False: {}  # megatron's default: random init in host memory
        try:
            reference = roles.load_model(str(mg), "--ref-model", args.settings, value_head=value_head)
        finally:
            roles.from_checkpoint = planned
        differ = []
        for kind in ("named_parameters", "named_buffers"):
            ours, theirs = dict(getattr(built, kind)()), dict(getattr(reference, kind)())
            if ours.keys() != theirs.keys():
                differ.append(f"{kind}: {sorted(set(ours) ^ set(theirs))}")
            for key in ours.keys() & theirs.keys():
                a, b = ours[key], theirs[key]
                if a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b):
                    differ.append(key)
                # megatron's own marks: which weights are split over TP, along which dim (clipping reads them)
                marks = [tuple(getattr(t, name, None) for name in TENSOR_PARALLEL_MARKS) for t in (a, b)]
                if marks[0] != marks[1]:
                    differ.append(f"{key} marks {marks[0]} != {marks[1]}")
        tokens = torch.randint(0, built.model_spec.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(6).repeat(2, 1)
        with torch.no_grad():  # what is neither a parameter nor a buffer (RoPE's frequencies) shows in the output
            outputs = [m.eval()(tokens, positions, None) for m in (built, reference)]
        if not torch.equal(*outputs):
            differ.append("output")
        results[(name, dtype)] = (differ, len(dict(built.named_parameters())), len(dict(built.named_buffers())))

    # a value-head checkpoint without its value head
    source = root / "mg_qwen2_value"
    broken = root / "mg_qwen2_value_headless"
    if not broken.exists():
        import shutil

        shutil.copytree(source, broken)
        shard = layout.shard_path(layout.checkpoint_dir(broken, "release"), 0, 0, 1)
        payload = torch.load(shard, weights_only=False)
        del payload["model"]["output_layer.weight"]
        torch.save(payload, shard)
    args = parse_args(["--stage", "grpo", "--ref-model", str(broken), "--data-path", "d", "--global-batch-size", "1",
                       "--train-iters", "1", "--verifier-function", "math_acc"])
    try:
        roles.load_model(str(broken), "--reward-model", args.settings, value_head=True)
        results["headless"] = None
    except ArgumentError as exc:
        results["headless"] = str(exc)
    return results


def test_models_built_without_random_init_equal_megatrons_default_path(tmp_path):
    (results,) = run_distributed(_startup_cases, 1, str(tmp_path))
    for (name, dtype) in [(f"{f}{'_value' if v else ''}", d) for f, v, d in MODELS]:
        differ, params, buffers = results[(name, dtype)]
        assert params > 5, name
        assert differ == [], f"{name} {dtype}: {differ[:8]}"
    message = results["headless"]
    assert message is not None, "a checkpoint without its value head loaded"
    assert message.startswith("--reward-model ") and "missing output_layer.weight" in message
