"""DeepSeek-V3 (model_type deepseek_v3): conversion, transformers parity, packed positions, greedy generation.

Tiny random DeepseekV3ForCausalLM models (tests/helpers/hf_tiny.py, DEEPSEEK_VARIANTS; the routing bias
e_score_correction_bias random too):
    deepseek_v3          q LoRA (q_a_proj / q_a_layernorm / q_b_proj), 8 experts in 4 groups of which 2 are kept,
                         top-4, routed_scaling_factor 2.5, one shared expert, layer 0 dense, YaRN factor 4 past 64
                         positions with mscale != mscale_all_dim
    deepseek_v3-noqlora  q_proj (q_lora_rank null), 2 groups keep 1, top-2, 2 shared experts, 4 layers of which 2
                         dense, plain RoPE

Checked: HF -> Megatron -> HF is bit-identical at TP2, EP2, PP2 and TP2 x PP2 x EP2 (and the export loads in
transformers); the logits of a converted checkpoint equal transformers' (fp32, eager attention, 80 tokens, past
YaRN's original 64) at TP1, TP2 (expert TP 2), EP2, TP2 x EP2 with expert TP 1, and PP2, and a value head's outputs
DeepseekV3ForSequenceClassification's at TP1, EP2, PP2; a forward with
position ids other than the slots (`forward_layout`, as packed RL rows use it) equals transformers with those
position ids, which needs the position ids to reach every MLA layer's own rotary embedding; greedy generation
(`mindspeed_llm.inference.generation.generate`: the static KV cache with batched and stepwise prefill, and the
continuous-batching engine, whose cache hook needs every MLA layer's rotary table long enough) equals
`transformers.generate`. Errors: FP8 checkpoints (weight_scale_inv) are refused naming the tensor and the fix,
multi-token-prediction layers are skipped with a note, unsupported config values are named. Stage: one GRPO
iteration trains a tiny DeepSeek-V3 actor at EP2; each MLA megatron patch (patches/mla.py) is shown needed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.hf_tiny import DEEPSEEK_VARIANTS, PAD_TOKEN_ID, build_tiny, deepseek_variant, save_tiny
from tests.helpers.hf_parity import case_diff, hf_reference
from tests.helpers.multiproc import run_distributed
from tests.helpers.patch_removal import without_patch
from tests.helpers.stage_layouts import run_stages

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TOL = 1e-5
BATCH, SEQ = 2, 80
# name -> (convert_hf_to_mg keyword arguments, distributed.initialize (tp, pp, ep, expert tp)); world size 2
LAYOUTS = {
    "tp1": (dict(), (1, 1, 1, 1)),
    "tp2": (dict(tp=2), (2, 1, 1, 2)),
    "ep2": (dict(ep=2), (1, 1, 2, 1)),
    "tp2ep2-etp1": (dict(tp=2, ep=2, etp=1), (2, 1, 2, 1)),
    "pp2": (dict(pp=2), (1, 2, 1, 1)),
}
CASES = list(DEEPSEEK_VARIANTS)
VALUE_CASES = ["deepseek_v3-value"]  # DeepseekV3ForSequenceClassification: the critic / reward model
VALUE_LAYOUTS = ("tp1", "ep2", "pp2")
PROMPTS = [[5, 9, 17, 33, 4, 8, 90], [7, 3, 11], [12, 13, 14, 15, 16]]
MAX_NEW = 10


def _packed_positions(s):
    # a prompt of 10 then a response that restarts at position 6 (as a second response after a shared prompt)
    return torch.cat([torch.arange(10), torch.arange(6, 6 + s - 10)]).unsqueeze(0)


@torch.no_grad()
def _hf_refs(model, ids):
    s = 24
    packed_ids = ids[:1, :s]
    pos = _packed_positions(s)
    greedy = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy.append(out[0, len(p):].tolist())
    return {"logits": model(input_ids=ids).logits.float(),
            "packed_ids": packed_ids, "packed_pos": pos,
            "packed_logits": model(input_ids=packed_ids, position_ids=pos).logits.float(),
            "greedy": greedy}


def _worker(rank, world_size, jobs):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_shard, load_spec
    from mindspeed_llm.inference.generation import generate
    from mindspeed_llm.inference.sampling import SamplingConfig
    from mindspeed_llm.models import build_model, forward_layout

    results = {"diffs": {}, "key_mismatch": {}, "ranks": {}, "packed": {}, "unpacked": {}, "greedy": {}}
    for layout, (tp, pp, ep, etp), cases in jobs:
        distributed.initialize(tp, pp, rank=rank, world_size=world_size, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp)
        ranks = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                 ps.get_expert_model_parallel_rank())
        results["ranks"][layout] = ranks
        for case in cases:
            name, ref = case["name"], case["ref"]
            spec = load_spec(case["root"])
            model = build_model(spec, value_head=case["value"]).eval()
            load_megatron_weights(model, case["root"])
            stored = load_shard(case["root"], ranks[0], ranks[1], ep_rank=ranks[2] if ep > 1 else 0)
            keys = set(stored["model"]) ^ set(model.state_dict())
            if keys:
                results["key_mismatch"][(layout, name)] = sorted(keys)
            diff = case_diff(model, case, tp, pp)
            if diff is not None:
                results["diffs"][(layout, name)] = diff
            if layout != "tp1" or case["value"]:
                continue
            ids, pos = ref["packed_ids"], ref["packed_pos"]
            with torch.no_grad():
                with forward_layout(model, position_ids=pos):
                    packed = model(ids, pos, None)
                plain = model(ids, pos, None)  # megatron alone rotates by slot: must differ from the reference
            results["packed"][name] = (packed - ref["packed_logits"]).abs().max().item()
            results["unpacked"][name] = (plain - ref["packed_logits"]).abs().max().item()
            for mode in ("batched", "stepwise", "continuous"):  # the static engine's two prefills, the default
                rollout = generate(model, PROMPTS, SamplingConfig(max_new_tokens=MAX_NEW, pad_token_id=0),
                                   **(dict(prefill=mode, engine="static") if mode != "continuous" else {}))
                results["greedy"][(name, mode)] = [r[:MAX_NEW].tolist() for r in rollout.responses]
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    base = tmp_path_factory.mktemp("deepseek_parity")
    per_layout = {name: [] for name in LAYOUTS}
    for index, name in enumerate(CASES + VALUE_CASES):
        value = name.endswith("-value")
        kwargs = dict(seed=300 + index, seq_cls=value, **deepseek_variant(name[:-len("-value")] if value else name))
        hf_dir = save_tiny("deepseek_v3", base / name / "hf", **kwargs)
        ids = torch.randint(3, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(index))
        if value:
            ids[1, -3:] = PAD_TOKEN_ID  # right padding: the pooled score is the last real token's
        model = build_tiny("deepseek_v3", **kwargs)
        ref = hf_reference(model, ids, True) if value else _hf_refs(model, ids)
        for layout, (convert, _) in LAYOUTS.items():
            if value and layout not in VALUE_LAYOUTS:
                continue
            root = base / name / f"mg_{layout}"
            convert_hf_to_mg(hf_dir, root, progress=False, value_head=value, **convert)
            per_layout[layout].append(dict(name=name, root=str(root), ids=ids, ref=ref, value=value))
    jobs = [(layout, LAYOUTS[layout][1], cases) for layout, cases in per_layout.items()]
    merged = {"diffs": {}, "key_mismatch": {}, "ranks": {}, "packed": {}, "unpacked": {}, "greedy": {},
              "refs": {c["name"]: c["ref"] for c in per_layout["tp1"] if not c["value"]}}
    for result in run_distributed(_worker, 2, jobs):
        for key in ("diffs", "key_mismatch", "packed", "unpacked", "greedy"):
            merged[key].update(result[key])
        for layout, ranks in result["ranks"].items():
            merged["ranks"].setdefault(layout, set()).add(ranks)
    return merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(parity, layout, case):
    diff = parity["diffs"][(layout, case)]
    assert diff <= TOL, f"{case} at {layout}: max |logits - transformers| = {diff:.3g}"


@pytest.mark.parametrize("layout", VALUE_LAYOUTS)
def test_value_head_matches_sequence_classification(parity, layout):
    """Per-token values equal score(hidden) and the last non-pad token's value transformers' pooled score."""
    diff = parity["diffs"][(layout, "deepseek_v3-value")]
    assert diff <= TOL, f"value head at {layout}: max |value - transformers| = {diff:.3g}"


def test_shard_keys_equal_gptmodel_state_dict(parity):
    assert parity["key_mismatch"] == {}


def test_layouts_really_split(parity):
    ranks = parity["ranks"]
    assert ranks["ep2"] == {(0, 0, 0), (0, 0, 1)}
    assert ranks["tp2ep2-etp1"] == {(0, 0, 0), (1, 0, 1)}
    assert ranks["pp2"] == {(0, 0, 0), (0, 1, 0)}


@pytest.mark.parametrize("case", CASES)
def test_position_ids_reach_every_mla_rotary(parity, case):
    """Packed rows restart positions: with forward_layout the logits equal transformers' at those position ids
    (megatron alone rotates by slot, which is far off)."""
    assert parity["packed"][case] <= TOL, parity["packed"][case]
    assert parity["unpacked"][case] > 1e-3, "the reference does not depend on the position ids"


@pytest.mark.parametrize("mode", ["batched", "stepwise", "continuous"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_transformers(parity, case, mode):
    assert parity["greedy"][(case, mode)] == parity["refs"][case]["greedy"]


# ------------------------------------------------------------------------------------------- conversion

def _load(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(pp=2), dict(tp=2, pp=2, ep=2),
                                    dict(tp=2, ep=2, etp=1)], ids=["tp2", "ep2", "pp2", "tp2pp2ep2", "tp2ep2-etp1"])
@pytest.mark.parametrize("case", CASES)
def test_hf_mg_hf_round_trip_is_bit_identical(tmp_path, case, layout):
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_hf
    from mindspeed_llm.models import ArchitectureSpec

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", seed=7, **deepseek_variant(case))
    spec = convert_hf_to_mg(hf_dir, tmp_path / "mg", progress=False, **layout)
    convert_mg_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    source, back = _load(hf_dir), _load(tmp_path / "back")
    assert set(source) == set(back)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert any(n.endswith("e_score_correction_bias") for n in back)
    assert ArchitectureSpec.from_hf_config(tmp_path / "back") == spec
    if layout == dict(tp=2):  # the export is a transformers model with the source's outputs
        ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids).logits
            b = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(input_ids=ids).logits
        assert torch.equal(a, b)


def test_shard_tensors_split_as_megatron_expects(tmp_path):
    """TP2 x EP2 shards: MLA projections column-split (rows), o_proj row-split, norms / router / expert bias whole,
    each EP rank its own experts under local indices."""
    from mindspeed_llm.checkpoint import convert_hf_to_mg, load_shard

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", seed=3)
    convert_hf_to_mg(hf_dir, tmp_path / "mg", tp=2, ep=2, progress=False)
    src = _load(hf_dir)
    a = "model.layers.1.self_attn."
    for t in range(2):
        for e in range(2):
            shard = load_shard(tmp_path / "mg", t, 0, ep_rank=e)["model"]
            m = "decoder.layers.1."
            got = lambda name: shard[m + "self_attention." + name]  # noqa: E731
            assert torch.equal(got("linear_q_down_proj.weight"), src[a + "q_a_proj.weight"].chunk(2)[t])
            assert torch.equal(got("linear_kv_down_proj.weight"), src[a + "kv_a_proj_with_mqa.weight"].chunk(2)[t])
            assert torch.equal(got("linear_kv_up_proj.weight"), src[a + "kv_b_proj.weight"].chunk(2)[t])
            assert torch.equal(got("linear_proj.weight"), src[a + "o_proj.weight"].chunk(2, 1)[t])
            assert torch.equal(got("kv_layernorm.weight"), src[a + "kv_a_layernorm.weight"])
            bias = src["model.layers.1.mlp.gate.e_score_correction_bias"]
            assert torch.equal(shard[m + "mlp.router.expert_bias"], bias)
            assert shard[m + "mlp.router.expert_bias"].dtype == torch.float32
            down = src[f"model.layers.1.mlp.experts.{4 * e + 1}.down_proj.weight"]
            assert torch.equal(shard[m + "mlp.experts.local_experts.1.linear_fc2.weight"], down.chunk(2, 1)[t])


# ------------------------------------------------------------------------------------------- errors

def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def test_fp8_checkpoint_is_refused_naming_the_tensor_and_the_fix(tmp_path):
    from safetensors.torch import save_file

    from mindspeed_llm.checkpoint import ConversionError, convert_hf_to_mg

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf")
    state = _load(hf_dir)
    state["model.layers.1.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    name = r"model\.layers\.1\.self_attn\.q_a_proj\.weight_scale_inv"
    with pytest.raises(ConversionError, match=name + ".*fp8_cast_bf16"):
        convert_hf_to_mg(hf_dir, tmp_path / "mg", progress=False)
    assert not os.path.exists(tmp_path / "mg" / "latest_checkpointed_iteration.txt")


def test_mtp_layers_are_skipped_with_a_note(tmp_path, capfd):
    from safetensors.torch import save_file

    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_hf

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", seed=5)
    plain = _load(hf_dir)
    state = dict(plain)
    state["model.layers.2.enorm.weight"] = torch.ones(64)  # an MTP layer (index num_hidden_layers)
    state["model.layers.2.eh_proj.weight"] = torch.ones(64, 128)
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(hf_dir, num_nextn_predict_layers=1)
    convert_hf_to_mg(hf_dir, tmp_path / "mg", progress=False)
    assert "multi-token-prediction" in capfd.readouterr().err
    convert_mg_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    back = _load(tmp_path / "back")
    assert set(back) == set(plain) and all(torch.equal(back[k], plain[k]) for k in plain)


@pytest.mark.parametrize("key,value,words", [
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("rope_interleave", False, "rope_interleave"),
    ("norm_topk_prob", False, "norm_topk_prob"),
    ("topk_group", 1, "topk_group"),  # top-4 of 1 group of 4: megatron would rank groups by their top 4
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_config_values_are_named(key, value, words):
    from tests.helpers.hf_tiny import tiny_config

    from mindspeed_llm.models import ArchitectureSpec, UnsupportedModelError

    config = tiny_config("deepseek_v3", **deepseek_variant("deepseek_v3")).to_dict()
    config[key] = value
    with pytest.raises(UnsupportedModelError, match=words):
        ArchitectureSpec.from_hf_config(config)


def test_parallel_sizes_that_do_not_divide_mla_are_named():
    from tests.helpers.hf_tiny import tiny_config

    from mindspeed_llm.models import ArchitectureSpec

    spec = ArchitectureSpec.from_hf_config(tiny_config("deepseek_v3", **deepseek_variant("deepseek_v3")).to_dict())
    spec.check_parallel(2, 2, 2, 2)
    with pytest.raises(ValueError, match="q_lora_rank=24"):
        spec.check_parallel(16, 1, 1, 1)


# ------------------------------------------------------------------------------------------- a stage

@pytest.mark.slow
def test_grpo_trains_a_deepseek_v3_actor_at_ep2(tmp_path):
    """One GRPO iteration (rule reward) with a tiny DeepSeek-V3 actor and reference at EP2 (all-to-all dispatcher,
    --moe-routing-replay as the 671B launcher runs):
    MoE metrics finite, both expert-parallel shards saved with their own experts moved, the dense part (MLA) moved,
    and the routing bias changed by megatron's aux-loss-free balancing update."""
    import json
    from tests.helpers import word_task

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    task = word_task.build(tmp_path / "task")
    hf = save_tiny("deepseek_v3", tmp_path / "hf", seed=11, vocab_size=word_task.VOCAB)
    actor = tmp_path / "mg_ep2"
    convert_hf_to_mg(hf, actor, ep=2, tokenizer_dir=task["tokenizer"], progress=False)
    out = tmp_path / "out"
    argv = ["--stage", "grpo", "--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "5",
            "--data-path", task["data"], "--tokenizer-name-or-path", task["tokenizer"], "--max-length", "64",
            "--max-new-tokens", "8", "--do-sample", "--lr", "0.01", "--log-interval", "1",
            "--ref-model", str(actor), "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.001",
            "--train-iters", "1", "--save", str(out), "--metrics-jsonl", str(out / "m.jsonl"),
            "--n-samples-per-prompt", "2", "--verifier-function", "odd_first_word", "--kl-coef", "0.05",
            "--moe-routing-replay"]
    run_distributed(run_stages, 2, [argv])
    rows = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1]
    for key in ("actor/moe/seq_load_balancing_loss", "actor/moe/tokens_per_expert_max", "actor/pg_loss"):
        assert torch.isfinite(torch.tensor(rows[0][key])), key
    saved = {p.parent.name: torch.load(p, weights_only=False)["model"]
             for p in sorted((out / "actor" / "iter_0000001").glob("*/model_optim_rng.pt"))}
    before = {e: torch.load(next((actor / "release").glob(f"mp_rank_00_00{e}/model_optim_rng.pt")),
                            weights_only=False)["model"] for e in range(2)}
    assert sorted(saved) == ["mp_rank_00_000", "mp_rank_00_001"]
    for e in range(2):
        now, then = saved[f"mp_rank_00_00{e}"], before[e]
        for key in ("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                    "decoder.layers.0.self_attention.linear_q_down_proj.weight",
                    "decoder.layers.1.mlp.router.expert_bias"):
            assert not torch.equal(now[key], then[key].to(now[key].dtype)), (e, key)


# ------------------------------------------------------------------------------------------- the MLA patches

def _without_patch_worker(rank, world_size, target):
    """Build a tiny DeepSeek-V3 with the patch of `target` undone (the others applied; None: all applied); the error,
    or None."""
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, rank=rank, world_size=world_size)
    if target is None:  # every patch applied
        return _build_and_train_deepseek()
    with without_patch(target):
        return _build_and_train_deepseek()


def _build_and_train_deepseek():
    from tests.helpers.hf_tiny import tiny_config

    from mindspeed_llm.models import ArchitectureSpec, build_model
    from mindspeed_llm.models.attention import PackedGroups

    spec = ArchitectureSpec.from_hf_config(tiny_config("deepseek_v3", **deepseek_variant("deepseek_v3")).to_dict())
    try:
        for attention in ("sdpa", "local"):  # the default fused core attention, and megatron's local one
            model = build_model(spec, attention=attention)
            ids = torch.randint(3, 256, (2, 12))
            mask = torch.zeros(2 * 12, dtype=torch.bool)
            mask[-3:] = True  # padding, as the RL passes mark it for megatron's MoE
            model.train()
            model(ids, torch.arange(12).expand(2, 12), None, padding_mask=mask.view(2, 12)).sum().backward()
        # a packed micro-batch of one prompt group (one row: prompt 4, 2 responses of 4), fused attention
        groups = PackedGroups(2, (4,), (4,), 12)
        model = build_model(spec)
        model(ids[:1], torch.arange(12)[None], None, packed_seq_params=groups.seq_params()).sum().backward()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("target", [
    None,
    "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__",
    "megatron.core.transformer.multi_latent_attention.HAVE_TE",
    "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",
    "megatron.core.transformer.multi_latent_attention.MLASelfAttention.get_query_key_value_tensors",
], ids=["all", "k_v_channels", "have_te", "expert_bias_padding", "sbhd_packed_params"])
def test_each_mla_patch_is_needed(target):
    """With every patch a training forward + backward (with a padding mask) runs with either core attention, and
    so does a packed micro-batch of one row; without any one of the patches it fails in megatron (TypeError for
    the first two: the local attention's constructor, the TE check; a broadcast RuntimeError for the expert-bias
    count; a shape error when MLA squeezes the one row's batch dim)."""
    (error,) = run_distributed(_without_patch_worker, 1, target)
    if target is None:
        assert error is None, error
    else:
        expected = {"expert_bias": "routing_map & (~padding_mask)", "HAVE_TE": "TypeError", "__init__": "TypeError",
                    "get_query_key_value_tensors": "must have same number of dimensions"}
        marker = next(v for k, v in expected.items() if target.endswith(k))
        assert error is not None and marker in error, error


def _bf16_load_worker(rank, world_size, root):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model

    distributed.initialize(1, 1, rank=rank, world_size=world_size)
    model = build_model(load_spec(root), params_dtype="bf16")
    load_megatron_weights(model, root)
    bias = model.decoder.layers[1].mlp.router.expert_bias
    with torch.no_grad():
        logits = model(torch.randint(3, 256, (1, 8)), torch.arange(8).unsqueeze(0), None)
    return str(bias.dtype), str(model.decoder.layers[1].mlp.router.weight.dtype), bool(torch.isfinite(logits).all())


def test_bf16_checkpoint_keeps_the_expert_bias_fp32(tmp_path):
    """A bf16 conversion (as for the 671B model) stores every weight in bf16 but the routing bias in fp32 (megatron's
    router buffer and transformers' are fp32: a bf16 bias would move expert choices), loads into a bf16 model, and
    exports the bias back in fp32."""
    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_hf, load_shard

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", seed=9)
    convert_hf_to_mg(hf_dir, tmp_path / "mg", params_dtype="bf16", progress=False)
    shard = load_shard(tmp_path / "mg", 0, 0)["model"]
    assert shard["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert shard["decoder.layers.1.self_attention.linear_kv_up_proj.weight"].dtype == torch.bfloat16
    (result,) = run_distributed(_bf16_load_worker, 1, str(tmp_path / "mg"))
    assert result == ("torch.float32", "torch.bfloat16", True)
    convert_mg_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    source, back = _load(hf_dir), _load(tmp_path / "back")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert back[bias].dtype == torch.float32 and torch.equal(back[bias], source[bias])
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], source[name].to(torch.bfloat16))
