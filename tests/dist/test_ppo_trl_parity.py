"""Stage-level parity: `--stage trl_ppo` against TRL 1.12 `PPOTrainer` (trl.experimental.ppo), same numbers.

Both sides start from the same weights (the tiny Qwen2 policy `hf_actor` and the Qwen2ForSequenceClassification
`hf_reward` of `stage_assets`, fp32), see the same prompts and the same FIXED responses, and run two iterations
of two PPO epochs over one mini-batch of 4 rows, with plain SGD (no momentum) at a learning rate large enough
that the second epoch's policy ratios and values leave their clip ranges.

Our side is the real stage (`mindspeed_llm.rl.trainer.run(parse_args(posttrain_argv(...) + ...))` in one gloo
process); only the sampler of the rollout is replaced: `mindspeed_llm.rl.rollouts.plain.generate` returns a
`Rollout` holding the fixed responses. Everything downstream (layout, old / reference log-probs, critic values,
reward-model score, KL rewards, GAE, whitening, the Megatron updates, metric reduction, the JSONL logger) runs
unmodified. TRL's side is `PPOTrainer.train()` with `batch_generation` replaced by a function that returns the
same responses and, as the generation "scores", the policy's logits on them divided by TRL's generation
temperature (what `generate(..., output_scores=True)` returns for `do_sample` with only a temperature warper).

Rollouts that exercise TRL's layout rules: ragged responses of width 6 = `response_length` = `--max-new-tokens`,
some ending in EOS (one after a single token, one on the last column, so its score cannot go one past it) and some
truncated without EOS (score on the last column); prompts of DIFFERENT lengths (our own preprocessed arithmetic
prompts with 1..4-digit numbers): TRL left-pads the queries and derives position ids from the attention mask, our
layout right-pads `prompt + response` per row with positions 0..T-1, so equal values check that both treat
padding right.

Aligned settings (ours -> TRL), all set explicitly on both sides:

* kl_coef 0.05 (ours defaults to 0.3), k1 estimator (`--kl-penalty k1` / `kl_estimator="k1"`);
* cliprange 0.1, cliprange_value 0.02 (narrower than TRL's 0.2 so that a moderate step clips), vf_coef 0.1,
  gamma 1.0, lam 0.95;
* whiten_rewards off on both; advantages are always whitened on both;
* missing_eos_penalty: None on both (our flag unset);
* stop token: TRL `stop_token="eos"` (truncates after the first EOS, as our rollout ends rows there);
* temperature: TRL divides logits by `temperature + 1e-7` (also for the old log-probs, through the generation
  scores); we pass `--temperature 1.0000001`, the same divisor;
* optimizers: TRL trains policy and value model with ONE optimizer on `pg_loss + vf_coef * vf_loss`, we use two
  Megatron optimizers (actor on `pg_loss`, critic on `vf_coef * vf_loss`). The parameter sets are disjoint, so
  the gradients are the same, and plain SGD (`--optimizer sgd --sgd-momentum 0` / `optim="sgd"`, weight decay 0,
  constant LR on both) steps each parameter by `-lr * grad`. TRL's PPO loop never clips gradients (it ignores
  `max_grad_norm`), so we pass `--clip-grad 0` (off);
* batches: global batch 4 = one mini-batch = TRL `per_device_train_batch_size 4`, `gradient_accumulation_steps 1`,
  `num_mini_batches 1`, `num_ppo_epochs 2`; OUR side splits it into two micro-batches (`--micro-batch-size 2`).
  TRL's losses are means over each micro-batch, ours are the mini-batch's global means whatever the micro-batch
  size (layout invariance): with TRL's one micro-batch per mini-batch both mean the same thing, and equal values
  check our global normalisation across micro-batches;
* precision fp32 on both (TRL's config defaults to bf16: `bf16=False`), dropout is 0 in both models;
* the reference: TRL takes any `ref_model`; our stage loads actor and reference from `--ref-model`, which would
  make the KL of iteration 1 exactly 0 and its comparison empty. So the reference is a perturbed copy of the policy
  (weights + N(0, 0.02) noise), handed to TRL as `ref_model` and loaded into our stage's `reference` right after
  the stage is built (`load_megatron_weights` from its Megatron conversion).

What is compared, and why it survives any CPU's BLAS yet catches a wrong loss scale:

* the GRADIENT of the first update, every parameter of actor and critic (Megatron's fused QKV / gate-up split into
  TRL's names), relative to that gradient's norm: `|g_ours - g_trl| <= 1e-4 |g_trl|`. Float rounding differs by
  ~1e-6 between kernels; a loss off by any factor (a dropped `--vf-coef`, a division by the wrong micro-batch
  count) misses by that factor. `test_parity_catches_loss_scale_bugs` runs our side with each of those two bugs
  and checks that exactly this comparison fails (Adam, which the old version of this test used, normalises each
  gradient element away and would hide both);
* the weight CHANGE over the whole run (4 SGD steps), every parameter, relative to that change's norm (1e-3: the
  later steps start from weights that already differ by float rounding);
* per iteration, the logged metrics within 1e-5 (absolute; 1e-4 in iteration 2, after two SGD steps): `actor/pg_loss` vs `loss/policy_avg`,
  `critic/vf_loss` (the unscaled value loss) vs `loss/value_avg`, `kl/mean` vs `objective/kl`,
  `non_score_reward`, `score/mean` vs `objective/scores`, `actor/lr` vs `lr`, the clip fractions
  (`actor/pg_clipfrac` vs `policy/clipfrac_avg`, `critic/vf_clipfrac` vs `val/clipfrac_avg`: non-zero on both
  sides, since the second epoch's ratios move beyond 1 +- 0.1 and its values beyond the old ones +- 0.02), and
  `actor/abs_pg_loss` (`mean(max(|A r|, |A clip(r)|))`, which TRL does not log) vs the same formula on TRL's own
  whitened advantages and log-probs captured inside its loop. The clip fractions count tokens past a boundary, so
  the test also checks that no policy ratio lies within 1e-4 of 1 +- 0.1 (a count that float rounding could flip;
  the values' distance to their clip is not checked: TRL computes them inside its loop, out of reach).
"""

import dataclasses
import json
import types
import warnings
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402
from tests.helpers.stage_assets import posttrain_argv  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

WIDTH = 6  # response_length / --max-new-tokens; the fixed responses use all of it
TEMPERATURE = 1.0
TRL_TEMPERATURE_EPS = 1e-7  # TRL divides logits by temperature + 1e-7
LR = 0.1  # plain SGD: the second epoch's ratios and values leave their clip ranges (module docstring)
KL_COEF = 0.05
CLIP = 0.1
CLIP_VALUE = 0.02
SEED = 7
# Tolerances, with what this test measured on an AMD EPYC (Zen 3) in brackets: a margin of 4x or more everywhere.
TOL = 1e-5  # iteration 1's logged metrics, absolute [2.4e-7]
TOL_AFTER_UPDATE = 1e-4  # iteration 2's: after two SGD steps at lr 0.1 the weights differ by float rounding [3.3e-6]
GRAD_TOL = 1e-4  # the first update's gradients, relative to each tensor's norm [1.5e-6]
DELTA_TOL = 1e-3  # the weight changes of the run (4 SGD steps), relative to each change's norm [2.5e-5]
CLIP_MARGIN = 1e-4  # no policy ratio this close to 1 +- CLIP
ITERS = 2
EPOCHS = 2


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


def _mg_to_hf(tensors, spec, value_head):
    """{Megatron name: full tensor} of a whole model (TP1, PP1) -> {HF name: tensor} (QKV and gate/up split)."""
    from mindspeed_llm.checkpoint import hf_mapping as hfm
    from mindspeed_llm.checkpoint.megatron_names import layer_key, mg_layer_names

    full, out = dict(tensors), {}
    for index in range(spec.num_layers):
        layer = {rel: full.pop(layer_key(index, rel)) for rel in mg_layer_names(spec)}
        out.update(hfm.mg_layer_to_hf(layer, spec, index))
    out.update(hfm.mg_nonlayer_to_hf(full, spec, value_head))
    return out


def _hf_tensors(module, value_head, of="weights"):
    """A Megatron model's weights (or gradients, `main_grad`) by HF name, fp32 copies."""
    named = {name: (p.main_grad if of == "grads" else p).detach().float().clone()
             for name, p in module.named_parameters()}
    return _mg_to_hf(named, module.model_spec, value_head)


def _our_stage(rank, world_size, argv, responses, reference_root, mutation=None):
    """Runs the real trl_ppo stage with fixed responses; returns the prompts it drew, the first update's
    gradients and the run's weight changes (HF names). `mutation` plants a loss-scale bug (the mutation test)."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.checkpoint import load_megatron_weights
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.update import engine
    from mindspeed_llm.rl.rollouts import plain as rollout
    from mindspeed_llm.rl.stages import STAGES

    record = {"prompts": [], "grads": {}}

    def fixed_generate(model, prompts, sampling, *, iteration=0, **_):
        record["prompts"].append([list(p) for p in prompts])
        return _fixed_rollout(prompts, responses[iteration - 1], sampling.pad_token_id, sampling.eos_token_id)

    def recording_first_step(role, trained):
        step = trained.optimizer.step

        def first_step_recorded():
            if role not in record["grads"]:  # the reduced gradient the first optimizer step applies
                record["grads"][role] = _hf_tensors(trained.module, role == "critic", of="grads")
            return step()

        trained.optimizer.step = first_step_recorded

    stage_cls = STAGES["trl_ppo"]
    built = {}

    def stage_with_reference(settings, tokenizer, build):
        if mutation == "vf_coef_ignored":
            settings = dataclasses.replace(  # the critic backpropagates its unscaled value loss
                settings, loss=dataclasses.replace(settings.loss, vf_coef=1.0))
        stage = stage_cls(settings, tokenizer, build)
        load_megatron_weights(stage.reference, reference_root)
        built["stage"] = stage
        built["initial"] = {role: _hf_tensors(m.module, role == "critic") for role, m in stage.roles().items()}
        for role, trained in stage.roles().items():
            recording_first_step(role, trained)
        return stage

    with pytest.MonkeyPatch.context() as patch:  # put back after the run: the next body may get these ranks
        if mutation == "loss_divided_by_microbatch_count":  # leaves Megatron's / num_microbatches
            patch.setattr(engine, "schedule_loss_scale", lambda num_microbatches, dp: float(dp))
        patch.setattr(rollout, "generate", fixed_generate)
        patch.setitem(STAGES, "trl_ppo", stage_with_reference)
        trainer.run(parse_args(argv, world_size))
    stage = built["stage"]
    record["deltas"] = {}
    for role, trained in stage.roles().items():
        final = _hf_tensors(trained.module, role == "critic")
        record["deltas"][role] = {k: final[k] - built["initial"][role][k] for k in final}
    return record


# ---------------------------------------------------------------------------------------------- TRL's side
def _trl_ppo(paths, hf_ref, prompts_per_iter, responses, out_dir):
    """TRL's PPOTrainer.train() on the same prompts / responses; its logs, the first update's gradients, the
    run's weight changes and the internals captured in its loop."""
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
        per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=EPOCHS,
        local_rollout_forward_batch_size=4, total_episodes=4 * ITERS,
        optim="sgd", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        kl_coef=KL_COEF, kl_estimator="k1", cliprange=CLIP, cliprange_value=CLIP_VALUE, vf_coef=0.1,
        gamma=1.0, lam=0.95, whiten_rewards=False, temperature=TEMPERATURE, response_length=WIDTH,
        stop_token="eos", missing_eos_penalty=None,
    )
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         eval_dataset=dataset)
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD and trainer.optimizer.param_groups[0]["momentum"] == 0
    # Our sampler's prompts, in order; TRL would shuffle.
    trainer.dataloader = DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=DataCollatorWithPadding(tokenizer))

    logs, captured = [], {"whitened": [], "logprobs": [], "grads": {}}
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

    models = {"actor": policy, "critic": value_model}
    optimizer_step = trainer.optimizer.step

    def first_step_recorded(*args, **kwargs):
        if not captured["grads"]:
            captured["grads"] = {role: {n: p.grad.detach().clone() for n, p in m.named_parameters()}
                                 for role, m in models.items()}
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = first_step_recorded
    # Mini-batch order: TRL's micro-batch is its whole mini-batch, so the order changes nothing; fixed anyway.
    shim = types.SimpleNamespace(random=types.SimpleNamespace(permutation=lambda n: np.arange(n)))
    saved = {name: getattr(trl_ppo, name) for name in ("batch_generation", "masked_whiten", "selective_log_softmax",
                                                       "np")}
    trl_ppo.batch_generation = fixed_batch_generation
    trl_ppo.masked_whiten = capture_whiten
    trl_ppo.selective_log_softmax = capture_logprobs
    trl_ppo.np = shim
    initial = {role: {n: p.detach().clone() for n, p in m.named_parameters()} for role, m in models.items()}
    try:
        trainer.train()
    finally:
        for name, value in saved.items():
            setattr(trl_ppo, name, value)
    assert step["i"] == ITERS
    captured["deltas"] = {role: {n: p.detach() - initial[role][n] for n, p in m.named_parameters()}
                          for role, m in models.items()}
    return logs, captured


def _trl_policy_internals(captured):
    """Per iteration, from TRL's own advantages and log-probs: `abs_pg_loss` = mean over the epochs' steps of
    `masked_mean(max(|A r|, |A clip(r)|))`, and every ratio of the run (to check their distance to the clip)."""
    per_iter, ratios = [], []
    # Per iteration TRL calls selective_log_softmax for: old (generation), reference, then one per epoch.
    logprobs = list(captured["logprobs"])
    for adv, mask in captured["whitened"]:
        old = logprobs.pop(0)
        logprobs.pop(0)  # reference
        values = []
        for _ in range(EPOCHS):
            new = logprobs.pop(0)
            ratio = torch.exp(new.masked_fill(~mask, 1.0) - old.masked_fill(~mask, 1.0))
            a = adv.masked_fill(~mask, 0)
            abs_loss = torch.maximum((a * ratio).abs(), (a * ratio.clamp(1 - CLIP, 1 + CLIP)).abs())
            values.append(float((abs_loss * mask).sum() / mask.sum()))
            ratios.append(ratio[mask])
        per_iter.append(sum(values) / len(values))
    assert not logprobs
    return per_iter, torch.cat(ratios)


# ---------------------------------------------------------------------------------------------- the comparison
PAIRS = {
    "actor/pg_loss": "loss/policy_avg",
    "critic/vf_loss": "loss/value_avg",
    "kl/mean": "objective/kl",
    "non_score_reward": "objective/non_score_reward",
    "score/mean": "objective/scores",
    "actor/pg_clipfrac": "policy/clipfrac_avg",
    "critic/vf_clipfrac": "val/clipfrac_avg",
    "actor/lr": "lr",
}


def _relative_differences(kind, ours, theirs, tol):
    """Report lines and failures of per-tensor comparisons, `|ours - theirs| <= tol |theirs|` (norms)."""
    report, failures = [], []
    for role in ("actor", "critic"):
        assert set(ours[role]) == set(theirs[role]), (role, sorted(set(ours[role]) ^ set(theirs[role])))
        for name, t in theirs[role].items():
            scale = float(t.norm())
            rel = float((ours[role][name] - t).norm()) / scale if scale else float("inf")
            line = f"{kind} {role}/{name}: |trl|={scale:.3g} relative difference {rel:.2e}"
            report.append(line)
            if not rel <= tol:
                failures.append(line)
    return report, failures


def _compare(ours_metrics, record, logs, captured):
    """All comparisons of the module docstring: (report lines, failure lines, TRL's ratios)."""
    trl_abs, ratios = _trl_policy_internals(captured)
    report, failures = [], []
    for it, (mine, theirs) in enumerate(zip(ours_metrics, logs), start=1):
        rows = [(k, mine[k], t, theirs[t]) for k, t in PAIRS.items()]
        rows.append(("actor/abs_pg_loss", mine["actor/abs_pg_loss"], "abs_pg_loss(TRL internals)", trl_abs[it - 1]))
        for ours_key, a, trl_key, b in rows:
            line = f"iter {it} {ours_key}={a:.9g} {trl_key}={b:.9g} diff={abs(a - b):.2e}"
            report.append(line)
            if not abs(a - b) <= (TOL if it == 1 else TOL_AFTER_UPDATE):
                failures.append(line)
    for kind, key, tol in (("grad", "grads", GRAD_TOL), ("delta", "deltas", DELTA_TOL)):
        lines, bad = _relative_differences(kind, record[key], captured[key], tol)
        report += lines
        failures += bad
    return report, failures, ratios


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def parity(stage_paths, tmp_path_factory):
    """Our stage and TRL's trainer on the same inputs, once for the module; `ours(mutation)` reruns our side."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("ppo_parity")
    tokenizer = AutoTokenizer.from_pretrained(stage_paths["tokenizer"])
    responses = _fixed_responses(tokenizer.eos_token_id)
    data = _ragged_prompts(root, stage_paths["tokenizer"])
    hf_ref, mg_ref = _perturbed_reference(stage_paths["hf_actor"], root, stage_paths["tokenizer"])

    def ours(mutation=None):
        metrics_path = root / f"metrics_{mutation}.jsonl"
        argv = posttrain_argv(stage_paths, "trl_ppo", iters=ITERS, extra=[
            "--data-path", data, "--seed", str(SEED), "--optimizer", "sgd", "--sgd-momentum", "0",
            "--lr", str(LR), "--critic-lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", "0",
            "--clip-grad", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--ppo-mini-batch-size", "4", "--ppo-epochs", str(EPOCHS),
            "--max-new-tokens", str(WIDTH), "--temperature", repr(TEMPERATURE + TRL_TEMPERATURE_EPS),
            "--kl-coef", str(KL_COEF), "--kl-penalty", "k1", "--clip-ratio", str(CLIP), "--cliprange-value", str(CLIP_VALUE),
            "--vf-coef", "0.1", "--gamma", "1.0", "--lam", "0.95", "--metrics-jsonl", str(metrics_path),
        ])
        (record,) = run_distributed(_our_stage, 1, argv, responses, mg_ref, mutation)
        return [json.loads(line) for line in metrics_path.read_text().splitlines()], record

    metrics, record = ours()
    prompts = record["prompts"]
    assert len(prompts) == ITERS and all(len(p) == 4 for p in prompts)
    assert len({len(p) for batch in prompts for p in batch}) > 1, "the prompts should have different lengths"
    logs, captured = _trl_ppo(stage_paths, hf_ref, prompts, responses, root / "trl")
    assert len(logs) == ITERS
    return {"ours": ours, "metrics": metrics, "record": record, "logs": logs, "captured": captured}


def test_trl_ppo_stage_matches_trl_ppo_trainer(parity):
    ours = parity["metrics"]
    assert [m["iteration"] for m in ours] == list(range(1, ITERS + 1))
    report, failures, ratios = _compare(ours, parity["record"], parity["logs"], parity["captured"])
    print("\n".join(report))
    assert not failures, "trl_ppo differs from TRL PPOTrainer:\n" + "\n".join(failures)

    # The comparisons are not of zeros: the quantities that carry information are clearly non-zero,
    for m in ours:
        for key in ("actor/pg_loss", "critic/vf_loss", "kl/mean", "score/mean", "actor/abs_pg_loss"):
            assert abs(m[key]) > 1e-3, (key, m[key])
    # clipping really happens on both sides (the second epoch's ratios and values leave their ranges),
    for m, t in zip(ours, parity["logs"]):
        assert m["actor/pg_clipfrac"] > 0.02 and t["policy/clipfrac_avg"] > 0.02
        assert m["critic/vf_clipfrac"] > 0.02 and t["val/clipfrac_avg"] > 0.02
    # and no ratio sits so close to a clip boundary that float rounding could flip its count.
    margin = float(((ratios - 1).abs() - CLIP).abs().min())
    print(f"closest policy ratio to a clip boundary: {margin:.2e} away")
    assert margin > CLIP_MARGIN, f"a policy ratio is {margin:.2e} from the clip boundary; pick other settings"
    # Every step moved the weights: the first update's gradients are far from zero.
    for role, grads in parity["record"]["grads"].items():
        assert float(torch.stack([g.norm() for g in grads.values()]).norm()) > 1e-3, role


@pytest.mark.parametrize("mutation, broken", [
    ("vf_coef_ignored", "grad critic/"),
    ("loss_divided_by_microbatch_count", "grad actor/"),
])
def test_parity_catches_loss_scale_bugs(parity, mutation, broken):
    """A loss off by a constant factor (the critic's `--vf-coef` dropped; the loss divided by the micro-batch
    count once more than it should be) fails the gradient comparison, whatever Adam would have hidden."""
    metrics, record = parity["ours"](mutation)
    _, failures, _ = _compare(metrics, record, parity["logs"], parity["captured"])
    grads = [line for line in failures if line.startswith(broken)]
    assert grads, f"the {mutation} bug went unnoticed:\n" + "\n".join(failures)
    if mutation == "vf_coef_ignored":  # only the critic's gradient is off, by the factor 1 / vf_coef = 10
        assert not [line for line in failures if line.startswith("grad actor/")]
