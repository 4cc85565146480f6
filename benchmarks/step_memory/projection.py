"""The projection of a launcher per device and phase (`project`), the flags of a lever setting (`lever_flags`), the
cheapest levers that fit (`recommend`), the rows of the lever table (`lever_rows`, `long_response_rows`) and every
launcher's (`project_launchers`)."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.step_memory.fit import (
    predict_head, predict_layer_saved, predict_peak, predict_working_set, shared_bytes,
)
from benchmarks.step_memory.launch import (
    Launch, layouts, Levers, micro_batch_shape, model_states, param_counts, read_launcher, StateBytes, with_layout,
)
from benchmarks.step_memory.micro_batching import micro_batch_costs, skewed_mix
from benchmarks.step_memory.shapes import ACCELERATOR, GB, LAUNCHERS, MODELS, TARGET_TRAIN_GB, model_shape


def project(launch: Launch, coefs: Dict[str, dict], levers: Levers, table: StateBytes) -> dict:
    """Per-device bytes of each phase at the worst pipeline stage: the rollout (model states + KV cache of the rows
    in flight + the prefill's or a decode step's working set), the forward-only passes (states + one micro-batch's
    forward working set) and the update (states + the micro-batches in flight under 1F1B + one backward's working
    set), by the fit of the levers' attention. A launcher whose activations are not described (`state_only`) gets
    its model states alone (a lower bound). Sequence parallelism divides the update's and the passes' hidden-sized
    activations by TP as well (the rollout runs without it); context parallelism CP gives a rank 1/CP of each
    micro-batch's tokens, plus the keys and values of the whole rows that each layer all-gathers (`kv_gathered`),
    and 1/CP of the rollout's rows (computed, not measured: `assumptions`)."""
    launch = with_layout(launch, levers)
    coef = coefs.get(levers.attention)
    local = levers.attention == "local"
    policy = launch.roles[0].shape
    stages = sorted({0, launch.pp - 1})
    sp, cp = levers.sequence_parallel and launch.tp > 1, launch.cp
    result = dict(levers=asdict(levers), label=levers.label(), stages={},
                  layout=dict(tp=launch.tp, pp=launch.pp, ep=launch.ep, dp=launch.dp, expert_dp=launch.expert_dp,
                              cp=cp, world=launch.world),
                  activations_described=not launch.state_only and coef is not None)
    for stage in stages:
        layers = policy.layers // launch.pp
        last = stage == launch.pp - 1
        states = model_states(launch, levers, table, stage)
        update_states = max(sum(v.values()) for k, v in states.items() if k.startswith("update."))
        phases = {"rollout": dict(states=sum(states["rollout"].values())),
                  "passes": dict(states=sum(states["passes"].values())),
                  "train": dict(states=update_states)}
        entry = dict(phases=phases, states_by_role=states)
        if result["activations_described"]:
            # rollout: KV cache of this stage's layers for the rows in flight, + the prefill or a decode step
            rows = min(levers.rollout_max_num_seqs or launch.rollout_rows, launch.rollout_rows)
            prompts = max(1, math.ceil(rows / launch.n_samples))  # a prompt's samples share one prefill
            if levers.rollout_max_num_batched_tokens:  # the engine prefills at most that many tokens at once
                prompts = min(prompts, max(1, levers.rollout_max_num_batched_tokens // launch.prompt_cap))
            slots = launch.prompt_cap + launch.response_cap
            kv_heads = max(1, policy.kv_heads // launch.tp)
            kv_cache = 2 * layers * slots * rows * kv_heads * policy.head_dim * 2
            prefill = predict_working_set(coef, policy, "forward", "none", launch.prompt_cap, prompts, launch.tp)
            prefill_buffer = prompts * policy.heads / launch.tp * launch.prompt_cap ** 2 * 2 if local else 0.0
            # a decode step: with the local attention megatron repeat_interleaves one layer's K and V cache to all
            # query heads on accelerators (the CPU patch that avoids it is CPU-only; the fused attention reads the
            # groups in place); sampling reads [rows, V] logits (bf16, an fp32 copy, probabilities)
            decode = ((2 * slots * rows * (policy.heads // launch.tp) * policy.head_dim * 2 if local else 0.0)
                      + (rows * policy.vocab * 10 if last else 0.0))
            # passes: one forward-only micro-batch (no grad)
            f_rows, f_len, f_read = micro_batch_shape(launch, levers, levers.forward_micro_batch_tokens
                                                      or levers.micro_batch_tokens)
            passes = predict_peak(coef, policy, "none", f_len, f_rows / cp, f_read / cp, kind="forward",
                                  tp=launch.tp, layers=layers, head=last, attention=levers.attention,
                                  device_type=ACCELERATOR, sp=sp)
            kv_width = max(1, policy.kv_heads // launch.tp) * policy.head_dim
            # CP: one layer's keys and values all-gathered for its whole rows (bf16): transient in a no-grad pass
            passes_gathered = f_rows * f_len * 2 * kv_width * 2 if cp > 1 else 0.0
            # update: micro-batches in flight on this stage under 1F1B, each with its saved activations
            mb_rows, mb_len, read = micro_batch_shape(launch, levers, levers.micro_batch_tokens)
            micro_batches = (max(1, launch.mini_batch // launch.dp // launch.micro_batch_size)
                             if levers.micro_batch_tokens is None else launch.pp)  # a budget: at least PP, say
            in_flight = min(launch.pp - stage, micro_batches)
            full_layers = (layers if levers.recompute_layers is None else min(layers, levers.recompute_layers)) \
                if levers.recompute == "full" else 0
            other = levers.recompute if levers.recompute != "full" else "none"
            tokens = mb_rows * mb_len / cp  # this rank's: 1/CP of each row's positions
            per_token = {mode: predict_layer_saved(coef, policy, mode, mb_len, launch.tp, sp)["layer_total"]
                         for mode in (other, "full")}
            saved = tokens * ((layers - full_layers) * per_token[other] + full_layers * per_token["full"])
            saved += shared_bytes(policy, mb_rows / cp, mb_len, levers.layout == "packed", levers.attention)
            # CP: a layer's keys and values all-gathered for the whole rows (bf16), saved by the core attention for
            # its backward where it is not recomputed; selective recompute checkpoints the core attention, which
            # gathers inside, and full recompute keeps the layer input only: there the gather is redone in the
            # backward (transient, with its gradient before the reduce-scatter)
            gathered = mb_rows * mb_len * 2 * kv_width * 2 if cp > 1 else 0.0
            kv_kept_layers = layers - full_layers if other == "none" else 0
            saved += kv_kept_layers * gathered
            candidates = []
            if layers - full_layers:
                candidates.append(predict_working_set(coef, policy, "train", other, mb_len, mb_rows / cp, launch.tp,
                                                      sp) + gathered * (1 if other == "none" else 2))
            if full_layers:  # a recomputed layer's backward: its recomputed saved set + the backward's working set
                candidates.append(predict_working_set(coef, policy, "train", "full", mb_len, mb_rows / cp,
                                                      launch.tp, sp) + 2 * gathered)
            if last:
                saved += predict_head(coef, "head_saved", policy, tokens, read / cp, launch.tp, sp=sp)
                candidates += [predict_head(coef, f"head_{way}.train", policy, tokens, read / cp, launch.tp,
                                            ACCELERATOR, sp=sp) for way in ("backward", "forward")]
            train_buffer = mb_rows * policy.heads / launch.tp * mb_len ** 2 * 2 if local else 0.0
            buffer = max(prefill_buffer, train_buffer, passes["global_buffer"])  # megatron's, kept once allocated
            phases["rollout"].update(kv_cache=kv_cache, working_set=max(prefill, decode), global_buffer=buffer)
            phases["passes"].update(working_set=passes["transient"] + passes_gathered, global_buffer=buffer)
            phases["train"].update(activations_in_flight=in_flight * saved, in_flight=in_flight,
                                   working_set=max(candidates), global_buffer=buffer)
            entry.update(kv_gathered=dict(per_layer=gathered, kept_layers=kv_kept_layers))
            entry.update(prefill=prefill, decode=decode, rollout_rows=rows,
                         micro_batch=dict(rows=mb_rows, length=mb_len, read=read),
                         forward_micro_batch=dict(rows=f_rows, length=f_len, read=f_read))
        for phase in phases.values():
            phase["total"] = sum(v for k, v in phase.items() if k != "in_flight")
        result["stages"][stage] = entry
    for phase in ("rollout", "passes", "train"):
        result[phase] = max(result["stages"][s]["phases"][phase]["total"] for s in stages)
        result[f"{phase}_states"] = max(result["stages"][s]["phases"][phase]["states"] for s in stages)
    return result


def lever_flags(launch: Launch, levers: Levers) -> List[str]:
    """The command-line flags of `levers`, and the layout variables of the launchers."""
    layers = launch.roles[0].shape.layers // (levers.pipeline_parallel or launch.pp)
    out = []
    if levers.attention == "local":
        out.append("--attention-backend local")
    if levers.recompute == "selective":
        out.append("--recompute-granularity selective")
    elif levers.recompute == "full":
        k = levers.recompute_layers or layers
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" if k >= layers
                   else f"--recompute-granularity full --recompute-method block --recompute-num-layers {k}")
    if levers.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    out += [f"--offload-train-{f}" for f in levers.offload_flags]
    if levers.offload_ref_reward:
        out.append("--offload-ref-reward")
    if levers.micro_batch_tokens:
        out.append(f"--max-tokens-per-micro-batch {levers.micro_batch_tokens}")
    if levers.forward_micro_batch_tokens:
        out.append(f"--forward-max-tokens-per-micro-batch {levers.forward_micro_batch_tokens}")
    if levers.rollout_max_num_seqs:
        out.append(f"--rollout-max-num-seqs {levers.rollout_max_num_seqs}")
    if levers.rollout_max_num_batched_tokens:
        out.append(f"--rollout-max-num-batched-tokens {levers.rollout_max_num_batched_tokens}")
    if levers.pipeline_parallel and levers.pipeline_parallel != launch.pp:
        out.append(f"PP={levers.pipeline_parallel}")
    if levers.expert_parallel and levers.expert_parallel != launch.ep:
        out.append(f"EP={levers.expert_parallel}")
    if levers.sequence_parallel:
        out.append("--sequence-parallel")
    if (levers.context_parallel or launch.cp) > 1:
        out.append(f"--context-parallel-size {levers.context_parallel or launch.cp}")
    world = with_layout(launch, levers).world
    if world != launch.world:  # CP without the devices to take from DP (8 a node, launch_env.sh)
        out.append(f"NNODES={world // 8}" if world % 8 == 0 else f"{world} devices")
    return out


# The recommendation's headroom for the fit: a phase fits when its model state plus its other bytes (KV cache,
# activations, working sets, buffers) with this share added stay within the limit (the fit's peaks are within
# about +-10% at the main shape; see the fit check)
FIT_MARGIN = 0.10


def _fits(p: dict, limit: float, phases=("rollout", "passes", "train")) -> bool:
    return all(p[ph] + FIT_MARGIN * (p[ph] - p[f"{ph}_states"]) <= limit for ph in phases)


def _padding_ratio(launch: Launch, budget: Optional[int]) -> float:
    """Processed / real tokens of the update's micro-batches at the skewed mix of the launcher's rollout (by count
    when `budget` is None)."""
    launch_prompts, responses = skewed_mix(launch.rollout_rows, launch.n_samples, launch.prompt_cap,
                                           launch.response_cap)
    costs = micro_batch_costs(launch_prompts, responses, launch.n_samples, launch.micro_batch_size,
                              budget or launch.prompt_cap + launch.response_cap)
    return costs["by_count" if budget is None else "token_budget"]["tokens_ratio"]


def recommend(launch: Launch, coefs: Dict[str, dict], table: StateBytes, limit_gb: float = TARGET_TRAIN_GB) -> dict:
    """The cheapest levers under which the update, the passes and the rollout each fit `limit_gb` (with the fit's
    headroom, `FIT_MARGIN`), with the fused
    attention and the distributed optimizer wherever DP > 1 (no extra communication volume): at the launcher's
    layout first, then other (PP, EP) layouts (`layouts`). Cheapest first: recompute (none, selective, full of k
    layers per stage, smallest k first) outside, model-state offload inside (nothing, --offload-ref-reward, the
    --offload-train-* flags too), for the update and the passes at one row at the cap; then the largest token
    budget (4, 2 or 1 rows at the cap) that keeps the update within the limit and the largest forward budget
    (8 .. 1 rows) for the passes (a budget that pads more than micro-batches by count is not taken); then the
    rollout: all rows at once, with the offloads chosen, then with every --offload-train-* flag, then with the rows
    in flight halving (--rollout-max-num-seqs)."""
    limit = limit_gb * GB
    cap = launch.prompt_cap + launch.response_cap
    notes: List[str] = []
    state_options = [dict(offload_ref_reward=launch.levers.offload_ref_reward)]
    if any(r.offloadable for r in launch.roles) and not launch.levers.offload_ref_reward:
        state_options.append(dict(offload_ref_reward=True))
    state_options.append(dict(state_options[-1], offload_optimizer=True, offload_grad=True, offload_param=True))
    chosen = None
    for pp, ep in layouts(launch):
        lay = with_layout(launch, Levers(pipeline_parallel=pp, expert_parallel=ep))
        layers = launch.roles[0].shape.layers // pp
        ladder = [dict(recompute="none"), dict(recompute="selective")] + [
            dict(recompute="full", recompute_layers=k if k < layers else None) for k in range(1, layers + 1)]
        base = dict(attention="sdpa", distributed_optimizer=launch.levers.distributed_optimizer or lay.dp > 1
                    or lay.expert_dp > 1,
                    micro_batch_tokens=cap, forward_micro_batch_tokens=cap,
                    pipeline_parallel=pp if pp != launch.pp else None, expert_parallel=ep if ep != launch.ep else None)
        for rc in ladder:
            for state in state_options:
                levers = Levers(**base, **rc, **state)
                if _fits(project(launch, coefs, levers, table), limit, ("passes", "train")):
                    chosen = levers
                    break
            if chosen:
                break
        if chosen:
            if (pp, ep) != (launch.pp, launch.ep):
                notes.append(f"does not fit at the launcher's layout (PP{launch.pp} EP{launch.ep}); fits at PP{pp} "
                             f"EP{ep}")
            break
    if chosen is None:
        notes.append(f"the update does not fit {limit_gb:g} GB at any layout with these levers")
        chosen = Levers(attention="sdpa", distributed_optimizer=True, recompute="full", offload_ref_reward=True,
                        offload_optimizer=True, offload_grad=True, offload_param=True, micro_batch_tokens=cap,
                        forward_micro_batch_tokens=cap)
    # budgets of at most 4 (update) / 8 (passes) rows at the cap: beyond that fewer, larger micro-batches save
    # little and only take the margin; a budget that pads more than 1.2x (or than micro-batches by count) at the
    # skewed mix is not taken (a few samples in one budget micro-batch are padded to their longest); a budget of
    # one row at the cap only replaces micro-batches of one sample (it lets short samples share one), or is the
    # last resort where micro-batches by count do not fit
    padding = max(1.2, _padding_ratio(launch, None))
    for key, phase, sizes in (("micro_batch_tokens", "train", (4, 2)),
                              ("forward_micro_batch_tokens", "passes", (8, 4, 2))):
        options = [rows * cap for rows in sizes if _padding_ratio(launch, rows * cap) <= padding]
        options += ([cap] if launch.micro_batch_size == 1 else []) + [None, cap]
        for budget in options:
            candidate = replace(chosen, **{key: budget})
            if _fits(project(launch, coefs, candidate, table), limit, (phase,)):
                chosen = candidate
                break
    # the rollout: all rows at once, with the training state's offload if needed, then fewer rows in flight
    total = with_layout(launch, chosen).rollout_rows
    offload = dict(offload_optimizer=True, offload_grad=True, offload_param=True)
    found = None
    for option, rows in [(dict(), None), (offload, None)] + [(offload, r) for r in
                                                             (total // 2 ** k for k in range(1, 12)) if r >= 1]:
        candidate = replace(chosen, **option, rollout_max_num_seqs=rows)
        if _fits(project(launch, coefs, candidate, table), limit, ("rollout",)):
            found = candidate
            break
    if found is None:
        notes.append(f"the rollout does not fit {limit_gb:g} GB even one row at a time")
    else:
        chosen = found
    p = project(launch, coefs, chosen, table)
    return dict(levers=asdict(chosen), label=chosen.label(), flags=lever_flags(launch, chosen),
                rollout_gb=p["rollout"] / GB, passes_gb=p["passes"] / GB, train_gb=p["train"] / GB, notes=notes)


def lever_rows(launch: Launch, recommended: Levers) -> List[Tuple[str, Levers]]:
    """The projection's rows: as launched, each lever flipped from there, the recommendation (and each of its
    levers taken back, where it differs from the launcher)."""
    base = launch.levers
    cap = launch.prompt_cap + launch.response_cap
    rows = [("as launched", base)]
    flips = [
        ("attention " + ("local" if base.attention == "sdpa" else "sdpa"),
         dict(attention="local" if base.attention == "sdpa" else "sdpa")),
        ("no recompute", dict(recompute="none", recompute_layers=None)),
        ("recompute selective", dict(recompute="selective", recompute_layers=None)),
        ("recompute full", dict(recompute="full", recompute_layers=None)),
        ("dist-opt " + ("off" if base.distributed_optimizer else "on"),
         dict(distributed_optimizer=not base.distributed_optimizer)),
        ("offload-train " + ("off" if base.offload_flags else "on (optimizer, grad, param)"),
         dict(offload_optimizer=not base.offload_flags, offload_grad=not base.offload_flags,
              offload_param=not base.offload_flags)),
        ("offload-ref " + ("off" if base.offload_ref_reward else "on"),
         dict(offload_ref_reward=not base.offload_ref_reward)),
        ("micro-batches by count" if base.micro_batch_tokens else "token budget = 1 row at the cap",
         dict(micro_batch_tokens=None, forward_micro_batch_tokens=None) if base.micro_batch_tokens
         else dict(micro_batch_tokens=cap)),
        ("token budget x2", dict(micro_batch_tokens=2 * (base.micro_batch_tokens or cap))),
        ("rollout rows in flight / 2", dict(rollout_max_num_seqs=max(1, (base.rollout_max_num_seqs
                                                                         or launch.rollout_rows) // 2))),
        ("rollout rows in flight / 4", dict(rollout_max_num_seqs=max(1, (base.rollout_max_num_seqs
                                                                         or launch.rollout_rows) // 4))),
    ]
    if launch.n_samples > 1 and base.layout == "row":
        flips.append((f"packed prompt groups (mbs {launch.n_samples})", dict(layout="packed")))
    if launch.tp > 1 and not base.sequence_parallel:
        flips.append(("+ sequence parallel", dict(sequence_parallel=True)))
    # CP needs the fused attention (arguments.py) and refuses a mixture of experts (rl/update/moe.model_options); it takes
    # its ranks from DP, or more devices where DP is 1 already (`with_layout`)
    if launch.cp == 1 and base.attention == "sdpa" and not launch.roles[0].shape.experts:
        cp_dp = launch.world // (launch.tp * launch.pp * 2)
        where = f"DP{cp_dp}" if cp_dp else f"{launch.tp * launch.pp * 2} devices, DP1"
        flips.append((f"+ CP 2 ({where})", dict(context_parallel=2)))
        if base.micro_batch_tokens:  # a budget counts a rank's tokens: halved, a micro-batch holds the same rows
            flips.append((f"+ CP 2 ({where}), budgets / 2", dict(
                context_parallel=2, micro_batch_tokens=max(-(-cap // 2), base.micro_batch_tokens // 2),
                forward_micro_batch_tokens=max(-(-cap // 2), (base.forward_micro_batch_tokens
                                                              or base.micro_batch_tokens) // 2))))
    if launch.state_only:  # the model state's levers only
        flips = [f for f in flips if f[0].startswith(("dist-opt", "offload"))]
    for label, change in flips:
        levers = replace(base, **change)
        if levers != base:
            rows.append((label, levers))
    if recommended != base:
        rows.append(("recommended", recommended))
    return rows


# The long-response config: the launcher at a 16k response (prompt 2048, --max-new-tokens 16384 --max-length 18432)
LONG_RESPONSE = dict(prompt_cap=2048, response_cap=16384, max_length=18432)
LONG_RESPONSE_LAUNCHERS = ("examples/mcore/qwen25/grpo_qwen25_7b.sh", "examples/mcore/qwen25/ppo_qwen25_32b.sh")


def long_response_rows(launch: Launch) -> Tuple[Launch, List[Tuple[str, Levers]]]:
    """The launcher at `LONG_RESPONSE`, and its rows: as launched (its token budgets raised to one row where they
    are below it: `arguments._check_token_budgets` refuses them), + sequence parallelism, + SP + CP 2 (budgets one
    row's share of a rank), then what it needs to fit `TARGET_TRAIN_GB` (fewer rollout rows in flight; full
    recompute for the update's margin)."""
    long = replace(launch, **LONG_RESPONSE)
    n = long.n_samples
    width = long.prompt_cap + (n if launch.levers.layout == "packed" else 1) * long.response_cap
    base = launch.levers

    def budgets(levers: Levers, cp: int) -> Levers:
        row = -(-width // cp)
        return replace(levers, micro_batch_tokens=max(levers.micro_batch_tokens, row)
                       if levers.micro_batch_tokens else None,
                       forward_micro_batch_tokens=max(levers.forward_micro_batch_tokens, row)
                       if levers.forward_micro_batch_tokens else None)

    launched = budgets(base, 1)
    sp = replace(launched, sequence_parallel=long.tp > 1)
    cp2 = budgets(replace(sp, context_parallel=2, micro_batch_tokens=-(-width // 2) if base.micro_batch_tokens
                          else None), 2)
    rows = [("as launched at 16k" + (" (budgets raised to one row)" if launched != base else ""), launched),
            ("+ sequence parallel", sp), ("+ SP + CP 2", cp2)]
    # the rollout's KV cache grows with the response: fewer rows in flight (of a rank's rows at CP 2)
    in_flight = int(min(base.rollout_max_num_seqs or math.inf, with_layout(long, cp2).rollout_rows))
    for k in (2, 4):
        rows.append((f"+ SP + CP 2, rollout rows in flight / {k} ({max(1, in_flight // k)})",
                     replace(cp2, rollout_max_num_seqs=max(1, in_flight // k))))
    rows.append(("+ SP + CP 2 + full recompute, rollout rows in flight / 2",
                 replace(cp2, recompute="full", recompute_layers=None, rollout_max_num_seqs=max(1, in_flight // 2))))
    return long, rows


def _row_entry(label: str, launch: Launch, levers: Levers, p: dict) -> dict:
    return dict(label=label, levers=asdict(levers), flags=lever_flags(launch, levers),
                activations_described=p["activations_described"], layout=p["layout"],
                **{f"{k}_gb": p[k] / GB for k in ("rollout", "passes", "train", "rollout_states",
                                                  "passes_states", "train_states")},
                stages={str(s): {ph: {k: (v / GB if k != "in_flight" else v) for k, v in d.items()}
                                 for ph, d in st["phases"].items()}
                        for s, st in p["stages"].items()},
                states_by_role_gb={str(s): {ph: {k: v / GB for k, v in roles_.items()}
                                            for ph, roles_ in st["states_by_role"].items()}
                                   for s, st in p["stages"].items()})


def project_launchers(coefs: Dict[str, dict], table: StateBytes, launchers: Sequence[str]) -> dict:
    out = {}
    for path in launchers:
        launch = read_launcher(path)
        model = LAUNCHERS[path]["model"]
        rec = recommend(launch, coefs, table) if not launch.state_only else None
        rows = []
        for label, levers in lever_rows(launch, Levers(**rec["levers"]) if rec else launch.levers):
            rows.append(_row_entry(label, launch, levers, project(launch, coefs, levers, table)))
        long_rows = None
        if path in LONG_RESPONSE_LAUNCHERS and not launch.state_only:
            long, variants = long_response_rows(launch)
            long_rows = [_row_entry(label, long, levers, project(long, coefs, levers, table))
                         for label, levers in variants]
        if launch.state_only:  # what the distributed optimizer and the offloads leave at best
            best = replace(launch.levers, distributed_optimizer=True, offload_ref_reward=True, offload_optimizer=True,
                           offload_grad=True, offload_param=True)
            p = project(launch, coefs, best, table)
            rows.append(dict(label="best model state (dist-opt, every offload)", levers=asdict(best),
                             flags=lever_flags(launch, best), activations_described=False, layout=p["layout"],
                             **{f"{k}_gb": p[k] / GB for k in ("rollout", "passes", "train", "rollout_states",
                                                               "passes_states", "train_states")}))
        counted = param_counts(model_shape(model))["total"]
        mb = None
        if not launch.state_only:
            prompts, responses = skewed_mix(launch.rollout_rows, launch.n_samples, launch.prompt_cap,
                                            launch.response_cap)
            mb = micro_batch_costs(prompts, responses, launch.n_samples, launch.micro_batch_size,
                                   (Levers(**rec["levers"]).micro_batch_tokens if rec else None)
                                   or launch.prompt_cap + launch.response_cap)
        out[path] = dict(
            model=model, stage=launch.stage, world=launch.world, tp=launch.tp, pp=launch.pp, ep=launch.ep,
            dp=launch.dp, expert_dp=launch.expert_dp, state_only=launch.state_only,
            roles=[dict(name=r.name, trainable=r.trainable, value_head=r.value_head, offloadable=r.offloadable)
                   for r in launch.roles],
            rollout_rows=launch.rollout_rows, micro_batch_size=launch.micro_batch_size, prompt_cap=launch.prompt_cap,
            response_cap=launch.response_cap, mini_batch=launch.mini_batch, flags=launch.flags,
            as_launched=asdict(launch.levers), params_counted=counted,
            params_published=MODELS[model]["published_params"], rows=rows, recommended=rec, micro_batching=mb,
            long_response=dict(config=LONG_RESPONSE, rows=long_rows) if long_rows else None)
    return out
