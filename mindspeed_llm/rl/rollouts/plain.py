"""One rollout: the generation engine's settings from the run's `SamplingSettings`, generation with the actor's own
weights into an `Experience`, the rollout's length statistics, what `--mask-truncated-completions` takes out of the
losses, and how far the sampler's log-probs are from the training forward's."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from mindspeed_llm import distributed
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.inference import SamplingConfig, generate
from mindspeed_llm.models import routing
from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics import mean_min_max
from mindspeed_llm.rl.rollouts.base import CarriesNothing
from mindspeed_llm.rl.settings import SamplingSettings


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


def rollout(actor_module, rows: Sequence[dict], sampling: SamplingConfig, iteration: int, tokenizer,
            samples_per_prompt: int = 1) -> Experience:
    """Generate `samples_per_prompt` responses per row, a row's samples consecutive; the rows' labels and the
    texts ride along in `Experience.sample_data`.

    Sample k of the prompt at position p of the global batch (`row["position"]`, set by the trainer) draws
    from the random stream p * n + k, so a sampled rollout is the same at any data-parallel size.
    """
    n = samples_per_prompt
    samples = [row for row in rows for _ in range(n)]
    prompts = [list(row["input_ids"]) for row in samples]  # never cut: the trainer checked --max-prompt-length
    sample_ids = [row.get("position", i) * n + k for i, row in enumerate(rows) for k in range(n)]
    # Ids past the tokenizer (Megatron's padded vocabulary) are never sampled.
    # A mixture of experts records each token's experts (--moe-routing-replay, moe/routing_mismatch)
    result = generate(actor_module, prompts, sampling, iteration=iteration, sample_ids=sample_ids,
                      vocab_size=len(tokenizer), record_routing=True)
    exp = Experience.from_rollout(result)
    exp.routing_recorded = routing.is_moe(actor_module)  # the old-log-prob pass compares routing with it
    exp.sample_data = SampleData.of_prompts(samples, finish_reasons=list(result.finish_reasons),
                                            texts=result.decode(tokenizer))
    return exp


def gather_context_parallel(exp: Experience) -> Experience:
    """Under context parallelism the CP ranks of a DP rank generate their own prompts (data-parallel replicas in the
    rollout, `distributed.rollout_parallel_info`), but every later forward splits each sequence over them: each
    then holds the whole DP rank's share, the CP ranks' rollouts one after another in CP rank order (their prompts'
    order in the global batch). The same Experience without context parallelism."""
    parts = distributed.gather_over_context_parallel(exp.select(torch.arange(exp.batch_size), device="cpu"))
    if len(parts) == 1:
        return exp
    return Experience.concat(parts, exp.tokens.device)


class SingleTurnRollouts(CarriesNothing):
    """The `single_turn` rollout strategy (`rollout_strategies`): one generation of the iteration's prompt batch,
    `samples_per_prompt` samples a prompt, the CP ranks' rollouts gathered (`gather_context_parallel`). Nothing
    carries over between iterations."""

    name = "single_turn"
    flag = None  # the default

    def __init__(self, actor_module, tokenizer, sampling: SamplingConfig, samples_per_prompt: int = 1):
        self.actor_module, self.tokenizer, self.sampling = actor_module, tokenizer, sampling
        self.samples_per_prompt = int(samples_per_prompt)

    @classmethod
    def from_settings(cls, settings, actor_module, tokenizer, sampling: SamplingConfig) -> "SingleTurnRollouts":
        return cls(actor_module, tokenizer, sampling, settings.algorithm.n_samples_per_prompt)

    def collect(self, iteration: int, prompts) -> Tuple[Experience, Dict[str, float]]:
        exp = rollout(self.actor_module, prompts.first_batch, self.sampling, iteration, self.tokenizer,
                      samples_per_prompt=self.samples_per_prompt)
        return gather_context_parallel(exp), {}  # the CP ranks' rollouts: this DP rank's share, on each of them


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
