"""On-policy distillation in the real stages (--teacher-load; `rl/distillation.py`): one iteration of grpo and of
trl_ppo on the tiny word task with a teacher of ANOTHER size than the actor (4 layers, hidden 32 against 2 x 64;
the same 256-word vocabulary, `word_task.TEACHER_SHAPE`), where

* the teacher's log-probs of the sampled tokens, and its top-k, equal transformers' on the teacher's Hugging Face
  weights at the rollout temperature (an independent reference of the teacher's pass: its read positions, the
  temperature, the top-k over the vocab shard);
* the `distill/*` metrics and `timing/teacher` are logged, in both modes (reward, loss), both stages, with a LoRA
  student and on multi-turn tool trajectories (over the model's own tokens: tool tokens are never distilled);
* a teacher equal to the actor gives a KL of ~0 (k1, and the top-k forward KL at k = the vocabulary, which covers
  the teacher's whole mass);
* trl_ppo's token rewards carry -coef x KL per token: the logged per-sample reward sum is the score, the KL
  penalty and -coef x the distillation KL summed over the response.

(The math against dense references: tests/unit/test_distill.py, tests/dist/test_distill_dist.py; the refusals:
tests/unit/test_arguments.py, tests/dist/test_stages_errors.py.)
"""

import math

import pytest

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_layouts import layout_argv, metrics_row

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

PADDED_VOCAB = 320  # a teacher's rows: the word task's 256 and 64 of padding

GRPO = ["--global-batch-size", "4", "--n-samples-per-prompt", "2", "--kl-coef", "0.05", "--lr", "0.5"]
PPO = ["--global-batch-size", "4", "--kl-coef", "0.05", "--lr", "0.2"]
VERIFIER = ["--verifier-function", "odd_first_word"]


def cases(task):
    teacher, actor = ["--teacher-load", task["mg_teacher_tp1pp1"]], ["--teacher-load", task["mg_actor_tp1pp1"]]
    return {
        # k1 as a reward at another rollout temperature (the teacher's log-probs are taken at it)
        "grpo_k1_reward": ("grpo", GRPO + VERIFIER + teacher + ["--temperature", "0.7"]),
        # pure distillation (no verifier, no reward model), one sample per prompt, k3 as a loss
        "grpo_k3_loss": ("grpo", GRPO + teacher + ["--distill-loss", "k3", "--distill-mode", "loss",
                                                   "--n-samples-per-prompt", "1"]),
        "grpo_topk_loss": ("grpo", GRPO + VERIFIER + teacher + [
            "--distill-loss", "topk_forward_kl", "--distill-mode", "loss", "--distill-topk", "8",
            "--temperature", "0.7", "--distill-coef", "0.5", "--offload-ref-reward"]),
        # the top-k KL as a reward of a token estimator; the teacher is the actor and k the whole vocabulary
        "grpo_self_topk_reward": ("grpo", GRPO + actor + [
            "--distill-loss", "topk_forward_kl", "--distill-topk", "256", "--adv-estimator", "reinforce_plus_plus"]),
        "trl_ppo_k3_reward": ("trl_ppo", PPO + teacher + ["--distill-loss", "k3", "--distill-coef", "0.5"]),
        # a LoRA student: the teacher is a model of its own (the reference is the actor's base)
        "grpo_lora_k3_reward": ("grpo", GRPO + VERIFIER + teacher + ["--distill-loss", "k3", "--lora-target-modules",
                                                                     "linear_qkv", "--lora-r", "4"]),
        "trl_ppo_self_k1": ("trl_ppo", PPO + actor),
        # a teacher padded to more vocabulary rows than the actor: read over the actor's 256 ids
        "grpo_padded_topk_loss": ("grpo", GRPO + VERIFIER + ["--teacher-load", task["mg_teacher_padded"],
                                                             "--distill-loss", "topk_forward_kl", "--distill-mode",
                                                             "loss", "--distill-topk", "8", "--temperature", "0.7"]),
    }


def tools_argv(task, out):
    """grpo on multi-turn tool trajectories (test_stages_multi_turn's word tools): the teacher scores the model's
    turns, never the tool tokens between them."""
    from tests.helpers.word_task import TOOLS_DIR

    return ["--stage", "grpo", "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path",
            task["chat_tokenizer"], "--data-path", task["data"], "--global-batch-size", "2", "--micro-batch-size", "2",
            "--train-iters", "1", "--max-length", "24", "--max-prompt-length", "8", "--max-new-tokens", "4",
            "--do-sample", "--seed", "5", "--lr", "1e-2", "--stop-token-ids", ",".join(map(str, range(100, 140))),
            "--tool-config", task["tools"], "--tool-parser-format", "first_word_even", "--max-assistant-turns", "3",
            "--max-total-response-length", "14", "--max-tool-response-length", "3", "--n-samples-per-prompt", "2",
            "--custom-reward-function", f"{TOOLS_DIR / 'word_tools.py'}:turns_reward", "--kl-coef", "0.01",
            "--teacher-load", task["mg_teacher_tp1pp1"], "--distill-loss", "k3",
            "--metrics-jsonl", str(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    import sys

    from tests.helpers import word_task

    from mindspeed_llm.checkpoint import convert_hf_to_mg
    from tests.helpers.hf_tiny import save_tiny

    root = tmp_path_factory.mktemp("distill_task")
    paths = word_task.build(root, reward=True, teacher=True)
    # the same tokenizer padded to more rows (as Qwen2.5 7B's 152,064 against 0.5B's 151,936)
    paths["hf_teacher_padded"] = save_tiny("qwen2", root / "hf_teacher_padded", seed=9, vocab_size=PADDED_VOCAB,
                                           **word_task.TEACHER_SHAPE)
    convert_hf_to_mg(paths["hf_teacher_padded"], str(root / "mg_teacher_padded"), 1, 1,
                     tokenizer_dir=paths["tokenizer"], progress=False)
    paths["mg_teacher_padded"] = str(root / "mg_teacher_padded")
    sys.path.insert(0, str(word_task.TOOLS_DIR))  # the warm ranks take the caller's sys.path (multiproc.py)
    yield dict(paths, **word_task.write_chat_tools(root, paths["tokenizer"]))
    sys.path.remove(str(word_task.TOOLS_DIR))


def _run_recorded(rank, world_size, runs):
    """`run_stages` on each argv, recording what each run's teacher pass put on the experience (the batch's tokens
    and masks with it)."""
    from mindspeed_llm.rl import distillation
    from tests.helpers.stage_layouts import run_stages

    records, score = [], distillation.Distillation.score

    def recording(self, exp, plan, timers, student):
        out = score(self, exp, plan, timers, student)
        records.append({name: None if getattr(exp, name) is None else getattr(exp, name).detach().cpu().clone()
                        for name in ("tokens", "prompt_lengths", "responses", "response_mask", "teacher_logp",
                                     "teacher_topk_ids", "teacher_topk_logp")}
                       | {"action_mask": exp.action_mask.cpu().clone()})
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distillation.Distillation, "score", recording)
        run_stages(rank, world_size, runs)
    return records


@pytest.fixture(scope="module")
def runs(task, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_runs")
    named = cases(task)
    argvs = [layout_argv(task, stage, "mbs1", extra, root / name) for name, (stage, extra) in named.items()]
    named["grpo_tools_k3_reward"] = ("grpo", ())
    argvs.append(tools_argv(task, root / "grpo_tools_k3_reward"))
    records = run_distributed(_run_recorded, 1, argvs)[0]
    assert len(records) == len(named)
    return {name: (metrics_row(root / name, skipped=()), record) for name, record in zip(named, records)}


def _hf_teacher_logprobs(hf_path, record, temperature, vocab=None):
    """transformers' log-softmax(logits / T) of the teacher at every response position of the record's rows (over its
    first `vocab` ids: a padded teacher's are the actor's)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for b in range(record["tokens"].shape[0]):
            p = int(record["prompt_lengths"][b])
            r = int(record["response_mask"][b].sum())
            ids = record["tokens"][b, :p + r][None]
            logits = model(ids).logits[0, :, :vocab].float() / temperature
            out.append(torch.log_softmax(logits, -1)[p - 1:p - 1 + r])  # position p - 1 + j predicts token j
    return out


@pytest.mark.parametrize("name", ["grpo_k1_reward", "grpo_topk_loss", "trl_ppo_k3_reward", "grpo_lora_k3_reward",
                                  "grpo_padded_topk_loss"])
def test_the_teachers_pass_equals_transformers_at_the_rollout_temperature(runs, task, name):
    import torch

    from tests.helpers.word_task import VOCAB

    _, record = runs[name]
    extra = cases(task)[name][1]
    temperature = float(extra[extra.index("--temperature") + 1]) if "--temperature" in extra else 1.0  # the rollout's
    padded = "padded" in name  # its log-softmax over the actor's ids only
    reference = _hf_teacher_logprobs(task["hf_teacher_padded" if padded else "hf_teacher"], record, temperature,
                                     VOCAB if padded else None)
    for b, logp in enumerate(reference):
        r = logp.shape[0]
        sampled = logp.gather(-1, record["responses"][b, :r, None]).squeeze(-1)
        torch.testing.assert_close(record["teacher_logp"][b, :r], sampled, atol=2e-5, rtol=0)
        assert torch.all(record["teacher_logp"][b, r:] == 0)  # nothing past the response
        if record["teacher_topk_ids"] is not None:
            k = record["teacher_topk_ids"].shape[-1]
            values, ids = logp.topk(k, dim=-1)
            torch.testing.assert_close(record["teacher_topk_logp"][b, :r], values, atol=2e-5, rtol=0)
            # the same ids, but for ties closer than rounding (none in practice on random weights)
            assert (record["teacher_topk_ids"][b, :r] == ids).float().mean() > 0.99


def test_the_distill_metrics_are_logged(runs):
    for name, (metrics, record) in runs.items():
        topk = "topk" in name
        assert {"distill/kl_mean", "distill/teacher_logp_mean", "timing/teacher"} <= set(metrics), name
        assert ("distill/topk_mass" in metrics) == topk, name
        assert ("distill/loss" in metrics) == ("loss" in name), name
        assert metrics["timing/teacher"] > 0
        assert metrics["distill/teacher_logp_mean"] < 0
        mask = record["action_mask"]
        mean = float((record["teacher_logp"] * mask).sum() / mask.sum())
        assert metrics["distill/teacher_logp_mean"] == pytest.approx(mean, abs=1e-5), name
        if topk:
            assert 0 < metrics["distill/topk_mass"] <= 1 + 1e-6
        if "self" not in name and "k1" not in name:  # k3 and the forward KL are >= 0, and the teacher differs
            assert metrics["distill/kl_mean"] > 1e-3, name
    # tool tokens are read by the teacher but never distilled: the means are over the model's own tokens
    _, record = runs["grpo_tools_k3_reward"]
    tools = record["response_mask"] - record["action_mask"]
    assert tools.sum() > 0
    over_all = float((record["teacher_logp"] * record["response_mask"]).sum() / record["response_mask"].sum())
    assert abs(runs["grpo_tools_k3_reward"][0]["distill/teacher_logp_mean"] - over_all) > 1e-3
    # the loss mode's loss is coef x its KL (token-mean, one optimizer step)
    metrics, _ = runs["grpo_topk_loss"]
    assert metrics["distill/loss"] == pytest.approx(0.5 * metrics["distill/kl_mean"], rel=1e-5)


def test_a_teacher_equal_to_the_actor_gives_zero_kl(runs):
    for name in ("grpo_self_topk_reward", "trl_ppo_self_k1"):
        metrics, _ = runs[name]
        assert abs(metrics["distill/kl_mean"]) < 1e-5, (name, metrics["distill/kl_mean"])
    # k = the vocabulary: the top-k holds all the teacher's mass
    assert runs["grpo_self_topk_reward"][0]["distill/topk_mass"] == pytest.approx(1.0, abs=1e-5)


def test_trl_ppos_token_rewards_carry_the_distillation_term(runs):
    """critic/rewards/mean (the mean per-sample sum of the token rewards, no whitening) = score/mean +
    non_score_reward (-kl_coef x the reference KL) - coef x the distillation KL summed over each response: every
    response here has all --max-new-tokens 8 tokens, so that sum is 8 x distill/kl_mean."""
    metrics, record = runs["trl_ppo_k3_reward"]
    assert float(record["action_mask"].sum(-1).min()) == 8 == metrics["response_length/min"]
    expected = metrics["score/mean"] + metrics["non_score_reward"] - 0.5 * 8 * metrics["distill/kl_mean"]
    assert metrics["critic/rewards/mean"] == pytest.approx(expected, abs=1e-5)
    assert not math.isclose(metrics["critic/rewards/mean"], metrics["score/mean"] + metrics["non_score_reward"],
                            abs_tol=1e-3)
