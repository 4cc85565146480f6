"""`mindspeed_llm/arguments/validation.py`'s `validate_args`: each inconsistent combination of flags is refused by
`parse_args` with an `ArgumentError` naming the flags, before any model is built. (The same mistakes through
posttrain_gpt.py's exit code and stderr: tests/dist/test_stages_errors.py; the ranges of single flags:
tests/unit/test_argument_ranges.py.)
"""

import pytest

from mindspeed_llm.arguments import ArgumentError, parse_args

BASE = ["--data-path", "d", "--train-iters", "1", "--global-batch-size", "4", "--ref-model", "r"]


@pytest.mark.parametrize("extra,world,needle", [
    (["--stage", "grpo", "--verifier-function", "math_acc", "--max-new-tokens", "64", "--max-length", "64"], 1,
     "--max-new-tokens 64 must be smaller than --max-length 64"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--tensor-model-parallel-size", "2"], 3,
     "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--global-batch-size", "3"], 2,
     "--global-batch-size 3 is not divisible by the data-parallel size 2"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--n-samples-per-prompt", "3", "--micro-batch-size",
      "4"], 2, "--global-batch-size 4 x --n-samples-per-prompt 3 = 12 sequences is not divisible by data-parallel"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--ppo-mini-batch-size", "6"], 1,
     "--ppo-mini-batch-size 6 must divide the 32 sequences"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "format", "--verifier-weight", "1"], 1,
     "--verifier-weight has 1 values for 2 --verifier-function names"),
    (["--stage", "trl_ppo"], 1, "--reward-model is required for --stage trl_ppo"),
    (["--stage", "grpo"], 1, "--stage grpo needs a reward"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--bf16", "--fp16"], 1, "--bf16 and --fp16 are exclusive"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--save-interval", "2"], 1, "--save-interval needs --save"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--micro-batch-size", "0"], 1,
     "--micro-batch-size 0 must be >= 1"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--lr", "nan"], 1, "--lr nan must be a finite number"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--lr=-1e-3"], 1, "--lr -0.001 must be > 0"),
    (["--stage", "trl_ppo", "--reward-model", "x", "--critic-lr", "inf"], 1, "--critic-lr inf must be a finite"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--ckpt-step", "3"], 1, "--ckpt-step 3 needs --load DIR"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--save-hf"], 1, "--save-hf writes a Hugging Face folder "
     "beside each checkpoint: it needs --save DIR"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--save", "s", "--save-hf", "--save-hf-merge-lora"], 1,
     "--save-hf-merge-lora merges a LoRA actor's adapters into the --save-hf folder: it needs --save-hf and a LoRA run"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--allow-reference-change"], 1,
     "--allow-reference-change applies to a resume: it needs --load DIR"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--override-opt_param-scheduler",
      "--use-checkpoint-opt_param-scheduler"], 1, "contradict each other"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--n-samples-per-prompt", "4", "--ppo-mini-batch-size",
      "4", "--global-batch-size", "4"], 2, "--ppo-mini-batch-size 4 must be a multiple of --n-samples-per-prompt 4 x"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--rollout-max-num-seqs", "0"], 1,
     "--rollout-max-num-seqs 0 must be >= 1"),
    (["--stage", "grpo", "--verifier-function", "math_acc", "--rollout-max-num-batched-tokens=-4"], 1,
     "--rollout-max-num-batched-tokens -4 must be >= 1"),
])
def test_inconsistent_flags_are_refused_by_name(extra, world, needle):
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + extra, world_size=world)
    assert needle in str(err.value)


# On-policy distillation (`arguments/distill.py`): each refusal names the flag and the fix.
TEACHER = ["--teacher-load", "t"]
GRPO_MATH = ["--stage", "grpo", "--verifier-function", "math_acc"]


@pytest.mark.parametrize("extra,needle", [
    (GRPO_MATH + ["--distill-coef", "0.5"], "--distill-coef 0.5 without --teacher-load: distillation needs a "
                                            "teacher; add --teacher-load PATH"),
    (GRPO_MATH + ["--distill-loss", "k3", "--distill-topk", "4"], "--distill-loss k3, --distill-topk 4 without "
                                                                  "--teacher-load"),
    (GRPO_MATH + TEACHER + ["--distill-mode", "loss"], "--distill-loss k1 cannot be --distill-mode loss: its "
                                                       "gradient is that of the student's log-prob alone"),
    (["--stage", "trl_ppo", "--reward-model", "x"] + TEACHER + ["--distill-loss", "k3", "--distill-mode", "loss"],
     "--distill-mode loss is grpo's: --stage trl_ppo takes the distillation as a per-token reward"),
    (GRPO_MATH + TEACHER + ["--distill-topk", "8"], "--distill-topk 8 applies to --distill-loss topk_forward_kl, "
                                                    "not to --distill-loss k1"),
    (GRPO_MATH + TEACHER + ["--distill-loss", "topk_forward_kl", "--distill-topk", "0"], "--distill-topk 0 must be "
                                                                                         ">= 1"),
    (GRPO_MATH + TEACHER + ["--distill-coef", "0"], "--distill-coef 0.0 must be > 0"),
])
def test_distillation_flags_are_refused_by_name(extra, needle):
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + extra, world_size=1)
    assert needle in str(err.value)


def test_distillation_defaults_and_pure_distillation():
    """With --teacher-load alone grpo needs no other reward (pure distillation), and the defaults are resolved:
    k1 as a reward, coefficient 1.0, no top-k; topk_forward_kl gets k = 32. Without a teacher nothing is set."""
    pure = parse_args(BASE + ["--stage", "grpo"] + TEACHER, world_size=1).settings.distill
    assert (pure.teacher_load, pure.distill_loss, pure.distill_mode, pure.distill_coef, pure.distill_topk) == (
        "t", "k1", "reward", 1.0, None)
    topk = parse_args(BASE + GRPO_MATH + TEACHER + ["--distill-loss", "topk_forward_kl", "--distill-mode", "loss",
                                                    "--distill-coef", "0.5"], world_size=1).settings.distill
    assert (topk.distill_loss, topk.distill_mode, topk.distill_coef, topk.distill_topk) == (
        "topk_forward_kl", "loss", 0.5, 32)
    ppo = parse_args(BASE + ["--stage", "trl_ppo", "--reward-model", "x"] + TEACHER + ["--distill-loss", "k3"],
                     world_size=1).settings.distill
    assert (ppo.distill_loss, ppo.distill_mode) == ("k3", "reward")
    # a group of one: the group advantage is 0, the teacher's term trains; without a teacher it is refused
    assert parse_args(BASE + GRPO_MATH + TEACHER + ["--n-samples-per-prompt", "1"], world_size=1).settings.algorithm \
        .n_samples_per_prompt == 1
    with pytest.raises(ArgumentError, match="with --n-samples-per-prompt 1 every advantage is 0"):
        parse_args(BASE + GRPO_MATH + ["--n-samples-per-prompt", "1"], world_size=1)
    off = parse_args(BASE + GRPO_MATH, world_size=1).settings.distill
    assert off.teacher_load is None and off.distill_loss is None and off.distill_coef is None
