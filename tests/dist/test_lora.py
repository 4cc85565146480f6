"""LoRA against `peft`'s LoRA on the transformers models, and adapters in and out (issue 29).

The reference is `peft` 0.21 (`get_peft_model` with a `LoraConfig` on `tests/helpers/hf_tiny.py` models, fp32): random
non-zero A and B (`init_lora_weights=False`) on q, k, v, o, gate, up and down, saved with `save_pretrained`. Ours reads
that folder (`checkpoint/lora.read_peft`), adds adapters to the converted Megatron model (`models/lora.apply_lora`)
and loads them (`rl/update/lora.load_adapter`, each rank its TP slice). Two adapters per model:

* `indep`: PEFT's usual adapter, each of q / k / v (and gate / up) with its own A: read as one stacked adapter per
  fused Megatron linear (rank 3r on linear_qkv, 2r on linear_fc1);
* `shared`: the same with A_k = A_v = A_q and A_up = A_gate, the form an export of ours has: read as rank r.

One 2-process gloo run (phase 1) does, at TP1 (run as DP2), TP2, PP2 and TP2 with sequence parallelism (the row
adapters' B gradients summed over TP as megatron's finalize_model_grads sums the marked ones), for a Qwen2 and a
tied Llama policy and a Qwen2 value model:

* logits (values) against peft's, within 1e-5;
* the gradient of a fixed linear function of the logits (of the values) w.r.t. every adapter, merged over the TP
  ranks, against peft's: with shared A's, our A's gradient is the sum of peft's q / k / v (gate / up) A gradients and
  our B's the fused rows of theirs (the chain rule of a shared parameter), within 1e-4 of their norm; a replicated
  tensor's gradient is the same on every TP rank (the adapters' all-reduces), the value head's too;
* an adapter checkpoint of the `shared` adapter written by the real `checkpoint.training.save` at TP2;
* for the mixtures of experts (a Qwen3-MoE at EP2 and a DeepSeek-V3, multi-latent attention and experts, at EP2;
  its MLA adapters also at TP2) random adapters on every target, their logits, and their adapter checkpoints.

The parent then runs `convert_ckpt.py`: `--lora-load` of the TP2 adapter checkpoint merged into Hugging Face weights
(transformers' logits = peft's unmerged ones), `--save-lora-to-hf` back to a PEFT folder (equal to the original
shared adapter tensor for tensor; peft loads it onto the base and gives the same logits), `--lora-load` of the
`indep` PEFT folder merged into a PP2 Megatron checkpoint, and the MoE checkpoints merged at EP2 (and TP2). Phase 2
(2 processes) loads the merged checkpoints -- logits equal the unmerged ones -- and `--lora-load`s the TP2 adapter
checkpoint into a PP2 model (a reshard of the adapters; peft's logits again).
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers.hf_tiny import build_tiny, save_tiny  # noqa: E402
from tests.helpers.lora_adapters import adapter_grads, randomise_b  # noqa: E402
from tests.helpers.multiproc import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

peft = pytest.importorskip("peft")

TOL = 1e-5
GRAD_TOL = 1e-4
R, ALPHA = 4, 8
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MG_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2_sp": (2, 1)}  # tp2_sp: with --sequence-parallel
SP_LAYOUTS = ("tp2_sp",)
CASES = {"qwen2": dict(family="qwen2", tie=False, value=False),
         "llama-tied": dict(family="llama", tie=True, value=False),
         "qwen2-value": dict(family="qwen2", tie=False, value=True)}
BATCH, SEQ = 2, 10  # TP2 + SP splits the sequence in two


def _ids(vocab, seed):
    return torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _peft_model(case, seed, shared):
    from peft import LoraConfig, get_peft_model

    model = build_tiny(case["family"], tie=case["tie"], seq_cls=case["value"], seed=seed, num_layers=4)
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=HF_TARGETS, init_lora_weights=False,
                        task_type="SEQ_CLS" if case["value"] else "CAUSAL_LM")
    torch.manual_seed(seed + 1)
    pm = get_peft_model(model, config)
    with torch.no_grad():
        for name, module in pm.named_modules():
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(0, 0.2)  # B != 0: the adapters change the output
        if shared:
            for name, module in pm.named_modules():
                for tied, source in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
                    if name.endswith(tied):
                        other = pm.get_submodule(name[:-len(tied)] + source)
                        module.lora_A["default"].weight.copy_(other.lora_A["default"].weight)
        if case["value"]:
            for name, param in pm.named_parameters():
                if "score" in name and "modules_to_save" in name:
                    param.normal_(0, 0.5)
    return pm.eval()


def _peft_outputs(pm, ids, value, seed):
    """(output, {hf module: (dA, dB)}, value head grad) of a fixed linear function of the output."""
    pm.zero_grad()
    if value:
        hidden = pm.base_model.model.model(input_ids=ids).last_hidden_state
        out = pm.base_model.model.score(hidden)
    else:
        out = pm(input_ids=ids).logits
    (out * _weights(out.shape, seed)).sum().backward()
    grads, head = {}, None
    for name, param in pm.named_parameters():
        if param.grad is None:
            continue
        if ".lora_" in name:
            module = name.split("base_model.model.", 1)[1].split(".lora_")[0]
            grads.setdefault(module, {})["A" if ".lora_A." in name else "B"] = param.grad.clone()
        elif "score" in name:
            head = param.grad.clone()
    return out.detach(), {k: (v["A"], v["B"]) for k, v in grads.items()}, head


# ------------------------------------------------------------------------------------------- worker
def _forward_backward(model, ids, tp, pp, value, weights):
    """Output (full on the last stage, None elsewhere) and the backward of sum(output * weights) over the layout
    (TP: each rank its vocabulary slice; PP: the first stage's hidden states sent, their gradient sent back)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    if pp > 1 and ps.is_pipeline_first_stage():
        hidden = model(ids, pos, None)
        dist.send(hidden.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        hidden.backward(grad)
        return None
    buf = None
    if pp > 1:
        buf = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
        buf.requires_grad_(True)
        model.set_input_tensor(buf)
    out = model(ids, pos, None)
    if tp > 1 and not value:
        rank, width = ps.get_tensor_model_parallel_rank(), out.shape[-1]
        local_weights = weights[..., rank * width:(rank + 1) * width]
    else:
        local_weights = weights
    (out * local_weights).sum().backward()
    if buf is not None:
        dist.send(buf.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    out = out.detach()
    if tp > 1 and not value:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out


def _lora_model(root, adapter_path, value=False, sp=False):
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.checkpoint import lora as lora_files
    from mindspeed_llm.models import build_model, lora
    from mindspeed_llm.rl.update.lora import load_adapter

    spec = load_spec(root)
    model = build_model(spec, value_head=value, sequence_parallel=sp)
    load_megatron_weights(model, root)
    if adapter_path is None:
        return model.eval()
    adapter = lora_files.read_adapter(adapter_path, spec)
    lora.apply_lora(model, adapter.config)
    load_adapter(model, adapter)
    if value and getattr(model, "output_layer", None) is not None:  # the last stage's head
        with torch.no_grad():
            model.output_layer.weight.copy_(adapter.tensors["output_layer.weight"])
    return model.eval()


def _save_adapters(model, root, base):
    from mindspeed_llm.checkpoint import training as training_ckpt
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.lora import LoRATrainableModel

    trained = LoRATrainableModel(model, OptimizerSettings(lr=1e-3), name="actor", base=base)
    training_ckpt.save(root, 1, {"actor": trained}, {"sampler": {}})


def _phase1(rank, world_size, jobs):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model, lora

    results = {"out": {}, "grads": {}, "same": {}, "head": {}, "moe": {}}
    for layout, (tp, pp, ep), cases in jobs:
        distributed.initialize(tp, pp, rank=rank, world_size=world_size, expert_model_parallel_size=ep)
        for case in cases:
            key = (layout, case["name"])
            if case.get("moe"):  # random adapters on every target; logits and an adapter checkpoint
                spec = load_spec(case["root"])
                model = build_model(spec)
                load_megatron_weights(model, case["root"])
                lora.apply_lora(model, lora.LoRAConfig(r=R, alpha=ALPHA, target_modules=tuple(case["targets"])),
                                seed=3)
                randomise_b(model, seed=5)
                model.eval()
                with torch.no_grad():
                    out = _forward_backward_free(model, case["ids"], tp, pp)
                    with lora.adapters_disabled(model):
                        base = _forward_backward_free(model, case["ids"], tp, pp)
                _save_adapters(model, case["save"], case["root"])
                if out is not None and ps.get_tensor_model_parallel_rank() == 0:
                    results["moe"][key] = (out, base)
                continue
            model = _lora_model(case["root"], case["adapter"], case["value"], sp=layout in SP_LAYOUTS)
            out = _forward_backward(model, case["ids"], tp, pp, case["value"], case["weights"])
            grads, same = adapter_grads(model)
            results["grads"].setdefault(key, {}).update(grads)
            results["same"].setdefault(key, {}).update(same)
            if out is not None:
                results["out"][key] = out
                if case["value"]:
                    head = model.output_layer.weight.grad.clone()
                    heads = [torch.empty_like(head) for _ in range(tp)]
                    if tp > 1:
                        import torch.distributed as dist

                        dist.all_gather(heads, head, group=ps.get_tensor_model_parallel_group())
                    results["head"][key] = (head, all(torch.equal(heads[0], h) for h in heads) if tp > 1 else True)
            if case.get("save"):
                _save_adapters(model, case["save"], case["root"])
        ps.destroy_model_parallel()
    return results


def _forward_backward_free(model, ids, tp, pp):
    from tests.helpers.hf_parity import megatron_forward

    return megatron_forward(model, ids, tp, pp)


def _phase2(rank, world_size, jobs):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from mindspeed_llm import distributed

    results = {}
    for layout, (tp, pp, ep), cases in jobs:
        distributed.initialize(tp, pp, rank=rank, world_size=world_size, expert_model_parallel_size=ep)
        for case in cases:
            model = _lora_model(case["root"], case.get("adapter"))
            with torch.no_grad():
                out = _forward_backward_free(model, case["ids"], tp, pp)
            if out is not None and ps.get_tensor_model_parallel_rank() == 0:
                results[(layout, case["name"])] = out
        ps.destroy_model_parallel()
    return results


# ------------------------------------------------------------------------------------------- fixture
def _convert(*argv):
    import convert_ckpt

    code = convert_ckpt.main([*map(str, argv), "--no-progress"])
    assert code == 0, argv


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    base = tmp_path_factory.mktemp("lora")
    jobs = {layout: [] for layout in LAYOUTS}
    refs, paths = {}, {}
    for index, (name, case) in enumerate(CASES.items()):
        seed = 10 + index
        hf = save_tiny(case["family"], base / name / "hf", tie=case["tie"], seq_cls=case["value"], seed=seed,
                       num_layers=4)
        paths[name] = {"hf": hf}
        for layout, (tp, pp) in LAYOUTS.items():
            if layout in SP_LAYOUTS:  # the TP2 checkpoint, built with sequence parallelism
                paths[name][layout] = paths[name]["tp2"]
                continue
            root = base / name / f"mg_{layout}"
            convert_hf_to_mg(hf, root, tp, pp, value_head=case["value"], progress=False)
            paths[name][layout] = str(root)
        for kind in ("indep", "shared"):
            pm = _peft_model(case, seed, shared=kind == "shared")
            folder = base / name / f"peft_{kind}"
            pm.save_pretrained(folder)
            ids = _ids(pm.config.vocab_size, seed)
            refs[(name, kind)] = _peft_outputs(pm, ids, case["value"], seed + 7)
            paths[name][kind] = str(folder)
            out_shape = refs[(name, kind)][0].shape
            for layout in LAYOUTS:
                save = str(base / name / "ckpt_tp2") if (layout == "tp2" and kind == "shared" and not case["value"]) \
                    else None
                jobs[layout].append(dict(name=f"{name}/{kind}", root=paths[name][layout], adapter=str(folder),
                                         value=case["value"], ids=ids, weights=_weights(out_shape, seed + 7),
                                         save=save))
                if save:
                    paths[name]["ckpt_tp2"] = save
    # mixtures of experts: Qwen3-MoE and DeepSeek-V3 at EP2, DeepSeek's multi-latent attention also at TP2
    moe_jobs = {"ep2": [], "tp2": []}
    for name, family, targets in (("qwen3_moe", "qwen3_moe", MG_TARGETS),
                                  ("deepseek", "deepseek_v3", ["linear_q_down_proj", "linear_q_up_proj",
                                                               "linear_kv_down_proj", "linear_kv_up_proj",
                                                               "linear_proj", "linear_fc1", "linear_fc2"])):
        hf = save_tiny(family, base / name / "hf", seed=30, vocab_size=256)
        paths[name] = {"hf": hf}
        ids = _ids(256, 31)
        for layout, convert, run_targets in (("ep2", dict(tp=1, ep=2), targets),
                                             ("tp2", dict(tp=2), [t for t in targets if "fc" not in t])):
            if name == "qwen3_moe" and layout == "tp2":
                continue
            root = base / name / f"mg_{layout}"
            convert_hf_to_mg(hf, root, progress=False, **convert)
            save = base / name / f"ckpt_{layout}"
            paths[name][layout], paths[name][f"ckpt_{layout}"] = str(root), str(save)
            moe_jobs[layout].append(dict(name=name, root=str(root), ids=ids, moe=True, targets=run_targets,
                                         save=str(save)))
    phase1_jobs = [(layout, (*LAYOUTS[layout], 1), cases) for layout, cases in jobs.items()]
    phase1_jobs += [("moe_ep2", (1, 1, 2), moe_jobs["ep2"]), ("moe_tp2", (2, 1, 1), moe_jobs["tp2"])]
    merged = {"out": {}, "grads": {}, "same": {}, "head": {}, "moe": {}}
    for result in run_distributed(_phase1, 2, phase1_jobs):
        for part, values in result.items():
            for key, value in values.items():
                if isinstance(value, dict):
                    merged[part].setdefault(key, {}).update(value)
                else:
                    merged[part].setdefault(key, value)

    # convert_ckpt.py: merged exports and the PEFT export
    q = paths["qwen2"]
    _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", q["tp1"], "--lora-load",
             os.path.join(q["ckpt_tp2"], "actor"), "--save-dir", base / "merged_hf")
    _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", q["tp1"], "--lora-load",
             os.path.join(q["ckpt_tp2"], "actor"), "--save-lora-to-hf", "--save-dir", base / "exported_peft")
    _convert("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", q["tp2"], "--lora-load", q["indep"],
             "--target-pipeline-parallel-size", "2", "--save-dir", base / "merged_pp2")
    phase2 = {"pp2": [dict(name="merged_indep", root=str(base / "merged_pp2"), ids=jobs["pp2"][0]["ids"]),
                      dict(name="lora_load_resharded", root=q["pp2"], adapter=os.path.join(q["ckpt_tp2"], "actor"),
                           ids=jobs["pp2"][1]["ids"])],
              "ep2": [], "tp2": []}
    for name in ("qwen3_moe", "deepseek"):
        for layout, extra in (("ep2", ["--target-expert-parallel-size", "2"]), ("tp2", ["--target-tensor-parallel-size",
                                                                                       "2"])):
            if f"ckpt_{layout}" not in paths[name]:
                continue
            out = base / name / f"merged_{layout}"
            _convert("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", paths[name][layout],
                     "--lora-load", os.path.join(paths[name][f"ckpt_{layout}"], "actor"), "--save-dir", out, *extra)
            phase2[layout].append(dict(name=name, root=str(out), ids=_ids(256, 31)))
    phase2_jobs = [("pp2", (1, 2, 1), phase2["pp2"]), ("ep2", (1, 1, 2), phase2["ep2"]),
                   ("tp2", (2, 1, 1), phase2["tp2"])]
    second = {}
    for result in run_distributed(_phase2, 2, phase2_jobs):
        for key, value in result.items():
            second.setdefault(key, value)
    return dict(refs=refs, paths=paths, phase1=merged, phase2=second, base=base)


# ------------------------------------------------------------------------------------------- tests
PARITY = [(layout, name, kind) for layout in LAYOUTS for name in CASES for kind in ("indep", "shared")]


@pytest.mark.parametrize("layout,name,kind", PARITY)
def test_logits_match_peft(runs, layout, name, kind):
    ours = runs["phase1"]["out"][(layout, f"{name}/{kind}")]
    ref = runs["refs"][(name, kind)][0]
    diff = (ours - ref).abs().max().item()
    print(f"{name} {kind} at {layout}: max |output - peft| {diff:.2e}")
    assert diff <= TOL, f"{name} {kind} at {layout}: max |output - peft| = {diff:.3g}"
    assert (ref - _no_lora_reference(runs, name)).abs().max() > 0.1  # the adapters act


def _no_lora_reference(runs, name):
    case = CASES[name]
    pm = _peft_model(case, 10 + list(CASES).index(name), shared=False)
    ids = _ids(pm.config.vocab_size, 10 + list(CASES).index(name))
    with torch.no_grad(), pm.disable_adapter():
        if case["value"]:
            return pm.base_model.model.score(pm.base_model.model.model(input_ids=ids).last_hidden_state)
        return pm(input_ids=ids).logits


def _expected_grads(peft_grads, spec_like):
    """peft's gradients in our modules: A shared by q / k / v (gate / up) gets the sum of their A gradients; B is the
    fused rows of theirs."""
    from mindspeed_llm.checkpoint import hf_mapping as hfm

    out = {}
    for index in range(4):
        p, attn, mlp = f"model.layers.{index}.", f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
        q, k, v = (peft_grads[attn + x] for x in ("q_proj", "k_proj", "v_proj"))
        out[f"decoder.layers.{index}.self_attention.linear_qkv"] = (
            q[0] + k[0] + v[0], hfm.fuse_qkv(q[1], k[1], v[1], spec_like))
        out[f"decoder.layers.{index}.self_attention.linear_proj"] = peft_grads[attn + "o_proj"]
        gate, up = peft_grads[mlp + "gate_proj"], peft_grads[mlp + "up_proj"]
        out[f"decoder.layers.{index}.mlp.linear_fc1"] = (gate[0] + up[0], torch.cat([gate[1], up[1]], 0))
        out[f"decoder.layers.{index}.mlp.linear_fc2"] = peft_grads[mlp + "down_proj"]
        del p
    return out


@pytest.mark.parametrize("layout,name", [(layout, name) for layout in LAYOUTS for name in CASES])
def test_adapter_gradients_match_peft(runs, layout, name):
    from mindspeed_llm.checkpoint import load_spec

    spec = load_spec(runs["paths"][name]["tp1"])
    ours = runs["phase1"]["grads"][(layout, f"{name}/shared")]
    _, peft_grads, peft_head = runs["refs"][(name, "shared")]
    expected = _expected_grads(peft_grads, spec)
    assert sorted(ours) == sorted(expected)
    worst = 0.0
    for module, (ga, gb) in expected.items():
        for what, got, ref in (("A", ours[module][0], ga), ("B", ours[module][1], gb)):
            rel = float((got - ref).norm() / ref.norm())
            worst = max(worst, rel)
            assert rel <= GRAD_TOL, f"{name} at {layout}: d{what} of {module} differs by {rel:.2e} of its norm"
    print(f"{name} at {layout}: largest relative gradient difference {worst:.2e}")
    if layout in ("tp2", "tp2_sp"):  # the replicated adapter tensors' gradients are the same on both TP ranks
        same = runs["phase1"]["same"][(layout, f"{name}/shared")]
        assert same and all(same.values()), same
    if CASES[name]["value"]:
        head, replicated = runs["phase1"]["head"][(layout, f"{name}/shared")]
        assert replicated
        rel = float((head - peft_head).norm() / peft_head.norm())
        assert rel <= GRAD_TOL, f"value head gradient at {layout}: {rel:.2e}"


def test_merged_hf_export_matches_peft(runs):
    """--lora-load of the TP2 adapter checkpoint merged into Hugging Face weights: transformers' logits of the merged
    model = peft's logits of the unmerged adapter."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(runs["base"] / "merged_hf", dtype=torch.float32).eval()
    ref = runs["refs"][("qwen2", "shared")][0]
    ids = _ids(merged.config.vocab_size, 10)
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - ref).abs().max().item()
    assert diff <= TOL, diff


def test_peft_export_round_trip(runs):
    """--save-lora-to-hf of the adapter checkpoint gives peft's own adapter back (tensor for tensor, the shared A
    in each of q, k, v and gate, up), and peft loads it onto the base with the same logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = runs["base"] / "exported_peft"
    original = load_file(os.path.join(runs["paths"]["qwen2"]["shared"], "adapter_model.safetensors"))
    written = load_file(exported / "adapter_model.safetensors")
    assert sorted(written) == sorted(original)
    for key in original:
        torch.testing.assert_close(written[key], original[key], rtol=0, atol=0)
    base = AutoModelForCausalLM.from_pretrained(runs["paths"]["qwen2"]["hf"], dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, exported).eval()
    ids = _ids(base.config.vocab_size, 10)
    with torch.no_grad():
        diff = (pm(input_ids=ids).logits - runs["refs"][("qwen2", "shared")][0]).abs().max().item()
    assert diff <= TOL, diff


def test_merged_megatron_and_resharded_lora_load(runs):
    """A PEFT adapter (its own A per q / k / v) merged into a PP2 Megatron checkpoint, and the TP2 adapter
    checkpoint `--lora-load`ed into a PP2 model: both give peft's logits."""
    second = runs["phase2"]
    for name, ref in (("merged_indep", runs["refs"][("qwen2", "indep")][0]),
                      ("lora_load_resharded", runs["refs"][("qwen2", "shared")][0])):
        diff = (second[("pp2", name)] - ref).abs().max().item()
        assert diff <= TOL, f"{name}: {diff:.3g}"


@pytest.mark.parametrize("layout,name", [("ep2", "qwen3_moe"), ("ep2", "deepseek"), ("tp2", "deepseek")])
def test_expert_and_mla_adapters_merged_equal_unmerged(runs, layout, name):
    """Adapters on the experts' (and shared experts') linears at EP2 and on multi-latent attention's projections at
    EP2 and TP2: the model with them equals its checkpoint merged by `convert_ckpt.py --lora-load` (W + s B A)."""
    unmerged, base = runs["phase1"]["moe"][(f"moe_{layout}", name)]
    merged = runs["phase2"][(layout, name)]
    assert (unmerged - base).abs().max() > 0.05  # the adapters act
    diff = (merged - unmerged).abs().max().item()
    assert diff <= TOL, f"{name} at {layout}: merged vs unmerged {diff:.3g}"
