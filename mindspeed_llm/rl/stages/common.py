"""What the trl_ppo and grpo stages share: loading their models, one rollout, scoring, the clipped policy
loss, and rollout statistics. Each piece is a function; the stages compose them (the update loop itself is
`rl/ppo_loop.py`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence

import torch

from mindspeed_llm import device
from mindspeed_llm.arguments import ArgumentError
from mindspeed_llm.checkpoint import load_megatron_weights, load_spec
from mindspeed_llm.inference import SamplingConfig, generate
from mindspeed_llm.models import ModelSpec, build_model
from mindspeed_llm.rl import rewards as rule_rewards
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.metrics import length_stats
from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.passes import response_logprobs, reward_scores
from mindspeed_llm.rl.update import OptimizerSettings, TrainableModel


# ---------------------------------------------------------------------------------------------- models
def _checked_spec(root: str, flag: str, args) -> ModelSpec:
    spec = load_spec(root)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "vocab_size"):
        wanted = getattr(args, name, None)
        if wanted is not None and wanted != getattr(spec, name):
            raise ValueError(
                f"--{name.replace('_', '-')} {wanted} does not match the checkpoint {flag} {root} "
                f"({name}={getattr(spec, name)}); drop the flag or convert the right model"
            )
    return spec


def load_model(root: str, flag: str, args, value_head: bool = False):
    """A GPTModel (or value-head model) for this rank on the accelerator, weights from a Megatron checkpoint
    at `root` (built in host memory, as megatron's CPU initialisation does, then moved).

    Every problem (missing files, a causal LM where a value head is needed, a TP/PP the model cannot be
    split into, a spec that contradicts the model flags) is raised before any compute, naming `flag`.
    """
    try:
        spec = _checked_spec(root, flag, args)
        model = build_model(spec, params_dtype=args.params_dtype, value_head=value_head)
        load_megatron_weights(model, root)
    except (ValueError, FileNotFoundError) as exc:
        raise ArgumentError(f"{flag} {root}: {exc}") from exc
    return model.to(device.current_device())


def frozen(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def trainable(model, args, name: str) -> TrainableModel:
    """The actor or the critic with its optimizer and LR schedule from the command line."""
    critic = name == "critic"
    schedule_on_resume = ("override" if args.override_opt_param_scheduler else
                          "checkpoint" if args.use_checkpoint_opt_param_scheduler else "check")
    return TrainableModel(model, OptimizerSettings(
        lr=args.critic_lr if critic else args.lr, optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
        min_lr=args.min_lr, lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
        schedule_on_resume=schedule_on_resume, lr_flag="--critic-lr" if critic else "--lr",
    ), name=name, check_finite=args.check_for_nan_in_loss_and_grad)


def load_reward_model(args):
    """The frozen reward model (value head) of `--reward-model` (in host memory with --offload-ref-reward)."""
    return offloaded(frozen(load_model(args.reward_model, "--reward-model", args, value_head=True)),
                     args.offload_ref_reward)


def check_same_vocab(models: Dict[str, Optional[torch.nn.Module]]) -> None:
    """All models of a stage read the same token ids (None entries: roles this run does not load)."""
    sizes = {name: m.model_spec.vocab_size for name, m in models.items() if m is not None}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ArgumentError(f"the models disagree on vocabulary size ({listed}); all must share one tokenizer")


def offloaded(model, offload: bool):
    """With --offload-ref-reward, a frozen model waits in host memory until `on_device` brings it in."""
    return model.to("cpu") if offload else model


@contextlib.contextmanager
def on_device(model, offload: bool, timers):
    """With `offload`, bring a frozen model to the accelerator for the block and back to host memory after it,
    timed as `timing/ref_onload` and `timing/ref_offload` (MindSpeed-RL's names; ~0 s on a CPU machine)."""
    if not offload:
        yield model
        return
    with timers("ref_onload"):
        model.to(device.current_device())
    try:
        yield model
    finally:
        with timers("ref_offload"):
            model.to("cpu")


# ---------------------------------------------------------------------------------------------- rollout
def sampling_config(args, tokenizer, greedy: Optional[bool] = None) -> SamplingConfig:
    do_sample = args.do_sample if greedy is None else not greedy
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SamplingConfig(
        do_sample=do_sample, temperature=args.temperature, top_k=args.top_k or None,
        top_p=args.top_p if args.top_p < 1.0 else None, max_new_tokens=args.max_new_tokens,
        max_length=args.max_length, eos_token_id=eos, stop_token_ids=tuple(args.stop_token_ids),
        pad_token_id=pad, seed=args.seed,
    )


def rollout(actor_module, rows: Sequence[dict], sampling: SamplingConfig, iteration: int, tokenizer,
            samples_per_prompt: int = 1) -> Experience:
    """Generate `samples_per_prompt` responses per row, a row's samples consecutive; the rows' labels and the
    texts ride along in `Experience.extras`.

    Sample k of the prompt at position p of the global batch (`row["position"]`, set by the trainer) draws
    from the random stream p * n + k, so a sampled rollout is the same at any data-parallel size.
    """
    n = samples_per_prompt
    samples = [row for row in rows for _ in range(n)]
    prompts = [list(row["input_ids"]) for row in samples]  # never cut: the trainer checked --max-prompt-length
    sample_ids = [row.get("position", i) * n + k for i, row in enumerate(rows) for k in range(n)]
    # Ids past the tokenizer (Megatron's padded vocabulary) are never sampled.
    result = generate(actor_module, prompts, sampling, iteration=iteration, sample_ids=sample_ids,
                      vocab_size=len(tokenizer))
    exp = Experience.from_rollout(result)
    exp.group_size = n
    exp.extras["labels"] = [row.get("labels") for row in samples]
    exp.extras["indices"] = [row.get("index") for row in samples]
    exp.extras["finish_reasons"] = list(result.finish_reasons)  # "eos" | "stop" | "length"
    exp.extras["texts"] = result.decode(tokenizer)
    return exp


def rollout_metrics(exp: Experience) -> Dict[str, float]:
    metrics = {}
    metrics.update(length_stats("response_length", exp.response_lengths))
    metrics.update(length_stats("prompt_length", exp.prompt_lengths))
    reasons = exp.extras["finish_reasons"]
    # Share of responses cut by --max-new-tokens / --max-length rather than ended by EOS or a stop token.
    metrics["response_clip_ratio"] = sum(r == "length" for r in reasons) / max(len(reasons), 1)
    return metrics


# ---------------------------------------------------------------------------------------------- scoring
class Scorer:
    """Sequence scores from rule verifiers and/or a reward model (weighted sum), with their metrics."""

    @classmethod
    def from_args(cls, args, reward_model=None) -> "Scorer":
        return cls(args.verifier_function, args.verifier_weight, reward_model, args.reward_model_weight,
                   args.offload_ref_reward)

    def __init__(self, verifier_names: Sequence[str], verifier_weights: Sequence[float],
                 reward_model=None, reward_model_weight: float = 1.0, offload: bool = False):
        for name in verifier_names:
            rule_rewards.get_verifier(name)  # unknown names fail now, listing the valid ones
        self.verifier_names = list(verifier_names)
        self.verifier_weights = list(verifier_weights)
        self.reward_model = reward_model
        self.reward_model_weight = reward_model_weight
        self.offload = offload

    def __call__(self, exp: Experience, micro_batch_size: int, timers) -> tuple:
        on = exp.tokens.device
        total = torch.zeros(exp.batch_size, device=on)
        metrics: Dict[str, float] = {}
        if self.reward_model is not None:
            with timers("reward_model"), on_device(self.reward_model, self.offload, timers):
                rm = reward_scores([self.reward_model], exp, micro_batch_size)
            total += self.reward_model_weight * rm
            metrics["reward_model/mean"] = float(rm.mean())
        if self.verifier_names:
            with timers("rule_reward"):
                try:
                    rule_total, per_verifier, failures = rule_rewards.score_batch(
                        exp.extras["texts"], exp.extras["labels"], self.verifier_names, self.verifier_weights,
                    )
                except rule_rewards.MissingLabelError as exc:
                    index = exp.extras["indices"][exc.row_index]
                    raise ArgumentError(
                        f"prompt {index} of the dataset has no label, but --verifier-function {exc.verifier} needs "
                        "one; preprocess with a labels column (--map-keys '{\"labels\": \"answer\"}', "
                        "R1AlpacaStyleInstructionHandler)"
                    ) from exc
            total += torch.as_tensor(rule_total, dtype=torch.float32, device=on)
            metrics.update(rule_rewards.reward_metrics(per_verifier, failures))
        return total, metrics


def apply_missing_eos_penalty(scores: torch.Tensor, exp: Experience, penalty: Optional[float]) -> torch.Tensor:
    """TRL's `missing_eos_penalty`: subtract it from the score of every response that did not end in EOS."""
    if penalty is None:
        return scores
    return scores - penalty * (~exp.ended_with_eos).float()


# ---------------------------------------------------------------------------------------------- loss
def clipped_policy_loss(args, logits, micro_batch, kl_coef: float = 0.0):
    """The actor's loss of both stages on one micro-batch: the clipped surrogate (`--clip-ratio`,
    `--clip-ratio-high`, `--dual-clip`, `--loss-agg-mode`), plus `kl_coef` x the KL to the reference
    (`--kl-penalty`; grpo's KL loss) and the entropy bonus (`--entropy-coeff`), over the loss mask.
    Returns (loss, metrics) as shares of the mini-batch's (its totals ride in the micro-batch, `ppo_loop`).
    Without `old_logp` in the micro-batch (see `ppo_loop.old_logp_is_current`) the old log-probs are `logp`'s."""
    logp, entropy = response_logprobs(logits, micro_batch, args.temperature, with_entropy=True)
    old_logp = micro_batch.get("old_logp")
    return core_algos.policy_loss(
        logp, logp.detach() if old_logp is None else old_logp, micro_batch["advantages"], micro_batch["loss_mask"],
        clip_low=args.clip_ratio, clip_high=args.clip_ratio_high, dual_clip=args.dual_clip, agg=args.loss_agg_mode,
        max_len=args.max_new_tokens, ref_logp=micro_batch.get("ref_logp"), kl_coef=kl_coef,
        kl_kind=args.kl_penalty, entropy=entropy, entropy_coeff=args.entropy_coeff,
        total_tokens=micro_batch["total_tokens"], total_sequences=micro_batch["total_sequences"],
    )


def prefixed(prefix: str, metrics: Dict[str, float]) -> Dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}
