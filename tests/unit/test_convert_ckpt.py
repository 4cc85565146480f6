"""convert_ckpt.py and mindspeed_llm.checkpoint without building Megatron models (those: test_models_parity.py).

Round trips HF -> mg -> HF are bit-identical for every family, TP=1/2, PP=1/2, with and without --orm;
the exports load in `transformers`; errors name the file, tensor or flag; checkpoints are published
atomically.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.hf_tiny import FAMILIES, build_tiny, save_tiny
from tests.helpers.convert_checks import assert_identical, convert_cli, hf_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import convert_ckpt  # noqa: E402
from mindspeed_llm import checkpoint as ckpt  # noqa: E402
from mindspeed_llm.checkpoint import megatron_layout as layout  # noqa: E402


# ------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("orm", [False, True], ids=["lm", "orm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_bit_identical(tmp_path, family, orm):
    """HF -> mg (TP x PP in {1,2}^2) -> HF gives the same tensors, tied and untied, through the CLI."""
    for tie in (False, True):
        src = save_tiny(family, tmp_path / f"hf_{tie}", tie=tie, seq_cls=orm, num_layers=4, seed=7)
        original = hf_tensors(src)
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            mg, out = tmp_path / f"mg_{tie}_{tp}{pp}", tmp_path / f"out_{tie}_{tp}{pp}"
            flags = ["--orm"] if orm else []
            assert convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                               "--save-dir", mg, "--target-tensor-parallel-size", tp,
                               "--target-pipeline-parallel-size", pp, *flags) == 0
            assert layout.find_layout(layout.checkpoint_dir(mg, "release")) == (tp, pp)
            assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg,
                               "--save-dir", out, *flags) == 0
            assert_identical(original, hf_tensors(out))


def test_exports_load_in_transformers_with_same_outputs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    ids[1, -2:] = 0
    for family in FAMILIES:
        for seq_cls in (False, True):
            tie = family in ("llama", "qwen2") and not seq_cls
            src = save_tiny(family, tmp_path / f"{family}{seq_cls}", tie=tie, seq_cls=seq_cls, seed=3)
            mg, out = tmp_path / f"{family}{seq_cls}_mg", tmp_path / f"{family}{seq_cls}_out"
            ckpt.convert_hf_to_mg(src, mg, tp=2, pp=2, value_head=seq_cls, progress=False)
            ckpt.convert_mg_to_hf(mg, out, progress=False)
            config = json.load(open(out / "config.json"))
            assert "quantization_config" not in config and config["architectures"][0].endswith(
                "ForSequenceClassification" if seq_cls else "ForCausalLM")
            auto = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
            reference = build_tiny(family, tie=tie, seq_cls=seq_cls, seed=3)
            loaded = auto.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
            assert loaded.config.pad_token_id == reference.config.pad_token_id
            with torch.no_grad():
                assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits), (family, seq_cls)


def test_reshard_mg_to_mg_and_iteration_checkpoints(tmp_path):
    src = save_tiny("qwen3", tmp_path / "hf", tie=True, num_layers=4, seed=1)
    ckpt.convert_hf_to_mg(src, tmp_path / "tp2", tp=2, pp=1, progress=False)
    assert convert_cli("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", tmp_path / "tp2",
                       "--save-dir", tmp_path / "pp2", "--target-pipeline-parallel-size", 2) == 0
    assert layout.find_layout(tmp_path / "pp2" / "release") == (1, 2)
    # the same tensors: merge both back to one full state dict
    info = layout.checkpoint_info(tmp_path / "pp2")
    assert info["tp"] == 1 and info["pp"] == 2 and info["spec"] == ckpt.load_spec(tmp_path / "tp2")
    ckpt.convert_mg_to_hf(tmp_path / "pp2", tmp_path / "out", progress=False)
    assert_identical(hf_tensors(src), hf_tensors(tmp_path / "out"))
    # a training-style iteration checkpoint is found through the tracker
    shard = layout.load_shard(tmp_path / "pp2", 0, 1)
    staging = layout.prepare_staging(tmp_path / "pp2", 20)
    for pp_rank in range(2):
        layout.save_file(layout.load_shard(tmp_path / "pp2", 0, pp_rank),
                         layout.shard_path(staging, 0, pp_rank, 2))
    layout.publish(staging, layout.checkpoint_dir(tmp_path / "pp2", 20))
    layout.write_latest(tmp_path / "pp2", 20)
    assert layout.read_latest(tmp_path / "pp2") == 20
    assert os.path.isfile(tmp_path / "pp2" / "iter_0000020" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert torch.equal(layout.load_shard(tmp_path / "pp2", 0, 1)["model"]["output_layer.weight"],
                       shard["model"]["output_layer.weight"])


def test_checkpoint_format(tmp_path):
    src = save_tiny("qwen2", tmp_path / "hf", seq_cls=True, num_layers=2, seed=2)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", tp=2, pp=2, value_head=True, params_dtype="bf16", progress=False)
    assert open(tmp_path / "mg" / "latest_checkpointed_iteration.txt").read().strip() == "release"
    names = sorted(os.listdir(tmp_path / "mg" / "release"))
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first = layout.load_shard(tmp_path / "mg", 1, 0)
    last = layout.load_shard(tmp_path / "mg", 1, 1)
    for payload in (first, last):
        assert payload["checkpoint_version"] == 3.0 and payload["iteration"] == 0
        assert payload["args"].tensor_model_parallel_size == 2 and payload["args"].pipeline_model_parallel_size == 2
        assert payload["args"].params_dtype == torch.bfloat16 and payload["args"].value_head is True
        assert payload["model_spec"]["family"] == "qwen2"
    assert "embedding.word_embeddings.weight" in first["model"] and "output_layer.weight" not in first["model"]
    assert first["model"]["embedding.word_embeddings.weight"].shape == (128, 64)  # vocab split
    assert first["model"]["decoder.layers.0.self_attention.linear_qkv.bias"].dtype == torch.bfloat16
    head = last["model"]["output_layer.weight"]
    assert head.shape == (1, 64) and head.dtype == torch.float32  # value head: replicated, fp32
    assert torch.equal(head, layout.load_shard(tmp_path / "mg", 0, 1)["model"]["output_layer.weight"])
    # each shard stores only its own slice (no shared full storage pickled per rank)
    path = layout.shard_path(tmp_path / "mg" / "release", 0, 0, 2)
    stage_bytes = sum(t.numel() * t.element_size() for t in first["model"].values() if t is not None)
    assert os.path.getsize(path) < stage_bytes * 1.3 + 20000


def test_tied_embeddings_pp2_last_stage_holds_copy(tmp_path):
    src = save_tiny("llama", tmp_path / "hf", tie=True, num_layers=2, seed=5)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", tp=2, pp=2, progress=False)
    for tp_rank in range(2):
        first = layout.load_shard(tmp_path / "mg", tp_rank, 0)["model"]
        last = layout.load_shard(tmp_path / "mg", tp_rank, 1)["model"]
        assert torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])
    ckpt.convert_hf_to_mg(src, tmp_path / "mg1", tp=1, pp=1, progress=False)
    assert "output_layer.weight" not in layout.load_shard(tmp_path / "mg1", 0, 0)["model"]


def test_dtypes(tmp_path):
    model = build_tiny("mistral", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    ckpt.convert_hf_to_mg(tmp_path / "hf", tmp_path / "mg", tp=2, progress=False)  # dtype follows the weights
    assert layout.checkpoint_info(tmp_path / "mg")["params_dtype"] == torch.bfloat16
    shard = layout.load_shard(tmp_path / "mg", 0, 0)["model"]
    assert {t.dtype for t in shard.values() if t is not None} == {torch.bfloat16}
    ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out", progress=False)
    assert_identical(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
    ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out32", params_dtype="fp32", progress=False)
    assert {t.dtype for t in hf_tensors(tmp_path / "out32").values()} == {torch.float32}


def test_reads_sharded_safetensors_and_pytorch_bin(tmp_path):
    from mindspeed_llm.checkpoint.hf_files import save_hf_weights

    model = build_tiny("qwen2", seed=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for fmt in ("sharded", "bin", "bin_sharded"):
        src = tmp_path / fmt
        src.mkdir()
        model.config.to_json_file(src / "config.json")
        if fmt == "sharded":
            files = save_hf_weights(state, str(src), max_shard_bytes=40_000)
            assert "model.safetensors.index.json" in files and len(files) > 3
        elif fmt == "bin":
            torch.save(state, src / "pytorch_model.bin")
        else:
            names = list(state)
            halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                      "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
            for file, keys in halves.items():
                torch.save({k: state[k] for k in keys}, src / file)
            json.dump({"weight_map": {k: f for f, keys in halves.items() for k in keys}},
                      open(src / "pytorch_model.bin.index.json", "w"))
        ckpt.convert_hf_to_mg(src, tmp_path / f"{fmt}_mg", tp=2, pp=2, progress=False)
        ckpt.convert_mg_to_hf(tmp_path / f"{fmt}_mg", tmp_path / f"{fmt}_out", progress=False)
        out = hf_tensors(tmp_path / f"{fmt}_out")
        assert_identical(state, out)


def test_tokenizer_files_travel(tmp_path):
    from transformers import AutoTokenizer

    src = save_tiny("llama", tmp_path / "hf", tokenizer=True, seed=8)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", progress=False)
    assert os.path.isfile(tmp_path / "mg" / "tokenizer.json")
    tok = AutoTokenizer.from_pretrained(tmp_path / "mg")  # stages find a tokenizer in the mg dir
    assert tok("w5 w6")["input_ids"][-2:] == [5, 6]
    ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out", progress=False)  # from the mg dir by default
    assert AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "</s>"
    # --tokenizer-dir wins
    bare = save_tiny("llama", tmp_path / "bare", seed=8)
    other = tmp_path / "tok"
    from tests.helpers.hf_tiny import write_tokenizer
    write_tokenizer(other, 256)
    ckpt.convert_hf_to_mg(bare, tmp_path / "mg2", tokenizer_dir=str(other), progress=False)
    assert os.path.isfile(tmp_path / "mg2" / "tokenizer.json")
    ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out2", tokenizer_dir=str(other), progress=False)
    assert open(tmp_path / "out2" / "tokenizer.json").read() == open(other / "tokenizer.json").read()
    # and on a reshard (mg -> mg), which used to copy --load-dir's whatever --tokenizer-dir said
    import json
    import shutil

    marked = tmp_path / "tok_marked"
    shutil.copytree(other, marked)
    config = json.loads((marked / "tokenizer_config.json").read_text())
    (marked / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=77)))
    ckpt.convert_mg_to_mg(tmp_path / "mg", tmp_path / "mg_tp1", tokenizer_dir=str(marked), progress=False)
    assert json.loads((tmp_path / "mg_tp1" / "tokenizer_config.json").read_text())["model_max_length"] == 77


def test_model_type_aliases(tmp_path):
    src = save_tiny("qwen2", tmp_path / "hf", seed=9)
    for alias in ("qwen25", "qwen2.5", "qwen2"):
        ckpt.convert_hf_to_mg(src, tmp_path / alias, model_type_hf=alias, progress=False)
    assert ckpt.load_spec(tmp_path / "qwen25").family == "qwen2"


# ------------------------------------------------------------------------------------------- errors

def _error(capsys, *argv) -> str:
    assert convert_cli(*argv) == 1
    return capsys.readouterr().err


def test_error_unsupported_architecture(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "hf", seed=10)
    config = json.load(open(os.path.join(src, "config.json")))
    config["model_type"] = "gpt2"
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert "model_type 'gpt2' is not supported" in err and "llama, qwen2, qwen3, mistral" in err
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg", "--model-type-hf", "baichuan")
    assert "--model-type-hf 'baichuan' is not supported" in err and "qwen25" in err
    src2 = save_tiny("llama", tmp_path / "hf2", seed=10)
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src2,
                 "--save-dir", tmp_path / "mg", "--model-type-hf", "qwen3")
    assert "config.json says model_type 'llama'" in err
    assert not os.path.exists(tmp_path / "mg" / "latest_checkpointed_iteration.txt")


def test_error_missing_files(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "hf", seed=11)
    os.remove(os.path.join(src, "model.safetensors"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert f"no Hugging Face weights in {src}" in err and "model.safetensors" in err
    os.remove(os.path.join(src, "config.json"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert f"no config.json in {src}" in err
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", tmp_path / "nope",
                 "--save-dir", tmp_path / "mg")
    assert "does not exist" in err
    # a missing tensor is named
    src = save_tiny("qwen2", tmp_path / "hf3", seed=11)
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.bias"]
    from safetensors.torch import save_file
    save_file(state, os.path.join(src, "model.safetensors"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert "model.layers.1.self_attn.k_proj.bias" in err
    # mg side: no tracker
    os.makedirs(tmp_path / "empty")
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "empty",
                 "--save-dir", tmp_path / "out")
    assert (f"no latest_checkpointed_iteration.txt in {tmp_path / 'empty'}: pass a directory written by "
            f"convert_ckpt.py or --save") in err
    # mg side: tracker but a shard missing
    good = save_tiny("llama", tmp_path / "hf4", seed=11)
    ckpt.convert_hf_to_mg(good, tmp_path / "mg4", tp=2, progress=False)
    os.remove(layout.shard_path(tmp_path / "mg4" / "release", 1, 0, 1))
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg4",
                 "--save-dir", tmp_path / "out")
    assert "model_optim_rng.pt" in err and "mp_rank_01" in err


def test_error_parallel_size_does_not_divide(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "hf", num_layers=4, seed=12)
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg", "--target-tensor-parallel-size", 3)
    assert "--target-tensor-parallel-size 3 does not divide" in err and "num_attention_heads=4" in err
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg", "--target-pipeline-parallel-size", 3)
    assert "--target-pipeline-parallel-size 3 does not divide num_layers=4" in err
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", progress=False)
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", tmp_path / "mg",
                 "--save-dir", tmp_path / "mg3", "--target-tensor-parallel-size", 8)
    assert "--target-tensor-parallel-size 8 does not divide" in err


def test_error_orm_without_score(tmp_path, capsys):
    src = save_tiny("qwen3", tmp_path / "hf", seed=13)
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg", "--orm")
    assert "--orm" in err and "has no score.weight" in err and "ForSequenceClassification" in err
    rm = save_tiny("qwen3", tmp_path / "rm", seq_cls=True, seed=13)
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", rm,
                 "--save-dir", tmp_path / "mg")
    assert "pass --orm" in err
    ckpt.convert_hf_to_mg(src, tmp_path / "lm", progress=False)
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "lm",
                 "--save-dir", tmp_path / "out", "--orm")
    assert "has no value head" in err


# ------------------------------------------------------------------------------------------- atomicity

def test_killed_conversion_leaves_previous_checkpoint(tmp_path, monkeypatch):
    src = save_tiny("llama", tmp_path / "hf", num_layers=2, seed=14)
    root = tmp_path / "mg"
    ckpt.convert_hf_to_mg(src, root, tp=1, progress=False)
    real = layout.save_file
    calls = []

    def dying_save(payload, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")  # as if the process died mid-write
        real(payload, path)

    monkeypatch.setattr(layout, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.convert_hf_to_mg(src, root, tp=2, progress=False)
    monkeypatch.setattr(layout, "save_file", real)
    # the previous complete checkpoint is still what readers see; the half-written one is a dot-dir
    assert layout.read_latest(root) == "release"
    assert layout.find_layout(root / "release") == (1, 1)
    assert os.path.isdir(layout.staging_dir(root, "release"))
    ckpt.convert_hf_to_mg(src, root, tp=2, progress=False)
    assert layout.find_layout(root / "release") == (2, 1)
    assert not os.path.exists(layout.staging_dir(root, "release"))
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "generation_config.json", "latest_checkpointed_iteration.txt", "release"]


def test_fresh_killed_conversion_looks_incomplete(tmp_path, monkeypatch):
    src = save_tiny("llama", tmp_path / "hf", num_layers=2, seed=15)
    monkeypatch.setattr(layout, "write_latest", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ckpt.convert_hf_to_mg(src, tmp_path / "mg", progress=False)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no latest_checkpointed_iteration.txt"):
        ckpt.load_spec(tmp_path / "mg")


def test_killed_export_has_no_config(tmp_path, monkeypatch):
    from mindspeed_llm.checkpoint import hf_files

    src = save_tiny("llama", tmp_path / "hf", num_layers=2, seed=16)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", progress=False)
    ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out", progress=False)
    assert os.path.isfile(tmp_path / "out" / "config.json")

    def dying(*a, **k):
        raise KeyboardInterrupt()

    monkeypatch.setattr(hf_files, "save_hf_weights", dying)
    with pytest.raises(KeyboardInterrupt):
        ckpt.convert_mg_to_hf(tmp_path / "mg", tmp_path / "out", progress=False)
    assert not os.path.exists(tmp_path / "out" / "config.json")


def test_layout_names():
    assert layout.checkpoint_dir("/r", "release") == "/r/release"
    assert layout.checkpoint_dir("/r", 1234) == "/r/iter_0001234"
    assert layout.shard_path("/r/release", 3, 0, 1) == "/r/release/mp_rank_03/model_optim_rng.pt"
    assert layout.shard_path("/r/iter_0000001", 1, 2, 4) == "/r/iter_0000001/mp_rank_01_002/model_optim_rng.pt"


def test_export_replaces_stale_weight_files(tmp_path):
    from transformers import AutoModelForCausalLM

    src = save_tiny("qwen3", tmp_path / "hf", num_layers=2, seed=17)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "notes.txt"):
        (out / name).write_text("stale")
    ckpt.convert_mg_to_hf(tmp_path / "mg", out, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"]
    AutoModelForCausalLM.from_pretrained(out)


# ------------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["data-cut", "header-cut"])
def test_error_truncated_safetensors_names_the_file(tmp_path, capsys, keep):
    src = save_tiny("llama", tmp_path / "hf", seed=30)
    weights = os.path.join(src, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: int(len(data) * keep)])
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert f"{weights} cannot be read" in err and "truncated" in err and "Traceback" not in err
    assert [ln for ln in err.splitlines() if "error:" in ln] == [err.strip().splitlines()[-1]]  # one line
    assert not os.path.exists(tmp_path / "mg" / "latest_checkpointed_iteration.txt")


def test_error_truncated_megatron_shard_names_the_file(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "hf", seed=31)
    ckpt.convert_hf_to_mg(src, tmp_path / "mg", tp=2, progress=False)
    for rank in (1, 0):  # a later shard (read while merging), then the first (read for the spec)
        shard = layout.shard_path(tmp_path / "mg" / "release", rank, 0, 1)
        data = open(shard, "rb").read()
        open(shard, "wb").write(data[: len(data) // 2])
        err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
                     "--save-dir", tmp_path / "out")
        assert f"{shard} cannot be read: it is truncated or corrupt" in err and "Traceback" not in err


def test_error_config_sizes_do_not_match_the_weights(tmp_path, capsys):
    src = save_tiny("qwen2", tmp_path / "hf", seed=32)
    config = json.load(open(os.path.join(src, "config.json")))
    config["intermediate_size"] = 96  # the weights have 128
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert (f"tensor model.layers.0.mlp.gate_proj.weight in {src} has shape (128, 64) but "
            f"{os.path.join(src, 'config.json')} (intermediate_size=96, hidden_size=64) implies (96, 64)") in err
    config["intermediate_size"], config["num_key_value_heads"] = 128, 1  # k/v have 2 heads of 16
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert "tensor model.layers.0.self_attn.k_proj.weight" in err and "has shape (32, 64)" in err
    assert "(num_key_value_heads=1, head_dim=16, hidden_size=64) implies (16, 64)" in err
    assert not os.path.exists(tmp_path / "mg" / "latest_checkpointed_iteration.txt")


def test_error_vocab_size_disagrees_with_the_embedding(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "hf", tie=True, seed=33)  # 256 rows
    config = json.load(open(os.path.join(src, "config.json")))
    config["vocab_size"] = 300
    json.dump(config, open(os.path.join(src, "config.json"), "w"))
    err = _error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                 "--save-dir", tmp_path / "mg")
    assert (f"{os.path.join(src, 'config.json')} says vocab_size=300 but model.embed_tokens.weight in {src} "
            f"has 256 rows; set vocab_size to 256") in err
    assert not os.path.exists(tmp_path / "mg" / "latest_checkpointed_iteration.txt")


def test_error_training_save_root_points_to_the_roles(tmp_path, capsys):
    """A stage's --save root: actor/ and critic/ checkpoints plus the top-level resume tracker."""
    root = tmp_path / "save"
    ckpt.convert_hf_to_mg(save_tiny("qwen2", tmp_path / "hf", seed=34), root / "actor", progress=False)
    ckpt.convert_hf_to_mg(save_tiny("qwen2", tmp_path / "rm", seq_cls=True, seed=34), root / "critic",
                          value_head=True, progress=False)
    layout.write_latest(root, 4)
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", root,
                 "--save-dir", tmp_path / "out")
    assert f"--load-dir {root} is a training --save directory" in err and "iter_0000004" not in err
    assert f"pass --load-dir {root / 'actor'} (or --load-dir {root / 'critic'} with --orm)" in err
    err = _error(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", root,
                 "--save-dir", tmp_path / "mg2")
    assert "is a training --save directory" in err
    assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", root / "critic",
                       "--save-dir", tmp_path / "out", "--orm") == 0


def test_write_errors_and_save_dirs_are_named(tmp_path, capsys, monkeypatch):
    """A full disk (torch's zip writer says "unexpected pos"), a --save-dir that is a file, and one holding
    something that is not an earlier conversion are each one line naming the path and the fix, no traceback."""
    src = save_tiny("llama", tmp_path / "hf", seed=11)
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src), "--no-progress"]
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64384 vs 64272")

    monkeypatch.setattr(torch, "save", full_disk)
    assert convert_ckpt.main([*argv, "--save-dir", str(tmp_path / "mg")]) == 1
    err = capsys.readouterr().err
    assert "No space left on device writing" in err and "model_optim_rng.pt" in err and "free space there" in err
    monkeypatch.setattr(torch, "save", real_save)

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert convert_ckpt.main([*argv, "--save-dir", str(a_file)]) == 1
    assert f"--save-dir {a_file} is a file" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert convert_ckpt.main([*argv, "--save-dir", str(other)]) == 1
    assert "not an earlier mg conversion" in capsys.readouterr().err and (other / "notes.txt").read_text() == "keep me"
    # an earlier conversion may be replaced
    assert convert_ckpt.main([*argv, "--save-dir", str(tmp_path / "mg2")]) == 0
    assert convert_ckpt.main([*argv, "--save-dir", str(tmp_path / "mg2")]) == 0


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    from tests.helpers.hf_tiny import write_tokenizer

    src = save_tiny("llama", tmp_path / "hf", seed=12)  # a 256-token vocabulary
    big, fits = tmp_path / "big", tmp_path / "fits"
    write_tokenizer(big, 1000)
    write_tokenizer(fits, 256)
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src), "--no-progress"]
    assert convert_ckpt.main([*argv, "--save-dir", str(tmp_path / "mg"), "--tokenizer-dir", str(big)]) == 1
    err = capsys.readouterr().err
    assert f"--tokenizer-dir {big} has 1000 tokens but the model's vocabulary has 256" in err
    assert not (tmp_path / "mg").exists()
    assert convert_ckpt.main([*argv, "--save-dir", str(tmp_path / "mg"), "--tokenizer-dir", str(fits)]) == 0


def test_a_tokenizer_flag_without_a_tokenizer_is_refused(tmp_path, capsys):
    """--tokenizer-dir (or --tokenizer-model's folder) without tokenizer files would copy nothing, without a word."""
    src = save_tiny("llama", tmp_path / "hf", seed=12)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "generation_config.json").write_text("{}")  # copied with a tokenizer, but not one
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src), "--no-progress",
            "--save-dir", str(tmp_path / "mg")]
    for flag, named in (("--tokenizer-dir", f"--tokenizer-dir {empty}"),
                        ("--tokenizer-model", f"--tokenizer-model {empty} (its folder {empty})")):
        value = empty
        assert convert_ckpt.main([*argv, flag, str(value)]) == 1
        err = capsys.readouterr().err
        assert f"{named} holds no tokenizer" in err and "nothing would be copied" in err, err
        assert not (tmp_path / "mg").exists()


# ------------------------------------------------------------------------------------------- an adapter's own base

def _convert(*argv):
    return convert_cli(*[str(a) for a in argv])


@pytest.mark.parametrize("tp, pp, dtype, tie", [(2, 1, torch.float32, False), (1, 2, torch.bfloat16, True)])
def test_an_adapter_checkpoint_merges_onto_its_own_base_only(tmp_path, capsys, tp, pp, dtype, tie):
    """An adapter checkpoint of a LoRA run (TP2, or PP2 in bf16 over tied embeddings) records each rank's base
    fingerprint; convert_ckpt.py --lora-load recomputes them from the --load-dir it is given (another layout, another
    precision on disk): its own base merges to Hugging Face and Megatron alike, another model of the same shape is
    refused by name with nothing written, and --allow-base-mismatch merges it anyway with a warning."""
    from tests.helpers.convert_checks import write_adapter_checkpoint

    own = save_tiny("llama", tmp_path / "own", seed=21, tie=tie)
    other = save_tiny("llama", tmp_path / "other", seed=22, tie=tie)
    adapter = write_adapter_checkpoint(own, tmp_path / "adapter", tp=tp, pp=pp, dtype=dtype)
    for name, hf in (("own", own), ("other", other)):
        assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf,
                        "--save-dir", tmp_path / f"{name}_mg") == 0
    capsys.readouterr()
    merges = [("mg", "hf", "{}_mg"), ("mg", "mg", "{}_mg"), ("hf", "mg", "{}")]
    for load, save, where in merges:
        out = tmp_path / f"own_{load}2{save}"
        assert _convert("--load-model-type", load, "--save-model-type", save, "--load-dir",
                        tmp_path / where.format("own"), "--lora-load", adapter, "--save-dir", out) == 0, \
            capsys.readouterr().err
        out = tmp_path / f"other_{load}2{save}"
        assert _convert("--load-model-type", load, "--save-model-type", save, "--load-dir",
                        tmp_path / where.format("other"), "--lora-load", adapter, "--save-dir", out) == 1
        err = capsys.readouterr().err
        assert f"--lora-load {adapter}: its adapters were trained on {tmp_path / 'adapter_base_mg'}" in err, err
        assert f"differ from --load-dir {tmp_path / where.format('other')}'s" in err and \
            "--allow-base-mismatch" in err
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "other_mg",
                    "--lora-load", adapter, "--save-dir", tmp_path / "forced", "--allow-base-mismatch") == 0
    assert "warning: --allow-base-mismatch: --lora-load" in capsys.readouterr().err
    assert (tmp_path / "forced" / "model.safetensors").exists()


def test_a_critics_adapter_checkpoint_merges_onto_its_own_value_model_only(tmp_path, capsys):
    """A trl_ppo LoRA run's critic (a value model converted with --orm, its head trained beside the adapters and so
    not part of the recorded base) at TP2: --lora-load --orm recomputes the base from the value model's full tensors
    without the head; its own base merges (the trained head in place of the base's), another value model of the same
    shape is refused by name."""
    from safetensors.torch import load_file

    from tests.helpers.convert_checks import write_adapter_checkpoint

    own = save_tiny("llama", tmp_path / "own", seed=31, seq_cls=True)
    other = save_tiny("llama", tmp_path / "other", seed=32, seq_cls=True)
    adapter = write_adapter_checkpoint(own, tmp_path / "critic", tp=2, value_head=True)
    for name, hf in (("own", own), ("other", other)):
        out = tmp_path / f"{name}_merged"
        code = _convert("--load-model-type", "hf", "--save-model-type", "mg", "--orm",
                        "--load-dir", hf, "--lora-load", adapter, "--save-dir", out)
        assert code == (0 if name == "own" else 1), capsys.readouterr().err
    assert "its adapters were trained on" in capsys.readouterr().err
    assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--orm", "--load-dir",
                    tmp_path / "own_merged", "--save-dir", tmp_path / "own_hf") == 0
    merged = load_file(tmp_path / "own_hf" / "model.safetensors")
    base = load_file(os.path.join(own, "model.safetensors"))
    assert not torch.equal(merged["score.weight"], base["score.weight"])  # the critic's trained head


def test_save_lora_to_hf_records_the_checked_base(tmp_path, capsys):
    """--save-lora-to-hf writes a PEFT folder only for the adapter's own base, and names the Hugging Face model that
    base came from (what peft loads it onto); another base of the same shape is refused, for a PEFT folder read back
    too (its base_model_name_or_path), unless --allow-base-mismatch."""
    from tests.helpers.convert_checks import write_adapter_checkpoint

    own, other = save_tiny("qwen2", tmp_path / "own", seed=23), save_tiny("qwen2", tmp_path / "other", seed=24)
    adapter = write_adapter_checkpoint(own, tmp_path / "adapter", tp=2)
    for name, hf in (("own", own), ("other", other)):
        assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf,
                        "--save-dir", tmp_path / f"{name}_mg") == 0
    capsys.readouterr()
    export = ["--load-model-type", "mg", "--save-model-type", "hf", "--lora-load", adapter, "--save-lora-to-hf"]
    assert _convert(*export, "--load-dir", tmp_path / "other_mg", "--save-dir", tmp_path / "peft_other") == 1
    assert "its adapters were trained on" in capsys.readouterr().err and not (tmp_path / "peft_other").exists()
    assert _convert(*export, "--load-dir", tmp_path / "own_mg", "--save-dir", tmp_path / "peft") == 0
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == own
    # the PEFT folder names its base: merged onto it (or the Megatron checkpoint converted from it), not another
    merge = ["--load-model-type", "mg", "--save-model-type", "hf", "--lora-load", tmp_path / "peft"]
    assert _convert(*merge, "--load-dir", tmp_path / "own_mg", "--save-dir", tmp_path / "merged") == 0
    capsys.readouterr()
    assert _convert(*merge, "--load-dir", tmp_path / "other_mg", "--save-dir", tmp_path / "merged_other") == 1
    err = capsys.readouterr().err
    assert f"adapter_config.json names the base {own!r}, not --load-dir {tmp_path / 'other_mg'}" in err, err
    assert not (tmp_path / "merged_other").exists()
    assert _convert(*merge, "--load-dir", tmp_path / "other_mg", "--save-dir", tmp_path / "merged_other",
                    "--allow-base-mismatch") == 0


# ------------------------------------------------------------------------------------------- --save-hf's folder
def _save_hf_folder(ckpt_dir, pp, lora_base="", **options):
    """--save-hf's folder of a checkpoint directory, written in this process (every stage here)."""
    from mindspeed_llm.checkpoint import save_hf

    entry, problem = save_hf.write_folder(str(ckpt_dir), list(range(pp)), save_hf.SaveHF(**options), lora_base)
    assert problem is None, problem
    return entry, os.path.join(ckpt_dir, "hf")


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_save_hf_folder_loads_in_transformers_at_every_layout(tmp_path, family, tie):
    """--save-hf's folder (one safetensors file per layer, written stage by stage) holds the model's own tensors at
    TP 1/2 x PP 1/2, each layout's folder equal to TP1's; transformers loads it and gives the source model's logits;
    the config and tokenizer travel."""
    from transformers import AutoModelForCausalLM
    from tests.helpers.hf_tiny import write_tokenizer

    src = save_tiny(family, tmp_path / "hf", tie=tie, num_layers=4, seed=11)
    write_tokenizer(tmp_path / "tok")
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
    folders = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        mg = tmp_path / f"mg{tp}{pp}"
        ckpt.convert_hf_to_mg(src, str(mg), tp, pp, progress=False)
        release = layout.checkpoint_dir(str(mg), layout.RELEASE)
        entry, folder = _save_hf_folder(release, pp, tokenizers=(str(tmp_path / "nowhere"), str(tmp_path / "tok")))
        assert entry == {"dir": "hf", "format": "model"}
        assert not os.path.exists(os.path.join(release, "hf.partial"))
        assert "tokenizer.json" in os.listdir(folder) or "tokenizer_config.json" in os.listdir(folder)
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        assert files == [f"model-{k:05d}-of-00006.safetensors" for k in range(1, 7)]  # embeddings, 4 layers, head
        assert_identical(hf_tensors(src), hf_tensors(folder))
        folders[(tp, pp)] = hf_tensors(folder)
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for found in folders.values():
        assert_identical(folders[(1, 1)], found)


def test_save_hf_of_a_lora_actor_is_a_peft_folder_or_merged(tmp_path):
    """A LoRA actor's checkpoint (adapters only) gives a PEFT adapter folder that peft loads onto the Hugging Face
    base with the logits of peft's own merge, and with merge_lora full weights that give the same logits."""
    import peft
    from transformers import AutoModelForCausalLM
    from tests.helpers.convert_checks import write_adapter_checkpoint

    base_hf = save_tiny("qwen2", tmp_path / "base", num_layers=2, seed=31)
    adapter = write_adapter_checkpoint(base_hf, tmp_path / "adapter", tp=2, pp=2, target="linear_fc1")
    base_mg = adapter + "_base_mg"
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    ckpt_dir = layout.checkpoint_dir(adapter, 1)
    entry, folder = _save_hf_folder(ckpt_dir, 2, lora_base=base_mg)
    assert entry["format"] == "peft" and sorted(os.listdir(folder))[:2] == ["adapter_config.json",
                                                                           "adapter_model.safetensors"]
    with open(os.path.join(folder, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base_hf)
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_hf), folder).eval()
    with torch.no_grad():
        adapted = peft_model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_hf).eval()(ids).logits
    assert not torch.allclose(adapted, plain)  # the adapter changes the model
    os.rename(folder, str(tmp_path / "peft_folder"))
    entry, folder = _save_hf_folder(ckpt_dir, 2, lora_base=base_mg, merge_lora=True)
    assert entry["format"] == "merged"
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
