"""On-policy distillation's math (mindspeed_llm.rl.core_algos.distill) against hand-computed numbers and plain-torch
dense references; TP=2 over gloo equals TP=1: tests/dist/test_distill_dist.py."""

import math
from dataclasses import replace

import pytest
import torch

from mindspeed_llm.rl import core_algos as ca


def close(actual, expected, atol=1e-6, rtol=0.0):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=rtol)


# Two sampled tokens: student log-probs s, teacher log-probs t.
S = torch.tensor([[-1.0, -2.0]])
T = torch.tensor([[-1.5, -0.5]])
M = torch.tensor([[1, 1]])


def test_reverse_kl_estimators_by_hand():
    close(ca.reverse_kl(S, T, "k1"), [[0.5, -1.5]])  # s - t
    # k3 = exp(t - s) - (t - s) - 1: t - s = -0.5 -> e^-0.5 + 0.5 - 1 = 0.1065307; t - s = 1.5 -> e^1.5 - 2.5 = 1.9816891
    close(ca.reverse_kl(S, T, "k3"), [[0.10653066, 1.98168907]])
    # no [-10, 10] clamp of the value (that of the reference KL): t - s = 4 -> e^4 - 5 = 49.59815
    close(ca.reverse_kl(torch.tensor([-5.0]), torch.tensor([-1.0]), "k3"), [49.59815003], atol=1e-4)
    with pytest.raises(ValueError, match="unknown distillation KL estimator 'k9'.*k1, k3"):
        ca.reverse_kl(S, T, "k9")


def test_token_rewards_are_minus_coef_kl_on_the_mask():
    kl = ca.reverse_kl(S, T, "k1").requires_grad_()
    rewards = ca.distill_token_rewards(kl, torch.tensor([[1, 0]]), coef=0.5)
    close(rewards, [[-0.25, 0.0]])  # -0.5 * 0.5, and the masked token gets nothing
    assert not rewards.requires_grad


def test_reverse_kl_loss_aggregates_and_its_gradient_is_one_minus_the_ratio():
    s = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -4.0, -1.0]], requires_grad=True)
    t = torch.tensor([[-1.5, -0.5, -0.3], [-0.2, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = ca.reverse_kl_loss(s, t, mask, "k3")
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.5) - 2.5, math.exp(0.5) - 1.5]  # the three tokens of the mask
    close(loss, sum(k3) / 3)
    close(metrics["kl"], sum(k3) / 3)
    close(metrics["teacher_logp"], (-1.5 - 0.5 - 0.2) / 3)
    loss.backward()
    # d k3 / d s = 1 - exp(t - s), times the token-mean weight 1/3; 0 off the mask
    expected = torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(1.5), 0.0], [1 - math.exp(0.5), 0.0, 0.0]]) / 3
    close(s.grad, expected)

    seq_loss, _ = ca.reverse_kl_loss(s, t, mask, "k3", agg="seq-mean-token-mean")
    close(seq_loss, ((k3[0] + k3[1]) / 2 + k3[2]) / 2)
    half, _ = ca.reverse_kl_loss(s, t, mask, "k3", total_tokens=6)  # a share of a batch of 6 tokens
    close(half, sum(k3) / 6)


def test_k1_is_refused_as_a_loss():
    with pytest.raises(ValueError, match="k1 estimator cannot be a distillation loss.*reward"):
        ca.reverse_kl_loss(S, T, M, "k1")
    with pytest.raises(ValueError, match="unknown distillation KL estimator 'topk_forward_kl'"):
        ca.reverse_kl_loss(S, T, M, "topk_forward_kl")
    assert [name for name, spec in ca.DISTILL_LOSSES.items() if spec.as_loss] == ["k3", "topk_forward_kl"]


# Teacher p_T = [1/2, 1/4, 1/8, 1/8], student uniform; logits shifted by constants (the log-softmax removes them) and,
# for the temperature case, doubled with T = 2.
P_TEACHER = torch.tensor([0.5, 0.25, 0.125, 0.125])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_forward_kl_by_hand(temperature):
    teacher = (P_TEACHER.log() + 3.0) * temperature
    student = torch.full((4,), 1.7 * temperature)
    top = ca.teacher_topk(teacher, 2, temperature=temperature)
    assert top.ids.tolist() == [0, 1]
    close(top.logp, [math.log(0.5), math.log(0.25)])
    kl, mass = ca.topk_forward_kl(student, teacher, 2, temperature=temperature)
    # 1/2 (log 1/2 - log 1/4) + 1/4 (log 1/4 - log 1/4) = 1/2 log 2: the student's log-probs over all 4 tokens,
    # nothing renormalised over the top-2 (that would give 2/3 log(4/3) + 1/3 log(2/3) = 0.0566)
    close(kl, 0.5 * math.log(2))
    close(mass, 0.75)
    # k = V: the exact KL, 1/2 log 2 + 0 + 2 * 1/8 (log 1/8 - log 1/4) = 1/4 log 2
    kl, mass = ca.topk_forward_kl(student, teacher, 4, temperature=temperature)
    close(kl, 0.25 * math.log(2))
    close(mass, 1.0)


def _dense_forward_kl(student_logits, teacher_logits, temperature=1.0):
    """KL(teacher || student) over the whole vocabulary, plain torch."""
    t = torch.log_softmax(teacher_logits.float() / temperature, -1)
    s = torch.log_softmax(student_logits.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_k_equal_to_the_vocabulary_is_the_exact_forward_kl(dtype, tol, temperature):
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(3, 5, 37, generator=g) * 3).to(dtype)
    teacher = (torch.randn(3, 5, 37, generator=g) * 3).to(dtype)
    kl, mass = ca.topk_forward_kl(student, teacher, 37, temperature=temperature)
    assert kl.shape == mass.shape == (3, 5) and kl.dtype == torch.float32
    close(kl, _dense_forward_kl(student, teacher, temperature), atol=tol)
    close(mass, torch.ones(3, 5), atol=tol)


def test_topk_matches_a_dense_truncated_reference_and_the_gradient_is_autograds():
    g = torch.Generator().manual_seed(1)
    student = torch.randn(2, 6, 50, generator=g) * 2
    teacher = torch.randn(2, 6, 50, generator=g) * 2
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    temperature, k = 0.8, 5

    # Dense reference: the teacher's top-k from torch.topk on the full logits, both log-softmaxes over all 50 ids.
    s_ref = student.clone().requires_grad_()
    t_logp = torch.log_softmax(teacher / temperature, -1)
    top_ids = t_logp.topk(k, -1).indices
    t_top = t_logp.gather(-1, top_ids)
    s_top = torch.log_softmax(s_ref / temperature, -1).gather(-1, top_ids)
    kl_ref = (t_top.exp() * (t_top - s_top)).sum(-1)
    for agg in ("token-mean", "seq-mean-token-mean"):
        s = student.clone().requires_grad_()
        top = ca.teacher_topk(teacher, k, temperature=temperature)
        assert torch.equal(top.ids, top_ids)
        close(top.logp, t_top, atol=1e-5)
        loss, metrics = ca.topk_forward_kl_loss(s, top, mask, temperature=temperature, agg=agg)
        m = mask.float()
        weights = m / m.sum() if agg == "token-mean" else m / m.sum(-1, keepdim=True) / 2
        loss_ref = (kl_ref * weights).sum()
        close(loss, loss_ref.detach(), atol=1e-6)
        close(metrics["kl"], (kl_ref * m).sum().detach() / m.sum(), atol=1e-6)
        close(metrics["topk_mass"], (t_top.exp().sum(-1) * m).sum() / m.sum(), atol=1e-6)
        loss.backward()
        s_ref.grad = None
        loss_ref.backward(retain_graph=True)
        close(s.grad, s_ref.grad, atol=1e-7)
        assert s.grad.abs().sum() > 0 and (s.grad[mask == 0] == 0).all()


def test_bad_top_k_and_shapes_are_refused():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\].*got 9"):
        ca.teacher_topk(logits, 9)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\].*got 0"):
        ca.teacher_topk(logits, 0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        ca.teacher_topk(logits, 2, temperature=0.0)
    top = ca.teacher_topk(logits, 2)
    with pytest.raises(ValueError, match=r"teacher top-k ids \(3, 2\) do not match the student logits \(4, 8\)"):
        ca.forward_kl_on_teacher_topk(torch.randn(4, 8), top)


def test_k3_loss_gradient_wrt_the_student_logits_is_autograds_on_a_dense_formula():
    from mindspeed_llm.rl.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 30, generator=g) * 2
    tokens = torch.randint(0, 30, (2, 4), generator=g)
    teacher_logp = -torch.rand(2, 4, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    a = logits.clone().requires_grad_()
    loss, _ = ca.reverse_kl_loss(vocab_parallel_logprobs(a, tokens), teacher_logp, mask, "k3")
    loss.backward()
    b = logits.clone().requires_grad_()
    s = torch.log_softmax(b, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    dense = ((torch.exp(teacher_logp - s) - (teacher_logp - s) - 1) * mask).sum() / mask.sum()
    dense.backward()
    close(loss, dense.detach(), atol=1e-6, rtol=1e-5)  # the loss is ~80: float32's last bits
    close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- the stages' wiring
def _distill_case(estimator: str, loss: str = "k1", coef: float = 0.5, kl_coef: float = 0.0):
    """A grpo stage's advantage step and the run's `Distillation` on a hand-made batch of one prompt group of 2:
    row 0 has 4 response tokens, its second a tool token; row 1 has 3. The teacher's pass is replaced by the given
    teacher log-probs (its real pass: tests/dist/test_stages_distill.py)."""
    from mindspeed_llm.rl.distillation import Distillation
    from mindspeed_llm.rl.experience import Experience
    from mindspeed_llm.rl.settings import AlgorithmSettings, DistillSettings, LossSettings, Settings
    from mindspeed_llm.rl.stages import grpo

    settings = Settings(
        algorithm=AlgorithmSettings(stage="grpo", adv_estimator=estimator, n_samples_per_prompt=2, kl_coef=kl_coef,
                                    gamma=1.0),
        loss=LossSettings(kl_penalty="k1", loss_agg_mode="token-mean"),
        distill=DistillSettings(teacher_load="t", distill_loss=loss, distill_mode="reward", distill_coef=coef))
    stage = object.__new__(grpo.GRPOStage)
    stage.settings, stage.algorithm, stage.reference = settings, settings.algorithm, None
    stage.estimator, stage.advantages = grpo._advantage_estimator(settings.algorithm)
    exp = Experience(tokens=torch.zeros(2, 6, dtype=torch.long), position_ids=torch.arange(6).expand(2, 6),
                     prompt_lengths=torch.tensor([2, 2]), responses=torch.ones(2, 4, dtype=torch.long),
                     response_mask=torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]]), ended_with_eos=torch.ones(2).bool(),
                     tool_mask=torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 0]]))
    exp.scores = torch.tensor([1.0, 0.0])
    exp.old_logp = torch.tensor([[-1.0, -3.0, -2.0, -0.5], [-1.5, -0.2, -1.0, 0.0]])
    teacher_logp = torch.tensor([[-1.5, -0.1, -1.0, -0.5], [-1.0, -0.7, -1.0, 0.0]])
    distill = Distillation(settings, teacher=torch.nn.Linear(1, 1))
    return grpo, stage, distill, exp, teacher_logp


def _score(distill, exp, teacher_logp, monkeypatch):
    from mindspeed_llm.rl import distillation
    from mindspeed_llm.rl.metrics import Timers

    monkeypatch.setattr(distillation, "teacher_scores",
                        lambda model, exp, plan, temperature, topk, vocab_size: (teacher_logp, None))
    monkeypatch.setattr(distillation, "sum_over_data_parallel", lambda t: t)
    return distill.score(exp, None, Timers(), student=None)


@pytest.mark.parametrize("loss", ["k1", "k3"])
def test_grpo_reward_mode_adds_minus_coef_kl_per_token_after_the_group_advantage(loss, monkeypatch):
    """--distill-mode reward with an outcome estimator: the advantage of token t of row b is the group advantage of
    its score plus -coef x KL(old_logp, teacher_logp) of that token; the tool token gets neither."""
    grpo, stage, distill, exp, teacher_logp = _distill_case("grpo", loss)
    monkeypatch.setattr(grpo, "sum_over_data_parallel", lambda t: t)
    metrics, rewards = _score(distill, exp, teacher_logp, monkeypatch)
    logged_rewards, logged_advantages = stage._advantages(exp, rewards)
    # by hand: the group (1, 0) has mean 0.5 and sample std sqrt(0.5); grpo divides by std + 1e-6
    group = 0.5 / (math.sqrt(0.5) + 1e-6)
    d = [[-0.5, None, 1.0, 0.0], [0.5, -0.5, 0.0, None]]  # teacher - student on the model's own tokens
    if loss == "k1":
        kl = [[0.5, 0, -1.0, 0.0], [-0.5, 0.5, 0.0, 0]]
    else:  # exp(d) - d - 1
        kl = [[0 if x is None else math.exp(x) - x - 1 for x in row] for row in d]
    expected = [[group - 0.5 * kl[0][0], 0.0, group - 0.5 * kl[0][2], group - 0.5 * kl[0][3]],
                [-group - 0.5 * kl[1][0], -group - 0.5 * kl[1][1], -group - 0.5 * kl[1][2], 0.0]]
    close(exp.advantages, expected, atol=1e-5)
    # logged per sample: the mean advantage over its 3 actions, the score plus its summed distillation reward
    close(logged_advantages, [sum(expected[0]) / 3, sum(expected[1]) / 3], atol=1e-5)
    close(logged_rewards, [1 - 0.5 * (kl[0][0] + kl[0][2] + kl[0][3]), 0 - 0.5 * (kl[1][0] + kl[1][1] + kl[1][2])],
          atol=1e-5)
    kl_tokens = [kl[0][0], kl[0][2], kl[0][3], kl[1][0], kl[1][1], kl[1][2]]
    assert metrics["distill/kl_mean"] == pytest.approx(sum(kl_tokens) / 6, abs=1e-6)
    assert metrics["distill/teacher_logp_mean"] == pytest.approx((-1.5 - 1.0 - 0.5 - 1.0 - 0.7 - 1.0) / 6, abs=1e-6)


def test_grpo_reward_mode_enters_a_token_estimators_rewards_before_the_discounted_sum(monkeypatch):
    """--distill-mode reward with reinforce_plus_plus: the estimator's token rewards are the score on the last action
    plus -coef x k1 on every action (the tool token compacted away); the estimator itself is spied on."""
    grpo, stage, distill, exp, teacher_logp = _distill_case("reinforce_plus_plus", "k1", coef=2.0)
    monkeypatch.setattr(grpo, "sum_over_data_parallel", lambda t: t)
    seen = {}

    def spy(rewards, mask, n, sum_across=None):
        seen["rewards"], seen["mask"] = rewards.clone(), mask.clone()
        return rewards

    stage.advantages = spy
    _, rewards = _score(distill, exp, teacher_logp, monkeypatch)
    stage._advantages(exp, rewards)
    # row 0's actions (tool token left out): k1 = 0.5, -1.0, 0.0; score 1 on its last action
    close(seen["rewards"], [[-1.0, 2.0, 0.0 + 1.0, 0.0], [1.0, -1.0, 0.0, 0.0]])
    close(seen["mask"], [[1, 1, 1, 0], [1, 1, 1, 0]])


@pytest.mark.parametrize("loss", ["k3", "topk_forward_kl"])
def test_the_loss_modes_term_and_its_gradient_equal_autograd_on_a_dense_reference(loss, monkeypatch):
    """`Distillation.loss_term` on one micro-batch (the read positions of `rl/update/passes.py`, --loss-agg-mode
    seq-mean-token-mean with the mini-batch's totals, --distill-coef) against the same loss written densely in plain
    torch, value and gradient w.r.t. the student's logits; the teacher's top-k as `teacher_topk` gives it."""
    from mindspeed_llm.rl.distillation import Distillation
    from mindspeed_llm.rl.update import passes

    monkeypatch.setattr(passes.parallel_state, "get_tensor_model_parallel_group", lambda: None)
    gen = torch.Generator().manual_seed(7)
    V, T_, k, temperature, coef = 11, 6, 4, 0.8, 0.5
    prompts, mask = [2, 3], torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    responses = torch.randint(0, V, (2, 3), generator=gen)
    logits = torch.randn(2, T_, V, generator=gen, requires_grad=True)
    teacher_logits = 2 * torch.randn(2, 3, V, generator=gen)
    top = ca.teacher_topk(teacher_logits, k, temperature=temperature)
    index = torch.tensor([[p - 1 + j for j in range(3)] for p in prompts]).clamp(max=T_ - 1)
    mb = dict(responses=responses, response_index=index, row_index=torch.arange(2), logits_from=torch.tensor(0),
              teacher_topk_ids=top.ids, teacher_topk_logp=top.logp, loss_mask=mask,
              total_tokens=torch.tensor(5.0), total_sequences=torch.tensor(2.0))
    teacher_logp = torch.log_softmax(teacher_logits / temperature, -1).gather(-1, responses[..., None])[..., 0]
    mb["teacher_logp"] = teacher_logp
    distill = object.__new__(Distillation)
    distill.sampled, distill.estimator, distill.coef = loss == "k3", loss, coef
    distill.temperature, distill.agg, distill.max_len = temperature, "seq-mean-token-mean", 3
    logp = passes.response_logprobs(logits, mb, temperature)
    term, metrics = distill.loss_term(logits, logp, mb)
    (grad,) = torch.autograd.grad(term, logits)

    dense_logits = logits.detach().clone().requires_grad_(True)
    # position p - 1 + j predicts response token j
    log_s = torch.log_softmax(dense_logits[torch.arange(2)[:, None], index] / temperature, -1)  # [2, 3, V]
    if loss == "k3":
        d = teacher_logp - log_s.gather(-1, responses[..., None])[..., 0]
        per_token = torch.exp(d) - d - 1
    else:
        log_t = torch.log_softmax(teacher_logits / temperature, -1)
        in_topk = torch.zeros_like(log_t).scatter(-1, top.ids, 1.0)
        per_token = (in_topk * log_t.exp() * (log_t - log_s)).sum(-1)
    # seq-mean-token-mean: each sequence's token mean, averaged over the 2 sequences
    reference = coef * ((per_token * mask).sum(-1) / mask.sum(-1)).sum() / 2
    (dense_grad,) = torch.autograd.grad(reference, dense_logits)
    torch.testing.assert_close(term, reference, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, dense_grad, atol=1e-6, rtol=1e-5)
    assert float(metrics["distill_loss"]) == pytest.approx(float(reference.detach()), rel=1e-5)


def test_a_teacher_of_another_vocabulary_is_refused_before_any_model_is_built(monkeypatch):
    """`RoleFactory.check_teacher` reads the two checkpoints' specs only, and both stages call it before building
    their actor: a teacher of a smaller vocabulary (or a --distill-topk over the actor's) is refused naming
    --teacher-load without a model built; one padded to more rows is taken."""
    from types import SimpleNamespace

    from mindspeed_llm.errors import ArgumentError
    from mindspeed_llm.rl.settings import AlgorithmSettings, DistillSettings, ModelSources, Settings
    from mindspeed_llm.rl.stages import grpo, trl_ppo
    from mindspeed_llm.rl.update import roles

    vocab = {"actor": 256, "teacher": 200, "same": 256, "padded": 320}
    monkeypatch.setattr(roles, "load_spec", lambda root: SimpleNamespace(vocab_size=vocab[root]))
    settings = Settings(distill=DistillSettings(teacher_load="teacher", distill_loss="k1", distill_mode="reward",
                                                distill_coef=1.0),
                        algorithm=AlgorithmSettings(stage="grpo", adv_estimator="grpo", n_samples_per_prompt=2),
                        models=ModelSources(ref_model="actor", reward_model="reward", load="actor"))
    with pytest.raises(ArgumentError, match="--teacher-load teacher: the teacher's vocabulary has 200 tokens, the "
                                            "actor's 256"):
        roles.RoleFactory(settings).check_teacher("actor")
    # the same tokenizer padded to more rows (Qwen2.5 7B's 152,064 against 0.5B's 151,936): read over the actor's ids
    roles.RoleFactory(replace(settings, distill=replace(settings.distill, teacher_load="padded"))).check_teacher("actor")
    topk = Settings(distill=DistillSettings(teacher_load="same", distill_loss="topk_forward_kl", distill_topk=300))
    with pytest.raises(ArgumentError, match=r"--distill-topk 300 exceeds the vocabulary of 256 tokens \(--teacher-load "
                                            r"same\)"):
        roles.RoleFactory(topk).check_teacher("actor")
    roles.RoleFactory(Settings()).check_teacher("actor")  # no teacher: nothing to check

    built = []
    factory = roles.RoleFactory(settings)
    monkeypatch.setattr(factory, "trained", lambda *a, **k: built.append(a))
    for stage in (grpo.GRPOStage, trl_ppo.TrlPPOStage):
        with pytest.raises(ArgumentError, match="the teacher's vocabulary has 200 tokens"):
            stage(settings, None, factory)
    assert built == []


@pytest.mark.parametrize("tp", [1, 2])
def test_a_teacher_padded_to_more_rows_is_read_over_the_actors_ids(tp, monkeypatch):
    """A teacher of the actor's tokenizer padded to more vocabulary rows (`vocab_size` < its shard layout's): its
    log-probs and top-k equal those of its logits cut to the actor's ids, at TP1 and, shard by shard, at TP2 (the
    padding rows sit in the last shard: a plain-torch log-softmax over the cut logits is the reference)."""
    from mindspeed_llm.rl.update import passes

    gen = torch.Generator().manual_seed(3)
    V_actor, V_teacher, k, temperature = 10, 12, 4, 0.7
    full = 3 * torch.randn(2, 3, V_teacher, generator=gen)
    full[..., V_actor:] += 20  # padding rows the teacher would otherwise rank first
    responses = torch.randint(0, V_actor, (2, 3), generator=gen)
    mb = dict(responses=responses, response_index=torch.arange(3).expand(2, 3), row_index=torch.arange(2),
              logits_from=torch.tensor(0))
    reference = torch.log_softmax(full[..., :V_actor] / temperature, -1)
    shard = V_teacher // tp
    for rank in range(tp):  # each rank's shard, the group's collectives stood in by the whole vocabulary's values
        monkeypatch.setattr(passes, "_group_world_rank", lambda group, rank=rank: (tp, rank))
        masked = passes._without_padding_rows(full[..., rank * shard:(rank + 1) * shard].reshape(-1, shard),
                                              V_actor, None)
        ids = torch.arange(rank * shard, (rank + 1) * shard)
        assert torch.equal(masked[:, ids < V_actor], full[..., rank * shard:(rank + 1) * shard].reshape(-1, shard)[
            :, ids < V_actor])
        assert bool((masked[:, ids >= V_actor] == passes.PADDING_LOGIT).all())
    monkeypatch.setattr(passes, "_group_world_rank", lambda group: (1, 0))
    monkeypatch.setattr(passes.parallel_state, "get_tensor_model_parallel_group", lambda: None)
    out = passes.response_teacher_scores(full, mb, temperature, k, vocab_size=V_actor)
    torch.testing.assert_close(out[..., 0], reference.gather(-1, responses[..., None])[..., 0])
    top = reference.topk(k, dim=-1)
    assert torch.equal(out[..., 1:1 + k].round().long(), top.indices)
    torch.testing.assert_close(out[..., 1 + k:], top.values)
    unmasked = passes.response_teacher_scores(full, mb, temperature, k)  # without it the padding rows rank first
    assert bool((unmasked[..., 1:1 + k].round().long() >= V_actor).any())
