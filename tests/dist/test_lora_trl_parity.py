"""One grpo update with LoRA against TRL 1.12's `GRPOTrainer` with a `peft` adapter, on the same weights and batch.

Both sides start from the same base (the word task's tiny Qwen2, fp32) and the same PEFT adapter (random non-zero A
and B, `init_lora_weights=False`); ours reads it with `--lora-load` (each of q / k / v and gate / up with its own A:
stacked into Megatron's fused linears). TRL's side is a `PeftModel` made trainable, with the "ref" adapter TRL's
`GRPOTrainer.__init__` adds for a pretrained adapter (a copy of it: the reference is the initial policy, as ours);
its loss is `GRPOTrainer._compute_loss` on a stubbed trainer (`test_trl_parity._trl_grpo`, loss_type "bnpo" = our
token-mean, beta = --kl-coef with k3 = --kl-penalty k3), its reference log-probs `_get_per_token_logps_and_entropies`
under TRL's `use_adapter(model, "ref")`, as `_generate_and_score_completions` computes them.

Our side is the real stage (`trainer.run`) with the rollout's sampler replaced by fixed responses (ragged, some
ending in EOS, as `test_ppo_trl_parity.py` does) to 2 prompts of equal length x 2 samples; a rule verifier scores them
so that each group has spread, and TRL is given our per-sample advantages (their math is checked against TRL in
`test_trl_parity.py`). SGD without momentum, no gradient clipping, on both sides.

* Every adapter linear (q, k, v, o, gate, up, down): the first update's gradient of every adapter tensor within 1e-4
  of TRL's (relative to its norm): our stacked A's rows are [A_q; A_k; A_v] and their gradients TRL's, the diagonal
  blocks of our B TRL's B's (the off-diagonal blocks, zero at the start, have no TRL counterpart). The KL term is 0 at
  a first update on both sides (policy = reference).
* o_proj and down_proj only (`linear_proj linear_fc2`, the same parameters on both sides), two epochs: the second
  step's gradients (ratios away from 1, KL to the reference non-zero) within 1e-4, and its KL and clip fraction.
"""

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.multiproc import run_distributed  # noqa: E402

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

GRAD_TOL = 1e-4
LR, KL_COEF, CLIP = 1.0, 0.05, 0.2
EOS = 2  # the word tokenizer's </s>
RESPONSES = [[71, 80, 90, 100, 110, 120], [72, 81, EOS], [95, EOS], [96, 97, 98, 99, 100, 101]]
WIDTH = 6
PEFT_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def first_word_odd(text, label):
    words = text.split()
    return float(bool(words) and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 1)


def _our_stage(rank, world_size, runs):
    """Each (argv) run of the grpo stage with fixed responses: per optimizer step the adapters' gradients (global
    names), the prompts, the per-sample advantages and the metrics row."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.inference import Rollout
    from mindspeed_llm.models import lora
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.rollouts import plain as rollout
    from mindspeed_llm.rl.stages import STAGES, grpo
    from mindspeed_llm.rl.verifiers import register_verifier

    register_verifier("first_word_odd", override=True)(first_word_odd)
    record = {}

    def fixed_generate(model, prompts, sampling, **_):
        record["prompts"] = [list(p) for p in prompts]
        batch = len(prompts)
        resp = torch.full((batch, WIDTH), sampling.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, WIDTH), dtype=torch.long)
        for b, r in enumerate(RESPONSES):
            resp[b, :len(r)] = torch.tensor(r)
            mask[b, :len(r)] = 1
        ended = torch.tensor([r[-1] == EOS for r in RESPONSES])
        return Rollout(prompts=torch.tensor(prompts), prompt_lengths=torch.tensor([len(p) for p in prompts]),
                       responses=resp, response_mask=mask, response_lengths=mask.sum(-1), ended_with_eos=ended,
                       finish_reasons=["eos" if e else "length" for e in ended.tolist()], log_probs=None,
                       pad_token_id=sampling.pad_token_id)

    update = grpo.ppo_update

    def recording_update(model, exp, *rest, **kwargs):
        mask = exp.response_mask
        record["advantages"] = ((exp.advantages * mask).sum(-1) / mask.sum(-1)).tolist()
        return update(model, exp, *rest, **kwargs)

    stage_cls = STAGES["grpo"]

    def stage_recording(settings, tokenizer, build):
        stage = stage_cls(settings, tokenizer, build)
        step = stage.actor.optimizer.step

        def recorded_step():
            record["grads"].append({name + suffix: t.main_grad.detach().clone()
                                    for name, pair in lora.adapter_tensors(stage.actor.module).items()
                                    for suffix, t in zip((".lora.A", ".lora.B"), pair)})
            return step()

        stage.actor.optimizer.step = recorded_step
        return stage

    out = []
    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        patch.setattr(rollout, "generate", fixed_generate)
        patch.setattr(grpo, "ppo_update", recording_update)
        patch.setitem(STAGES, "grpo", stage_recording)
        for argv, metrics_path in runs:
            record.clear()
            record["grads"] = []
            trainer.run(parse_args(argv, world_size))
            record["metrics"] = json.loads(Path(metrics_path).read_text().splitlines()[-1])
            out.append(dict(record))
    return out


def _word_prompts(root: Path, tokenizer: str) -> str:
    """Prompts of 4 words each (equal token lengths: TRL left-pads and its positions count the pads)."""
    from mindspeed_llm.data.preprocess import preprocess

    raw = root / "equal_prompts.json"
    raw.write_text(json.dumps([{"problem": f"w{70 + i} w{90 + i} w{110 + i} w{130 + i}", "answer": "-"}
                               for i in range(8)]))
    prefix = root / "data" / "equal_prompts"
    preprocess(["--input", str(raw), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer,
                "--output-prefix", str(prefix), "--handler-name", "R1AlpacaStyleInstructionHandler",
                "--prompt-type", "empty", "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}),
                "--log-interval", "0"])
    return str(prefix)


def _peft_adapter(hf_dir: str, out: Path, targets) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets))
    with torch.no_grad():
        for module in pm.modules():
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(0, 0.1)
    pm.save_pretrained(out)
    return str(out)


def _argv(paths, data, adapter, out: Path, epochs: int):
    return ["--stage", "grpo", "--micro-batch-size", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "2",
            "--ppo-mini-batch-size", "4", "--ppo-epochs", str(epochs), "--train-iters", "1", "--seed", "5",
            "--data-path", data, "--tokenizer-name-or-path", paths["tokenizer"], "--ref-model",
            paths["mg_actor_tp1pp1"], "--max-length", "32", "--max-new-tokens", str(WIDTH), "--temperature", "1.0",
            "--optimizer", "sgd", "--sgd-momentum", "0", "--lr", str(LR), "--clip-grad", "0", "--weight-decay", "0",
            "--kl-coef", str(KL_COEF), "--kl-penalty", "k3", "--loss-agg-mode", "token-mean", "--clip-ratio",
            str(CLIP), "--verifier-function", "first_word_odd", "--lora-load", adapter,
            "--metrics-jsonl", str(out / "metrics.jsonl")]


# ---------------------------------------------------------------------------------------------- TRL's side
def _trl_steps(hf_dir, adapter, record, steps):
    """TRL's loss, metrics and adapter gradients at each of `steps` SGD steps on our batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import use_adapter

    from tests.helpers.trl_reference import trl_grpo

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    # GRPOTrainer.__init__ with a pretrained adapter and beta != 0 (trl/trainer/grpo_trainer.py, TRL 1.12)
    model.add_adapter("ref", model.peft_config["default"])
    for name, param in model.named_parameters():
        if ".default." in name:
            model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
    model.train()
    prompt_ids = torch.tensor(record["prompts"])
    completion_ids = torch.zeros(len(RESPONSES), WIDTH, dtype=torch.long)
    completion_mask = torch.zeros(len(RESPONSES), WIDTH, dtype=torch.long)
    for b, r in enumerate(RESPONSES):
        completion_ids[b, :len(r)] = torch.tensor(r)
        completion_mask[b, :len(r)] = 1
    trainer = trl_grpo("bnpo", KL_COEF, 0.0, 1.0, CLIP, CLIP, WIDTH, model, gas=1, spg=1)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    with torch.no_grad():
        with use_adapter(model, adapter_name="ref"):
            ref, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, WIDTH)
        old, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, WIDTH)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor(record["advantages"]),
                  old_per_token_logps=old, ref_per_token_logps=ref)
    out = []
    trained = {n: p for n, p in model.named_parameters() if ".default." in n and p.requires_grad}
    for _ in range(steps):
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in trained.items()}
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        out.append(dict(loss=float(loss), grads=grads, metrics=logged))
        with torch.no_grad():
            for p in trained.values():
                p.sub_(LR * p.grad)
    return out


def _trl_by_module(grads):
    """{HF module name: (dA, dB)} from TRL's parameter names."""
    out = {}
    for name, g in grads.items():
        module = name.split("base_model.model.", 1)[1].split(".lora_")[0]
        out.setdefault(module, {})["A" if ".lora_A." in name else "B"] = g
    return {k: (v["A"], v["B"]) for k, v in out.items()}


def _compare(ours, theirs, spec):
    """(report, failures): our stacked adapters' gradients against TRL's per-module ones."""
    from mindspeed_llm.checkpoint import hf_mapping as hfm

    report, failures = [], []

    def check(label, got, ref):
        rel = float((got - ref).norm() / ref.norm())
        line = f"{label}: |trl|={float(ref.norm()):.3g} relative difference {rel:.2e}"
        report.append(line)
        if not rel <= GRAD_TOL:
            failures.append(line)

    for index in range(spec.num_layers):
        attn, mlp = f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
        mg = f"decoder.layers.{index}."
        fused = ((mg + "self_attention.linear_qkv", [attn + x for x in ("q_proj", "k_proj", "v_proj")], "qkv"),
                 (mg + "mlp.linear_fc1", [mlp + "gate_proj", mlp + "up_proj"], "halves"),
                 (mg + "self_attention.linear_proj", [attn + "o_proj"], "one"),
                 (mg + "mlp.linear_fc2", [mlp + "down_proj"], "one"))
        for module, parts, how in fused:
            present = [p for p in parts if p in theirs]
            if not present:
                assert module + ".lora.A" not in ours
                continue
            a, b = ours[module + ".lora.A"], ours[module + ".lora.B"]
            rows = list(hfm.split_qkv(b, spec)) if how == "qkv" else list(torch.chunk(b, 2)) if how == "halves" \
                else [b]
            start = 0
            for part, b_rows in zip(parts, rows):
                ta, tb = theirs[part]
                r = ta.shape[0]
                check(f"{part} dA", a[start:start + r], ta)
                check(f"{part} dB", b_rows[:, start:start + r], tb)
                start += r
    return report, failures


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from tests.helpers import word_task

    root = tmp_path_factory.mktemp("lora_trl")
    paths = word_task.build(root)
    data = _word_prompts(root, paths["tokenizer"])
    hf = str(root / "hf_actor")
    adapters = {"all": _peft_adapter(hf, root / "peft_all", PEFT_ALL),
                "o_down": _peft_adapter(hf, root / "peft_o_down", ["o_proj", "down_proj"])}
    runs = [(_argv(paths, data, adapters["all"], root / "all", 1), root / "all" / "metrics.jsonl"),
            (_argv(paths, data, adapters["o_down"], root / "o_down", 2), root / "o_down" / "metrics.jsonl")]
    ours = dict(zip(("all", "o_down"), run_distributed(_our_stage, 1, runs)[0]))
    theirs = {"all": _trl_steps(hf, adapters["all"], ours["all"], 1),
              "o_down": _trl_steps(hf, adapters["o_down"], ours["o_down"], 2)}
    from mindspeed_llm.checkpoint import load_spec

    return ours, theirs, load_spec(paths["mg_actor_tp1pp1"])


def test_first_update_gradients_match_trl_grpo_with_peft(parity):
    ours, theirs, spec = parity
    assert len(ours["all"]["grads"]) == 1
    assert len(set(ours["all"]["advantages"])) > 1  # the groups carry signal
    report, failures = _compare(ours["all"]["grads"][0], _trl_by_module(theirs["all"][0]["grads"]), spec)
    print("\n".join(report))
    assert len(report) == 2 * 7 * spec.num_layers
    assert not failures, "\n".join(failures)
    assert theirs["all"][0]["metrics"]["kl"] == 0 and ours["all"]["metrics"]["actor/kl_loss"] == 0


def test_second_epoch_gradients_kl_and_clipping_match(parity):
    ours, theirs, spec = parity
    assert len(ours["o_down"]["grads"]) == 2
    for step in range(2):
        report, failures = _compare(ours["o_down"]["grads"][step], _trl_by_module(theirs["o_down"][step]["grads"]),
                                    spec)
        print(f"step {step + 1}:\n" + "\n".join(report))
        assert len(report) == 2 * 2 * spec.num_layers
        assert not failures, "\n".join(failures)
    second = theirs["o_down"][1]["metrics"]
    metrics = ours["o_down"]["metrics"]  # the means over the iteration's two steps; the first step's KL and clip are 0
    assert second["kl"] > 1e-6
    assert abs(2 * metrics["actor/kl_loss"] - second["kl"]) <= 1e-6 + 1e-4 * second["kl"]
    assert abs(2 * metrics["actor/pg_clipfrac"] - second["clip_ratio/region_mean"]) <= 1e-6
