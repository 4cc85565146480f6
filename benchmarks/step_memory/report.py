"""The text report of a benchmark JSON (`report`), its assumptions (`ASSUMPTIONS`) and the targets checked
(`targets`)."""

from __future__ import annotations

import os
from typing import List

from benchmarks.step_memory.fit import predict_working_set
from benchmarks.step_memory.launch import Levers
from benchmarks.step_memory.shapes import DEVICES_GB, TARGET_TRAIN_GB, Shape


ASSUMPTIONS = [
    "Shapes are the models' config.json values (MODELS); parameter counts computed from them are checked against "
    "the published ones (JSON projection.*.params_counted).",
    "Launcher flags come from running each launcher (its default node count, 8 devices a node) with a stub python "
    "and mindspeed_llm.arguments.parse_args; critic / reward models are value-head models of the same trunk.",
    "Rollout: without --rollout-max-num-seqs all gbs x n / DP rows of a rank are in flight at once; the engine's KV "
    "cache is 2 x layers x (prompt cap + response cap) x rows x kv heads / TP x head dim x 2 B per stage; with N "
    "rows in flight it holds N rows; a prompt's n samples share one prefill, which runs the prompt cap for "
    "ceil(rows / n) prompts at once, or for --rollout-max-num-batched-tokens / prompt cap of them.",
    "A decode step on an accelerator with the local attention adds megatron's repeat_interleave of one layer's K "
    "and V cache to all query heads (the fused attention reads the KV groups in place), and [rows, V] logits x "
    "10 B for sampling; computed, not measured.",
    "Training micro-batches: by count, --micro-batch-size rows at the cap (a micro-batch with a response at the cap "
    "is cut to that width); with a token budget B: B tokens as B / cap rows at the cap (the largest sum of s^2), "
    "every token read (prompts may be short); packed: mbs / n rows of prompt cap + n x response cap.",
    "Pipeline: 1F1B keeps min(PP - stage, micro-batches) micro-batches' saved activations in flight (with a token "
    "budget PP of them); the first and last stages are projected and the larger is reported.",
    "Model state by part (weights, grads, masters, moments) in bytes per parameter as measured (rl/update/model_state."
    "bytes_per_parameter of a real TrainableModel after an Adam step): at DP1 with megatron's optimizer, and with "
    "the distributed optimizer at DP2 on two gloo processes; a part whose DP2 bytes are below 3/4 of the plain "
    "ones is taken as divided by DP (expert DP for experts). Frozen models: the measured frozen bytes per "
    "parameter. --offload-train-*: the parts roles.offload_parts names leave the device from one update to the "
    "next (the measured fraction stays), the critic's weights come back for its values pass; --offload-ref-reward: "
    "a frozen model counts only in its own pass.",
    "Activations per token per layer and working sets come from the fit of each attention at TP1; under TP the "
    "hidden-sized terms stay replicated (no sequence parallelism) and the q / kv / FFN / heads terms divide "
    "(checked at TP2).",
    "Sequence parallelism (--sequence-parallel; computed, not measured): in the update and the passes every "
    "per-token term of the saved bytes (the hidden-sized ones and the per-token scalars too) and the hidden-sized "
    "terms of a layer's working set and of the head's per-token part divide by TP; a layer's working set adds the "
    "bf16 layer input all-gathered over TP for the column-parallel linears (tokens x h, the whole sequence). "
    "Weights and their gradients, the rotary table and token ids are unchanged. Generation runs without it "
    "(the rollout is unchanged).",
    "Context parallelism CP N (--context-parallel-size; computed, not measured): in the update and the passes a "
    "rank holds 1/N of each micro-batch's positions: saved bytes, working sets, the head and its reads per token "
    "/ N. A token budget counts a rank's tokens (arguments._check_token_budgets), so a micro-batch of budget B "
    "holds B x N tokens of rows. Each layer all-gathers its keys and values for the whole rows (rows x S x 2 x "
    "kv heads / TP x head dim x 2 B): kept for the backward by every layer that is not recomputed (counted on "
    "top of the local k and v the fit already holds, an overestimate of 1/N of it); selective recompute "
    "checkpoints the core attention, which gathers inside, and full recompute keeps the layer input only: there "
    "the gather is redone in the backward (two gathered sizes in the working set: the keys and values and their "
    "gradients before the reduce-scatter; one where they are kept). A no-grad pass adds one layer's gather. The "
    "padding of rows to a multiple of 2N is not counted.",
    "Context parallelism in the rollout and the model state: each CP rank generates its own samples as a DP "
    "replica does (prompts dealt over DP x CP, rows a rank gbs x n / (DP x CP)); CP ranks hold whole layers, so "
    "the model state divides by neither, except that the distributed optimizer shards over megatron's dp_cp "
    "group (its divided parts / (DP x CP)). CP takes its ranks from DP at the same world; where DP is 1 already "
    "the world grows to TP x PP x CP devices (the layout column says how many).",
    "The fused attention's fit is of torch's CPU kernel (saves q, k, v, the output and one fp32 log-sum-exp per "
    "query and head); NPU's npu_fusion_attention keeps [b, heads, s, 8] fp32 softmax max and sum instead (60 B more "
    "per token and head), CUDA's flash kernels the log-sum-exp: not measured here.",
    "Mixture of experts: a rank's routed tokens per local token equal top-k on average (balanced routing, "
    "dropless); the all-to-all dispatcher was measured at EP1.",
    "Megatron's global memory buffer (the local attention's [b x heads, s, s] bf16 score target) keeps its largest "
    "size once allocated (prefill or update) and is counted in every phase; the fused attention does not use it.",
    "Optimizer step temporaries, communication buffers, the allocator's fragmentation and the framework's own "
    "workspace are not counted: the 56 GB target leaves 8 GB of a 64 GB device for them.",
    "Skewed mix: 10% of responses at the cap, the rest uniform in 10-50% of it; prompts uniform in 5-15% of the "
    "prompt cap, one per prompt group.",
]


def fmt_gb(x) -> str:
    return "-" if x is None else f"{x:6.1f}"


def print_table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(str(h).ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _state_text(run: dict) -> str:
    if "bytes_per_param" not in run:
        return f"did not run ({run.get('error', 'not measured')[:160]})"
    return ", ".join(f"{k} {v:.2f}" for k, v in run["bytes_per_param"].items())


def _lever_table(entries: List[dict]) -> str:
    rows = []
    for r in entries:
        worst = max(r["rollout_gb"], r["passes_gb"], r["train_gb"])
        fits = "/".join(str(gb) for gb in DEVICES_GB.values() if worst <= gb) or "neither"
        bound = "" if r["activations_described"] else ">="
        lay = r["layout"]
        where = f"TP{lay['tp']} PP{lay['pp']} CP{lay.get('cp', 1)} DP{lay['dp']} ({lay.get('world', '?')})"
        rows.append([r["label"], where, bound + fmt_gb(r["rollout_gb"]).strip(),
                     bound + fmt_gb(r["passes_gb"]).strip(), bound + fmt_gb(r["train_gb"]).strip(),
                     fmt_gb(r["rollout_states_gb"]).strip(), fmt_gb(r["train_states_gb"]).strip(),
                     "yes" if worst <= TARGET_TRAIN_GB else "no", fits])
    return print_table(rows, ["levers", "layout (devices)", "rollout GB", "passes GB", "train GB", "state@rollout",
                              "state@train", f"all<={TARGET_TRAIN_GB}", "fits GB"])


def report(data: dict) -> str:
    out = []
    cases = [c for c in data["cases"] if c["case"]["tag"] in ("main", "packed")]
    rows = []
    for c in cases:
        name = c["case"]["name"].split(" h")[0]
        if "saved" not in c:
            rows.append([name, "-", "-", "-", "-", "-", "-", c.get("skipped") or c.get("error", "")])
            continue
        pl = c["per_layer"]
        rows.append([name, c["tokens"], f"{pl['layer_total']:.0f}", f"{pl.get('attention', 0):.0f}",
                     f"{c['peak'] / 2**20:.0f}", f"{c['global_buffer'] / 2**20:.0f}",
                     f"{c['time_s']:.1f}" if "time_s" in c else "-", c.get("measured_on", "")])
    out.append("Measured (" + data["meta"]["shape_text"] + "):")
    out.append(print_table(rows, ["case", "tokens", "saved B/tok/layer", "of it attention", "peak MiB",
                                  "buffer MiB", "time s", "measured"]))
    checks = data.get("peak_check", {})
    scripted = checks.get("scripted", {})
    out.append(f"\nPeak method: a scripted sequence {scripted.get('measured')} B measured, "
               f"{scripted.get('expected')} B expected")
    for key, label in (("rss", "glibc's default"), ("rss_fixed_mmap_threshold", "MALLOC_MMAP_THRESHOLD_=131072")):
        rss = checks.get(key)
        if rss and "rss_rise" in rss:
            out.append(f"  RSS of a fresh process over one step ({rss['case'].split(' h')[0]}, {label}): rises "
                       f"{rss['rss_rise'] / 2**20:.0f} MiB, the profiler's peak {rss['profiler_peak'] / 2**20:.0f} MiB "
                       f"({100 * (rss['rss_rise'] / rss['profiler_peak'] - 1):+.0f}%)")
    fit = data["fit"]
    out.append("\nFit check (saved per token per layer; peak of the step), by the fit of the case's attention:")
    rows = [[e["name"].split(" L")[0], e["tag"], f"{e.get('saved_per_layer_token', 0):.0f}",
             f"{e.get('predicted', 0):.0f}", f"{100 * e.get('error', 0):+.1f}%", f"{e['peak'] / 2**20:.0f}",
             f"{e['predicted_peak'] / 2**20:.0f}", f"{100 * e['peak_error']:+.1f}%"]
            for e in fit["check"] if e["tag"] in ("main", "held_out", "moe_held_out", "packed")]
    out.append(print_table(rows, ["case", "tag", "measured", "fit", "err", "peak MiB", "fit MiB", "err"]))
    for attention, errors in fit["held_out"].items():
        out.append(f"{attention}: held-out max |error| saved {100 * errors['saved']:.1f}%, "
                   f"peak {100 * errors['peak']:.1f}%")
    if data.get("tp2", {}).get("check"):
        out.append("\nTP2 (2 gloo processes, rank 0) against the TP rule:")
        rows = [[e["name"].split(" h")[0], f"{e.get('measured_tp1', 0):.0f}", f"{e['measured_tp2']:.0f}",
                 f"{e['predicted_tp2']:.0f}", f"{100 * e['error']:+.1f}%", f"{e.get('replicated', 0):.0f}",
                 f"{e.get('divided', 0):.0f}"] for e in data["tp2"]["check"]]
        out.append(print_table(rows, ["case", "TP1", "TP2", "TP2 fit", "err", "replicated", "divided"]))
    elif data.get("tp2", {}).get("error"):
        out.append("\nTP2 did not run: " + data["tp2"]["error"][-300:])
    if data.get("generate"):
        out.append("\nRollout (generate, static KV cache; peak vs KV cache + the no-grad forward fit + buffer):")
        rows = []
        coefs = data["fit"]["coefficients"]
        for g in data["generate"]:
            shape, attention = Shape(**g["shape"]), g.get("attention", "local")
            if attention not in coefs:
                continue
            buffer = g["batch"] * shape.heads * g["prompt"] ** 2 * 2 if attention == "local" else 0
            fit_bytes = (predict_working_set(coefs[attention], shape, "forward", "none", g["prompt"], g["batch"])
                         + buffer + g["kv_cache"])
            rows.append([attention, g["batch"], g["prompt"], g["new_tokens"], f"{g['kv_cache'] / 2**20:.1f}",
                         f"{g['peak'] / 2**20:.1f}", f"{fit_bytes / 2**20:.1f}",
                         f"{100 * (fit_bytes - g['peak']) / g['peak']:+.1f}%"])
        out.append(print_table(rows, ["attention", "rows", "prompt", "new", "KV MiB", "peak MiB", "fit MiB", "err"]))
        for k in data.get("kv_check", []):
            out.append(f"KV check ({k['attention']}): {k['new_tokens'][0]} -> {k['new_tokens'][1]} new tokens: peak "
                       f"rises {k['peak_rise'] / 2**20:.2f} MiB, megatron's KV sizing {k['kv_cache_rise'] / 2**20:.2f}"
                       " MiB")
    ms = data["model_state"]
    states = (data.get("tp2") or {}).get("model_state") or {}
    out.append("\nModel state, bytes per parameter (measured, rl/update/model_state.bytes_per_parameter):")
    out.append(f"  DP1, megatron's optimizer: {_state_text(ms)}; frozen {ms['frozen_bytes_per_param']:.2f}")
    out.append(f"  DP1, distributed optimizer: {_state_text(data.get('model_state_distributed_optimizer_dp1', {}))}")
    for key, label in (("dp2", "DP2, megatron's optimizer"),
                       ("distributed_optimizer_dp2", "DP2, distributed optimizer")):
        if key in states:
            out.append(f"  {label}: {_state_text(states[key])}")
    for source, run in (("DP1", ms), ("DP2 dist-opt", states.get("distributed_optimizer_dp2", {}))):
        for name, entry in (run.get("offloaded") or {}).items():
            left = entry["on_device_during_rollout"]
            out.append(f"  {source} {name}: on the device during the rollout " + ", ".join(
                f"{k} {v:.2f}" for k, v in left.items()) + " B/param")
    out.append(f"  projection's table: {data['model_state_table']['source']}")
    out.append("\nMicro-batches at the skewed mix (processed / real tokens, attention work / real):")
    rows = []
    for name, mb in data["micro_batching"].items():
        if not mb:
            continue
        for mode in ("padded", "by_count", "token_budget", "packed_by_count", "packed_token_budget"):
            if mode in mb:
                rows.append([name, mode, "computed", f"{mb[mode]['tokens_ratio']:.2f}x",
                             f"{mb[mode]['attention_ratio']:.2f}x", mb[mode]["largest_micro_batch_tokens"]])
        for mode, plan in (mb.get("plan") or {}).items():
            rows.append([name, mode, "MicroBatchPlan", f"{plan['tokens_ratio']:.2f}x", "-",
                         plan["largest_micro_batch_tokens"]])
    out.append(print_table(rows, ["batch", "micro-batches", "how", "tokens", "attention", "largest mb tokens"]))
    for path, p in data["projection"].items():
        ep = f" EP{p['ep']}" if p["ep"] > 1 else ""
        out.append(f"\n{path}: {p['model']} {p['stage']}, world {p['world']} = TP{p['tp']} PP{p['pp']} "
                   f"DP{p['dp']}{ep}, rollout rows/rank {p['rollout_rows']}, mbs {p['micro_batch_size']}, caps "
                   f"{p['prompt_cap']}+{p['response_cap']} (params {p['params_counted'] / 1e9:.2f}B, published "
                   f"{p['params_published'] / 1e9:.2f}B)" + (" -- model state only (activations not described)"
                                                             if p["state_only"] else ""))
        out.append(_lever_table(p["rows"]))
        if p.get("long_response"):
            c = p["long_response"]["config"]
            out.append(f"long-response config (prompt {c['prompt_cap']}, --max-new-tokens {c['response_cap']} "
                       f"--max-length {c['max_length']}):")
            out.append(_lever_table(p["long_response"]["rows"]))
        rec = p["recommended"]
        if rec:
            out.append(f"recommended (<= {TARGET_TRAIN_GB} GB in every phase): {rec['label']}\n  flags: "
                       + (" ".join(rec["flags"]) or "nothing") + f"\n  -> rollout {rec['rollout_gb']:.1f}, passes "
                       f"{rec['passes_gb']:.1f}, train {rec['train_gb']:.1f} GB"
                       + (f" ({'; '.join(rec['notes'])})" if rec["notes"] else ""))
    out.append("\nTargets:")
    for t in data["targets"]:
        out.append(f"  [{t['status']}] {t['target']}: {t['measured']}")
    out.append("\nAssumptions:")
    out += [f"  - {a}" for a in data["assumptions"]]
    return "\n".join(out)


def targets(data: dict) -> List[dict]:
    """The project's targets, with what was measured or projected (met / not met / pending)."""
    out = []
    for path in ("examples/mcore/qwen25/ppo_qwen25_32b.sh", "examples/mcore/qwen25/grpo_qwen25_7b.sh"):
        p = data["projection"].get(path)
        if p is None:
            continue
        launched = p["rows"][0]
        out.append(dict(target=f"{os.path.basename(path)} training peak <= {TARGET_TRAIN_GB} GB per device",
                        status="met" if launched["train_gb"] <= TARGET_TRAIN_GB else "not met",
                        measured=f"as launched ({Levers(**launched['levers']).label()}): train "
                                 f"{launched['train_gb']:.1f}, rollout {launched['rollout_gb']:.1f}, passes "
                                 f"{launched['passes_gb']:.1f} GB; recommended {p['recommended']['train_gb']:.1f} GB"))
    sdpa = sorted((c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["attention"] == "sdpa"
                   and c["case"]["recompute"] == "none" and c["case"]["kind"] == "train" and "saved" in c),
                  key=lambda c: c["seq"])
    if len(sdpa) >= 2:
        per_token = [c["per_layer"]["attention"] for c in sdpa]
        linear = max(per_token) <= 1.05 * min(per_token)
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s",
                        status="met" if linear else "not met",
                        measured="attention B/token/layer at s = " + ", ".join(
                            f"{c['seq']}: {x:.0f}" for c, x in zip(sdpa, per_token))
                                 + " (constant per token = linear per layer)"))
    else:
        out.append(dict(target="with SDPA, attention's saved bytes per layer grow linearly with s",
                        status="pending", measured="fewer than two SDPA lengths measured"))
    full = [c for c in data["cases"] if c["case"]["tag"] == "main" and c["case"]["recompute"] == "full"
            and c["case"]["kind"] == "train" and "saved" in c]
    if full:
        h = full[0]["case"]["shape"]["hidden"]
        worst = max(c["per_layer"]["layer_total"] for c in full)
        out.append(dict(target="full recompute keeps at most about 2*H bytes per token per layer",
                        status="met" if worst <= 2.05 * h else "not met",
                        measured=f"{worst:.1f} B/token/layer = {worst / h:.3f} H (H = {h}, {len(full)} cases); shared "
                                 "per micro-batch (rotary table, mask, token ids) counted apart"))
    generic = data["micro_batching"].get("skewed mix (generic)")
    if generic:
        plan = generic.get("plan", {}).get("token_budget")
        ratio = plan["tokens_ratio"] if plan else generic["token_budget"]["tokens_ratio"]
        out.append(dict(target="token-budget micro-batches process <= 1.2x the real tokens at the skewed mix",
                        status="met" if ratio <= 1.2 else "not met",
                        measured=f"MicroBatchPlan with max_tokens {generic['budget']}: {ratio:.2f}x (by count "
                                 f"{generic['by_count']['tokens_ratio']:.2f}x, padded to the batch's longest "
                                 f"{generic['padded']['tokens_ratio']:.2f}x)"))
    for path, p in data["projection"].items():
        launched = p["rows"][0]
        worst = max(launched["rollout_gb"], launched["passes_gb"], launched["train_gb"])
        out.append(dict(target=f"{os.path.basename(path)} fits {TARGET_TRAIN_GB} GB in every phase as launched",
                        status="met" if worst <= TARGET_TRAIN_GB and launched["activations_described"] else "not met",
                        measured=f"rollout {launched['rollout_gb']:.1f}, passes {launched['passes_gb']:.1f}, train "
                                 f"{launched['train_gb']:.1f} GB" + ("" if launched["activations_described"] else
                                                                      " (model state alone: a lower bound)")))
    return out
