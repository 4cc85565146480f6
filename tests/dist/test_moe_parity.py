"""Converted mixture-of-experts checkpoints give the logits / values of `transformers` (fp32, eager attention).

The parent builds tiny random Qwen3-MoE (also a variant with a dense layer and norm_topk_prob=False, i.e.
megatron's pre-softmax router), Qwen2-MoE (shared expert and its sigmoid gate) and Mixtral models
(tests/helpers/hf_tiny.py), their *ForSequenceClassification value heads, the transformers reference outputs, and
converts each to every layout. ONE spawned 2-process gloo run then initialises each layout in turn (megatron's
expert groups included), builds the GPTModel from the checkpoint's spec (`build_model(load_spec(root))`),
loads this rank's (tp, pp, ep) shard with `load_megatron_weights` and runs the forward (helpers shared with
test_models_parity.py). Layouts at world 2:

    tp1           TP1 (DP2), experts whole on every rank
    tp2           TP2, expert TP 2 (each expert tensor-split like the dense MLP), EP1
    ep2           EP2: 2 of the experts per rank (local indices), DP2 for the dense part
    tp2ep2-etp1   TP2 x EP2 with expert TP 1: converted with --target-expert-parallel-size 2
                  --expert-tensor-parallel-size 1, and with --moe-tp-extend-ep at EP1 x TP2 (the same layout)
    pp2           PP2

A separate 4-process run checks TP2 x EP2 with expert TP 2. Tolerance 1e-5 (fp32), as for the dense families.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.hf_tiny import MOE_VARIANTS, build_tiny, save_tiny
from tests.helpers.hf_parity import TOL, case_diff, hf_reference, token_ids
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

# name -> (convert_hf_to_mg keyword arguments, distributed.initialize (tp, pp, ep, expert tp), world size)
LAYOUTS = {
    "tp1": (dict(), (1, 1, 1, 1), 2),
    "tp2": (dict(tp=2), (2, 1, 1, 2), 2),
    "ep2": (dict(ep=2), (1, 1, 2, 1), 2),
    "tp2ep2-etp1": (dict(tp=2, ep=2, etp=1), (2, 1, 2, 1), 2),
    "pp2": (dict(pp=2), (1, 2, 1, 1), 2),
    "tp2ep2-etp2": (dict(tp=2, ep=2), (2, 1, 2, 2), 4),
}
EXTEND = "tp2ep2-etp1"  # also loaded from a --moe-tp-extend-ep (EP1 x TP2) conversion
# Sizes none of the other tests use (16 experts top-4, head_dim 16, every other layer dense through
# decoder_sparse_step, tied embeddings): nothing in the conversion may assume the tiny configs' sizes.
OTHER = {"qwen3_moe-other": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                                               head_dim=16, decoder_sparse_step=2, tie=True))}
VARIANTS = {**MOE_VARIANTS, **OTHER}
LM_CASES = list(VARIANTS)
VALUE_CASES = ["qwen3_moe-value", "qwen2_moe-value", "mixtral-value"]
VALUE_LAYOUTS = ("ep2", "tp2ep2-etp1", "pp2", "tp2ep2-etp2")
NUM_LAYERS = 4


def _moe_worker(rank, world_size, jobs):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_shard, load_spec
    from mindspeed_llm.models import build_model

    results = {"diffs": {}, "key_mismatch": {}, "ranks": {}}
    for layout, (tp, pp, ep, etp), cases in jobs:
        distributed.initialize(tp, pp, rank=rank, world_size=world_size, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp)
        ranks = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                 ps.get_expert_model_parallel_rank())
        results["ranks"][layout] = ranks
        for case in cases:
            spec = load_spec(case["root"])
            model = build_model(spec, value_head=case["value"]).eval()
            load_megatron_weights(model, case["root"])
            stored = load_shard(case["root"], ranks[0], ranks[1], ep_rank=ranks[2] if ep > 1 else 0)
            keys = {k for k in set(stored["model"]) ^ set(model.state_dict())}
            if keys:
                results["key_mismatch"][(layout, case["name"])] = sorted(keys)
            diff = case_diff(model, case, tp, pp)
            if diff is not None:
                results["diffs"][(layout, case["name"])] = diff
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    base = tmp_path_factory.mktemp("moe_parity")
    per_layout = {name: [] for name in LAYOUTS}
    for index, name in enumerate(LM_CASES + VALUE_CASES):
        value = name.endswith("-value")
        family, overrides = VARIANTS[name[:-len("-value")] if value else name]
        kwargs = dict(seq_cls=value, seed=200 + index, num_layers=NUM_LAYERS, **overrides)
        hf_dir = save_tiny(family, base / name / "hf", **kwargs)
        ids = token_ids(256, seed=index, pad_tail=3 if value else 0)
        ref = hf_reference(build_tiny(family, **kwargs), ids, value)
        for layout, (convert, _, _) in LAYOUTS.items():
            if value and layout not in VALUE_LAYOUTS:
                continue
            root = base / name / f"mg_{layout}"
            convert_hf_to_mg(hf_dir, root, value_head=value, progress=False, **convert)
            per_layout[layout].append(dict(name=name, root=str(root), ids=ids, ref=ref, value=value))
            if layout == EXTEND:
                root = base / name / "mg_extend"
                convert_hf_to_mg(hf_dir, root, tp=2, moe_tp_extend_ep=True, value_head=value, progress=False)
                per_layout[layout].append(dict(name=name + "-extend", root=str(root), ids=ids, ref=ref, value=value))
    merged = {"diffs": {}, "key_mismatch": {}, "ranks": {}}
    for world in sorted({w for _, _, w in LAYOUTS.values()}):
        jobs = [(layout, LAYOUTS[layout][1], cases) for layout, cases in per_layout.items()
                if LAYOUTS[layout][2] == world]
        for result in run_distributed(_moe_worker, world, jobs):
            merged["diffs"].update(result["diffs"])
            merged["key_mismatch"].update(result["key_mismatch"])
            for layout, ranks in result["ranks"].items():
                merged["ranks"].setdefault(layout, set()).add(ranks)
    return merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", LM_CASES)
def test_logits_match_transformers(parity, layout, case):
    diff = parity["diffs"][(layout, case)]
    assert diff <= TOL, f"{case} at {layout}: max |logits - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", LM_CASES + VALUE_CASES)
def test_moe_tp_extend_ep_checkpoint_matches_transformers(parity, case):
    """--moe-tp-extend-ep at EP1 x TP2 loads at TP2 x EP2 with expert TP 1 and gives transformers' outputs."""
    diff = parity["diffs"][(EXTEND, case + "-extend")]
    assert diff <= TOL, f"{case} (--moe-tp-extend-ep): max diff {diff:.3g}"


@pytest.mark.parametrize("layout", VALUE_LAYOUTS)
@pytest.mark.parametrize("case", VALUE_CASES)
def test_value_head_matches_sequence_classification(parity, layout, case):
    """Per-token values equal score(hidden) and the last non-pad token's value HF's pooled score."""
    diff = parity["diffs"][(layout, case)]
    assert diff <= TOL, f"{case} at {layout}: max |value - transformers| = {diff:.3g}"


def test_shard_keys_equal_gptmodel_state_dict(parity):
    assert parity["key_mismatch"] == {}


def test_layouts_really_split_the_experts(parity):
    """The runs had the expert-parallel ranks they claim (else an EP2 case would pass as EP1)."""
    ranks = parity["ranks"]
    assert ranks["ep2"] == {(0, 0, 0), (0, 0, 1)}
    assert ranks["tp2ep2-etp1"] == {(0, 0, 0), (1, 0, 1)}
    assert ranks["tp2ep2-etp2"] == {(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)}
    assert ranks["pp2"] == {(0, 0, 0), (0, 1, 0)}
