"""The `plain` sample generator and what every rollout shares: the generation engine's settings from the run's
`SamplingSettings`, one model turn a sample with the actor's own weights into an `Experience`, the CP ranks' rollouts
gathered, the rollout's length statistics, what `--mask-truncated-completions` takes out of the
losses, and how far the sampler's log-probs are from the training forward's."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from mindspeed_llm import distributed
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.inference import Rollout, SamplingConfig
from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics import mean_min_max
from mindspeed_llm.rl.settings import SamplingSettings


def generate(*args, **kwargs) -> Rollout:
    """`inference.generate`, imported on first use (this module is read at argument validation, before
    megatron-core is; a test replaces this name to stand in for the engine)."""
    from mindspeed_llm.inference import generate as engine_generate

    return engine_generate(*args, **kwargs)


def _is_moe(model) -> bool:
    from mindspeed_llm.models import routing

    return routing.is_moe(model)


def sampling_config(sampling: SamplingSettings, tokenizer, greedy: Optional[bool] = None) -> SamplingConfig:
    """The generation engine's settings of the run's `sampling` and the tokenizer's EOS / pad ids: sampling, lengths,
    stop ids, and the engine's limits (`--rollout-max-num-seqs`, `--rollout-max-num-batched-tokens`). `greedy`
    overrides `--do-sample`. A
    --stop-token-ids id the tokenizer cannot produce (generation never samples past it) is refused, naming the
    tokenizer's size."""
    outside = [t for t in sampling.stop_token_ids if not 0 <= t < len(tokenizer)]
    if outside:
        raise ArgumentError(f"--stop-token-ids {' '.join(map(str, outside))}: outside the tokenizer's ids 0.."
                            f"{len(tokenizer) - 1} (--tokenizer-name-or-path), so no response could ever stop there; "
                            "give ids of this tokenizer")
    do_sample = sampling.do_sample if greedy is None else not greedy
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SamplingConfig(
        do_sample=do_sample, temperature=sampling.temperature, top_k=sampling.top_k or None,
        top_p=sampling.top_p if sampling.top_p < 1.0 else None, max_new_tokens=sampling.max_new_tokens,
        max_length=sampling.max_length, eos_token_id=eos, stop_token_ids=tuple(sampling.stop_token_ids),
        pad_token_id=pad, seed=sampling.seed, max_num_seqs=sampling.rollout_max_num_seqs,
        max_num_batched_tokens=sampling.rollout_max_num_batched_tokens,
    )


class PlainGenerator:
    """The `plain` sample generator (`base.SampleGenerator`), the default: one model turn a sample, with the actor's
    own weights, each sample within --max-new-tokens (and --max-length). Ids past the tokenizer (Megatron's padded
    vocabulary) are never sampled; a mixture of experts records each token's experts (--moe-routing-replay,
    moe/routing_mismatch)."""

    name = "plain"
    flag = None  # the default
    budget_flag = "--max-new-tokens"
    observes = False
    continues = True

    def __init__(self, actor_module, tokenizer, sampling: SamplingConfig, samples_per_prompt: int = 1):
        self.actor_module, self.tokenizer, self.sampling = actor_module, tokenizer, sampling
        self.samples_per_prompt = int(samples_per_prompt)
        self.routing_recorded = actor_module is not None and _is_moe(actor_module)

    @classmethod
    def selected(cls, settings) -> bool:
        return True

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling: SamplingConfig) -> "PlainGenerator":
        return cls(actor_module, tokenizer, sampling, settings.algorithm.n_samples_per_prompt)

    @property
    def whole_budget(self) -> int:
        return self.sampling.max_new_tokens

    def response_budgets(self, prompt_lengths: Sequence[int]) -> List[int]:
        return self.sampling.response_budgets(list(prompt_lengths))

    def generate(self, iteration: int, samples: Sequence[dict], sample_ids: Sequence[int], continuations=None,
                 budgets=None, sampling: Optional[SamplingConfig] = None) -> Rollout:
        prompts = [list(row["input_ids"]) for row in samples]  # never cut: the trainer checked --max-prompt-length
        return self.engine(iteration, prompts, sample_ids, continuations, budgets, sampling or self.sampling)

    def engine(self, iteration: int, prompts: List[List[int]], sample_ids: Sequence[int], continuations, budgets,
               sampling: SamplingConfig, turns=None, options=None) -> Rollout:
        """One `inference.generate` call on the actor (what a subclass wraps, and a test replaces)."""
        return generate(self.actor_module, prompts, sampling, iteration=iteration, sample_ids=list(sample_ids),
                        vocab_size=len(self.tokenizer), record_routing=True, continuations=continuations,
                        response_budgets=budgets, turns=turns, options=options)

    def carried(self, reason: str, length: int, whole: int) -> bool:
        # a response that reached the call's budget before its whole one was cut, not finished
        return reason == "unfinished" or (reason == "length" and length < whole)

    def experience(self, result: Rollout, samples: Sequence[dict], **sample_data) -> Experience:
        """The Experience of `result`; the rows' labels and the texts ride along in `Experience.sample_data`."""
        exp = Experience.from_rollout(result)
        exp.routing_recorded = self.routing_recorded  # the old-log-prob pass compares routing with it
        exp.sample_data = SampleData.of_prompts(samples, finish_reasons=list(result.finish_reasons),
                                                texts=result.decode(self.tokenizer), **sample_data)
        return exp

    def metrics(self, exp: Experience, stats: Sequence[Dict[str, float]], seconds: float) -> Dict[str, float]:
        return {}


def gather_context_parallel(exp: Experience) -> Experience:
    """Under context parallelism the CP ranks of a DP rank generate their own prompts (data-parallel replicas in the
    rollout, `distributed.rollout_parallel_info`), but every later forward splits each sequence over them: each
    then holds the whole DP rank's share, the CP ranks' rollouts one after another in CP rank order (their prompts'
    order in the global batch). The same Experience without context parallelism."""
    parts = distributed.gather_over_context_parallel(exp.select(torch.arange(exp.batch_size), device="cpu"))
    if len(parts) == 1:
        return exp
    return Experience.concat(parts, exp.tokens.device)


def rollout_metrics(exp: Experience) -> Dict[str, float]:
    """`response_length/*`: the model's own tokens of each response (`Experience.action_lengths`; the tool-response
    tokens of a multi-turn rollout left out), and with tool tokens `response_length_with_tools/*`, every token fed
    after the prompt (what the token budgets count); `prompt_length/*`; `response_clip_ratio`."""
    metrics = {}
    metrics.update(mean_min_max("response_length", exp.action_lengths))
    if exp.tool_mask is not None:
        metrics.update(mean_min_max("response_length_with_tools", exp.response_lengths))
    metrics.update(mean_min_max("prompt_length", exp.prompt_lengths))
    # Share of responses cut by --max-new-tokens / --max-length rather than ended by EOS or a stop token.
    cut = truncated(exp)
    metrics["response_clip_ratio"] = float(cut.sum()) / max(len(cut), 1)
    return metrics


def truncated(exp: Experience) -> torch.Tensor:
    """[B] bool: the responses cut by --max-new-tokens / --max-length (finish reason "length": neither EOS nor a stop
    token ended them)."""
    return torch.tensor([r == "length" for r in exp.sample_data.finish_reasons], dtype=torch.bool,
                        device=exp.response_mask.device)


def mask_truncated_completions(exp: Experience) -> Dict[str, float]:
    """`--mask-truncated-completions` (TRL's `mask_truncated_completions`): the truncated responses leave every loss
    through the loss mask (their lengths, read positions and scores stay). Returns the share taken out."""
    cut = truncated(exp)
    exp.truncated_out = cut  # `Experience.loss_mask` leaves them out
    return {"truncated_masked_fraction": float(cut.float().mean())}


def mismatch_metrics(exp: Experience, routing_mismatch: Optional[float] = None) -> Dict[str, float]:
    """`rollout_mismatch/*` (`core_algos.rollout_mismatch`) over the model's own response tokens (the sampler has no
    log-prob of a tool token), when the old log-probs come from
    a training forward (not the sampler's own) and the sampler's exist; and `moe/routing_mismatch`, the share of
    response token x MoE layer pairs whose top-k expert set differs between the rollout and that forward
    (`models/routing.py`), when that forward was a mixture of experts (`routing_mismatch`, what
    `passes.policy_logprobs` returned for it)."""
    metrics = {}
    if routing_mismatch is not None:
        metrics["moe/routing_mismatch"] = float(routing_mismatch)
    if exp.rollout_logp is None or exp.old_logp is None or exp.old_logp is exp.rollout_logp:
        return metrics
    stats = core_algos.rollout_mismatch(exp.old_logp, exp.rollout_logp, exp.action_mask)
    metrics.update({f"rollout_mismatch/{k}": float(v) for k, v in stats.items()})
    return metrics
