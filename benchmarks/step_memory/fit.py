"""The fit: per-layer saved bytes, working sets and the head's as non-negative least squares over shape features
(`fit_model`), their predictions (`predict_*`) and the held-out check (`check_fit`)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from benchmarks.step_memory.shapes import RECOMPUTE, Shape


# ---------------------------------------------------------------------------------------------- fit
# Per-token features of each part of a layer's saved bytes (TP=1): what each tensor's width is made of. "split"
# names the features that divide under tensor parallelism (the rest -- hidden-sized tensors, per-token scalars --
# stay replicated on every TP rank without sequence parallelism); checked against the TP2 measurement.
PART_FEATURES = {
    "norms": (("1", "h"), ()),
    # heads: the fused kernel's fp32 log-sum-exp per query and head; heads*s: the local attention's scores
    "attention": (("1", "h", "q", "kv", "heads", "heads*s", "qk_norm*(q+kv)"),
                  ("q", "kv", "heads", "heads*s", "qk_norm*(q+kv)")),
    "mlp": (("1", "h", "f"), ("f",)),
    "moe_mlp": (("1", "h", "E", "topk*h", "topk*f_moe"), ()),  # experts split by EP; per routed token alike
    "layer": (("1", "h"), ()),
    "checkpoint": (("1", "h"), ()),
}
# Bytes per micro-batch of one layer's working set (`summarize_phases`), as sums over its tokens / rows, and the
# sizes of its largest weights (fc1: 2 x FFN x h, qkv: h x (q + 2 kv) elements), whose bf16 gradient exists until
# DDP adds it to the fp32 buffer (without recompute; selective and full recompute add the recomputed saved set,
# see `predict_working_set`).
WORKING_SET_FEATURES = (("tokens*h", "tokens*q", "tokens*kv", "tokens*f", "tokens*topk*h", "rows*heads*s^2", "w_fc1",
                         "w_qkv"), ("tokens*q", "tokens*kv", "tokens*f", "rows*heads*s^2", "w_fc1", "w_qkv"))
# Bytes per micro-batch of the head (final norm, output layer, log-probs, loss): per token of the micro-batch, per
# read position (rows x response), and the output layer's weight gradient (bf16 V x h before DDP adds it to the
# fp32 buffer); the log-prob kernel's fp32 work buffer is computed (`logprob_work_bytes`), not fitted.
HEAD_FEATURES = (("tokens*h", "read*h", "read*V", "V*h"), ("read*V", "V*h"))
def feature_values(shape: Shape, seq: int, tp: int = 1, rows: int = 1, ep: int = 1, read: int = 0) -> Dict[str, float]:
    """Every feature's value for `shape` at row length `seq`, `rows` model rows and `read` read positions."""
    s = shape
    f_eff = s.topk * s.moe_ffn if s.experts else s.ffn
    tokens = rows * seq
    values = {"1": 1.0, "h": s.hidden, "q": s.q, "kv": s.kv, "heads": s.heads, "heads*s": s.heads * seq,
              "qk_norm*(q+kv)": (s.q + s.kv) if s.qk_norm else 0.0, "f": s.ffn, "E": s.experts,
              "topk*h": s.topk * s.hidden, "topk*f_moe": s.topk * s.moe_ffn, "V": s.vocab,
              "tokens": tokens, "tokens*h": tokens * s.hidden, "tokens*q": tokens * s.q, "tokens*kv": tokens * s.kv,
              "tokens*f": tokens * f_eff,
              "tokens*topk*h": tokens * s.topk * s.hidden, "rows*heads*s^2": rows * s.heads * seq * seq,
              "read*h": read * s.hidden, "read*V": read * s.vocab, "V*h": s.vocab * s.hidden,
              "w_fc1": 2 * (s.moe_ffn if s.experts else s.ffn) * s.hidden, "w_qkv": s.hidden * (s.q + 2 * s.kv)}
    return values


def _tp_divide(values: Dict[str, float], split: Sequence[str], tp: int,
               per_token: Sequence[str] = ()) -> Dict[str, float]:
    """`values` with the `split` features divided by `tp`; under sequence parallelism the caller passes the
    per-token features (`per_token`, the hidden-sized ones included) to divide as well."""
    return {k: (v / tp if k in split or k in per_token else v) for k, v in values.items()}


# Under sequence parallelism a TP rank holds 1/TP of the sequence outside the TP regions: the hidden-sized per-token
# tensors (residual, norms, the layer input the linears save) divide by TP like the rest; weights do not
SP_WORKING_SET = ("tokens*h", "tokens*topk*h")


def lstsq(rows: List[List[float]], targets: List[float], relative: bool = True):
    """Least squares with non-negative coefficients: the most negative feature is dropped and the rest refitted
    until none is negative (every feature is a tensor size; bytes per element cannot be negative). `relative`:
    each row weighed by 1 / its target (small shapes count as much as large ones), else absolute errors (the
    largest cases, the regime the projection extrapolates to, dominate)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    coef = np.zeros(a.shape[1]) if a.ndim == 2 else np.zeros(0)
    if not len(a):
        return coef.tolist()
    weight = 1.0 / np.maximum(np.abs(b), 1.0) if relative else np.ones_like(b)
    used = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    while used:
        cols = a[:, used] * weight[:, None]
        scale = np.abs(cols).max(axis=0)
        solution, *_ = np.linalg.lstsq(cols / scale, b * weight, rcond=None)
        solution = solution / scale
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[used] = solution
            break
        worst = int(np.argmin(solution))
        used = [j for k, j in enumerate(used) if k != worst]
    return coef.tolist()


def _predict(coef: Dict[str, float], values: Dict[str, float]) -> float:
    return sum(c * values[k] for k, c in coef.items())


def part_of(shape: Shape, part: str) -> str:
    return "moe_mlp" if part == "mlp" and shape.experts else part


def logprob_work_bytes(read: int, vocab_shard: int, device_type: str = "cpu") -> float:
    """`vocab_parallel_logprobs`' two fp32 chunk buffers (its forward and its backward each allocate them):
    2 x rows x V/TP x 4 B, rows = CHUNK_ELEMENTS // (V/TP) capped at the tokens (rl/logprobs.py)."""
    elements = (1 << 20) if device_type == "cpu" else (1 << 24)
    rows = max(1, min(read, elements // max(1, vocab_shard)))
    return 2.0 * rows * vocab_shard * 4


def _fit_rows(cases, names, target):
    rows, targets = [], []
    for c in cases:
        shape = Shape(**c["case"]["shape"])
        values = feature_values(shape, c["seq"], rows=c["rows"], read=c.get("read", c["rows"] * c["response"]))
        rows.append([values[n] for n in names])
        targets.append(target(c, shape))
    return rows, targets


def fit_model(cases: List[dict]) -> Dict[str, dict]:
    """The coefficients of each core attention (`fit_attention`), fitted on its own cases: {"sdpa": .., "local": ..}."""
    attentions = sorted({c["case"]["attention"] for c in cases if "saved" in c})
    return {a: fit_attention([c for c in cases if c["case"]["attention"] == a]) for a in attentions}


def fit_attention(cases: List[dict]) -> dict:
    """Least-squares coefficients (`lstsq`) of each saved part (per token per layer, by recompute mode), of one
    layer's working set without recompute (per micro-batch; train and no-grad forward; dense and MoE) and of the
    head (per micro-batch), from the measured cases (of one core attention) tagged main / fit / qk_norm / moe in the
    row layout; held-out and packed cases are predicted, not fitted."""
    fitted = [c for c in cases if c["case"]["tag"] in ("main", "fit", "qk_norm", "moe") and "saved" in c
              and c["case"]["layout"] == "row" and c["case"]["group"] == 1]
    coefficients: Dict[str, dict] = {}
    for mode in RECOMPUTE:
        train = [c for c in fitted if c["case"]["recompute"] == mode and c["case"]["kind"] == "train"]
        for part, (names, _split) in PART_FEATURES.items():
            key = "mlp" if part == "moe_mlp" else part
            group = [c for c in train if part_of(Shape(**c["case"]["shape"]), key) == part]
            if group:
                rows, targets = _fit_rows(group, names, lambda c, shape: c["per_layer"].get(key, 0.0))
                coefficients[f"saved.{mode}.{part}"] = dict(zip(names, lstsq(rows, targets)))
    for kind, phase in (("train", "bwd_layer"), ("forward", "fwd_layer")):
        for moe in (False, True):
            group = [c for c in fitted if c["case"]["recompute"] == "none" and c["case"]["kind"] == kind
                     and bool(c["case"]["shape"]["experts"]) == moe]
            if group:
                rows, targets = _fit_rows(group, WORKING_SET_FEATURES[0], lambda c, shape: c["phases"][phase])
                name = f"working_set.{kind}{'.moe' if moe else ''}"
                coefficients[name] = dict(zip(WORKING_SET_FEATURES[0], lstsq(rows, targets, relative=False)))

    def head_saved(c):
        return c["per_layer"].get("head", 0.0) * c["tokens"]

    def work(c, shape):
        return logprob_work_bytes(c.get("read", c["rows"] * c["response"]), shape.vocab)

    train = [c for c in fitted if c["case"]["kind"] == "train"]
    forward = [c for c in fitted if c["case"]["kind"] == "forward"]
    for name, group, target in (
            ("head_saved", train, lambda c, shape: head_saved(c)),
            ("head_backward.train", train, lambda c, shape: max(0.0, head_saved(c) + c["phases"]["bwd_head"]
                                                                - work(c, shape))),
            ("head_forward.train", train, lambda c, shape: max(0.0, c["phases"]["fwd_head"] - work(c, shape))),
            ("head_forward.forward", forward, lambda c, shape: max(0.0, c["phases"]["fwd_head"] - work(c, shape)))):
        if group:
            rows, targets = _fit_rows(group, HEAD_FEATURES[0], target)
            coefficients[name] = dict(zip(HEAD_FEATURES[0], lstsq(rows, targets, relative=name == "head_saved")))
    return coefficients


def predict_layer_saved(coef: dict, shape: Shape, mode: str, seq: int, tp: int = 1,
                        sp: bool = False) -> Dict[str, float]:
    """Saved bytes per token per layer by part at TP `tp` (the split features divided by `tp`; under sequence
    parallelism `sp` every feature: each is a per-token width)."""
    out = {}
    for part in ("norms", "attention", "mlp", "layer", "checkpoint"):
        name = part_of(shape, part)
        c = coef.get(f"saved.{mode}.{name}")
        if c is None:
            continue
        names = PART_FEATURES[name][0] if sp else ()
        out[part] = max(0.0, _predict(c, _tp_divide(feature_values(shape, seq), PART_FEATURES[name][1], tp,
                                                    names)))
    out["layer_total"] = sum(out.values())
    return out


def predict_working_set(coef: dict, shape: Shape, kind: str, mode: str, seq: int, rows: float, tp: int = 1,
                        sp: bool = False) -> float:
    """One layer's working set (bytes above the live memory when it starts): fitted without recompute; a
    recomputed layer's backward also rebuilds what recompute did not save (full: the whole layer's saved set;
    selective: the core attention's), checked against the measured selective / full cases (`check_fit`). `rows`
    may be a fraction (a context-parallel rank's share of the rows' tokens). Under sequence parallelism `sp` the
    hidden-sized terms divide by TP too, and the bf16 layer input all-gathered for the column-parallel linears
    (tokens x h, the whole sequence) is added (computed, not measured)."""
    c = coef.get(f"working_set.{kind}{'.moe' if shape.experts else ''}") or coef.get(f"working_set.{kind}")
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, seq, rows=rows), WORKING_SET_FEATURES[1], tp,
                        SP_WORKING_SET if sp else ())
    ws = max(0.0, _predict(c, values)) + (2.0 * rows * seq * shape.hidden if sp else 0.0)
    if kind == "train" and mode != "none":
        none = predict_layer_saved(coef, shape, "none", seq, tp, sp)["layer_total"]
        kept = predict_layer_saved(coef, shape, mode, seq, tp, sp)["layer_total"] if mode == "selective" else 0.0
        ws += max(0.0, none - kept) * rows * seq
    return ws


def predict_head(coef: dict, name: str, shape: Shape, tokens: float, read: float, tp: int = 1,
                 device_type: str = "cpu", sp: bool = False) -> float:
    """A head part's bytes for one micro-batch (the log-prob work buffer of `device_type` added to working sets);
    under sequence parallelism `sp` its per-token hidden-sized term (the final norm's) divides by TP."""
    c = coef.get(name)
    if c is None:
        return 0.0
    values = _tp_divide(feature_values(shape, tokens, read=read), HEAD_FEATURES[1], tp)
    values["tokens*h"] = tokens * shape.hidden / (tp if sp else 1)
    fitted = max(0.0, _predict(c, values))
    return fitted if name == "head_saved" else fitted + logprob_work_bytes(read, shape.vocab // tp, device_type)


def shared_bytes(shape: Shape, rows: int, seq: int, packed: bool, attention: str) -> float:
    """What every layer reads but is stored once per micro-batch: the rotary table indexed by position ids
    ([s, rows, 1, head dim] fp32), the token ids the embedding saves (int64) and, for the local attention only, the
    packed mask ([rows, 1, s, s] bool) or megatron's cached causal mask ([s, s] bool); the fused attention takes
    no mask (causal flag; packed groups as `PackedGroups`)."""
    mask = (rows if packed else 1) * seq * seq if attention == "local" else 0
    return rows * seq * shape.head_dim * 4 + mask + rows * seq * 8


def predict_peak(coef: dict, shape: Shape, mode: str, seq: int, rows: int, read: int, kind: str = "train",
                 tp: int = 1, packed: bool = False, layers: Optional[int] = None, head: bool = True,
                 attention: str = "local", device_type: str = "cpu", sp: bool = False) -> Dict[str, float]:
    """One micro-batch's activation peak from the fitted parts: saved layers + shared + the largest of (head saved
    + its backward, the head's forward, one layer's backward), plus megatron's global buffer (local attention);
    `sp`: under sequence parallelism. `rows` may be a fraction (a CP rank's share)."""
    layers = shape.layers if layers is None else layers
    tokens = rows * seq
    buffer = rows * shape.heads / tp * seq * seq * 2 if attention == "local" else 0.0
    if kind == "forward":
        ws = predict_working_set(coef, shape, "forward", "none", seq, rows, tp, sp)
        head_fwd = (predict_head(coef, "head_forward.forward", shape, tokens, read, tp, device_type, sp)
                    if head else 0.0)
        return dict(saved=0.0, transient=max(ws, head_fwd), global_buffer=buffer, peak=max(ws, head_fwd) + buffer)
    per_token = predict_layer_saved(coef, shape, mode, seq, tp, sp)["layer_total"]
    saved = layers * per_token * tokens + shared_bytes(shape, rows, seq, packed, attention)
    head_saved = predict_head(coef, "head_saved", shape, tokens, read, tp, sp=sp) if head else 0.0
    candidates = [predict_working_set(coef, shape, "train", mode, seq, rows, tp, sp)]
    if head:
        candidates += [predict_head(coef, "head_backward.train", shape, tokens, read, tp, device_type, sp),
                       predict_head(coef, "head_forward.train", shape, tokens, read, tp, device_type, sp)]
    transient = max(candidates)
    return dict(saved=saved + head_saved, head_saved=head_saved, transient=transient, global_buffer=buffer,
                peak=saved + transient + buffer)


def check_fit(coefs: Dict[str, dict], cases: List[dict]) -> List[dict]:
    """Measured against predicted (by the fit of the case's attention), per case: saved bytes per token per layer,
    and the step's peak."""
    out = []
    for c in cases:
        if "saved" not in c or c["case"]["attention"] not in coefs:
            continue
        shape, case = Shape(**c["case"]["shape"]), c["case"]
        coef = coefs[case["attention"]]
        entry = dict(name=case["name"], tag=case["tag"], kind=case["kind"], attention=case["attention"])
        if case["kind"] == "train":
            predicted = predict_layer_saved(coef, shape, case["recompute"], c["seq"])["layer_total"]
            measured = c["per_layer"]["layer_total"]
            entry.update(saved_per_layer_token=measured, predicted=predicted,
                         error=(predicted - measured) / measured if measured else 0.0)
        peak = predict_peak(coef, shape, case["recompute"], c["seq"], c["rows"],
                            c.get("read", c["rows"] * c["response"]), case["kind"],
                            packed=case["layout"] == "packed", attention=case["attention"])["peak"]
        entry.update(peak=c["peak"], predicted_peak=peak, peak_error=(peak - c["peak"]) / c["peak"])
        out.append(entry)
    return out
