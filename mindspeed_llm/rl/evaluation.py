"""Held-out evaluation of a policy: rollouts of held-out prompts (trajectories with the run's tools under
--tool-config), greedy by default or `--eval-n-samples N` samples a prompt, their scores, answers, lengths and KL
to the reference (the stages' `evaluate`), and the metrics of a held-out set from them (`set_metrics`,
`metrics/pass_at_k.py`).

Sample k of the held-out prompt at position p (its index in its held-out set, `row["position"]`, which the trainer
sets) draws from the random stream (seed, `EVAL_STREAM`, p * N + k): the same numbers at any data-parallel size,
at every evaluation of a run and after a resume (training iterations key their streams from 1 up, so evaluation
never shares one with a training rollout)."""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from mindspeed_llm import distributed
from mindspeed_llm.files import append_line, write_text_atomically
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.metrics import Timers
from mindspeed_llm.rl.metrics.pass_at_k import PromptResult, summarize
from mindspeed_llm.rl.metrics.samples import eval_rows
from mindspeed_llm.rl.update.passes import policy_logprobs
from mindspeed_llm.rl.update.roles import on_device
from mindspeed_llm.rl.rollout import rollout, sampling_config
from mindspeed_llm.rl.settings import LoopSettings, SamplingSettings

EVAL_STREAM = -1  # the `iteration` key of the evaluation samples' random streams
# the verifiers that check an extracted final answer: with one of them, maj@N votes over the answers
BOXED_ANSWER_VERIFIERS = frozenset({"math_acc", "base_acc", "math_17k_acc", "acc_for_ppo", "acc_for_dapo",
                                    "math_verify_reward"})
FIRST_LINE_VERIFIERS = frozenset({"first_line_answer"})


def eval_sampling_settings(sampling: SamplingSettings, evaluation: LoopSettings) -> SamplingSettings:
    """The held-out rollouts' sampling: the run's lengths and stop ids; greedy at one sample a prompt unless
    --eval-temperature is given, else sampled at --eval-temperature (default 1.0) and --eval-top-p, no top-k."""
    if evaluation.eval_n_samples == 1 and evaluation.eval_temperature is None:
        return replace(sampling, do_sample=False)
    temperature = 1.0 if evaluation.eval_temperature is None else evaluation.eval_temperature
    return replace(sampling, do_sample=True, temperature=temperature, top_p=evaluation.eval_top_p, top_k=0)


def answer_extractor(verifier_names: Sequence[str]):
    """A function text -> the normalised final answer (None: none), for maj@N, when one of the run's verifiers
    checks an extracted answer (`BOXED_ANSWER_VERIFIERS`: the last box, an <answer> tag or an Answer: line;
    `first_line_answer`: the first line's number); None otherwise (maj@N is then not reported)."""
    from mindspeed_llm.rl.verifiers import extract_answer, parse_first_line_answer

    names = set(verifier_names)
    if names & BOXED_ANSWER_VERIFIERS:
        def boxed(text):
            found = extract_answer(text)
            return None if found is None else re.sub(r"\s+", "", found.text) or None
        return boxed
    if names & FIRST_LINE_VERIFIERS:
        return parse_first_line_answer
    return None


def evaluate_policy(actor, reference, scorer, tokenizer, rows: Sequence[dict], sampling: SamplingSettings,
                    offload: bool = False, toolbox=None,
                    evaluation: Optional[LoopSettings] = None) -> List[PromptResult]:
    """One `PromptResult` per row of `rows` (this DP rank's share of a held-out set, each with its "position"):
    `evaluation.eval_n_samples` responses to it (`eval_sampling_settings`; `sampling`'s lengths and stop ids),
    their scores, extracted answers, and the per-sample sums of `response_length/mean` and, with a reference,
    `kl/mean` (the summed k1 KL of a response); `offload`: the reference waits in host memory
    (--offload-ref-reward). With the run's `toolbox` (`multi_turn.ToolBox`, --tool-config) the responses are
    trajectories, and `num_turns/mean`, `tool/calls` (per trajectory) say how they used the tools."""
    evaluation = evaluation or LoopSettings()
    n = evaluation.eval_n_samples
    timers = Timers()
    config = sampling_config(eval_sampling_settings(sampling, evaluation), tokenizer)
    if toolbox is None:
        exp = rollout(actor.module, rows, config, EVAL_STREAM, tokenizer, samples_per_prompt=n)
    else:
        from mindspeed_llm.rl.multi_turn import tool_rollout

        exp, _ = tool_rollout(actor.module, rows, config, tokenizer, toolbox, iteration=EVAL_STREAM,
                              samples_per_prompt=n)
    plan = MicroBatchPlan.build(exp, micro_batch_size=1)
    scores, _ = scorer(exp, plan, timers)
    per_sample = {"response_length/mean": exp.action_lengths.float().tolist()}
    if exp.sample_data.trajectories is not None:
        per_sample["num_turns/mean"] = [float(t["num_turns"]) for t in exp.sample_data.trajectories]
        per_sample["tool/calls"] = [float(t["tool_calls"]) for t in exp.sample_data.trajectories]
    if reference is not None:
        logp, _ = policy_logprobs(actor.chunks, exp, plan, compare_routing=exp.routing_recorded)
        with on_device(reference, offload, timers) as ref_model:
            ref, _ = policy_logprobs([ref_model], exp, plan)
        per_sample["kl/mean"] = ((logp - ref) * exp.action_mask).sum(-1).tolist()  # the model's tokens
    extract = answer_extractor(getattr(scorer, "verifier_names", ()))
    texts, scores = exp.sample_data.texts, scores.float().tolist()
    answers = [extract(text) if extract else None for text in texts]
    table = eval_rows(exp, scores, answers, evaluation.eval_pass_threshold, [int(r["position"]) for r in rows], n,
                      tokenizer, evaluation.log_samples) if evaluation.log_samples else []
    out = []
    for i, row in enumerate(rows):
        own = range(i * n, (i + 1) * n)
        source = row.get("data_source")
        out.append(PromptResult(
            position=int(row["position"]), source=None if source is None else str(source),
            scores=tuple(scores[j] for j in own), answers=tuple(answers[j] for j in own),
            sums=tuple((name, float(sum(values[j] for j in own))) for name, values in per_sample.items()),
            samples=tuple(r for r in table if r["position"] == int(row["position"]))))
    return out


def set_metrics(prefix: str, results: Sequence[PromptResult], threshold: float) -> Dict[str, float]:
    """The metrics of one held-out set (`pass_at_k.summarize`) under `prefix` ("eval" or "eval/NAME"), and, where
    its rows carry a `data_source`, of each source under `prefix/SOURCE`."""
    out = {f"{prefix}/{k}": v for k, v in summarize(results, threshold).items()}
    sources = sorted({r.source for r in results if r.source is not None})
    for source in sources:
        part = [r for r in results if r.source == source]
        out.update({f"{prefix}/{source}/{k}": v for k, v in summarize(part, threshold).items()})
    return out


def _set_results(stage, dataset, eval_prompts: int) -> List[PromptResult]:
    """Every DP rank's `PromptResult`s of the first `eval_prompts` prompts of `dataset` (0 = all), the prompts
    dealt over the DP ranks (a rank may hold none); the same list on every DP rank."""
    dp_rank, dp_size = distributed.data_parallel_info()
    count = len(dataset) if not eval_prompts else min(eval_prompts, len(dataset))
    subset = getattr(dataset, "indices", None)  # --split's valid part: the prompts' indices in --data-path
    rows = [dict(dataset[i], position=i, index=int(subset[i]) if subset is not None else i)
            for i in range(dp_rank, count, dp_size)]
    local = stage.evaluate(rows) if rows else []
    return [r for part in distributed.gather_over_data_parallel(local) for r in part]


class Evaluator:
    """The run's held-out evaluation, for the trainer's loop: which iterations evaluate (`due`: every
    --eval-interval and the last one; `before_train`: iteration 0 with --eval-before-train on a run that starts
    from scratch), the metrics of every set (`evaluate`), and `eval.csv` beside --metrics-jsonl (`record`, rank 0;
    one row per iteration, set and metric). Which iterations evaluate depends on the iteration alone, so a resumed
    run evaluates where the interrupted one would have, and none it already did; the CSV keeps the rows up to the
    iteration it resumes from (a fresh start rewrites it)."""

    def __init__(self, stage, sets: Sequence[tuple], loop: LoopSettings, start: int = 0, rank: int = 0):
        """`sets`: (name, dataset) pairs (name None: the unnamed set, metrics `eval/...`); empty: no evaluation."""
        self.stage, self.sets, self.loop, self.start = stage, list(sets), loop, start
        self.columns: Dict[str, tuple] = {}  # metric key -> (set, metric) of the CSV
        self.samples: List[dict] = []  # the last evaluation's sample-table rows (--log-samples)
        self.csv = None
        if self.sets and rank == 0 and loop.metrics_jsonl:
            self.csv = EvalTable(os.path.join(os.path.dirname(os.path.abspath(loop.metrics_jsonl)), "eval.csv"),
                                 keep_through=start)

    def due(self, iteration: int) -> bool:
        interval = self.loop.eval_interval
        return bool(self.sets and interval) and (iteration % interval == 0 or iteration == self.loop.train_iters)

    def before_train(self) -> bool:
        return bool(self.sets and self.loop.eval_interval and self.loop.eval_before_train) and self.start == 0

    def evaluate(self) -> Dict[str, float]:
        """The metrics of every set; with --log-samples, its first held-out samples wait in `samples` for
        `pop_samples`."""
        out = {}
        for name, dataset in self.sets:
            prefix = "eval" if name is None else f"eval/{name}"
            results = _set_results(self.stage, dataset, self.loop.eval_prompts)
            self.samples += [{"set": name or "eval", **row} for r in sorted(results, key=lambda r: r.position)
                             for row in r.samples]
            metrics = set_metrics(prefix, results, self.loop.eval_pass_threshold)
            self.columns.update({key: (name or "eval", key[len(prefix) + 1:]) for key in metrics})
            out.update(metrics)
        return out

    def pop_samples(self) -> List[dict]:
        """The sample-table rows of the evaluations since the last call (each set's first --log-samples samples)."""
        rows, self.samples = self.samples, []
        return rows

    def record(self, iteration: int, metrics: Dict[str, float]) -> None:
        if self.csv is not None:
            self.csv.write(iteration, [(*self.columns[k], v) for k, v in metrics.items() if k in self.columns])

    def close(self) -> None:
        if self.csv is not None:
            self.csv.close()
            self.csv = None


class EvalTable:
    """`eval.csv`: a header `iteration,set,metric,value` and one row per evaluated metric; opened keeping the rows of
    iterations <= `keep_through` when it is > 0 (a resume), none otherwise."""

    HEADER = ("iteration", "set", "metric", "value")

    def __init__(self, path: str, keep_through: int = 0):
        self.path = path
        kept = []
        if keep_through > 0 and os.path.exists(path):
            with open(path, newline="", encoding="utf-8") as f:
                kept = [row for row in csv.reader(f) if len(row) == 4 and row[0].isdigit()
                        and int(row[0]) <= keep_through]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomically(path, self._text([self.HEADER, *kept]))
        self._file = open(path, "a", newline="", encoding="utf-8")

    @staticmethod
    def _text(rows) -> str:
        out = io.StringIO()
        csv.writer(out).writerows(rows)
        return out.getvalue()

    def write(self, iteration: int, rows) -> None:
        # a failed write (a full disk) names the file and leaves no half row (`files.append_line`)
        append_line(self._file, self._text([(int(iteration), s, m, repr(float(v))) for s, m, v in rows]))

    def close(self) -> None:
        self._file.close()
