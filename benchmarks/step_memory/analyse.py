"""From the measurements to the JSON's analyses (`analyse`): the fit and its checks, the TP2 check, micro-batching, the
projection, the KV-cache check and the targets."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Dict, List, Sequence

from benchmarks.step_memory.fit import check_fit, fit_model, predict_layer_saved
from benchmarks.step_memory.launch import StateBytes
from benchmarks.step_memory.micro_batching import micro_batch_costs, plan_micro_batch_tokens, skewed_mix
from benchmarks.step_memory.projection import project_launchers
from benchmarks.step_memory.report import ASSUMPTIONS, targets
from benchmarks.step_memory.shapes import Shape


def tp_check(coefs: Dict[str, dict], tp1: List[dict], tp2: List[dict]) -> List[dict]:
    """Measured TP2 saved bytes per token per layer (rank 0) against the TP rule's prediction from the TP1 fit of
    the case's attention, and the replicated / divided split the two measurements give (m1 = r + d, m2 = r + d/2)."""
    by_name = {c["case"]["name"]: c for c in tp1 if "saved" in c}
    out = []
    for c in tp2:
        if "saved" not in c or c["case"]["attention"] not in coefs:
            continue
        shape, mode = Shape(**c["case"]["shape"]), c["case"]["recompute"]
        measured = c["per_layer"]["layer_total"]
        predicted = predict_layer_saved(coefs[c["case"]["attention"]], shape, mode, c["seq"], tp=2)["layer_total"]
        entry = dict(name=c["case"]["name"], attention=c["case"]["attention"], measured_tp2=measured,
                     predicted_tp2=predicted, error=(predicted - measured) / measured if measured else 0.0,
                     peak_tp2=c["peak"])
        ref = by_name.get(c["case"]["name"])
        if ref is not None:
            m1 = ref["per_layer"]["layer_total"]
            entry.update(measured_tp1=m1, replicated=2 * measured - m1, divided=2 * (m1 - measured))
            entry["parts"] = {k: dict(tp1=ref["per_layer"].get(k, 0.0), tp2=c["per_layer"].get(k, 0.0))
                              for k in ("norms", "attention", "mlp", "layer", "checkpoint")}
        out.append(entry)
    return out


def summarize_fit(coefs: Dict[str, dict], cases: List[dict]) -> dict:
    check = check_fit(coefs, cases)
    held = {a: [e for e in check if e["tag"] in ("held_out", "moe_held_out") and e["attention"] == a] for a in coefs}
    return dict(coefficients=coefs, check=check,
                held_out={a: dict(saved=max([abs(e.get("error", 0)) for e in h] or [0.0]),
                                  peak=max([abs(e["peak_error"]) for e in h] or [0.0])) for a, h in held.items()},
                main_max_error=max([abs(e.get("error", 0)) for e in check if e["tag"] == "main"] or [0.0]))


def generic_micro_batching() -> dict:
    """The skewed mix of 256 samples in prompt groups of 8, caps 2048 + 2048, micro-batches of 4 samples and a
    token budget of 4096: computed (`micro_batch_costs`) and measured on `MicroBatchPlan` (by count, by the budget,
    and packed by count with micro-batches of 8 = one prompt group)."""
    prompts, responses = skewed_mix(256, 8, 2048, 2048)
    out = micro_batch_costs(prompts, responses, 8, 4, 4096)
    out["plan"] = {"by_count": plan_micro_batch_tokens(prompts, responses, 8, 4, None),
                   "token_budget": plan_micro_batch_tokens(prompts, responses, 8, 4, 4096),
                   "packed_by_count": plan_micro_batch_tokens(prompts, responses, 8, 8, None)}
    return out


def analyse(data: dict, launchers: Sequence[str]) -> dict:
    """Fit, checks, micro-batching, projection and targets from the measurements in `data`."""
    coefs = fit_model(data["cases"])
    data["fit"] = summarize_fit(coefs, data["cases"])
    if data.get("tp2", {}).get("cases"):
        data["tp2"]["check"] = tp_check(coefs, data["cases"], data["tp2"]["cases"])
    data["micro_batching"] = {"skewed mix (generic)": generic_micro_batching()}
    table = StateBytes.measured(data)
    data["model_state_table"] = asdict(table)
    data["projection"] = project_launchers(coefs, table, launchers) if launchers else {}
    for path, p in data["projection"].items():
        data["micro_batching"][os.path.basename(path)] = p["micro_batching"]
    data["kv_check"] = kv_check(data.get("generate", []))
    data["targets"] = targets(data)
    data["assumptions"] = ASSUMPTIONS
    return data


def kv_check(generations: List[dict]) -> List[dict]:
    """Rollouts that differ only in new tokens: the rise of the peak against megatron's KV-cache sizing."""
    out = []
    for a in generations:
        for b in generations:
            if (a.get("attention"), a["batch"], a["prompt"]) == (b.get("attention"), b["batch"], b["prompt"]) \
                    and b["new_tokens"] > a["new_tokens"]:
                out.append(dict(attention=a.get("attention", "local"), batch=a["batch"], prompt=a["prompt"],
                                new_tokens=(a["new_tokens"], b["new_tokens"]), peak_rise=b["peak"] - a["peak"],
                                kv_cache_rise=b["kv_cache"] - a["kv_cache"]))
    return out
