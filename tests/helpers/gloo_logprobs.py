"""Helpers for tests/dist/test_logprobs_dist.py, tests/dist/test_triton_logprobs.py and
tests/dist/test_distill_dist.py: run a function on N local processes joined in a gloo group.

The worker functions live here (not in the test module) so the spawned children can import them by
module name without re-importing the test module's dependencies.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import free_port


def _entry(rank, world_size, port, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size=2, args=()):
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raises a worker's failure."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def tp_logprobs_worker(rank, world_size, cases):
    """Each rank holds one vocab shard; checks values and logits-gradients against the reference
    computed on the all-gathered full logits, for every case."""
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    group = dist.new_group(list(range(world_size)))
    for case in cases:
        shape, vocab, dtype, temperature, with_entropy, chunk_size, atol, rtol = case
        g = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own shard
        shard = vocab // world_size
        local = (torch.randn(*shape, shard, generator=g) * 3).to(dtype)
        tg = torch.Generator().manual_seed(7)  # targets identical on all ranks
        targets = torch.randint(0, vocab, shape, generator=tg)
        weights = [torch.randn(shape, generator=tg) for _ in range(2)]

        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        full = torch.cat(gathered, dim=-1).requires_grad_()
        assert torch.equal(full[..., rank * shard : (rank + 1) * shard].detach(), local)

        local = local.requires_grad_()
        out = vocab_parallel_logprobs(
            local, targets, tp_group=group, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size
        )
        ref = reference_logprobs(full, targets, temperature=temperature, with_entropy=with_entropy)
        out = out if with_entropy else (out,)
        ref = ref if with_entropy else (ref,)
        for o, r in zip(out, ref):
            assert o.dtype == torch.float32
            torch.testing.assert_close(o, r, atol=atol, rtol=rtol, msg=lambda m: f"rank {rank} {case}: {m}")
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
        sum((r * w).sum() for r, w in zip(ref, weights)).backward()
        expected = full.grad[..., rank * shard : (rank + 1) * shard]
        assert local.grad.dtype == dtype
        torch.testing.assert_close(
            local.grad.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"rank {rank} grad {case}: {m}"
        )


def tp_distill_worker(rank, world_size, cases):
    """Each rank holds one vocab shard of the same student and teacher logits; the teacher's top-k (ids, log-probs),
    the top-k forward KL, its top-k mass, the loss and each shard's logits-gradient must equal those of one rank
    holding the whole vocabulary (tp_group None), for every case."""
    from mindspeed_llm.rl import core_algos as ca

    group = dist.new_group(list(range(world_size)))
    for case in cases:
        shape, vocab, k, dtype, temperature, tol, grad_tol = case
        g = torch.Generator().manual_seed(11)  # the same full logits on every rank
        student = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
        teacher = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
        mask = (torch.rand(shape, generator=g) < 0.7).to(torch.int64)
        shard = vocab // world_size
        part = slice(rank * shard, (rank + 1) * shard)

        results = []
        for logits_s, logits_t, tp_group in ((student[..., part], teacher[..., part], group),
                                             (student, teacher, None)):
            s = logits_s.clone().requires_grad_()
            top = ca.teacher_topk(logits_t.clone(), k, tp_group, temperature)
            kl, mass = ca.forward_kl_on_teacher_topk(s, top, tp_group, temperature)
            loss, metrics = ca.topk_forward_kl_loss(s, top, mask, tp_group, temperature)
            loss.backward()
            results.append((top, kl, mass, loss, metrics, s.grad))
        (top2, kl2, mass2, loss2, m2, grad2), (top1, kl1, mass1, loss1, m1, grad1) = results

        def check(a, b, what, tol=tol):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"rank {rank} {case} {what}: {m}")

        assert torch.equal(top2.ids, top1.ids), f"rank {rank} {case}: top-k ids differ"
        check(top2.logp, top1.logp, "teacher top-k log-probs")
        check(kl2, kl1, "kl")
        check(mass2, mass1, "top-k mass")
        check(loss2, loss1, "loss")
        for name in ("kl", "topk_mass"):
            check(m2[name], m1[name], name)
        assert grad2.dtype == dtype and grad2.shape[-1] == shard
        check(grad2, grad1[..., part], "logits gradient of this shard", grad_tol)
