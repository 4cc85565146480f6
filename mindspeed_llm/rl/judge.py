"""The LLM judge (--judge-load): a frozen causal LM in the run's SPMD group that reads each sample's prompt and
response through --judge-template, writes a verdict greedily with the continuous-batching engine on its own weights,
and whose verdict, read by the parser (`judge_verdicts.py`), is one more part of the sequence score
(`scoring.Scorer`, weighted by --judge-weight). docs/algorithms.md, "LLM-as-judge rewards".

What the judge sees, per sample: ``{prompt}`` the actor's prompt token ids decoded with the run's tokenizer without
special tokens (a chat template's role words stay: the prompt as the actor saw it), ``{response}`` the response
text as the verifiers read it (`SampleData.texts`; with tools the whole trajectory's text), ``{label}`` the
dataset's label. The rendered text goes to the judge's tokenizer: through its chat template as one user message
with the generation prompt when the tokenizer has one, else encoded as plain text with the tokenizer's special
tokens (BOS). The verdict is the judge's tokens decoded without special tokens.

Cost: one greedy generation per sample, of at most --judge-max-new-tokens tokens, batched over the DP rank's
samples (every rank of a model-parallel group generates the same batch; the engine's limits are the rollout's,
--rollout-max-num-seqs / --rollout-max-num-batched-tokens). A judge prompt that leaves fewer than
--judge-max-new-tokens positions of the judge's context (`max_position_embeddings`) is not generated: its verdict
is empty and unparsed (`judge/too_long`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl import judge_verdicts
from mindspeed_llm.rl.judge_verdicts import JudgeTemplate, Parser


def generate(*args, **kwargs):
    """`inference.generate`, imported on first use (megatron-core comes with it; a test replaces this name)."""
    from mindspeed_llm.inference import generate as engine_generate

    return engine_generate(*args, **kwargs)


@dataclass
class Verdicts:
    """A batch's judgement: each sample's verdict text, its score (the parser's, else --judge-unparsed-score) and
    whether it parsed, with the metrics `judge/*`."""

    texts: List[str]
    scores: List[float]
    parsed: List[bool]
    metrics: Dict[str, float]


def prompt_texts(exp, tokenizer) -> List[str]:
    """Each sample's prompt decoded with the run's `tokenizer`, without special tokens."""
    return [tokenizer.decode(exp.tokens[i, : int(exp.prompt_lengths[i])].tolist(), skip_special_tokens=True)
            for i in range(exp.batch_size)]


class Judge:
    """The judge of a run: its frozen model (None: a stand-in whose `write` is overridden), its tokenizer, template
    and parser, and how its scores enter the sequence score. `__call__(exp, timers)` gives the batch's `Verdicts`."""

    def __init__(self, model, tokenizer, template: JudgeTemplate, parser: Parser, run_tokenizer, *,
                 weight: float = 1.0, unparsed_score: float = 0.0, max_new_tokens: int = 256, offload: bool = False,
                 max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None):
        self.model, self.tokenizer, self.template, self.parser = model, tokenizer, template, parser
        self.run_tokenizer = run_tokenizer
        self.weight, self.unparsed_score = float(weight), float(unparsed_score)
        self.max_new_tokens, self.offload = int(max_new_tokens), offload
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.uses_chat_template = bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def from_settings(cls, settings, run_tokenizer) -> Optional["Judge"]:
        """The run's judge (None without --judge-load): its template and parser (which `validate_args` checked),
        tokenizer (default the run's), then the frozen model (`roles.load_judge`), whose vocabulary must hold the
        tokenizer's ids."""
        judge = settings.judge
        if judge.judge_load is None:
            return None
        from mindspeed_llm.rl.update.roles import load_judge

        template = judge_verdicts.read_template(judge.judge_template)
        parser = judge_verdicts.load_parser(judge.judge_parser)
        tokenizer = run_tokenizer
        if judge.judge_tokenizer_name_or_path is not None:
            tokenizer = _load_tokenizer(judge.judge_tokenizer_name_or_path)
        model = load_judge(settings)
        vocab = model.model_spec.vocab_size
        if len(tokenizer) > vocab:
            which = (f"--judge-tokenizer-name-or-path {judge.judge_tokenizer_name_or_path}"
                     if judge.judge_tokenizer_name_or_path else "the run's tokenizer (--tokenizer-name-or-path)")
            raise ArgumentError(f"{which} has {len(tokenizer)} tokens but the judge's vocabulary (--judge-load "
                                f"{judge.judge_load}) has {vocab}: give the judge's own tokenizer with "
                                "--judge-tokenizer-name-or-path")
        sampling = settings.sampling
        return cls(model, tokenizer, template, parser, run_tokenizer, weight=judge.judge_weight,
                   unparsed_score=judge.judge_unparsed_score, max_new_tokens=judge.judge_max_new_tokens,
                   offload=settings.offload.offload_ref_reward, max_num_seqs=sampling.rollout_max_num_seqs,
                   max_num_batched_tokens=sampling.rollout_max_num_batched_tokens)

    # ------------------------------------------------------------------ the judge's prompts
    def prompts(self, exp) -> List[str]:
        """The rendered template of each sample of `exp` (module doc)."""
        data = exp.sample_data
        n = exp.batch_size
        labels = data.labels or [None] * n
        texts = data.texts or [""] * n
        return [self.template.render(prompt, response, label)
                for prompt, response, label in zip(prompt_texts(exp, self.run_tokenizer), texts, labels)]

    def encode(self, text: str) -> List[int]:
        """`text` as the judge's token ids: its chat template's user turn with the generation prompt, if it has one."""
        if self.uses_chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def context(self) -> Optional[int]:
        """The judge's context length (None: unknown, no limit checked)."""
        spec = getattr(self.model, "model_spec", None)
        return getattr(spec, "max_position_embeddings", None)

    # ------------------------------------------------------------------ the verdicts
    def write(self, prompts: Sequence[List[int]]) -> List[str]:
        """The judge's greedy verdicts on `prompts` (token ids), one engine call; the same on every rank of the
        model-parallel group."""
        from mindspeed_llm.inference import SamplingConfig

        tok = self.tokenizer
        eos = tok.eos_token_id
        sampling = SamplingConfig(do_sample=False, max_new_tokens=self.max_new_tokens, eos_token_id=eos,
                                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos,
                                  return_log_probs=False, max_num_seqs=self.max_num_seqs,
                                  max_num_batched_tokens=self.max_num_batched_tokens)
        rollout = generate(self.model, [list(p) for p in prompts], sampling, vocab_size=len(tok),
                           sample_ids=list(range(len(prompts))))
        return rollout.decode(tok)

    def __call__(self, exp, timers) -> Verdicts:
        from mindspeed_llm.rl.update.roles import on_device

        ids = [self.encode(text) for text in self.prompts(exp)]
        n, limit = len(ids), self.context()
        kept = [i for i, p in enumerate(ids) if limit is None or len(p) + self.max_new_tokens <= limit]
        texts, scores, parsed = [""] * n, [self.unparsed_score] * n, [False] * n  # too long: empty, unparsed
        if kept:
            with on_device(self.model, self.offload, timers):  # --offload-ref-reward: brought in for the call
                written = self.write([ids[i] for i in kept])
            got, ok = judge_verdicts.score_verdicts(self.parser, written, self.unparsed_score)
            for i, text, score, read in zip(kept, written, got, ok):
                texts[i], scores[i], parsed[i] = text, score, read
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        share = 1.0 / max(n, 1)
        metrics = {"judge/score_mean": sum(scores) * share, "judge/unparsed": (n - sum(parsed)) * share,
                   "judge/too_long": (n - len(kept)) * share, "judge/verdict_length_mean": sum(lengths) * share,
                   "judge/prompt_length_mean": sum(map(len, ids)) * share}
        return Verdicts(texts, scores, parsed, metrics)


def _load_tokenizer(path: str):
    """The judge's own tokenizer from a local folder (nothing downloaded), named by its flag when it fails."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers' own message does not name our flag
        raise ArgumentError(f"--judge-tokenizer-name-or-path {path}: cannot load a tokenizer ({exc}); give a local "
                            "Hugging Face tokenizer folder (convert_ckpt.py copies one next to the weights)") from exc
