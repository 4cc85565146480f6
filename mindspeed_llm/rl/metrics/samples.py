"""The sample tables (--log-samples N): what the model answered, row by row, for a person to read beside the metrics.

A training row (`rollout_rows`) is one rollout sample of the iteration: its prompt and response as text, the score
and its parts by verifier / reward model / tool / penalty (`SampleData.score_parts`), the label, the response's own
tokens (`response_length`, the model's tokens: tool answers excluded), how it ended (`finish_reason`: eos, stop,
length) and, for a multi-turn rollout, its turns and tool calls. An evaluation row (`eval_rows`) is one held-out
sample: the same, plus the set, the sample's number among the prompt's --eval-n-samples, the extracted answer and
whether it passed --eval-pass-threshold.

The rows go to `samples.jsonl` / `eval_samples.jsonl` beside --metrics-jsonl (one JSON object a row, with its
iteration) and to TensorBoard as a text table (`markdown_table`), by `MetricsLogger.log_samples`. Which rows: the
first N of the iteration's global batch (DP rank order, as the sampler deals the prompts), and the first N held-out
samples of each set (by position, then sample): the same rows at any parallel layout.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

# the columns of the TensorBoard tables, in order (the JSONL rows have every key)
TRAIN_COLUMNS = ("sample", "prompt_index", "score", "score_parts", "label", "response_length", "finish_reason",
                 "num_turns", "prompt", "response")
EVAL_COLUMNS = ("set", "position", "sample", "score", "passed", "answer", "label", "response_length",
                "finish_reason", "num_turns", "prompt", "response")
CELL_CHARS = 400  # a TensorBoard cell shows at most this many characters of a text (the JSONL has it whole)


def _prompt_texts(exp, rows: Sequence[int], tokenizer) -> List[str]:
    """The prompts of `rows` as the model saw them (the chat template's special tokens kept)."""
    out = []
    for i in rows:
        ids = exp.tokens[i, : int(exp.prompt_lengths[i])].tolist()
        out.append(tokenizer.decode(ids, skip_special_tokens=False))
    return out


def json_ready(value):
    """`value` as JSON takes it: tensors and numpy values as lists / numbers, containers walked, anything else as its
    text (labels may be numpy scalars or tensors; a dataset column may hold any object)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return str(value)


def _sample_columns(exp, i: int, prompt: str) -> dict:
    """The columns every table shares, of experience row `i`."""
    data = exp.sample_data
    row = {
        "prompt": prompt,
        "response": data.texts[i] if data.texts is not None else None,
        "label": json_ready(data.labels[i]) if data.labels is not None else None,
        "response_length": int(exp.action_lengths[i]),
        "finish_reason": data.finish_reasons[i] if data.finish_reasons is not None else None,
    }
    if data.trajectories is not None and data.trajectories[i] is not None:
        trajectory = data.trajectories[i]
        row.update(num_turns=trajectory.get("num_turns"), tool_calls=trajectory.get("tool_calls"),
                   turns=json_ready(trajectory.get("turns")))
    return row


def rollout_rows(exp, tokenizer, limit: int, first_sample: int = 0) -> List[dict]:
    """The first `limit` rows of a scored experience as table rows; `first_sample`: the global number of its first
    row (the DP rank's offset in the global batch)."""
    rows = list(range(min(limit, exp.batch_size)))
    data = exp.sample_data
    out = []
    for i, prompt in zip(rows, _prompt_texts(exp, rows, tokenizer)):
        row = {"sample": first_sample + i,
               "prompt_index": data.indices[i] if data.indices is not None else None,
               "score": float(exp.scores[i]) if exp.scores is not None else None,
               "score_parts": data.score_parts[i] if data.score_parts is not None else None}
        row.update(_sample_columns(exp, i, prompt))
        out.append(row)
    return out


def eval_rows(exp, scores: Sequence[float], answers: Sequence, threshold: float, positions: Sequence[int],
              samples_per_prompt: int, tokenizer, limit: int) -> List[dict]:
    """Table rows of a held-out rollout (`evaluation.evaluate_policy`'s experience, a prompt's samples consecutive)
    whose prompts sit at `positions` of their set, for the samples among the set's first `limit` (position x N +
    sample < limit); `scores` / `answers` per row of the experience. The set's name is added by the evaluator."""
    n = samples_per_prompt
    rows = [i for i in range(exp.batch_size) if positions[i // n] * n + i % n < limit]
    out = []
    for i, prompt in zip(rows, _prompt_texts(exp, rows, tokenizer)):
        row = {"position": int(positions[i // n]), "sample": i % n, "score": float(scores[i]),
               "passed": bool(scores[i] >= threshold), "answer": answers[i]}
        row.update(_sample_columns(exp, i, prompt))
        out.append(row)
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    text = str(value)
    if len(text) > CELL_CHARS:
        text = text[:CELL_CHARS] + " ..."
    # one table row a sample: a newline or a pipe would break the markdown table
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def shown_columns(rows: Sequence[dict], columns: Sequence[str]) -> List[str]:
    """The `columns` some row of `rows` has, in order (a table leaves out what no row carries)."""
    return [c for c in columns if any(c in r for r in rows)]


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """`rows` as a markdown table of `columns` (`shown_columns`), as TensorBoard's text tab renders it."""
    shown = shown_columns(rows, columns)
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in shown) + " |" for r in rows]
    return "\n".join(lines)


def first_rows(parts: Sequence[Sequence[dict]], limit: int, key: Optional[str] = None) -> List[dict]:
    """The first `limit` rows of the DP ranks' `parts` (in DP rank order, or sorted by `key` then sample)."""
    rows = [r for part in parts for r in part]
    if key is not None:
        rows.sort(key=lambda r: (r[key], r.get("sample", 0)))
    return rows[:limit]
