"""Accuracy of a Hugging Face model on the demo's problems, with ``transformers`` generate on CPU.

:func:`evaluate_hf` answers each problem greedily (batched, left padding) and scores the replies with a
registered verifier of :mod:`mindspeed_llm.rl.verifiers` (default: the demo's ``first_line_answer``;
``"math_acc"`` for ``\\boxed{}`` answers). :func:`sample_hf` draws ``n`` samples per problem at a
temperature and reports, besides the accuracy, the share of groups with *mixed* rewards (some right,
some wrong), i.e. the groups that give GRPO a non-zero advantage. :func:`measure_variant` runs both for
a task variant (what the table in :mod:`mindspeed_llm.demo.task` comes from)::

    python -m mindspeed_llm.demo.evaluate MODEL_DIR --problems test.json --max-new-tokens 24 --stop-token-ids 198 1116
    python -m mindspeed_llm.demo.evaluate MODEL_DIR --measure add20 addsub20 --output measure.json

Prompts: ``chat_template=True`` renders ``[system?, user]`` with the tokenizer's chat template.
``system_prompt=None`` (default) leaves the system turn out entirely, the same text as
``preprocess_data.py --prompt-type chatml`` for ChatML models (SmolLM2's Jinja template would otherwise
insert its default system prompt, about 20 tokens); ``system_prompt=TEMPLATE_DEFAULT`` keeps the
template's default (``--prompt-type smollm2``); a string is used as the system message.
``chat_template=False`` feeds the problem text as it is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional, Sequence, Union

from mindspeed_llm.rl.verifiers import score_batch

__all__ = [
    "TEMPLATE_DEFAULT",
    "DEFAULT_VERIFIER",
    "load_hf",
    "render_prompts",
    "evaluate_hf",
    "sample_hf",
    "measure_variant",
]

DEFAULT_VERIFIER = "first_line_answer"  # mindspeed_llm.rl.verifiers


class _TemplateDefault:
    def __repr__(self):
        return "TEMPLATE_DEFAULT"


TEMPLATE_DEFAULT = _TemplateDefault()
_MARK = "\x00SYSTEM-TURN-MARK\x00"


def load_hf(model_dir: Union[str, Path]):
    """``(model, tokenizer)`` in fp32 eval mode, tokenizer padding on the left."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok


def _resolve(model_or_dir):
    if isinstance(model_or_dir, (tuple, list)) and len(model_or_dir) == 2:
        return model_or_dir[0], model_or_dir[1]
    return load_hf(model_or_dir)


def _problem_text(p) -> str:
    return p["problem"] if isinstance(p, dict) else str(p)


def _label(p) -> Optional[str]:
    return str(p["answer"]) if isinstance(p, dict) and p.get("answer") is not None else None


def render_prompts(tokenizer, problems: Sequence, chat_template: bool = True, system_prompt=None) -> List[str]:
    """The prompt text of each problem (see the module docstring for ``system_prompt``)."""
    texts = [_problem_text(p) for p in problems]
    if not chat_template:
        return texts
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; pass chat_template=False")
    out = []
    for text in texts:
        user = [{"role": "user", "content": text}]
        if system_prompt is TEMPLATE_DEFAULT:
            out.append(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False))
        elif system_prompt is None:
            # render with a marker system turn and cut that turn off: no system text at all
            full = tokenizer.apply_chat_template([{"role": "system", "content": _MARK}] + user,
                                                 add_generation_prompt=True, tokenize=False)
            head = tokenizer.apply_chat_template([{"role": "system", "content": _MARK}],
                                                 add_generation_prompt=False, tokenize=False)
            if not full.startswith(head) or _MARK in full[len(head):]:
                raise ValueError("cannot drop the system turn of this chat template; pass a system_prompt")
            out.append(full[len(head):])
        else:
            out.append(tokenizer.apply_chat_template([{"role": "system", "content": str(system_prompt)}] + user,
                                                     add_generation_prompt=True, tokenize=False))
    return out


def _generate(model, tok, prompts: List[str], *, max_new_tokens: int, batch_size: int, do_sample: bool,
              temperature: float = 1.0, num_return_sequences: int = 1, seed: int = 0,
              stop_token_ids: Sequence[int] = ()):
    """Replies (decoded, special tokens dropped), reply lengths in tokens (eos / stop token included)
    and whether each reply hit ``max_new_tokens`` without an eos or stop token; ``num_return_sequences``
    replies per prompt, in order."""
    import torch

    eos_ids = model.generation_config.eos_token_id
    if eos_ids is None:
        eos_ids = tok.eos_token_id
    eos_set = set(eos_ids if isinstance(eos_ids, (list, tuple)) else [eos_ids])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_set))
    eos_set |= {int(t) for t in stop_token_ids}
    texts, lengths, truncated, prompt_tokens = [], [], [], []
    gen = dict(max_new_tokens=int(max_new_tokens), pad_token_id=pad_id, eos_token_id=sorted(eos_set))
    if do_sample:
        gen.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0,
                   num_return_sequences=int(num_return_sequences))
    else:
        gen.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if do_sample:
        torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_tokens.extend(enc["attention_mask"].sum(dim=1).tolist())
        with torch.no_grad():
            out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **gen)
        new = out[:, enc["input_ids"].shape[1]:]
        for row in new.tolist():
            n = len(row)
            for i, t in enumerate(row):
                if t in eos_set:
                    n = i + 1
                    break
            ended = n < len(row) or (n == len(row) and row and row[-1] in eos_set)
            lengths.append(n)
            truncated.append(not ended)
            texts.append(tok.decode(row[:n], skip_special_tokens=True))
    return texts, lengths, truncated, prompt_tokens


def _score(texts: List[str], labels: List[Optional[str]], verifier: str) -> List[float]:
    per_verifier, _ = score_batch(texts, labels, [verifier])  # an unknown name fails, listing the valid ones
    return [float(s) for s in per_verifier[verifier]]


def evaluate_hf(model_dir, problems: Sequence, max_new_tokens: int = 24, batch_size: int = 32,
                chat_template: bool = True, system_prompt=None, *, verifier: str = DEFAULT_VERIFIER,
                stop_token_ids: Sequence[int] = ()) -> dict:
    """Greedy accuracy of a model on ``problems`` (DeepScaleR rows ``{"problem", "answer"}``).

    ``model_dir``: a Hugging Face folder, or an already loaded ``(model, tokenizer)`` pair.
    ``stop_token_ids``: token ids that end a reply besides eos (like the RL stage's
    ``--stop-token-ids``; SmolLM2's newlines are 198 and 1116).
    Returns ``{"accuracy", "mean_length", "truncated", "mean_prompt_tokens", "n", "seconds", "samples"}``
    with ``samples`` a list of ``{"problem", "answer", "prompt", "response", "score", "length",
    "truncated"}``; ``mean_length`` is in generated tokens (eos included), ``truncated`` the share of
    replies that hit ``max_new_tokens``.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    model, tok = _resolve(model_dir)
    problems = list(problems)
    t0 = time.time()
    prompts = render_prompts(tok, problems, chat_template, system_prompt)
    texts, lengths, truncated, prompt_tokens = _generate(model, tok, prompts, max_new_tokens=max_new_tokens,
                                                         batch_size=batch_size, do_sample=False,
                                                         stop_token_ids=stop_token_ids)
    labels = [_label(p) for p in problems]
    scores = _score(texts, labels, verifier)
    n = len(problems)
    samples = [{"problem": _problem_text(p), "answer": lb, "prompt": pr, "response": r, "score": s,
                "length": ln, "truncated": tr}
               for p, lb, pr, r, s, ln, tr in zip(problems, labels, prompts, texts, scores, lengths, truncated)]
    return {
        "accuracy": sum(scores) / n if n else 0.0,
        "mean_length": sum(lengths) / n if n else 0.0,
        "truncated": sum(truncated) / n if n else 0.0,
        "mean_prompt_tokens": sum(prompt_tokens) / n if n else 0.0,
        "n": n,
        "seconds": time.time() - t0,
        "samples": samples,
    }


def sample_hf(model_dir, problems: Sequence, n_samples: int = 4, temperature: float = 1.0,
              max_new_tokens: int = 24, batch_size: int = 16, chat_template: bool = True, system_prompt=None,
              *, verifier: str = DEFAULT_VERIFIER, seed: int = 0, stop_token_ids: Sequence[int] = ()) -> dict:
    """Sampled accuracy and GRPO group statistics: ``n_samples`` replies per problem (pure temperature
    sampling: top_k 0, top_p 1), scored with ``verifier``.

    Returns ``{"accuracy", "mixed", "all_right", "all_wrong", "mean_length", "truncated", "n", "seconds",
    "groups"}``: ``mixed`` is the share of problems whose samples got both a reward 0 and a reward 1
    (what gives GRPO a gradient); ``groups`` the per-problem list of scores.
    """
    if n_samples < 1:
        raise ValueError("n_samples must be >= 1")
    model, tok = _resolve(model_dir)
    problems = list(problems)
    t0 = time.time()
    prompts = render_prompts(tok, problems, chat_template, system_prompt)
    per_batch = max(1, batch_size // n_samples)
    texts, lengths, truncated, _ = _generate(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=per_batch,
                                             do_sample=True, temperature=temperature,
                                             num_return_sequences=n_samples, seed=seed, stop_token_ids=stop_token_ids)
    labels = [_label(p) for p in problems for _ in range(n_samples)]
    scores = _score(texts, labels, verifier)
    groups = [scores[i * n_samples:(i + 1) * n_samples] for i in range(len(problems))]
    n = len(problems)
    mixed = sum(1 for g in groups if min(g) != max(g))
    right = sum(1 for g in groups if min(g) > 0)
    total = len(scores)
    return {
        "accuracy": sum(scores) / total if total else 0.0,
        "mixed": mixed / n if n else 0.0,
        "all_right": right / n if n else 0.0,
        "all_wrong": (n - mixed - right) / n if n else 0.0,
        "mean_length": sum(lengths) / total if total else 0.0,
        "truncated": sum(truncated) / total if total else 0.0,
        "n": n,
        "seconds": time.time() - t0,
        "groups": groups,
        "examples": texts[: 2 * n_samples],
    }


def measure_variant(model_dir, variant: str, *, n_greedy: int = 100, n_sampled: int = 64, n_samples: int = 4,
                    temperatures: Sequence[float] = (1.0, 0.7), max_new_tokens: int = 24, system_prompt=None,
                    seed: int = 1234, verifier: str = DEFAULT_VERIFIER, stop_token_ids: Sequence[int] = (),
                    log=print) -> dict:
    """Greedy accuracy on ``n_greedy`` held-out problems of ``variant`` and, per temperature, sampled
    accuracy and mixed-group share on the first ``n_sampled`` of them (the numbers of the table in
    :mod:`mindspeed_llm.demo.task`)."""
    from mindspeed_llm.demo.task import make_splits

    model_tok = _resolve(model_dir)
    _, test = make_splits(variant, n_test=n_greedy, seed=seed)
    result = {"variant": variant, "max_new_tokens": max_new_tokens,
              "system_prompt": repr(system_prompt) if system_prompt is not None else None}
    g = evaluate_hf(model_tok, test, max_new_tokens=max_new_tokens, batch_size=50, system_prompt=system_prompt,
                    verifier=verifier, stop_token_ids=stop_token_ids)
    result["greedy"] = {k: g[k] for k in ("accuracy", "mean_length", "truncated", "mean_prompt_tokens", "n", "seconds")}
    result["greedy_examples"] = [(s["problem"], s["answer"], s["response"], s["score"]) for s in g["samples"][:8]]
    log(json.dumps({"variant": variant, "greedy": result["greedy"]}), flush=True)
    for temp in temperatures:
        s = sample_hf(model_tok, test[:n_sampled], n_samples=n_samples, temperature=temp,
                      max_new_tokens=max_new_tokens, batch_size=64, system_prompt=system_prompt, verifier=verifier,
                      seed=seed, stop_token_ids=stop_token_ids)
        key = f"T{temp:g}"
        result[key] = {k: s[k] for k in ("accuracy", "mixed", "all_right", "all_wrong", "mean_length", "truncated",
                                         "n", "seconds")}
        result[key + "_examples"] = s["examples"]
        log(json.dumps({"variant": variant, key: result[key]}), flush=True)
    return result


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Greedy accuracy of a HF model on demo problems (or measure variants).")
    parser.add_argument("model_dir")
    parser.add_argument("--problems", help="a JSON / JSONL file of {problem, answer} rows")
    parser.add_argument("--measure", nargs="*", metavar="VARIANT", help="measure these task variants instead")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--verifier", default=DEFAULT_VERIFIER)
    parser.add_argument("--system-prompt", default=None,
                        help="system message; 'default' = the chat template's own default; omitted: none")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=[],
                        help="extra ids that end a reply (SmolLM2's newlines: 198 1116)")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[1.0, 0.7])
    parser.add_argument("--n-greedy", type=int, default=100)
    parser.add_argument("--n-sampled", type=int, default=64)
    parser.add_argument("--output", help="write the result JSON here")
    args = parser.parse_args(argv)
    system = TEMPLATE_DEFAULT if args.system_prompt == "default" else args.system_prompt
    if args.measure is not None:
        model_tok = load_hf(args.model_dir)
        results = []
        for name in args.measure:
            results.append(measure_variant(model_tok, name, n_greedy=args.n_greedy, n_sampled=args.n_sampled,
                                           max_new_tokens=args.max_new_tokens, system_prompt=system,
                                           temperatures=args.temperatures,
                                           verifier=args.verifier, stop_token_ids=args.stop_token_ids))
            if args.output:
                Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
        return 0
    if not args.problems:
        parser.error("--problems is required (or --measure)")
    from mindspeed_llm.demo.task import load_problems

    res = evaluate_hf(args.model_dir, load_problems(args.problems), args.max_new_tokens, args.batch_size,
                      system_prompt=system, verifier=args.verifier, stop_token_ids=args.stop_token_ids)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
