"""Summary table and plot of a demo run, grpo or trl_ppo: reward over iterations (each stage's own metric: grpo's
`grpo/score/*`, trl_ppo's `critic/score/*`), KL (grpo's KL loss, trl_ppo's KL in the reward), trl_ppo's value loss,
accuracy before / after (and, for a multi-turn run, model turns and tool calls per iteration; for a distillation
run, the KL to the teacher, the training accuracy its verifier recorded at weight 0, and the teacher's accuracy).

Input: the metrics JSONL that ``--metrics-jsonl`` (``MetricsLogger``) writes, one object per iteration
(``{"iteration": i, "grpo/score/mean": ..., "response_length/mean": ..., "actor/kl_loss": ...,
"e2e_tps": ..., "timing/all": ...}``), and the held-out accuracies before and after training
(numbers, or :func:`mindspeed_llm.demo.evaluate.evaluate_hf` results / their JSON files)::

    python -m mindspeed_llm.demo.report run/metrics.jsonl --before eval_before.json --after eval_after.json \\
        --png run/report.png

prints a table like::

    metric                    first 5   last 5    min      max
    reward (grpo/score/mean)  0.312     0.781     0.125    0.906
    ...
    held-out accuracy         before 0.340 -> after 0.710 (+0.370)

and writes a PNG (matplotlib, Agg backend, no display needed) with the reward per iteration (and its
moving average), the reply length, and the before/after accuracy bars.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

__all__ = ["REWARD_KEY", "REWARD_KEYS", "KL_KEYS", "load_metrics", "series", "panel_keys", "summarize",
           "format_summary", "plot_report", "write_report"]

REWARD_KEY = "grpo/score/mean"
# each stage's reward and KL (the first one a run has; trl_ppo logs actor/kl_loss as 0: its KL is in the reward)
REWARD_KEYS = (REWARD_KEY, "critic/score/mean")
KL_KEYS = ("kl/mean", "actor/kl_loss")
VALUE_LOSS_KEY = "critic/vf_loss"
TEACHER_KL_KEY = "distill/kl_mean"  # a run with --teacher-load (on-policy distillation)
# a verifier's own metric ("<name>_rewards/mean"): what a pure distillation run (score 0) plots as its reward when the
# verifier runs at weight 0, i.e. the share of correct samples
VERIFIER_SUFFIX = "_rewards/mean"
# (key, label) of the rows of the summary table, in order; missing keys are skipped
TABLE_KEYS = (
    (REWARD_KEY, "reward (grpo/score/mean)"),
    ("critic/score/mean", "reward (critic/score/mean)"),
    ("response_length/mean", "response length (tokens)"),
    ("kl/mean", "KL to reference (in the reward)"),
    ("actor/kl_loss", "KL to reference"),
    (TEACHER_KL_KEY, "KL to teacher (distill/kl_mean)"),
    ("distill/teacher_logp_mean", "teacher log-prob per token"),
    ("distill/topk_mass", "teacher top-k mass covered"),
    (VALUE_LOSS_KEY, "value loss (critic)"),
    ("actor/entropy", "entropy"),
    ("actor/pg_clipfrac", "clip fraction"),
    ("grad_norm", "grad norm"),
    ("num_turns/mean", "model turns per trajectory"),
    ("tool/calls", "tool calls per iteration"),
    ("tool/failures", "failed tool calls per iteration"),
    ("tool/response_length/mean", "tool tokens per trajectory"),
    ("e2e_tps", "e2e tokens/s"),
    ("timing/all", "seconds / iteration"),
)


def load_metrics(path: Union[str, Path]) -> List[dict]:
    """The per-iteration records of a metrics JSONL, sorted by iteration.

    Blank lines are skipped, and so is a line that is not valid JSON (a run killed mid-write leaves a
    partial last line; a warning says how many were dropped). When an iteration appears more than
    once (a resumed run appends to the file), the last record wins. ``null`` values stay ``None``.
    """
    records: Dict[int, dict] = {}
    bad = 0
    order = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if not isinstance(rec, dict):
                bad += 1
                continue
            it = rec.get("iteration")
            if it is None:
                it = order  # no iteration key: number the records in file order
            records[int(it)] = dict(rec, iteration=int(it))
            order += 1
    if bad:
        warnings.warn(f"{path}: skipped {bad} line(s) that are not JSON objects")
    return [records[k] for k in sorted(records)]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: Sequence[Mapping], key: str):
    """``(iterations, values)`` of ``key`` over the records that have a finite value for it."""
    xs, ys = [], []
    for rec in records:
        v = rec.get(key)
        if _finite(v):
            xs.append(rec["iteration"])
            ys.append(float(v))
    return xs, ys


def _first_present(records: Sequence[Mapping], keys: Sequence[str]) -> Optional[str]:
    for key in keys:
        if series(records, key)[1]:
            return key
    return None


def _recorded_verifier(records: Sequence[Mapping]) -> Optional[str]:
    """A verifier's own metric key, the first in the first record that has one (None: no verifier ran)."""
    for rec in records:
        for key in rec:
            if key.endswith(VERIFIER_SUFFIX) and series(records, key)[1]:
                return key
    return None


def panel_keys(records: Sequence[Mapping]) -> Dict[str, Optional[str]]:
    """The metric each panel plots for this run (None: the run has none): `reward` (the stage's own; for a pure
    distillation run, whose score is 0, the training accuracy its verifier recorded at weight 0), `kl` (grpo's
    KL loss, or trl_ppo's KL in the reward), `teacher_kl` (a distillation run's KL to its teacher), `value_loss`
    (trl_ppo's critic), `length`, `turns` (multi-turn)."""
    reward = _first_present(records, REWARD_KEYS)
    teacher_kl = _first_present(records, (TEACHER_KL_KEY,))
    if teacher_kl and (reward is None or not any(series(records, reward)[1])):
        reward = _recorded_verifier(records) or reward
    return {"reward": reward, "kl": _first_present(records, KL_KEYS), "teacher_kl": teacher_kl,
            "value_loss": _first_present(records, (VALUE_LOSS_KEY,)),
            "length": _first_present(records, ("response_length/mean",)),
            "turns": _first_present(records, ("num_turns/mean", "tool/calls"))}


def _reward_label(key: str) -> str:
    if key.endswith(VERIFIER_SUFFIX):
        return f"training accuracy ({key}, weight 0)"
    return f"reward ({key})"


def _accuracy(value) -> Optional[float]:
    """A float from a number, an evaluate_hf result dict, or the path of its JSON file."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return float(value["accuracy"])
    if isinstance(value, (int, float)):
        return float(value)
    path = Path(str(value))
    if path.is_file():
        return _accuracy(json.loads(path.read_text(encoding="utf-8")))
    return float(value)  # a number given as text


def summarize(records: Sequence[Mapping], before=None, after=None, window: int = 5, teacher=None) -> dict:
    """Per metric of ``TABLE_KEYS`` (of ``KL_KEYS`` the stage's own, as the panel plots it; a pure distillation run's
    recorded training accuracy first): mean of the first / last ``window`` iterations, min and max; the run's
    iteration count and wall time (sum of ``timing/all``); accuracies before / after (and the teacher's)."""
    out = {"iterations": len(records), "window": int(window), "metrics": {}}
    if records:
        out["first_iteration"] = records[0]["iteration"]
        out["last_iteration"] = records[-1]["iteration"]
    panels = panel_keys(records)
    kl = panels["kl"]  # the stage's own KL: trl_ppo's actor/kl_loss is a column of zeros beside kl/mean
    rows = list(TABLE_KEYS)
    if panels["reward"] and panels["reward"].endswith(VERIFIER_SUFFIX):
        rows.insert(0, (panels["reward"], _reward_label(panels["reward"])))
    for key, label in rows:
        if key in KL_KEYS and key != kl:
            continue
        _, ys = series(records, key)
        if not ys:
            continue
        w = max(1, min(int(window), len(ys)))
        out["metrics"][key] = {"label": label, "first": sum(ys[:w]) / w, "last": sum(ys[-w:]) / w,
                               "min": min(ys), "max": max(ys), "n": len(ys)}
    _, secs = series(records, "timing/all")
    if secs:
        out["seconds_total"] = sum(secs)
    out["accuracy_before"] = _accuracy(before)
    out["accuracy_after"] = _accuracy(after)
    if teacher is not None:
        out["accuracy_teacher"] = _accuracy(teacher)
    return out


def _fmt(v: float) -> str:
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return f"{v:.2e}"


def format_summary(summary: Mapping) -> str:
    """The summary as a fixed-width text table."""
    w = summary.get("window", 5)
    head = ("metric", f"first {w}", f"last {w}", "min", "max")
    rows = [head]
    for key, m in summary["metrics"].items():
        rows.append((m["label"], _fmt(m["first"]), _fmt(m["last"]), _fmt(m["min"]), _fmt(m["max"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * wd for wd in widths))
    it = summary.get("iterations", 0)
    tail = f"iterations: {it}"
    if "first_iteration" in summary:
        tail += f" ({summary['first_iteration']}..{summary['last_iteration']})"
    if summary.get("seconds_total") is not None:
        tail += f", {summary['seconds_total']:.0f} s in iterations"
    lines.append(tail)
    b, a = summary.get("accuracy_before"), summary.get("accuracy_after")
    if b is not None or a is not None:
        parts = []
        if b is not None:
            parts.append(f"before {b:.3f}")
        if a is not None:
            parts.append(f"after {a:.3f}")
        if a is not None and b is not None:
            parts.append(f"({a - b:+.3f})")
        lines.append("held-out accuracy: " + " -> ".join(parts[:2]) + (" " + parts[2] if len(parts) > 2 else "")
                     + (f"; teacher {summary['accuracy_teacher']:.3f}"
                        if summary.get("accuracy_teacher") is not None else ""))
    lora = summary.get("lora")
    if lora:
        share = lora["adapter_parameters"] / lora["base_parameters"] if lora.get("base_parameters") else 0.0
        lines.append(f"LoRA: r {lora['r']}, alpha {lora['alpha']:g} on {', '.join(lora['targets'])} (base frozen); "
                     f"adapter {lora['adapter_parameters'] / 1e6:.2f} M parameters ({share:.1%} of the base), "
                     f"{lora['adapter_bytes'] / 2**20:.1f} MiB; PEFT folder {lora['peft_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def _moving_average(ys: List[float], k: int) -> List[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_report(records: Sequence[Mapping], png_path: Union[str, Path], before=None, after=None,
                title: str = "GRPO on SmolLM2-135M-Instruct", smooth: int = 5,
                accuracy_label: str = "accuracy (greedy)", teacher=None) -> Path:
    """Write the PNG: reward per iteration (+ moving average over ``smooth``), response length with the KL (to the
    teacher in a distillation run), and held-out accuracy before / after (bars, with the `teacher`'s when given;
    left out when neither is given). Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    b, a = _accuracy(before), _accuracy(after)
    has_acc = b is not None or a is not None
    has_tools = bool(series(records, "tool/calls")[1] or series(records, "num_turns/mean")[1])
    ratios = [2.2, 1.6] + ([1.6] if has_tools else []) + ([1.0] if has_acc else [])
    ncols = len(ratios)
    fig = Figure(figsize=(4.6 * ncols, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, width_ratios=ratios))
    if has_tools:
        _plot_tools(axes.pop(2), records)

    keys = panel_keys(records)
    reward = keys["reward"] or REWARD_KEY
    ax = axes[0]
    xs, ys = series(records, reward)
    if ys:
        per_iteration = "share correct" if reward.endswith(VERIFIER_SUFFIX) else "mean reward"
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, color="tab:blue", alpha=0.55,
                label=f"{per_iteration} per iteration")
        if len(ys) > 2:
            k = max(1, min(int(smooth), len(ys)))
            ax.plot(xs, _moving_average(ys, k), linewidth=2.4, color="tab:blue",
                    label=f"moving average ({k} it.)")
    else:
        ax.text(0.5, 0.5, f"no {' / '.join(REWARD_KEYS)} in the metrics", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("iteration")
    if reward.endswith(VERIFIER_SUFFIX):  # a pure distillation run: its verifier recorded at weight 0
        ax.set_ylabel("share of correct samples")
        ax.set_title(f"Training accuracy ({reward}, weight 0)", fontsize=10)
    else:
        ax.set_ylabel("reward (share of correct samples)")
        ax.set_title(f"Training reward ({reward})")
    vx, vy = series(records, VALUE_LOSS_KEY)
    if vy:  # trl_ppo: the critic's value loss beside its reward
        ax3 = ax.twinx()
        ax3.plot(vx, vy, color="tab:brown", linewidth=1.0, linestyle=":", label="value loss (critic)")
        ax3.set_ylabel("value loss (critic)", color="tab:brown")
    if ys and min(ys) >= 0 and max(ys) <= 1:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ys:
        ax.legend(loc="lower right", fontsize=8)

    ax = axes[1]
    xs, ys = series(records, "response_length/mean")
    if ys:
        ax.plot(xs, ys, color="tab:orange", linewidth=1.8, label="response length")
        ax.set_ylabel("tokens per response (mean)", color="tab:orange")
        ax.set_ylim(bottom=0)
    kl_key, kl_label = (keys["teacher_kl"], "KL to teacher") if keys["teacher_kl"] else (keys["kl"], "KL to reference")
    kx, ky = series(records, kl_key) if kl_key else ([], [])
    if ky:
        ax2 = ax.twinx()
        ax2.plot(kx, ky, color="tab:purple", linewidth=1.2, linestyle="--", label=kl_label)
        ax2.set_ylabel(kl_label, color="tab:purple")
        if min(ky) >= 0:
            ax2.set_ylim(bottom=0)
    if not ys and not ky:
        ax.text(0.5, 0.5, "no response length / KL in the metrics", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("iteration")
    ax.set_title("Response length" + (f" and {kl_label}" if ky else ""))
    ax.grid(alpha=0.3)

    if has_acc:
        ax = axes[2]
        names, values, colors = [], [], []
        if b is not None:
            names.append("before")
            values.append(b)
            colors.append("tab:gray")
        if a is not None:
            names.append("after")
            values.append(a)
            colors.append("tab:green")
        t = _accuracy(teacher)
        if t is not None:
            names.append("teacher")
            values.append(t)
            colors.append("tab:olive")
        bars = ax.bar(names, values, color=colors, width=0.6)
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, v + 0.02, f"{v:.0%}", ha="center", va="bottom",
                    fontsize=11, fontweight="bold")
        ax.set_ylim(0, 1.12)
        ax.set_ylabel(accuracy_label)
        ax.set_title("Held-out accuracy")
        ax.grid(axis="y", alpha=0.3)

    if title:
        fig.suptitle(title, fontsize=12)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(png_path))
    return png_path


def _plot_tools(ax, records: Sequence[Mapping]) -> None:
    """Turns per trajectory and tool calls per iteration (the multi-turn rollouts' metrics)."""
    xs, ys = series(records, "num_turns/mean")
    if ys:
        ax.plot(xs, ys, color="tab:green", linewidth=1.8, marker="o", markersize=3, label="model turns (mean)")
        ax.set_ylabel("model turns per trajectory", color="tab:green")
        ax.set_ylim(bottom=0)
    cx, cy = series(records, "tool/calls")
    if cy:
        ax2 = ax.twinx()
        ax2.plot(cx, cy, color="tab:red", linewidth=1.2, linestyle="--", label="tool calls")
        fx, fy = series(records, "tool/failures")
        if fy:
            ax2.plot(fx, fy, color="tab:gray", linewidth=1.0, linestyle=":", label="failed calls")
        ax2.set_ylabel("tool calls per iteration", color="tab:red")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_title("Turns and tool calls")
    ax.grid(alpha=0.3)


def write_report(metrics_jsonl: Union[str, Path], png_path: Union[str, Path, None] = None, before=None,
                 after=None, *, title: str = "GRPO on SmolLM2-135M-Instruct", window: int = 5,
                 print_fn=print, lora: Optional[dict] = None, accuracy_label: str = "accuracy (greedy)",
                 teacher=None) -> dict:
    """Load the metrics, print the summary table, write the PNG (when ``png_path`` is given); returns
    the summary (with ``"png"``; ``lora``, a LoRA run's adapter summary, is printed and kept as ``"lora"``;
    ``teacher``, a distillation run's teacher accuracy, is a third bar and ``"accuracy_teacher"``)."""
    records = load_metrics(metrics_jsonl)
    summary = summarize(records, before, after, window=window, teacher=teacher)
    if lora is not None:
        summary["lora"] = dict(lora)
    if print_fn is not None:
        print_fn(format_summary(summary))
    if png_path is not None:
        summary["png"] = str(plot_report(records, png_path, before, after, title=title,
                                         accuracy_label=accuracy_label, teacher=teacher))
        if print_fn is not None:
            print_fn(f"plot: {summary['png']}")
    return summary


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Summarize a GRPO metrics JSONL and plot it.")
    parser.add_argument("metrics_jsonl")
    parser.add_argument("--before", help="held-out accuracy before training: a number or an evaluate JSON file")
    parser.add_argument("--after", help="held-out accuracy after training: a number or an evaluate JSON file")
    parser.add_argument("--png", help="write the plot here")
    parser.add_argument("--title", default="GRPO on SmolLM2-135M-Instruct")
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args(argv)
    write_report(args.metrics_jsonl, args.png, args.before, args.after, title=args.title, window=args.window)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
