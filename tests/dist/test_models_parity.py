"""Converted Hugging Face checkpoints give the logits / values of `transformers` at TP=1, TP=2 and PP=2.

One module-scoped run does everything that needs megatron: the parent builds tiny random HF models
(tests/helpers/hf_tiny.py; every family, tied and untied embeddings, random norms and biases), converts each to
Megatron with TP=1, TP=2 and PP=2 (plus TP=2 -> PP=2 resharded copies), computes the `transformers`
reference; then ONE spawned 2-process gloo run initialises each layout in turn (TP=1 runs as DP=2),
builds the GPTModel from the checkpoint's spec, loads its shard with `load_megatron_weights`, runs the
forward (PP: stage 0's hidden states are sent to stage 1 with p2p send/recv and fed with
`set_input_tensor`; TP: vocab shards all-gathered) and reports max |diff|. Tolerance: 1e-5 (fp32).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.hf_tiny import FAMILIES, build_tiny, save_tiny
from tests.helpers.hf_parity import TOL, case_diff, hf_reference, token_ids
from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
LM_CASES = [f"{family}-{'tied' if tie else 'untied'}" for family in FAMILIES for tie in (False, True)]
VALUE_CASES = ["llama-value", "qwen2-value", "qwen3-value"]
RESHARDED = [f"{family}-tied" for family in FAMILIES]  # also loaded at PP=2 from a TP=2 -> PP=2 reshard
NUM_LAYERS = 4


def _case(name):
    family, kind = name.split("-")
    return family, kind


# ------------------------------------------------------------------------------------------- worker


def _parity_worker(rank, world_size, jobs, error_roots):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    import dataclasses

    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_shard, load_spec
    from mindspeed_llm.models import build_model

    results = {"diffs": {}, "key_mismatch": {}, "errors": {}}
    for layout, (tp, pp), cases in jobs:
        distributed.initialize(tp, pp, rank=rank, world_size=world_size)
        for case in cases:
            spec = load_spec(case["root"])
            model = build_model(spec, value_head=case["value"]).eval()
            load_megatron_weights(model, case["root"])
            stored = load_shard(case["root"], ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
            keys = set(stored["model"]) ^ set(model.state_dict())
            if keys:
                results["key_mismatch"][(layout, case["name"])] = sorted(keys)
            diff = case_diff(model, case, tp, pp)
            if diff is not None:
                results["diffs"][(layout, case["name"])] = diff
        if layout == "tp2":
            # Loader errors: spec mismatch, value head vs LM, TP/PP layout mismatch, missing tracker.
            spec = load_spec(error_roots["lm_tp2"])
            attempts = {
                "vocab": (dataclasses.replace(spec, vocab_size=spec.vocab_size * 2), False, error_roots["lm_tp2"]),
                "layers": (dataclasses.replace(spec, num_layers=spec.num_layers + 2), False, error_roots["lm_tp2"]),
                "value_head": (load_spec(error_roots["value_tp2"]), False, error_roots["value_tp2"]),
                "layout": (load_spec(error_roots["lm_tp1"]), False, error_roots["lm_tp1"]),
                "no_tracker": (spec, False, error_roots["empty"]),
            }
            for label, (bad_spec, value, root) in attempts.items():
                model = build_model(bad_spec, value_head=value)
                try:
                    load_megatron_weights(model, root)
                    results["errors"][label] = None
                except Exception as err:  # noqa: BLE001 (the message is the result)
                    results["errors"][label] = f"{type(err).__name__}: {err}"
        ps.destroy_model_parallel()
    return results


# ------------------------------------------------------------------------------------------- fixture

@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from mindspeed_llm.checkpoint import convert_hf_to_mg, convert_mg_to_mg

    base = tmp_path_factory.mktemp("parity")
    per_layout = {name: [] for name in LAYOUTS}
    for index, name in enumerate(LM_CASES + VALUE_CASES):
        family, kind = _case(name)
        value = kind == "value"
        tie = kind == "tied" or (value and family == "qwen2")  # a tied config must still give an untied head
        hf_dir = save_tiny(family, base / name / "hf", tie=tie, seq_cls=value, seed=100 + index,
                           num_layers=NUM_LAYERS)
        model = build_tiny(family, tie=tie, seq_cls=value, seed=100 + index, num_layers=NUM_LAYERS)
        ids = token_ids(model.config.vocab_size, seed=index, pad_tail=3 if value else 0)
        ref = hf_reference(model, ids, value)
        for layout, (tp, pp) in LAYOUTS.items():
            root = base / name / f"mg_{layout}"
            convert_hf_to_mg(hf_dir, root, tp=tp, pp=pp, value_head=value, progress=False)
            per_layout[layout].append(dict(name=name, root=str(root), ids=ids, ref=ref, value=value))
        if name in RESHARDED:
            root = base / name / "mg_tp2_to_pp2"
            convert_mg_to_mg(base / name / "mg_tp2", root, tp=1, pp=2, progress=False)
            per_layout["pp2"].append(dict(name=name + "-resharded", root=str(root), ids=ids, ref=ref, value=False))
    empty = base / "empty"
    empty.mkdir()
    error_roots = {"lm_tp2": str(base / "llama-untied" / "mg_tp2"), "lm_tp1": str(base / "llama-untied" / "mg_tp1"),
                   "value_tp2": str(base / "llama-value" / "mg_tp2"), "empty": str(empty)}
    jobs = [(layout, LAYOUTS[layout], cases) for layout, cases in per_layout.items()]
    results = run_distributed(_parity_worker, 2, jobs, error_roots)
    merged = {"diffs": {}, "key_mismatch": {}, "errors": results[0]["errors"]}
    for r in results:
        merged["diffs"].update(r["diffs"])
        merged["key_mismatch"].update(r["key_mismatch"])
    return merged


# ------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", LM_CASES)
def test_logits_match_transformers(parity, layout, case):
    diff = parity["diffs"][(layout, case)]
    assert diff <= TOL, f"{case} at {layout}: max |logits - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", RESHARDED)
def test_resharded_tp2_to_pp2_logits(parity, case):
    diff = parity["diffs"][("pp2", case + "-resharded")]
    assert diff <= TOL, f"{case} resharded TP2->PP2: max diff {diff:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", VALUE_CASES)
def test_value_head_matches_sequence_classification(parity, layout, case):
    """Per-token values equal score(hidden) and the value at the last non-pad token equals HF's pooled logit."""
    diff = parity["diffs"][(layout, case)]
    assert diff <= TOL, f"{case} at {layout}: max |value - transformers| = {diff:.3g}"


def test_shard_keys_equal_gptmodel_state_dict(parity):
    assert parity["key_mismatch"] == {}


def test_every_case_ran(parity):
    expected = {(layout, case) for layout in LAYOUTS for case in LM_CASES + VALUE_CASES}
    expected |= {("pp2", case + "-resharded") for case in RESHARDED}
    assert expected <= set(parity["diffs"])


def test_loader_errors_name_both_values(parity):
    errors = parity["errors"]
    assert "vocab_size: checkpoint 256 vs model 512" in errors["vocab"], errors["vocab"]
    assert "num_layers: checkpoint 4 vs model 6" in errors["layers"], errors["layers"]
    assert "value-head" in errors["value_head"] and "causal LM" in errors["value_head"], errors["value_head"]
    assert "TP=1 x PP=1" in errors["layout"] and "--tensor-model-parallel-size 2" in errors["layout"], errors["layout"]
    assert "--target-tensor-parallel-size 2" in errors["layout"]
    assert "no latest_checkpointed_iteration.txt in" in errors["no_tracker"], errors["no_tracker"]
    assert "pass a directory written by convert_ckpt.py or --save" in errors["no_tracker"]
