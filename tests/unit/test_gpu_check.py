"""The GPU check's parts that a CPU machine can check, quickly (nothing heavy is run), in this process (`gpu_check.sh`
without a GPU and `gpu_check.py run --dry-run` as processes: tests/dist/test_gpu_check_dist.py):

* the command lines the H200 run would use are accepted by the real parsers (posttrain_gpt.py's,
  benchmarks/vs_trl.py's);
* `benchmarks/vs_trl.py --device / --dtype`: both sides set together (TRL's config, our argv and environment);
* `--device cuda` without a GPU: one line and a non-zero exit, from vs_trl.py and logprobs.py.
"""

import os

import pytest

from tests.helpers.scripts import ROOT, has_cuda, load_script


@pytest.fixture(scope="module")
def vs_trl():
    return load_script("bench_vs_trl", ROOT / "benchmarks" / "vs_trl.py")


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check_script", ROOT / "scripts" / "gpu_check.py")


def _check(gpu_check, *argv):
    opts = gpu_check.build_parser().parse_args(["run", *argv])
    opts.size = opts.size or ("full" if opts.device == "cuda" else "tiny")
    opts.budget = opts.budget or 480.0
    return gpu_check.Check(opts)


def test_h200_command_lines_parse(gpu_check, vs_trl):
    """The command lines of the full-size (H200) run pass posttrain_gpt.py's and vs_trl.py's own parsers."""
    from mindspeed_llm.arguments import parse_args

    check = _check(gpu_check, "--device", "cuda")
    steps = {s.name: s for s in check.steps}
    assert list(steps) == gpu_check.ORDER
    for stage in ("grpo", "trl_ppo"):
        (argv,) = steps[f"qwen_{stage}"].commands
        argv = [str(a) for a in argv]
        args = parse_args(argv[argv.index("posttrain_gpt.py") + 1:], world_size=1)
        assert args.stage == stage and args.bf16 and args.train_iters == 3
    for name in ("vs_trl_prepare", "vs_trl_fp32_grpo", "vs_trl_fp32_trl_ppo", "vs_trl_bf16_grpo",
                 "vs_trl_bf16_trl_ppo"):
        (argv,) = steps[name].commands
        argv = [str(a) for a in argv]
        args = vs_trl.build_parser().parse_args(argv[argv.index("benchmarks/vs_trl.py") + 1:])
        assert args.device == "cuda" and (args.tiny_layers, args.tiny_hidden, args.prompts) == (12, 768, 32)
        if name != "vs_trl_prepare":
            assert args.dtype == name.split("_")[2] and args.only == name.split("_", 3)[3]
    # the budget: the setup group side by side, then one step after the other
    sub = _check(gpu_check, "--device", "cuda", "--steps", "env,qwen_grpo", "--skip", "qwen_grpo")
    assert [s.name for s in sub.steps] == ["env"]
    with pytest.raises(SystemExit):
        _check(gpu_check, "--steps", "no_such_step")


def test_vs_trl_device_dtype_flags(vs_trl, tmp_path):
    defaults = vs_trl.build_parser().parse_args([])
    assert (defaults.device, defaults.dtype) == ("cpu", "fp32")
    model = {"hf": "HF", "hf_value": "HFV", "mg": "MG", "mg_value": "MGV"}
    schedule = [([1, 2, 3], "4")]
    expected = {("cpu", "fp32"): (True, False), ("cuda", "bf16"): (False, True), ("cuda", "fp32"): (False, False),
                ("cpu", "bf16"): (True, True)}
    for (device, dtype), (use_cpu, bf16) in expected.items():
        args = vs_trl.build_parser().parse_args(["--device", device, "--dtype", dtype])
        for stage in ("grpo", "trl_ppo"):
            spec = vs_trl.trl_spec(stage, model, schedule, tmp_path, args)
            config = vs_trl._trl_common_config(spec)
            assert (config["use_cpu"], config["bf16"], config["fp16"]) == (use_cpu, bf16, False), (device, dtype)
            ours = [str(a) for a in vs_trl.our_argv(stage, model, tmp_path / "data", tmp_path / "m.jsonl", args)]
            assert ("--bf16" in ours) == bf16
            assert "--fp16" not in ours
        assert vs_trl._env(2, device)["MINDSPEED_DEVICE"] == device
    # a spec written before --device / --dtype existed means the old behaviour: CPU, fp32
    old = {k: v for k, v in vs_trl.trl_spec("grpo", model, schedule, tmp_path, defaults).items()
           if k not in ("device", "dtype")}
    assert vs_trl._trl_common_config(old)["use_cpu"] is True
    with pytest.raises(ValueError):
        vs_trl.trl_precision_kwargs("tpu", "fp32")
    with pytest.raises(SystemExit):
        vs_trl.build_parser().parse_args(["--device", "tpu"])


def test_cuda_refused_in_one_line_without_gpu(vs_trl):
    """A SystemExit with a message: Python prints that one line (no traceback) and exits 1."""
    if has_cuda():
        pytest.skip("a GPU is here")
    logprobs = load_script("bench_logprobs", ROOT / "benchmarks" / "logprobs.py")
    for run in (lambda: vs_trl.main(["--device", "cuda", "--model", "tiny"]),
                lambda: logprobs.main(["--device", "cuda"])):
        with pytest.raises(SystemExit) as exc:
            run()
        message = exc.value.code
        assert isinstance(message, str) and "\n" not in message and "sees no CUDA device" in message, message


def test_npu_check_command_lines_parse():
    """scripts/npu_check.py's stage and memory command lines pass posttrain_gpt.py's and memory.py's parsers."""
    from mindspeed_llm.arguments import parse_args

    npu_check = load_script("npu_check_script", ROOT / "scripts" / "npu_check.py")
    memory = load_script("bench_memory", ROOT / "benchmarks" / "memory.py")
    opts = npu_check.build_parser().parse_args(["run"])
    opts.size, opts.json = "tiny", "unused.json"
    steps = {s.name: s for s in npu_check.NpuCheck(opts).steps}
    assert list(steps) == npu_check.ORDER
    for stage in ("grpo", "trl_ppo"):
        (argv,) = steps[f"qwen_{stage}"].commands
        argv = [str(a) for a in argv]
        args = parse_args(argv[argv.index("posttrain_gpt.py") + 1:], world_size=1)
        assert args.stage == stage and args.bf16 and args.train_iters == 3
    (argv,) = steps["memory"].commands
    argv = [str(a) for a in argv]
    args = memory.parse(argv[argv.index("benchmarks/memory.py") + 1:])
    assert args.device == "npu" and args.toy
