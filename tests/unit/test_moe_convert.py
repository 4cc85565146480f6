"""convert_ckpt.py for mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral), without building Megatron models
(the logits against transformers: test_moe_parity.py).

HF -> mg -> HF is bit-identical for every family at TP2, EP2, TP2 x EP2 (expert TP 2 and 1), --moe-tp-extend-ep,
PP2 (x EP2), with and without --orm; each shard holds exactly its expert-parallel rank's experts under local
indices (checked against the HF tensors directly, not through the converter's own merge); mg -> mg reshards
between expert layouts; transformers' fused expert format reads like the Hub format; errors name the flag.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.hf_tiny import MOE_VARIANTS, build_tiny, save_tiny
from tests.helpers.convert_checks import assert_identical, convert_cli, hf_tensors

from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_hf, convert_mg_to_mg  # noqa: E402
from mindspeed_llm.checkpoint import megatron_layout as layout  # noqa: E402

# name -> (convert_ckpt.py flags, stored (tp, pp, ep, expert tp), shard folders)
LAYOUTS = {
    "tp2": (["--target-tensor-parallel-size", 2], (2, 1, 1, 2), ["mp_rank_00", "mp_rank_01"]),
    "ep2": (["--target-expert-parallel-size", 2], (1, 1, 2, 1), ["mp_rank_00_000", "mp_rank_00_001"]),
    "tp2ep2": (["--target-tensor-parallel-size", 2, "--target-expert-parallel-size", 2], (2, 1, 2, 2),
               ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]),
    "tp2ep2-etp1": (["--target-tensor-parallel-size", 2, "--target-expert-parallel-size", 2,
                     "--expert-tensor-parallel-size", 1], (2, 1, 2, 1), ["mp_rank_00_000", "mp_rank_01_001"]),
    "tp2-extend": (["--target-tensor-parallel-size", 2, "--moe-tp-extend-ep"], (2, 1, 2, 1),
                   ["mp_rank_00_000", "mp_rank_01_001"]),
    "pp2": (["--target-pipeline-parallel-size", 2], (1, 2, 1, 1), ["mp_rank_00_000", "mp_rank_00_001"]),
    "pp2ep2": (["--target-pipeline-parallel-size", 2, "--target-expert-parallel-size", 2], (1, 2, 2, 1),
               ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]),
}
NUM_LAYERS = 4


def _save(tmp_path, name, seq_cls=False, seed=3, **extra):
    family, overrides = MOE_VARIANTS[name]
    return save_tiny(family, tmp_path / f"hf_{name}_{seq_cls}", seq_cls=seq_cls, seed=seed, num_layers=NUM_LAYERS,
                     **{**overrides, **extra})


def _hub_names(family):
    if family == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _check_expert_shards(mg, src, hf, family, tp, pp, ep, etp):
    """Every shard's local experts are the HF experts (`hf`, read from folder `src`) of its expert-parallel
    rank, sliced by expert TP."""
    ckpt = layout.checkpoint_dir(mg, "release")
    moe, (gate, up, down) = _hub_names(family)
    with open(os.path.join(os.fspath(src), "config.json")) as f:
        config = json.load(f)
    experts = config.get("num_experts") or config["num_local_experts"]
    dense = set(config.get("mlp_only_layers") or [])
    local, per_stage = experts // ep, NUM_LAYERS // pp
    checked = 0
    for t, p, e in layout.expected_shards(tp, pp, ep, etp):
        shard = layout.load_file(layout.shard_path(ckpt, t, p, pp, e, ep))["model"]
        for i in range(per_stage):
            g_layer = p * per_stage + i
            names = [n for n in shard if n.startswith(f"decoder.layers.{i}.mlp.experts.") and n.endswith(".weight")]
            if g_layer in dense:
                assert names == []
                continue
            assert len(names) == 2 * local, (t, p, e, i, names)
            for j in range(local):
                g = e * local + j
                src = f"model.layers.{g_layer}.{moe}experts.{g}."
                gw, uw, dw = hf[src + gate + ".weight"], hf[src + up + ".weight"], hf[src + down + ".weight"]
                if etp > 1:
                    gw, uw = gw.chunk(etp, 0)[t], uw.chunk(etp, 0)[t]
                    dw = dw.chunk(etp, 1)[t]
                fc1 = shard[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight"]
                fc2 = shard[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight"]
                assert torch.equal(fc1, torch.cat([gw, uw])), (t, p, e, i, j)
                assert torch.equal(fc2, dw), (t, p, e, i, j)
                checked += 1
            router = shard[f"decoder.layers.{i}.mlp.router.weight"]
            assert torch.equal(router, hf[f"model.layers.{g_layer}.{moe}gate.weight"])  # whole in every shard
    assert checked


def _assert_same_shards(a, b, label):
    """Two Megatron checkpoints have the same layout and the same tensors in every shard."""
    info = layout.checkpoint_info(a)
    other = layout.checkpoint_info(b)
    assert [info[k] for k in ("tp", "pp", "ep", "etp")] == [other[k] for k in ("tp", "pp", "ep", "etp")], label
    for t, p, e in layout.expected_shards(info["tp"], info["pp"], info["ep"], info["etp"]):
        sa = layout.load_shard(a, t, p, ep_rank=e)["model"]
        sb = layout.load_shard(b, t, p, ep_rank=e)["model"]
        assert sorted(sa) == sorted(sb), label
        for key, value in sa.items():
            assert (value is None and sb[key] is None) or torch.equal(value, sb[key]), (label, key)


# ------------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("orm", [False, True], ids=["lm", "orm"])
@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_round_trip_bit_identical(tmp_path, name, orm):
    """HF -> mg at every layout -> HF gives the same tensors (and the shards hold the right experts)."""
    family = MOE_VARIANTS[name][0]
    src = _save(tmp_path, name, seq_cls=orm)
    original = hf_tensors(src)
    flags = ["--orm"] if orm else []
    for label, (args, stored, folders) in LAYOUTS.items():
        mg, out = tmp_path / f"mg_{label}", tmp_path / f"out_{label}"
        assert convert_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src, "--save-dir", mg,
                           *args, *flags) == 0
        ckpt = layout.checkpoint_dir(mg, "release")
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("mp_rank")) == folders, label
        assert tuple(layout.read_layout(ckpt)) == stored, label
        info = layout.checkpoint_info(mg)
        assert (info["ep"], info["etp"], info["value_head"]) == (stored[2], stored[3], orm)
        _check_expert_shards(mg, src, original, family, *stored)
        assert convert_cli("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", out,
                           *flags) == 0
        assert_identical(original, hf_tensors(out))


def test_exports_load_in_transformers_identically(tmp_path):
    """save_pretrained (5.x) writes the per-expert Hub names this converter writes, and from_pretrained reads
    our export into the same (fused) parameters: identical logits / scores, config included."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from mindspeed_llm.checkpoint import hf_mapping as hfm
    from mindspeed_llm.models.architecture import ArchitectureSpec

    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    for name, (family, overrides) in MOE_VARIANTS.items():
        for seq_cls in (False, True):
            model = build_tiny(family, seq_cls=seq_cls, seed=11, num_layers=NUM_LAYERS, **overrides)
            src = tmp_path / f"{name}_{seq_cls}"
            model.save_pretrained(src)
            spec = ArchitectureSpec.from_hf_config(model.config.to_dict())
            written = {k[len("model."):] for k in hf_tensors(src) if k.startswith("model.")}
            assert written == {n for i in range(NUM_LAYERS) for n in hfm.hf_layer_names(spec, i)} | {
                "embed_tokens.weight", "norm.weight"}, name
            mg, out = tmp_path / f"mg_{name}_{seq_cls}", tmp_path / f"out_{name}_{seq_cls}"
            convert_hf_to_mg(src, mg, tp=2, ep=2, value_head=seq_cls, progress=False)
            convert_mg_to_hf(mg, out, progress=False)
            cls = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
            loaded = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
            ref_sd, got_sd = model.state_dict(), loaded.state_dict()
            assert sorted(ref_sd) == sorted(got_sd), name
            for key in ref_sd:
                assert torch.equal(ref_sd[key], got_sd[key]), (name, key)
            # Against the source folder loaded the same way: from_pretrained may pick another experts kernel
            # than the in-memory model (measured: 6e-8 apart there), so only like with like is bit-exact.
            reference = cls.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                assert torch.equal(reference(input_ids=ids).logits, loaded(input_ids=ids).logits), name


def test_fused_expert_format_reads_like_the_hub_format(tmp_path):
    """A folder holding transformers' in-memory fused experts (save_original_format=False) converts to the
    same shards as the Hub format (Mixtral's router renamed back from mlp.gate)."""
    for name in ("qwen3_moe-mixed", "qwen2_moe", "mixtral"):
        family, overrides = MOE_VARIANTS[name]
        model = build_tiny(family, seed=5, num_layers=NUM_LAYERS, **overrides)
        hub, fused = tmp_path / f"hub_{name}", tmp_path / f"fused_{name}"
        model.save_pretrained(hub)
        model.save_pretrained(fused, save_original_format=False)
        names = hf_tensors(fused)
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in names), sorted(names)[:8]  # really fused
        for kw in (dict(tp=2, ep=2), dict(tp=2, ep=2, etp=1), dict(pp=2, ep=2)):
            a, b = tmp_path / f"a_{name}", tmp_path / f"b_{name}"
            convert_hf_to_mg(hub, a, progress=False, **kw)
            convert_hf_to_mg(fused, b, progress=False, **kw)
            _assert_same_shards(a, b, (name, kw))


def test_reshard_between_expert_layouts(tmp_path):
    """mg -> mg: TP2 x EP2 -> EP1 / TP2 (expert TP 2) -> --moe-tp-extend-ep -> PP2 x EP2 -> TP1; every hop exports
    to the original HF tensors and gives the same shards as converting from HF at that layout."""
    for name in ("qwen2_moe", "qwen3_moe-mixed"):
        src = _save(tmp_path, name, seed=9)
        original = hf_tensors(src)
        chain = [dict(tp=2, ep=2), dict(tp=2), dict(tp=2, moe_tp_extend_ep=True), dict(pp=2, ep=2),
                 dict(tp=2, ep=2, etp=1), dict()]
        previous = tmp_path / f"{name}_0"
        convert_hf_to_mg(src, previous, progress=False, **chain[0])
        for hop, kw in enumerate(chain[1:], start=1):
            target, direct = tmp_path / f"{name}_{hop}", tmp_path / f"{name}_{hop}_direct"
            convert_mg_to_mg(previous, target, progress=False, **kw)
            convert_hf_to_mg(src, direct, progress=False, **kw)
            _assert_same_shards(target, direct, (name, kw))
            out = tmp_path / f"{name}_{hop}_hf"
            convert_mg_to_hf(target, out, progress=False)
            assert_identical(original, hf_tensors(out))
            previous = target


def test_other_sizes_round_trip(tmp_path):
    """No size is assumed: 6 layers, 12 experts top-3 with odd-per-rank counts (EP 4: 3 per rank), PP 3,
    Mixtral with 8 experts over --moe-tp-extend-ep 2 x TP 2, every other layer dense (decoder_sparse_step),
    tied embeddings (the last stage's copy at PP 2)."""
    cases = [
        ("qwen3_moe", dict(num_layers=6, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24,
                           mlp_only_layers=[0, 5]), dict(tp=2, pp=3, ep=4)),
        ("qwen3_moe", dict(num_layers=6, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24,
                           mlp_only_layers=[0, 5]), dict(tp=2, pp=3, ep=6, etp=1)),
        ("mixtral", dict(num_local_experts=8), dict(tp=2, ep=2, moe_tp_extend_ep=True)),
        ("qwen2_moe", dict(num_experts=6, shared_expert_intermediate_size=40), dict(tp=2, ep=3, pp=2)),
        ("qwen3_moe", dict(decoder_sparse_step=2, tie=True), dict(tp=2, ep=4, pp=2)),
        ("mixtral", dict(tie=True, num_layers=2), dict(pp=2, ep=2)),
    ]
    for index, (family, config, kw) in enumerate(cases):
        src = save_tiny(family, tmp_path / f"hf{index}", seed=index, **config)
        mg, out = tmp_path / f"mg{index}", tmp_path / f"out{index}"
        convert_hf_to_mg(src, mg, progress=False, **kw)
        info = layout.checkpoint_info(mg)
        expected_ep = kw.get("ep", 1) * (kw["tp"] if kw.get("moe_tp_extend_ep") else 1)
        assert info["ep"] == expected_ep
        convert_mg_to_hf(mg, out, progress=False)
        assert_identical(hf_tensors(src), hf_tensors(out))


# ------------------------------------------------------------------------------------------- errors

def _convert_error(capsys, *argv):
    assert convert_cli(*argv) == 1
    return capsys.readouterr().err


def test_errors_name_the_flag(tmp_path, capsys):
    moe = _save(tmp_path, "qwen3_moe")  # 8 experts, moe_intermediate_size 32
    dense = save_tiny("qwen3", tmp_path / "dense")
    odd = save_tiny("qwen3_moe", tmp_path / "odd", moe_intermediate_size=33)
    hf2mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--save-dir", tmp_path / "out"]

    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-expert-parallel-size", 3)
    assert "--target-expert-parallel-size 3 does not divide num_experts=8" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-expert-parallel-size", 3,
                         "--target-tensor-parallel-size", 2, "--moe-tp-extend-ep")
    assert "--target-expert-parallel-size 3 x --target-tensor-parallel-size 2 (--moe-tp-extend-ep) does not divide " \
           "num_experts=8" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", odd, "--target-tensor-parallel-size", 2)
    assert "--expert-tensor-parallel-size 2 does not divide moe_ffn_hidden_size=33" in err, err
    assert "--moe-tp-extend-ep" in err
    err = _convert_error(capsys, *hf2mg, "--load-dir", dense, "--target-expert-parallel-size", 2)
    assert "--target-expert-parallel-size 2 needs a mixture-of-experts model" in err and "qwen3" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", dense, "--moe-tp-extend-ep", "--target-tensor-parallel-size", 2)
    assert "--moe-tp-extend-ep needs a mixture-of-experts model" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-tensor-parallel-size", 2,
                         "--expert-tensor-parallel-size", 4)
    assert "--expert-tensor-parallel-size 4 must be 1 or --target-tensor-parallel-size 2" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-tensor-parallel-size", 2,
                         "--expert-tensor-parallel-size", 2, "--moe-tp-extend-ep")
    assert "--moe-tp-extend-ep" in err and "--expert-tensor-parallel-size 2 (drop one)" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-tensor-parallel-size", 2,
                         "--expert-tensor-parallel-size", 1)
    assert "needs a --target-expert-parallel-size that is a multiple of 2 (got 1)" in err, err
    err = _convert_error(capsys, *hf2mg, "--load-dir", moe, "--target-expert-parallel-size", 0)
    assert "--target-expert-parallel-size 0: must be >= 1" in err, err
    assert not os.path.exists(tmp_path / "out")  # nothing written by a refused conversion

    mg = tmp_path / "mg"
    convert_hf_to_mg(moe, mg, ep=2, progress=False)
    err = _convert_error(capsys, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg,
                         "--save-dir", tmp_path / "hf_out", "--target-expert-parallel-size", 2)
    assert "--target-expert-parallel-size 2: the Hugging Face export gathers every shard" in err, err
    err = _convert_error(capsys, "--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", mg,
                         "--save-dir", tmp_path / "mg2", "--target-expert-parallel-size", 16)
    assert "--target-expert-parallel-size 16 does not divide num_experts=8" in err, err


def test_error_missing_expert_and_fused_shape(tmp_path, capsys):
    """A Hub folder without one expert's tensor, and a fused tensor of the wrong expert count, are named."""
    from safetensors.torch import load_file, save_file

    src = _save(tmp_path, "qwen2_moe")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    err = _convert_error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                         "--save-dir", tmp_path / "out")
    assert "lacks tensors" in err and "model.layers.1.mlp.experts.3.down_proj.weight" in err, err

    family, overrides = MOE_VARIANTS["qwen3_moe"]
    fused = tmp_path / "fused"
    build_tiny(family, num_layers=2, **overrides).save_pretrained(fused, save_original_format=False)
    with open(fused / "config.json") as f:
        config = json.load(f)
    config["num_experts"] = 4  # the weights hold 8
    with open(fused / "config.json", "w") as f:
        json.dump(config, f)
    err = _convert_error(capsys, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", fused,
                         "--save-dir", tmp_path / "out2")
    assert "fused expert tensor model.layers.0.mlp.experts." in err and "num_experts=4" in err, err
    assert "(8, 64, " in err


def test_split_and_merge_model_in_memory(tmp_path):
    """sharding.split_model / merge_model (the in-memory API): a MoE checkpoint merged from its TP2 x PP2 files
    splits back into the same shards, and over TP2 x PP2 x EP2 with expert TP 1 ((tp, pp, ep) keys, only the
    pairs megatron's ranks have) merges back to the same full state dict."""
    from mindspeed_llm.checkpoint import merge_model, split_model

    src = _save(tmp_path, "qwen3_moe-mixed")
    mg = tmp_path / "mg"
    convert_hf_to_mg(src, mg, tp=2, pp=2, progress=False)
    info = layout.checkpoint_info(mg)
    shards = {(t, p): layout.load_shard(mg, t, p)["model"] for t in range(2) for p in range(2)}
    full = merge_model(shards, info["spec"], 2, 2, False)
    again = split_model(full, info["spec"], 2, 2, False)
    assert sorted(again) == sorted(shards)
    for key, shard in shards.items():
        assert sorted(shard) == sorted(again[key])
        for name, value in shard.items():
            assert (value is None and again[key][name] is None) or torch.equal(value, again[key][name]), name
    pairs = layout.expected_shards(2, 2, 2, 1)
    split = split_model(full, info["spec"], 2, 2, False, ep=2, etp=1, pairs=pairs)
    assert sorted(split) == sorted(pairs) == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    local = split[(1, 0, 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(local, full["decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight"])  # 8 experts / 2
    back = merge_model(split, info["spec"], 2, 2, False, ep=2, etp=1)
    assert sorted(back) == sorted(full)
    for name, value in full.items():
        assert torch.equal(back[name], value), name
