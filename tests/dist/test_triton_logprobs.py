"""The Triton log-prob + entropy kernel (mindspeed_llm.kernels.triton_logprobs) on CPU, under Triton's
interpreter: values and gradients against ``reference_logprobs`` (fp32 log-softmax on the full logits)
and against the chunked torch path, single shard and TP=2 over gloo; the real kernels compiled by Triton down to
an sm_90 cubin (no GPU needed to compile: catches what the interpreter lets through, e.g. a loop-carried type
change); and the kernel choice (``MINDSPEED_LOGPROBS_KERNEL``).

``TRITON_INTERPRET=1`` must be set before the kernels are defined and would change how any other Triton
code in the pytest process behaves, so the interpreted checks run in a child process: this file run as a
script (``python tests/dist/test_triton_logprobs.py CHECK``); a failed check exits non-zero with its traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (requirements-test.txt: pip install -c constraints.txt triton==3.9.0; "
    "the CPU wheel runs these checks under TRITON_INTERPRET=1)",
)

TOKENS, VOCAB = 7, 50  # non-powers of two: masked tails in every block layout
TEMPERATURES = (1.0, 0.6, 1.7)
BLOCKS = (None, 16)  # one block (64 >= 50) / four blocks with a masked tail: the online-softmax rescale


def _tol(dtype):
    # fp32: the same math in another order. Low precision: only the stored gradient is rounded (values are
    # fp32), so it may differ from the fp32 reference by one unit in the last place: 2**-7 (bf16), 2**-10 (fp16).
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2.0 ** -7),
            torch.float16: dict(atol=1e-6, rtol=2.0 ** -10)}[dtype]


@contextlib.contextmanager
def _kernel_env(value):
    old = os.environ.get("MINDSPEED_LOGPROBS_KERNEL")
    os.environ["MINDSPEED_LOGPROBS_KERNEL"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINDSPEED_LOGPROBS_KERNEL")
        else:
            os.environ["MINDSPEED_LOGPROBS_KERNEL"] = old


def _outputs_and_grad(fn, logits, weights, use):
    """fn(x) -> (logp, entropy); backward of sum(w * out) over the outputs picked by `use` ("both",
    "logp", "entropy"); returns the outputs (detached) and the logits' gradient."""
    x = logits.detach().clone().requires_grad_()
    logp, ent = fn(x)
    picked = {"both": (logp, ent), "logp": (logp,), "entropy": (ent,)}[use]
    ws = {"both": weights, "logp": weights[:1], "entropy": weights[1:]}[use]
    sum((o * w).sum() for o, w in zip(picked, ws)).backward()
    return logp.detach(), ent.detach(), x.grad


# ----------------------------------------------------------------------------------------------------
# Checks run in the child process (TRITON_INTERPRET=1).


def check_values_and_grads():
    from mindspeed_llm.kernels.triton_logprobs import triton_vocab_parallel_logprobs
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for temperature in TEMPERATURES:
            for block in BLOCKS:
                logits = (torch.randn(TOKENS, VOCAB, generator=g) * 3).to(dtype)
                targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
                weights = [torch.randn(TOKENS, generator=g) for _ in range(2)]
                # Which outputs get a gradient (the backward's three branches): all of them in fp32 only.
                for use in ("both", "logp", "entropy") if dtype == torch.float32 else ("both",):
                    case = f"{dtype} T={temperature} block={block} grad of {use}"
                    tri = _outputs_and_grad(
                        lambda x: triton_vocab_parallel_logprobs(x, targets, temperature=temperature, with_entropy=True,
                                                                 fwd_block=block, bwd_block=block),
                        logits, weights, use)
                    ref = _outputs_and_grad(
                        lambda x: reference_logprobs(x, targets, temperature=temperature, with_entropy=True),
                        logits, weights, use)
                    with _kernel_env("torch"):
                        chunked = _outputs_and_grad(
                            lambda x: vocab_parallel_logprobs(x, targets, temperature=temperature, with_entropy=True,
                                                              chunk_size=3),
                            logits, weights, use)
                    assert tri[2].dtype == dtype, case
                    for other, name in ((ref, "reference"), (chunked, "chunked torch path")):
                        for i, what in enumerate(("logp", "entropy")):
                            torch.testing.assert_close(tri[i], other[i], atol=1e-5, rtol=1e-5,
                                                       msg=lambda m: f"{case}: {what} vs {name}: {m}")
                        torch.testing.assert_close(tri[2].float(), other[2].float(), **_tol(dtype),
                                                   msg=lambda m: f"{case}: gradient vs {name}: {m}")
                    n += 1
                # Without entropy: logp and its gradient alone.
                x = logits.detach().clone().requires_grad_()
                lp = triton_vocab_parallel_logprobs(x, targets, temperature=temperature, fwd_block=block,
                                                    bwd_block=block)
                (lp * weights[0]).sum().backward()
                y = logits.detach().clone().requires_grad_()
                rlp = reference_logprobs(y, targets, temperature=temperature)
                (rlp * weights[0]).sum().backward()
                torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(x.grad.float(), y.grad.float(), **_tol(dtype))
    print(f"{n} cases ok")


def check_edge_cases():
    from mindspeed_llm.kernels import triton_logprobs as tl_mod
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(TOKENS, generator=g) for _ in range(2)]
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)

    def compare(logits, case, block=16, temperature=1.3):
        for use in ("both", "entropy"):
            tri = _outputs_and_grad(lambda x: tl_mod.triton_vocab_parallel_logprobs(
                x, targets, temperature=temperature, with_entropy=True, fwd_block=block, bwd_block=block),
                logits, weights, use)
            ref = _outputs_and_grad(lambda x: reference_logprobs(x, targets, temperature=temperature, with_entropy=True),
                                    logits, weights, use)
            for a, b, what in zip(tri, ref, ("logp", "entropy", "gradient")):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case} ({use}): {what}: {m}")

    # Nearly one-hot rows (p ~ 1 on one column), some of them on the target.
    peaked = torch.randn(TOKENS, VOCAB, generator=g)
    peaked[::2, 5] += 40.0
    targets[::3] = 5
    compare(peaked, "peaked rows")
    # The row max grows in every block (ascending logits): every step rescales the running sums.
    ascending = torch.linspace(-20.0, 20.0, VOCAB).repeat(TOKENS, 1) + 0.1 * torch.randn(TOKENS, VOCAB, generator=g)
    compare(ascending, "ascending rows")
    # ... and shrinks (the max is in the first block).
    compare(ascending.flip(1).contiguous(), "descending rows")
    # Row stride != width: a column slice of wider logits is read in place.
    wide = torch.randn(TOKENS, VOCAB + 14, generator=g)
    compare(wide[:, :VOCAB], "column slice")

    # Through vocab_parallel_logprobs with MINDSPEED_LOGPROBS_KERNEL=triton: 3-D input, the kernel is called.
    calls = []
    real = tl_mod.triton_vocab_parallel_logprobs

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    tl_mod.triton_vocab_parallel_logprobs = counting
    try:
        logits3 = torch.randn(2, 5, VOCAB, generator=g)
        targets3 = torch.randint(0, VOCAB, (2, 5), generator=g)
        with _kernel_env("triton"):
            lp, ent = vocab_parallel_logprobs(logits3, targets3, temperature=0.8, with_entropy=True)
        with _kernel_env("auto"):  # CPU: auto is the torch path even with Triton importable
            vocab_parallel_logprobs(logits3, targets3, temperature=0.8, with_entropy=True)
    finally:
        tl_mod.triton_vocab_parallel_logprobs = real
    assert calls == [torch.Size([10, VOCAB])], calls
    rlp, rent = reference_logprobs(logits3, targets3, temperature=0.8, with_entropy=True)
    assert lp.shape == (2, 5)
    torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, rent, atol=1e-5, rtol=1e-5)

    # Targets outside [0, V) give NaN (as in the torch path); the others are unaffected. No grad mode.
    logits = torch.randn(4, VOCAB, generator=g)
    bad = torch.tensor([0, VOCAB - 1, VOCAB, -1])
    with torch.no_grad():
        lp = tl_mod.triton_vocab_parallel_logprobs(logits, bad, fwd_block=16)
    assert torch.isfinite(lp[:2]).all() and torch.isnan(lp[2:]).all(), lp
    torch.testing.assert_close(lp[:2], reference_logprobs(logits[:2], bad[:2]), atol=1e-5, rtol=1e-5)

    # No tokens.
    empty = torch.zeros(0, VOCAB, requires_grad=True)
    lp, ent = tl_mod.triton_vocab_parallel_logprobs(empty, torch.zeros(0, dtype=torch.long), with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (0,) and empty.grad.shape == (0, VOCAB)
    print("edge cases ok")


def _tp_worker(rank, world_size, cases):
    import torch.distributed as dist

    from mindspeed_llm.kernels.triton_logprobs import triton_vocab_parallel_logprobs
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    group = dist.new_group(list(range(world_size)))
    shard = VOCAB // world_size
    for dtype_name, temperature, block in cases:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(100 + rank)
        # Rank 1's logits are larger: the ranks' local maxima differ and the sums must be moved to the global one.
        local = (torch.randn(TOKENS, shard, generator=g) * (2.0 + 3.0 * rank)).to(dtype)
        tg = torch.Generator().manual_seed(7)
        targets = torch.randint(0, VOCAB, (TOKENS,), generator=tg)
        targets[0], targets[1] = 0, VOCAB - 1  # one on each rank's shard for sure
        weights = [torch.randn(TOKENS, generator=tg) for _ in range(2)]
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        full = torch.cat(gathered, dim=-1)
        cols = slice(rank * shard, (rank + 1) * shard)
        case = f"rank {rank} {dtype_name} T={temperature} block={block}"

        tri = _outputs_and_grad(lambda x: triton_vocab_parallel_logprobs(
            x, targets, group, temperature, True, fwd_block=block, bwd_block=block), local, weights, "both")
        ref = _outputs_and_grad(lambda x: reference_logprobs(x, targets, temperature, True), full, weights, "both")
        with _kernel_env("torch"):
            chunked = _outputs_and_grad(lambda x: vocab_parallel_logprobs(
                x, targets, group, temperature, True, chunk_size=3), local, weights, "both")
        for i, what in enumerate(("logp", "entropy")):
            torch.testing.assert_close(tri[i], ref[i], atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {what}: {m}")
            torch.testing.assert_close(tri[i], chunked[i], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{case}: {what} vs chunked: {m}")
        assert tri[2].dtype == dtype and tri[2].shape == local.shape
        torch.testing.assert_close(tri[2].float(), ref[2][:, cols].float(), **_tol(dtype),
                                   msg=lambda m: f"{case}: gradient of this rank's shard: {m}")
        torch.testing.assert_close(tri[2].float(), chunked[2].float(), **_tol(dtype),
                                   msg=lambda m: f"{case}: gradient vs chunked: {m}")


def check_tp2():
    from tests.helpers.gloo_logprobs import run_gloo  # gloo workers without megatron's import (faster start)

    cases = [("float32", 1.0, None), ("float32", 0.6, 8), ("bfloat16", 1.7, 8)]
    run_gloo(_tp_worker, 2, (cases,))
    print("tp2 ok")


def check_compiles_for_cuda():
    """The real (not interpreted) kernels through Triton's compiler down to a cubin for sm_90 (H100 / H200),
    with the wheel's own ptxas: no GPU is needed to compile, only to run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mindspeed_llm.kernels import triton_logprobs as mod

    target = GPUTarget("cuda", 90, 32)
    for dtype in ("bf16", "fp16", "fp32"):
        fwd = {"logits_ptr": f"*{dtype}", "stride_row": "i32", "targets_ptr": "*i64", "vocab_start": "i32",
               "vocab_shard": "i32", "temperature": "fp32", "max_ptr": "*fp32", "stats_ptr": "*fp32", "n_rows": "i32",
               "WITH_ENTROPY": "constexpr", "BLOCK_V": "constexpr"}
        for with_entropy in (True, False):
            kernel = triton.compile(ASTSource(mod._logprobs_fwd_kernel, fwd, constexprs={
                "WITH_ENTROPY": with_entropy, "BLOCK_V": mod.FWD_BLOCK_V}), target=target, options={"num_warps": 8})
            assert kernel.asm.get("cubin"), (dtype, with_entropy)
        bwd = {"logits_ptr": f"*{dtype}", "stride_row": "i64", "grad_ptr": f"*{dtype}", "grad_stride_row": "i64",
               "log_z_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32", "grad_ent_ptr": "*fp32",
               "local_target_ptr": "*i64", "vocab_shard": "i32", "temperature": "fp32",
               "HAS_GRAD_LOGP": "constexpr", "HAS_GRAD_ENT": "constexpr", "BLOCK_V": "constexpr"}
        for has_lp, has_h in ((True, True), (True, False), (False, True)):
            kernel = triton.compile(ASTSource(mod._logprobs_bwd_kernel, bwd, constexprs={
                "HAS_GRAD_LOGP": has_lp, "HAS_GRAD_ENT": has_h, "BLOCK_V": mod.BWD_BLOCK_V}),
                target=target, options={"num_warps": 8})
            assert kernel.asm.get("cubin"), (dtype, has_lp, has_h)
    print("compiled for sm_90")


def _run_interpreted(check, timeout=300, interpret=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    env.pop("MINDSPEED_LOGPROBS_KERNEL", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    mode = "under TRITON_INTERPRET=1" if interpret else "(Triton's compiler, no interpreter)"
    assert proc.returncode == 0, (f"{check} failed {mode} (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")


# ----------------------------------------------------------------------------------------------------
# pytest


@needs_triton
def test_values_and_gradients_against_reference_and_chunked_path():
    _run_interpreted("check_values_and_grads")


@needs_triton
def test_edge_cases_and_dispatch():
    _run_interpreted("check_edge_cases")


@needs_triton
def test_tensor_parallel_2_ranks():
    _run_interpreted("check_tp2")


@needs_triton
def test_kernels_compile_for_cuda_without_a_gpu():
    _run_interpreted("check_compiles_for_cuda", interpret=False)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the compiled kernel on a CUDA device")
def test_cuda_kernel_at_a_real_vocabulary():
    """On a GPU: the compiled kernel, Qwen2.5's vocabulary (38 column blocks), against the reference and the torch
    path, through vocab_parallel_logprobs' default choice on CUDA."""
    from mindspeed_llm.kernels import select_logprobs_kernel
    from mindspeed_llm.rl.logprobs import reference_logprobs, vocab_parallel_logprobs

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: this test is about the compiled kernel")
    dev = torch.device("cuda")
    assert os.environ.get("MINDSPEED_LOGPROBS_KERNEL", "auto") != "auto" or select_logprobs_kernel(dev) == "triton"
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(64, 152064, generator=g) * 3).to(dev, dtype)
        targets = torch.randint(0, 152064, (64,), generator=g).to(dev)
        weights = [torch.randn(64, generator=g).to(dev) for _ in range(2)]
        for temperature in (1.0, 0.7):
            with _kernel_env("triton"):
                tri = _outputs_and_grad(lambda x: vocab_parallel_logprobs(x, targets, temperature=temperature,
                                                                          with_entropy=True), logits, weights, "both")
            with _kernel_env("torch"):
                chunked = _outputs_and_grad(lambda x: vocab_parallel_logprobs(
                    x, targets, temperature=temperature, with_entropy=True), logits, weights, "both")
            ref = _outputs_and_grad(lambda x: reference_logprobs(x, targets, temperature, True), logits, weights, "both")
            for other in (ref, chunked):
                for i in range(2):
                    torch.testing.assert_close(tri[i], other[i], atol=1e-4, rtol=1e-5)
                torch.testing.assert_close(tri[2].float(), other[2].float(), **_tol(dtype))


def test_kernel_choice(monkeypatch):
    import mindspeed_llm.kernels as kernels

    monkeypatch.delenv("MINDSPEED_LOGPROBS_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert kernels.select_logprobs_kernel(torch.device("cpu")) == "torch"
    assert kernels.select_logprobs_kernel(torch.device("cuda", 0)) == "triton"
    assert kernels.select_logprobs_kernel("npu") == "torch"
    monkeypatch.setenv("MINDSPEED_LOGPROBS_KERNEL", "torch")
    assert kernels.select_logprobs_kernel(torch.device("cuda", 0)) == "torch"
    monkeypatch.setenv("MINDSPEED_LOGPROBS_KERNEL", "Triton")
    assert kernels.select_logprobs_kernel(torch.device("cuda", 0)) == "triton"
    with pytest.raises(RuntimeError, match="logits are on 'cpu'.*TRITON_INTERPRET=1.*MINDSPEED_LOGPROBS_KERNEL=auto"):
        kernels.select_logprobs_kernel(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.select_logprobs_kernel(torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="MINDSPEED_LOGPROBS_KERNEL='cuda' is not a log-prob kernel: use one of auto, torch, triton"):
        kernels.select_logprobs_kernel(torch.device("cuda", 0), kernel="cuda")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="Triton is not installed.*MINDSPEED_LOGPROBS_KERNEL=torch"):
        kernels.select_logprobs_kernel(torch.device("cuda", 0))
    monkeypatch.setenv("MINDSPEED_LOGPROBS_KERNEL", "auto")
    assert kernels.select_logprobs_kernel(torch.device("cuda", 0)) == "torch"  # no Triton: the torch path


if __name__ == "__main__":
    torch.set_num_threads(1)
    globals()[sys.argv[1]]()
