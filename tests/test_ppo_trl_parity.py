"""Stage-level parity: `--stage trl_ppo` against TRL 1.12 `PPOTrainer` (trl.experimental.ppo), same numbers.

Both sides start from the same weights (the tiny Qwen2 policy `hf_actor` and the Qwen2ForSequenceClassification
`hf_reward` of `stage_assets`, fp32), see the same prompts and the same FIXED responses, and run two iterations
(one PPO epoch, one mini-batch of 4 rows in two micro-batches of 2, lr 1e-7, constant LR). The metrics each side
logs for both iterations must agree within 1e-5.

Our side is the real stage (`mindspeed_llm.rl.trainer.run(parse_args(posttrain_argv(...) + ...))` in one gloo
process); only the sampler of the rollout is replaced: `mindspeed_llm.rl.stages.common.generate` returns a
`Rollout` holding the fixed responses and, as the sampler's log-probs (which the stage takes as the old ones with
one epoch and one mini-batch, as TRL does), the policy's own at the sampling temperature. Everything downstream
(layout, reference log-probs, critic values, reward-model score, KL rewards, GAE, whitening, the Megatron
updates, metric reduction, the JSONL logger) runs unmodified. TRL's side is `PPOTrainer.train()` with `batch_generation` replaced by a function that returns the
same responses and, as the generation "scores", the policy's logits on them divided by TRL's generation
temperature (what `generate(..., output_scores=True)` returns for `do_sample` with only a temperature warper).

Rollouts that exercise TRL's layout rules: ragged responses of width 6 = `response_length` = `--max-new-tokens`,
some ending in EOS (one after a single token, one on the last column, so its score cannot go one past it) and some
truncated without EOS (score on the last column); prompts of DIFFERENT lengths (our own preprocessed arithmetic
prompts with 1..4-digit numbers): TRL left-pads the queries and derives position ids from the attention mask, our
layout right-pads `prompt + response` per row with positions 0..T-1, so equal values check that both treat
padding right.

Aligned defaults (ours -> TRL), all set explicitly on both sides:

* kl_coef 0.05 (ours defaults to 0.3), k1 estimator (`--kl-penalty k1` / `kl_estimator="k1"`);
* cliprange 0.2, cliprange_value 0.2, vf_coef 0.1, gamma 1.0, lam 0.95 (equal defaults, set anyway);
* whiten_rewards off on both; advantages are always whitened on both;
* missing_eos_penalty: None on both (our flag unset);
* stop token: TRL `stop_token="eos"` (truncates after the first EOS, as our rollout ends rows there);
* temperature: TRL divides logits by `temperature + 1e-7` (also for the old log-probs, through the generation
  scores); we pass `--temperature 1.0000001`, the same divisor;
* optimizers: TRL trains policy and value model with ONE AdamW on `pg_loss + vf_coef * vf_loss`, we use two
  Megatron Adams (actor on `pg_loss`, critic on `vf_coef * vf_loss`). The two parameter sets are disjoint, so the
  gradients are the same; Adam (betas 0.9/0.999, eps 1e-8, weight decay 0 on both) is per parameter, so the steps
  are the same too, provided nothing couples them: TRL's PPO loop never clips gradients (it ignores
  `max_grad_norm`), so we pass `--clip-grad 0` (off); lr 1e-7 (`--lr` = `--critic-lr`) constant on both;
* batches: global batch 4 = TRL `per_device_train_batch_size 2 x gradient_accumulation_steps 2`, one mini-batch
  (`--ppo-mini-batch-size 4` / `num_mini_batches 1`), `--micro-batch-size 2`, `local_rollout_forward_batch_size 4`;
  TRL's micro-batch composition comes from `np.random.permutation`, ours from a seeded `torch.randperm`: the test
  records our order (`Experience.select`) and hands it to TRL's loop, and feeds TRL the prompts our sampler drew,
  in order, with an unshuffled data loader;
* precision fp32 on both (TRL's config defaults to bf16: `bf16=False`), dropout is 0 in both models;
* the reference: TRL takes any `ref_model`; our stage loads actor and reference from `--ref-model`, which would
  make the KL of iteration 1 exactly 0 and its comparison empty. So the reference is a perturbed copy of the policy
  (weights + N(0, 0.02) noise), handed to TRL as `ref_model` and loaded into our stage's `reference` right after
  the stage is built (`load_megatron_weights` from its Megatron conversion).

What is compared, and why it means something. With lr 1e-7 and one epoch the ratio is 1 on every first step
(old log-probs come from the same weights), so TRL's clipped `pg_loss` is `-masked_mean(A)` per micro-batch and its
average over the two micro-batches is not 0 only because the micro-batches hold different tokens of the whitened
advantages (whose mean over the whole batch is 0): equal values check the advantages AND the micro-batch
composition. Per iteration:

* `actor/pg_loss` vs `loss/policy_avg`;
* `critic/vf_loss` (the unscaled value loss; the critic backpropagates `vf_coef *` it) vs `loss/value_avg`
  -- values at TRL's positions, returns from GAE over the p1 value mask;
* `kl/mean` vs `objective/kl`, `non_score_reward` vs `objective/non_score_reward`, `score/mean` vs
  `objective/scores` (reward model read at the last real token);
* `actor/abs_pg_loss` = `masked_mean(max(|A r|, |A clip(r)|))`, which TRL does not log, vs the same formula on
  TRL's own whitened advantages and log-probs captured inside its loop (wrapping `masked_whiten` and
  `selective_log_softmax`) -- a check of the advantages' magnitudes, not only of their micro-batch means;
* the clip fractions (`actor/pg_clipfrac` vs `policy/clipfrac_avg`, `critic/vf_clipfrac` vs `val/clipfrac_avg`)
  and `actor/lr` vs `lr`.

Iteration 2 runs after one optimizer step on each side. At lr 1e-7 that step moves the iteration-2 metrics by
only ~1e-5 (a run without the update differs from TRL by up to 1.5e-5 in `kl/mean`), so the updates are compared
directly as well: the change over the run of some actor and critic weights (final norm, layer-1 MLP down
projection, the output layer at the response tokens' rows / the value head) must be non-zero and equal to TRL's
within 1% of lr.
"""

import json
import sys
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from multiproc import run_distributed  # noqa: E402
from stage_assets import posttrain_argv  # noqa: E402

WIDTH = 6  # response_length / --max-new-tokens; the fixed responses use all of it
TEMPERATURE = 1.0
TRL_TEMPERATURE_EPS = 1e-7  # TRL divides logits by temperature + 1e-7
LR = 1e-7
KL_COEF = 0.05
SEED = 7
TOL = 1e-5
ITERS = 2


# ---------------------------------------------------------------------------------------------- fixtures
def _fixed_responses(eos):
    """Per iteration, the 4 responses (token lists): EOS-ended and truncated, ragged, EOS on the last column."""
    g = torch.Generator().manual_seed(123)

    def words(n):
        return torch.randint(1000, 100000, (n,), generator=g).tolist()

    return [
        [words(3) + [eos], words(WIDTH), words(WIDTH - 1) + [eos], [eos]],
        [words(1) + [eos], words(WIDTH), words(4) + [eos], words(2) + [eos]],
    ]


def _ragged_prompts(root: Path, tokenizer_dir: str) -> str:
    """Arithmetic prompts whose numbers have 1..4 digits (Qwen splits digits), so token lengths differ."""
    from mindspeed_llm.data.preprocess import preprocess

    rows, g = [], torch.Generator().manual_seed(5)
    for i in range(8):
        a = int(torch.randint(1, 10 ** (1 + i % 4), (1,), generator=g))
        b = int(torch.randint(1, 10 ** (1 + (i // 2) % 3), (1,), generator=g))
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    raw = root / "ragged.json"
    raw.write_text(json.dumps(rows))
    prefix = root / "data" / "ragged"
    preprocess(["--input", str(raw), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                tokenizer_dir, "--output-prefix", str(prefix), "--handler-name", "R1AlpacaStyleInstructionHandler",
                "--prompt-type", "qwen", "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}),
                "--log-interval", "0"])
    return str(prefix)


def _perturbed_reference(hf_actor: str, root: Path, tokenizer_dir: str):
    """The policy's weights + N(0, 0.02) noise, as a HF folder and its Megatron conversion."""
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    model = AutoModelForCausalLM.from_pretrained(hf_actor, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    hf_dir, mg_dir = root / "hf_ref", root / "mg_ref"
    model.save_pretrained(hf_dir)
    convert_hf_to_mg(str(hf_dir), str(mg_dir), 1, 1, tokenizer_dir=tokenizer_dir, progress=False)
    return str(hf_dir), str(mg_dir)


# ---------------------------------------------------------------------------------------------- our side
def _fixed_rollout(prompts, responses, pad, eos):
    from mindspeed_llm.inference import Rollout

    batch = len(prompts)
    prompt_t = torch.full((batch, max(map(len, prompts))), pad, dtype=torch.long)
    resp_t = torch.full((batch, WIDTH), pad, dtype=torch.long)
    mask = torch.zeros((batch, WIDTH), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        prompt_t[b, :len(p)] = torch.tensor(p)
        resp_t[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    ended = torch.tensor([r[-1] == eos for r in responses])
    return Rollout(
        prompts=prompt_t, prompt_lengths=torch.tensor([len(p) for p in prompts]), responses=resp_t,
        response_mask=mask, response_lengths=mask.sum(-1), ended_with_eos=ended,
        finish_reasons=["eos" if e else "length" for e in ended.tolist()], log_probs=None, pad_token_id=pad,
    )


def _our_stage(rank, world_size, argv, responses, reference_root):
    """Runs the real trl_ppo stage with fixed responses; returns the prompts it drew and its row orders."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.checkpoint import load_megatron_weights
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.experience import Experience
    from mindspeed_llm.rl.passes import policy_logprobs
    from mindspeed_llm.rl.stages import STAGES, common

    record = {"prompts": [], "orders": []}

    def fixed_generate(model, prompts, sampling, *, iteration=0, **_):
        record["prompts"].append([list(p) for p in prompts])
        rollout = _fixed_rollout(prompts, responses[iteration - 1], sampling.pad_token_id, sampling.eos_token_id)
        # The sampler's log-probs, which the stage takes as the old ones (one epoch, one mini-batch), as TRL
        # reads them off its generation scores: the policy's, at the sampling temperature.
        rollout.log_probs = policy_logprobs([model], Experience.from_rollout(rollout), len(prompts),
                                            sampling.temperature)
        return rollout

    select = Experience.select

    def recording_select(self, rows):
        record["orders"].append(torch.as_tensor(rows).tolist())
        return select(self, rows)

    stage_cls = STAGES["trl_ppo"]
    built = {}

    def stage_with_reference(args, tokenizer):
        stage = stage_cls(args, tokenizer)
        load_megatron_weights(stage.reference, reference_root)
        built["stage"] = stage
        built["initial"] = _watched(stage.actor.module, stage.critic.module, responses)
        return stage

    common.generate = fixed_generate
    Experience.select = recording_select
    STAGES["trl_ppo"] = stage_with_reference
    trainer.run(parse_args(argv, world_size))
    stage = built["stage"]
    final = _watched(stage.actor.module, stage.critic.module, responses)
    record["deltas"] = {k: final[k] - built["initial"][k] for k in final}
    return record


# Weights whose change over the run is compared (Megatron name, HF name); the actor's output layer only at the
# rows of the response tokens (its full delta is 151,936 x 64).
WATCHED = (
    ("actor", "decoder.final_layernorm.weight", "model.norm.weight"),
    ("actor", "decoder.layers.1.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight"),
    ("actor", "output_layer.weight", "lm_head.weight"),
    ("critic", "decoder.final_layernorm.weight", "model.norm.weight"),
    ("critic", "decoder.layers.1.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight"),
    ("critic", "output_layer.weight", "score.weight"),
)


def _response_token_rows(responses):
    return sorted({t for batch in responses for r in batch for t in r})


def _watched(actor, critic, responses, megatron=True):
    """{role/name: fp32 copy} of the WATCHED tensors of Megatron (or, with megatron=False, HF) models."""
    models = {"actor": actor, "critic": critic}
    out = {}
    for role, mg_name, hf_name in WATCHED:
        params = dict(models[role].named_parameters())
        tensor = params[mg_name if megatron else hf_name].detach().float().clone()
        if role == "actor" and hf_name == "lm_head.weight":
            tensor = tensor[_response_token_rows(responses)]
        out[f"{role}/{hf_name}"] = tensor
    return out


# ---------------------------------------------------------------------------------------------- TRL's side
def _trl_ppo(paths, hf_ref, prompts_per_iter, responses, orders, out_dir):
    """TRL's PPOTrainer.train() on the same prompts / responses / row orders; its logs and captured internals."""
    import numpy as np
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              DataCollatorWithPadding)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.ppo import PPOConfig, PPOTrainer
        from trl.experimental.ppo import ppo_trainer as trl_ppo

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"], padding_side="left")
    fp32 = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(paths["hf_actor"], **fp32)
    ref_policy = AutoModelForCausalLM.from_pretrained(hf_ref, **fp32)
    value_model = AutoModelForSequenceClassification.from_pretrained(paths["hf_reward"], num_labels=1, **fp32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(paths["hf_reward"], num_labels=1, **fp32)
    all_prompts = [p for batch in prompts_per_iter for p in batch]
    dataset = Dataset.from_dict({"input_ids": all_prompts})
    config = PPOConfig(
        output_dir=str(out_dir), report_to="none", seed=SEED, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", num_sample_generations=0, logging_steps=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=1, num_ppo_epochs=1,
        local_rollout_forward_batch_size=4, total_episodes=4 * ITERS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, kl_coef=KL_COEF, kl_estimator="k1", cliprange=0.2, cliprange_value=0.2, vf_coef=0.1,
        gamma=1.0, lam=0.95, whiten_rewards=False, temperature=TEMPERATURE, response_length=WIDTH,
        stop_token="eos", missing_eos_penalty=None,
    )
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         eval_dataset=dataset)
    # Our sampler's prompts, in order; TRL would shuffle.
    trainer.dataloader = DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=DataCollatorWithPadding(tokenizer))

    logs, captured = [], {"whitened": [], "logprobs": []}
    trainer.log = lambda metrics, *a, **k: logs.append(dict(metrics))
    step = {"i": 0}

    def fixed_batch_generation(model, queries, local_bs, pad_token_id, generation_config):
        rows = responses[step["i"]]
        step["i"] += 1
        resp = torch.full((queries.shape[0], WIDTH), pad_token_id, dtype=torch.long)
        for b, r in enumerate(rows):
            resp[b, :len(r)] = torch.tensor(r)
        query_responses = torch.cat([queries, resp], 1)
        with torch.no_grad():
            logits = trl_ppo.forward(model, query_responses, pad_token_id).logits[:, queries.shape[1] - 1:-1]
        return query_responses, logits / generation_config.temperature

    masked_whiten = trl_ppo.masked_whiten
    selective_log_softmax = trl_ppo.selective_log_softmax

    def capture_whiten(values, mask, shift_mean=True):
        out = masked_whiten(values, mask, shift_mean)
        captured["whitened"].append((out.detach().clone(), mask.clone()))
        return out

    def capture_logprobs(logits, index):
        out = selective_log_softmax(logits, index)
        captured["logprobs"].append(out.detach().clone())
        return out

    row_orders = list(orders)
    shim = types.SimpleNamespace(random=types.SimpleNamespace(permutation=lambda n: np.array(row_orders.pop(0))))
    saved = {name: getattr(trl_ppo, name) for name in ("batch_generation", "masked_whiten", "selective_log_softmax",
                                                       "np")}
    trl_ppo.batch_generation = fixed_batch_generation
    trl_ppo.masked_whiten = capture_whiten
    trl_ppo.selective_log_softmax = capture_logprobs
    trl_ppo.np = shim
    initial = _watched(policy, value_model, responses, megatron=False)
    try:
        trainer.train()
    finally:
        for name, value in saved.items():
            setattr(trl_ppo, name, value)
    assert step["i"] == ITERS and not row_orders
    final = _watched(policy, value_model, responses, megatron=False)
    captured["deltas"] = {k: final[k] - initial[k] for k in final}
    return logs, captured


def _trl_abs_pg_loss(captured, orders, cliprange=0.2):
    """`mean_microbatch(masked_mean(max(|A r|, |A clip(r)|)))` from TRL's own advantages and log-probs."""
    per_iter = []
    # Per iteration TRL calls selective_log_softmax for: old (generation), reference, then one per micro-batch.
    logprobs = list(captured["logprobs"])
    for (adv, mask), order in zip(captured["whitened"], orders):
        old = logprobs.pop(0)
        logprobs.pop(0)  # reference
        values = []
        for micro in (order[:2], order[2:]):
            new = logprobs.pop(0)
            m = mask[micro]
            old_mb = old[micro].masked_fill(~m, 1.0)
            new_mb = new.masked_fill(~m, 1.0)
            ratio = torch.exp(new_mb - old_mb)
            a = adv[micro].masked_fill(~m, 0)
            abs_loss = torch.maximum((a * ratio).abs(), (a * ratio.clamp(1 - cliprange, 1 + cliprange)).abs())
            values.append(float((abs_loss * m).sum() / m.sum()))
        per_iter.append(sum(values) / len(values))
    assert not logprobs
    return per_iter


# ---------------------------------------------------------------------------------------------- the test
def test_trl_ppo_stage_matches_trl_ppo_trainer(stage_paths, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stage_paths["tokenizer"])
    eos = tokenizer.eos_token_id
    responses = _fixed_responses(eos)
    data = _ragged_prompts(tmp_path, stage_paths["tokenizer"])
    hf_ref, mg_ref = _perturbed_reference(stage_paths["hf_actor"], tmp_path, stage_paths["tokenizer"])
    metrics_path = tmp_path / "metrics.jsonl"
    argv = posttrain_argv(stage_paths, "trl_ppo", iters=ITERS, extra=[
        "--data-path", data, "--seed", str(SEED), "--lr", str(LR), "--critic-lr", str(LR),
        "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0",
        "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--ppo-mini-batch-size", "4", "--ppo-epochs", "1",
        "--max-new-tokens", str(WIDTH), "--temperature", repr(TEMPERATURE + TRL_TEMPERATURE_EPS),
        "--kl-coef", str(KL_COEF), "--kl-penalty", "k1", "--clip-ratio", "0.2", "--cliprange-value", "0.2",
        "--vf-coef", "0.1", "--gamma", "1.0", "--lam", "0.95", "--metrics-jsonl", str(metrics_path),
    ])
    (record,) = run_distributed(_our_stage, 1, argv, responses, mg_ref)
    ours = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [m["iteration"] for m in ours] == list(range(1, ITERS + 1))

    # Our actor and critic shuffle with the same seed: one order per iteration, used by both.
    orders = record["orders"][0::2]
    assert record["orders"][1::2] == orders and len(orders) == ITERS
    prompts = record["prompts"]
    assert len(prompts) == ITERS and all(len(p) == 4 for p in prompts)
    assert len({len(p) for batch in prompts for p in batch}) > 1, "the prompts should have different lengths"

    logs, captured = _trl_ppo(stage_paths, hf_ref, prompts, responses, orders, tmp_path / "trl")
    assert len(logs) == ITERS
    trl_abs = _trl_abs_pg_loss(captured, orders)

    pairs = {
        "actor/pg_loss": "loss/policy_avg",
        "critic/vf_loss": "loss/value_avg",
        "kl/mean": "objective/kl",
        "non_score_reward": "objective/non_score_reward",
        "score/mean": "objective/scores",
        "actor/pg_clipfrac": "policy/clipfrac_avg",
        "critic/vf_clipfrac": "val/clipfrac_avg",
        "actor/lr": "lr",
    }
    report, failures = [], []
    for it, (mine, theirs) in enumerate(zip(ours, logs), start=1):
        rows = [(ours_key, mine[ours_key], trl_key, theirs[trl_key]) for ours_key, trl_key in pairs.items()]
        rows.append(("actor/abs_pg_loss", mine["actor/abs_pg_loss"], "abs_pg_loss(TRL internals)", trl_abs[it - 1]))
        for ours_key, a, trl_key, b in rows:
            line = f"iter {it} {ours_key}={a:.9g} {trl_key}={b:.9g} diff={abs(a - b):.2e}"
            report.append(line)
            if not abs(a - b) <= TOL:
                failures.append(line)
    for key, ours_delta in record["deltas"].items():
        trl_delta = captured["deltas"][key]
        err = float((ours_delta - trl_delta).abs().max())
        scale = float(trl_delta.abs().max())
        same_sign = float(((ours_delta > 0) == (trl_delta > 0)).float().mean())
        line = f"delta {key}: max|trl|={scale:.3g} max|ours-trl|={err:.3g} same sign {same_sign:.4f}"
        report.append(line)
        # Two Adam steps of lr 1e-7 move weights by up to ~2e-7: demand that they moved, and moved alike.
        if not (scale > 0.5 * LR and err <= 0.01 * LR):
            failures.append(line)
    print("\n".join(report))
    assert not failures, "trl_ppo differs from TRL PPOTrainer:\n" + "\n".join(failures)

    # The comparisons are not of zeros: the quantities that carry information are clearly non-zero.
    for m in ours:
        for key in ("actor/pg_loss", "critic/vf_loss", "kl/mean", "score/mean", "actor/abs_pg_loss"):
            assert abs(m[key]) > 1e-3, (key, m[key])
