"""MindSpeed-LLM's and MindSpeed-RL's published conversion commands (tests/fixtures/mindspeed_llm, verbatim) run here
with only paths and tiny parallel sizes substituted (`published_scripts.rewrite`): bash runs each script with a stub
`python` that records the converter's command line, which then converts a tiny model in-process. Round trips give
back the original tensors; the LoRA merge scripts merge a PEFT adapter; the flags that restate the model are
checked against it (--model-type-hf, --add-qkv-bias, --lora-r / --lora-alpha / --lora-target-modules, ...)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.convert_checks import assert_identical, convert_cli, hf_tensors
from tests.helpers.hf_tiny import save_tiny
from tests.helpers.published_scripts import fixture, recorded_command, rewrite, write_peft_adapter

from mindspeed_llm.checkpoint import load_spec


def _run(capsys, tmp_path, name, **values):
    """The fixture script `name` rewritten with `values`, run to its converter's command line and converted;
    returns (exit status, stderr)."""
    argv = recorded_command(rewrite(fixture(name), **values), tmp_path / f"run_{name}")
    capsys.readouterr()
    status = convert_cli(*argv)
    return status, capsys.readouterr().err


def _bf16(tensors):
    return {k: v.to(torch.bfloat16) for k, v in tensors.items()}


def test_rewrite_substitutes_paths_and_sizes_only():
    text = rewrite(fixture("qwen25_v1_hf2mcore.sh"), load_dir="/t/hf", save_dir="/t/mg",
                   tokenizer_model="/t/hf/tokenizer.json", target_tensor_parallel_size=2)
    assert "set_env.sh" not in text and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert text.split("python convert_ckpt.py")[1] == """ \\
       --use-mcore-models \\
       --model-type GPT \\
       --load-model-type hf \\
       --save-model-type mg \\
       --target-tensor-parallel-size 2 \\
       --target-pipeline-parallel-size 2 \\
       --add-qkv-bias \\
       --load-dir /t/hf \\
       --save-dir /t/mg \\
       --tokenizer-model /t/hf/tokenizer.json \\
       --model-type-hf llama2 \\
       --params-dtype bf16 # --num-layer-list 11,13,19,21 参数根据需要添加
"""
    with pytest.raises(ValueError, match="paths and parallel sizes only"):
        rewrite(fixture("qwen25_v1_hf2mcore.sh"), model_type_hf="qwen2")


def test_llama32_hf2mcore_and_mcore2hf(tmp_path, capsys):
    hf = save_tiny("llama", tmp_path / "hf", seed=1, tokenizer=True)
    status, err = _run(capsys, tmp_path, "llama32_hf2mcore.sh", load_dir=hf, save_dir=tmp_path / "mg",
                       tokenizer_model=f"{hf}/tokenizer.json")
    assert status == 0, err
    assert "ignored flags: --use-mcore-models" in err and "--model-type (GPT is the only" in err
    status, err = _run(capsys, tmp_path, "llama32_mcore2hf.sh", load_dir=tmp_path / "mg", save_dir=tmp_path / "out")
    assert status == 0, err
    assert_identical(_bf16(hf_tensors(hf)), hf_tensors(tmp_path / "out"))  # --params-dtype bf16
    # again into its own output: replaced in place (it is this program's)
    status, err = _run(capsys, tmp_path, "llama32_mcore2hf.sh", load_dir=tmp_path / "mg", save_dir=tmp_path / "out")
    assert status == 0 and "mg2hf" not in err and not (tmp_path / "out" / "mg2hf").exists(), err


def test_mcore2hf_into_the_original_model_keeps_it(tmp_path, capsys):
    """MindSpeed-LLM's llama32 mcore2hf script says to pass the original Hugging Face folder as --save-dir (its
    converter wrote to <save-dir>/mg2hf/): the original stays byte for byte, the model goes to mg2hf/."""
    hf = save_tiny("llama", tmp_path / "hf", seed=1, tokenizer=True)
    assert convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf,
                       "--save-dir", tmp_path / "mg") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    status, err = _run(capsys, tmp_path, "llama32_mcore2hf.sh", load_dir=tmp_path / "mg", save_dir=hf)
    assert status == 0, err
    assert f"the converted model goes to {hf}/mg2hf" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir() if p.is_file()} == before
    assert_identical(hf_tensors(hf), hf_tensors(tmp_path / "hf" / "mg2hf"))


@pytest.mark.parametrize("version", ["qwen25_v1", "rl_qwen25"])
def test_qwen25_llama2_with_qkv_bias_round_trip(tmp_path, capsys, version):
    hf = save_tiny("qwen2", tmp_path / "hf", seed=2, tokenizer=True)
    status, err = _run(capsys, tmp_path, f"{version}_hf2mcore.sh", load_dir=hf, save_dir=tmp_path / "mg",
                       tokenizer_model=f"{hf}/tokenizer.json", target_tensor_parallel_size=2)  # TP4: 2 kv heads
    assert status == 0, err
    assert "--model-type-hf llama2: MindSpeed-LLM's name for the llama layout, which qwen2 shares" in err
    assert load_spec(tmp_path / "mg").add_qkv_bias
    status, err = _run(capsys, tmp_path, f"{version}_mcore2hf.sh", load_dir=tmp_path / "mg",
                       save_dir=tmp_path / "out")
    assert status == 0, err
    assert_identical(_bf16(hf_tensors(hf)), hf_tensors(tmp_path / "out"))


@pytest.mark.parametrize("version", ["qwen25", "qwen25_v1", "qwen3"])
def test_lora_merge_command(tmp_path, capsys, version):
    """The published mcore2hf_lora command (r 8, alpha 16, linear_qkv linear_proj linear_fc1 linear_fc2) merges the
    adapter: every adapted weight is W + alpha / r * B @ A."""
    family = "qwen3" if version == "qwen3" else "qwen2"
    hf = save_tiny(family, tmp_path / "hf", seed=3)
    assert convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf,
                       "--save-dir", tmp_path / "mg") == 0
    pairs = write_peft_adapter(hf, tmp_path / "adapter", r=8, alpha=16, seed=4)
    values = dict(load_dir=tmp_path / "mg", lora_load=tmp_path / "adapter", save_dir=tmp_path / "out")
    if version != "qwen25_v1":
        values["hf_cfg_dir"] = hf
    status, err = _run(capsys, tmp_path, f"{version}_mcore2hf_lora.sh", **values)
    assert status == 0, err
    base, merged = hf_tensors(hf), hf_tensors(tmp_path / "out")
    assert sorted(base) == sorted(merged)
    for name, weight in base.items():
        expected = weight + 2.0 * pairs[name][1] @ pairs[name][0] if name in pairs else weight
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert len(pairs) == 7 * 2


def test_qwen3_and_qwen3_moe_round_trips(tmp_path, capsys):
    for family, name in (("qwen3", "qwen3"), ("qwen3_moe", "qwen3_moe")):
        hf = save_tiny(family, tmp_path / f"{name}_hf", seed=5)
        mg, out = tmp_path / f"{name}_mg", tmp_path / f"{name}_out"
        status, err = _run(capsys, tmp_path, f"{name}_hf2mcore.sh", load_dir=hf, save_dir=mg,
                           target_pipeline_parallel_size=2)  # PP8 of 2 layers
        assert status == 0, err
        if family == "qwen3_moe":
            assert "--model-type-hf" not in err  # qwen3-moe names qwen3_moe itself: no note
            assert "--moe-grouped-gemm (the checkpoint stores each expert apart" in err
        status, err = _run(capsys, tmp_path, f"{name}_mcore2hf.sh", load_dir=mg, save_dir=out, hf_cfg_dir=hf)
        assert status == 0, err
        assert_identical(hf_tensors(hf), hf_tensors(out))


def test_virtual_pipeline_script_is_refused_by_name(tmp_path, capsys):
    hf = save_tiny("qwen3_moe", tmp_path / "hf", seed=6)
    status, err = _run(capsys, tmp_path, "qwen3_moe_235b_hf2mcore.sh", load_dir=hf, save_dir=tmp_path / "mg",
                       target_pipeline_parallel_size=2, target_expert_parallel_size=2)
    assert status == 1 and "--noop-layers 94,95: noop layers renumber the decoder layers" in err


# ------------------------------------------------------------------------------------------- by hand

def _hf2mg(capsys, src, dst, *extra):
    capsys.readouterr()
    status = convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src, "--save-dir", dst,
                         *extra)
    return status, capsys.readouterr().err


def test_model_type_hf_of_the_same_layout_is_noted_another_refused(tmp_path, capsys):
    qwen2 = save_tiny("qwen2", tmp_path / "qwen2", seed=7)
    status, err = _hf2mg(capsys, qwen2, tmp_path / "a", "--model-type-hf", "llama2")
    assert status == 0 and "converting with the qwen2 mapping" in err and "(its q/k/v biases included)" in err
    status, err = _hf2mg(capsys, qwen2, tmp_path / "b", "--model-type-hf", "mixtral")
    assert status == 1 and "--model-type-hf 'mixtral' means model_type 'mixtral'" in err
    assert "says model_type 'qwen2'" in err
    moe = save_tiny("qwen3_moe", tmp_path / "moe", seed=7)
    status, err = _hf2mg(capsys, moe, tmp_path / "c", "--model-type-hf", "llama2")
    assert status == 1 and "'llama2' means model_type 'llama'" in err and "says model_type 'qwen3_moe'" in err
    # a Megatron input is checked against its stored model as well
    capsys.readouterr()
    assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "a",
                       "--save-dir", tmp_path / "out", "--model-type-hf", "qwen3-moe") == 1
    assert "the checkpoint" in capsys.readouterr().err


def test_add_qkv_bias_must_agree_with_the_config(tmp_path, capsys):
    llama = save_tiny("llama", tmp_path / "llama", seed=8)
    status, err = _hf2mg(capsys, llama, tmp_path / "mg", "--add-qkv-bias", "--model-type-hf", "llama2")
    assert status == 1 and "--add-qkv-bias: this llama model has no q/k/v biases" in err


def test_lora_flags_checked_against_the_adapter(tmp_path, capsys):
    hf = save_tiny("qwen2", tmp_path / "hf", seed=9)
    assert _hf2mg(capsys, hf, tmp_path / "mg")[0] == 0
    write_peft_adapter(hf, tmp_path / "adapter", r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj"))
    base = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
            "--save-dir", tmp_path / "out"]
    cases = [(["--lora-r", "16"], "--lora-r 16, but the adapter"),
             (["--lora-alpha", "32"], "--lora-alpha 32, but the adapter"),
             (["--lora-target-modules", "linear_qkv", "linear_proj"], "--lora-target-modules linear_qkv linear_proj, "
                                                                       "but the adapter")]
    for (extra, message), have in zip(cases, ("has r 8", "has alpha 16", "adapts linear_qkv\n")):
        capsys.readouterr()
        assert convert_cli(*base, "--lora-load", tmp_path / "adapter", *extra) == 1
        err = capsys.readouterr().err
        assert message in err and have in err, err
    assert convert_cli(*base, "--lora-load", tmp_path / "adapter", "--lora-r", "8", "--lora-alpha", "16",
                       "--lora-target-modules", "linear_qkv") == 0
    assert convert_cli(*base, "--lora-r", "8", "--lora-alpha", "16") == 1
    assert "--lora-r, --lora-alpha: no effect without --lora-load" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], "the stages here run without virtual pipeline stages"),
    (["--noop-layers", "0"], "--noop-layers 0: noop layers"),
    (["--num-layer-list", "1,3", "--target-pipeline-parallel-size", "2"], "pipeline stages here hold equal"),
    (["--num-layers", "5"], "--num-layers 5, but"),
    (["--first-k-dense-replace", "1"], "has a dense model"),
    (["--source-tensor-parallel-size", "2"], "describe a Megatron --load-dir"),
    (["--hf-cfg-dir", "x"], "--hf-cfg-dir x names the Hugging Face config of an mg -> hf export"),
])
def test_model_flags_refused_by_name(tmp_path, capsys, extra, message):
    hf = save_tiny("llama", tmp_path / "hf", seed=10, num_layers=4)
    status, err = _hf2mg(capsys, hf, tmp_path / "mg", *extra)
    assert status == 1 and message in err, err


def test_even_layer_list_and_ignored_flags_pass(tmp_path, capsys):
    hf = save_tiny("llama", tmp_path / "hf", seed=11, num_layers=4)
    status, err = _hf2mg(capsys, hf, tmp_path / "mg", "--num-layer-list", "2,2", "--target-pipeline-parallel-size",
                         "2", "--num-layers", "4", "--spec", "mindspeed_llm.tasks.models.spec.x", "layer_spec",
                         "--mla-mm-split", "--mtp-num-layers", "0")
    assert status == 0, err
    assert "--spec (the layer spec follows" in err and "--mla-mm-split" in err and "--mtp-num-layers" in err
    other = save_tiny("llama", tmp_path / "other", seed=11, num_layers=2)
    capsys.readouterr()
    assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
                       "--save-dir", tmp_path / "out", "--hf-cfg-dir", other, "--source-pipeline-parallel-size",
                       "2") == 1
    assert "its config.json describes another model" in capsys.readouterr().err
    assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
                       "--save-dir", tmp_path / "out", "--source-pipeline-parallel-size", "1") == 1
    assert "--source-pipeline-parallel-size 1, but" in capsys.readouterr().err


def test_convert_ckpt_v2_is_the_same_converter(tmp_path, capsys, monkeypatch):
    """MindSpeed-LLM's newer scripts call convert_ckpt_v2.py: the alias runs convert_ckpt.main on its argv."""
    import os
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr("sys.argv", ["convert_ckpt_v2.py", "--load-model-type", "mg", "--save-model-type", "hf",
                                     "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "o"), "--lora-r", "8"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(os.path.join(root, "convert_ckpt_v2.py"), run_name="__main__")
    assert exit_.value.code == 1 and "--lora-r: no effect without --lora-load" in capsys.readouterr().err
