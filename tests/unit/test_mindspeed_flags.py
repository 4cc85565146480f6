"""MindSpeed-LLM launch scripts parse here unchanged: the published trl_ppo command line, the model flags checked
against the checkpoint, the ignored switches reported by name, --max-length's default, --attention-backend /
--use-flash-attn reaching every role's model, and convert_ckpt.py / preprocess_data.py's spellings. What needs a
model run (--split evaluation, the scaling and bias flags, dropout): tests/dist/test_stages_mindspeed_flags.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

from mindspeed_llm import compat_flags
from mindspeed_llm.arguments import ArgumentError, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# examples/mcore/llama32/trl_ppo_llama32_1b.sh of MindSpeed-LLM: what it passes to posttrain_gpt.py, as published
# (paths replaced by names).
PUBLISHED_TRL_PPO = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-fused-swiglu --use-mcore-models "
    "--micro-batch-size 1 --global-batch-size 1 --bf16 --use-rotary-position-embeddings --rope-scaling-type llama3 "
    "--rope-scaling-factor 32.0 --low-freq-factor 1.0 --high-freq-factor 4.0 --original-max-position-embeddings 8192 "
    "--tokenizer-type PretrainedFromHF --tokenizer-name-or-path TOK --num-layers 16 --hidden-size 2048 "
    "--ffn-hidden-size 8192 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 131072 "
    "--max-position-embeddings 131072 --make-vocab-size-divisible-by 1 --padded-vocab-size 128256 "
    "--disable-bias-linear --attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0 "
    "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
    "--lr 1e-7 --train-iters 4 --lr-decay-style constant --min-lr 1e-7 --weight-decay 0.0 --lr-warmup-fraction 0.00 "
    "--clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096 --no-gradient-accumulation-fusion "
    "--no-load-optim --no-load-rng --finetune --is-instruction-dataset --variable-seq-lengths "
    "--attention-softmax-in-fp32 --no-masked-softmax-fusion --seq-length 8192 --data-path DATA --split 100,0,0 "
    "--log-interval 1 --save-interval 2000 --eval-interval 2000 --eval-iters 1 --stage trl_ppo --max-new-tokens 256 "
    "--max-length 512 --tokenizer-not-use-fast --distributed-backend nccl --ref-model SFT --reward-model RM --save SAVE"
).split()

# The published line's flags that are accepted and change nothing here, by reason.
PUBLISHED_IGNORED = {
    compat_flags.PERFORMANCE: ["--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion"],
    compat_flags.ALWAYS: ["--use-mcore-models", "--swiglu", "--use-rotary-position-embeddings",
                          "--attention-softmax-in-fp32", "--is-instruction-dataset", "--variable-seq-lengths"],
    compat_flags.CHECKPOINT: ["--make-vocab-size-divisible-by", "--init-method-std"],
    compat_flags.SEQ_LENGTH: ["--seq-length"],
    compat_flags.FP16_ONLY: ["--initial-loss-scale"],
}

BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
        "--global-batch-size", "4", "--ref-model", "r"]


def _parse(*extra, world=1, base=BASE):
    return parse_args(list(base) + list(extra), world_size=world)


# ------------------------------------------------------------------------------------------- the published script

def test_published_trl_ppo_command_line_parses():
    args = parse_args(PUBLISHED_TRL_PPO, world_size=4)
    parallel = args.settings.parallel
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
            parallel.data_parallel_size) == (2, 2, 1)
    assert args.max_length == 512 and args.max_new_tokens == 256 and args.settings.model.params_dtype == "bf16"
    assert args.rotary_base == 500000 and args.norm_epsilon == 1e-5 and args.rope_scaling_factor == 32.0
    assert args.tokenizer_not_use_fast and args.distributed_backend == "nccl"
    # --split 100,0,0 has no valid part: evaluation is off, said once, and the run goes on
    assert args.settings.loop.eval_interval is None and args.settings.data.split_weights[1] == 0
    assert [n for n in args.settings.startup.startup_notes if "evaluation is off" in n and "--split 100,0,0" in n]


def test_ignored_flags_are_named_once_with_their_reason():
    args = parse_args(PUBLISHED_TRL_PPO, world_size=4)
    expected = {flag: reason for reason, flags in PUBLISHED_IGNORED.items() for flag in flags}
    assert dict(args.settings.startup.ignored_flags) == expected
    lines = compat_flags.startup_lines(args.settings.startup, backend="gloo")
    ignored = [line for line in lines if line.startswith("ignored flags:")]
    assert len(ignored) == 1
    for reason, flags in PUBLISHED_IGNORED.items():
        assert f"{', '.join(flags)} ({reason})" in ignored[0]
    assert "--distributed-backend nccl: this device's collectives use gloo" in "\n".join(lines)
    on_nccl = compat_flags.startup_lines(args.settings.startup, backend="nccl")
    assert not [line for line in on_nccl if "--distributed-backend" in line]
    # --use-fused-swiglu is applied (device.FUSED_OPS), and said so at startup with what runs it
    assert args.settings.model.fused_ops == ("swiglu",)
    assert [line for line in lines if line.startswith("--use-fused-swiglu: on ")]
    # no flags of that kind, nothing to report; --fp16 honours the loss-scale flags
    assert _parse().settings.startup.ignored_flags == ()
    fp16 = _parse("--fp16", "--initial-loss-scale", "4096").settings.startup
    assert "--initial-loss-scale" not in dict(fp16.ignored_flags)


def test_environment_switches_are_printed_at_startup(monkeypatch):
    from mindspeed_llm.rl.startup import ENVIRONMENT_SWITCHES, startup_lines

    assert set(ENVIRONMENT_SWITCHES) == {"MINDSPEED_LOGPROBS_KERNEL", "MINDSPEED_SCAN_KERNEL", "MINDSPEED_LOSS_KERNEL",
                                         "MINDSPEED_DECODE_CUDA_GRAPH"}
    monkeypatch.setenv("MINDSPEED_LOSS_KERNEL", "torch")
    monkeypatch.delenv("MINDSPEED_DECODE_CUDA_GRAPH", raising=False)
    line = startup_lines(_parse().settings, backend="gloo")[-1]
    assert line.startswith("environment switches: ")
    assert "MINDSPEED_LOSS_KERNEL=torch," in line and "MINDSPEED_DECODE_CUDA_GRAPH=0 (default)" in line


def test_every_table_flag_parses():
    switches = list(compat_flags.IGNORED_SWITCHES)
    values = [x for flag in compat_flags.IGNORED_VALUES for x in (flag, "1")]
    args = _parse(*switches, *values)
    ignored = dict(args.settings.startup.ignored_flags)
    assert set(ignored) == set(compat_flags.IGNORED_SWITCHES) | set(compat_flags.IGNORED_VALUES)


@pytest.mark.parametrize("extra,needle", [
    (["--rope-scaling-type", "yarn"], "--rope-scaling-type yarn: megatron-core implements only llama3"),
    (["--low-freq-factor", "2"], "--low-freq-factor 2.0: megatron-core's llama3 RoPE scaling is implemented for "
                                 "--low-freq-factor 1.0 only"),
    (["--high-freq-factor", "8"], "--high-freq-factor 8.0"),
    (["--original-max-position-embeddings", "4096"], "--original-max-position-embeddings 4096"),
    (["--normalization", "LayerNorm"], "--normalization LayerNorm"),
    (["--position-embedding-type", "learned_absolute"], "--position-embedding-type learned_absolute"),
    (["--attention-dropout", "1.0"], "--attention-dropout 1.0 must be in [0, 1)"),
    (["--hidden-dropout=-0.1"], "--hidden-dropout -0.1 must be in [0, 1)"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale 0.0 must be > 0"),
    (["--split", "0,1,0"], "--split 0,1,0 leaves nothing to train on"),
    (["--split", "a,b"], "--split 'a,b': expected up to three weights"),
    (["--split", "1,2,3,4"], "expected up to three weights"),
    (["--split", "98,2,0", "--eval-data-path", "e"], "--eval-data-path and --split 98,2,0 both give held-out prompts; "
                                                     "pick one"),
    (["--eval-interval", "2"], "--eval-interval needs held-out prompts: --eval-data-path"),
    (["--max-prompt-length", "0"], "--max-prompt-length 0 must be >= 1"),
])
def test_compat_values_that_cannot_work_are_refused_by_name(extra, needle):
    with pytest.raises(ArgumentError) as err:
        _parse(*extra)
    assert needle in str(err.value)


def test_max_length_defaults_to_prompt_plus_response():
    def lengths(*flags):
        settings = _parse(*flags).settings
        return settings.sampling.max_length, settings.data.max_prompt_length

    assert lengths("--max-prompt-length", "2048", "--max-new-tokens", "2048")[0] == 4096
    assert lengths() == (256, 256 - 128)
    assert lengths("--max-length", "600", "--max-prompt-length", "100", "--max-new-tokens", "50") == (600, 100)
    with pytest.raises(ArgumentError, match="exceeds --max-length 128"):
        _parse("--max-length", "128", "--max-prompt-length", "100", "--max-new-tokens", "64")


def test_trl_ppo_accepts_n_samples_per_prompt():
    base = ["--stage", "trl_ppo", "--reward-model", "rm"] + BASE[4:]
    assert parse_args(base + ["--n-samples-per-prompt", "4"], world_size=1).settings.algorithm.n_samples_per_prompt == 4
    assert parse_args(base, world_size=1).settings.algorithm.n_samples_per_prompt == 1


def test_loss_scale_flags_reach_megatrons_grad_scaler_with_fp16():
    fp16 = _parse("--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "50", "--hysteresis", "3")
    assert fp16.settings.optimizer.loss_scale_settings() == dict(initial_loss_scale=4096.0, loss_scale_window=50.0,
                                                                 hysteresis=3)
    assert _parse("--bf16", "--initial-loss-scale", "4096").settings.optimizer.loss_scale_settings() == {}


# ------------------------------------------------------------------------------------------- --split and evaluation

@pytest.mark.parametrize("text,weights", [
    ("100,0,0", (1.0, 0.0, 0.0)), ("98 2 0", (0.98, 0.02, 0.0)), ("969/30/1", (0.969, 0.03, 0.001)),
    ("3,1", (0.75, 0.25, 0.0)), ("1", (1.0, 0.0, 0.0)),
])
def test_split_weights(text, weights):
    args = _parse("--split", text)
    assert args.settings.data.split_weights == pytest.approx(weights)


def test_eval_prompt_counts():
    def loop(*flags):
        return _parse(*flags).settings.loop

    assert loop("--split", "98,2,0", "--eval-interval", "5", "--eval-iters", "3").eval_prompts == 12
    args = _parse("--split", "98,2,0", "--eval-interval", "5", "--eval-iters", "3", "--eval-samples", "7")
    assert args.settings.loop.eval_prompts == 7 and args.settings.loop.eval_interval == 5  # on --split's valid part
    assert loop("--split", "98,2,0", "--eval-interval", "5").eval_prompts == 0  # all
    off = _parse("--split", "98,2,0", "--eval-interval", "5", "--eval-iters", "0")
    assert off.settings.loop.eval_interval is None and "--eval-iters 0" in " ".join(off.settings.startup.startup_notes)
    held = _parse("--split", "98,2,0")
    notes = " ".join(held.settings.startup.startup_notes)
    assert held.settings.loop.eval_interval is None and "never evaluated" in notes
    # --split without a valid part, but --eval-data-path: evaluated on that
    assert loop("--eval-data-path", "e", "--split", "100,0,0", "--eval-interval", "2").eval_interval == 2


def test_split_indices_are_disjoint_deterministic_and_rounded_as_megatron():
    import numpy as np

    from mindspeed_llm.data.prompt_dataset import split_indices

    train, valid, test = split_indices(50, (0.8, 0.2, 0.0), seed=7)
    assert (len(train), len(valid), len(test)) == (40, 10, 0)
    assert not set(train) & set(valid) and sorted(np.concatenate([train, valid])) == list(range(50))
    again = split_indices(50, (0.8, 0.2, 0.0), seed=7)
    assert all((a == b).all() for a, b in zip((train, valid, test), again))
    assert not (split_indices(50, (0.8, 0.2, 0.0), seed=8)[1] == valid).all()
    # Megatron-LM's rounding: 969,30,1 of 1000 prompts
    assert [len(p) for p in split_indices(1000, (0.969, 0.03, 0.001), seed=1)] == [969, 30, 1]
    assert [len(p) for p in split_indices(7, (1.0, 0.0, 0.0), seed=1)] == [7, 0, 0]


# ------------------------------------------------------------------------------------------- model flags vs checkpoint

@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    """A tiny tied Llama 3 style checkpoint (llama3 RoPE scaling factor 8, rope_theta 500000, 4 heads, 2 groups)."""
    from tests.helpers.hf_tiny import save_tiny
    from mindspeed_llm.checkpoint import convert_hf_to_mg

    root = tmp_path_factory.mktemp("llama_tied")
    convert_hf_to_mg(save_tiny("llama", root / "hf", tie=True), root / "mg", progress=False)
    return str(root / "mg")


def _check(root, *extra):
    from mindspeed_llm.rl.update.roles import _checked_spec

    return _checked_spec(root, "--ref-model", _parse(*extra).settings)


def test_matching_model_flags_pass(llama_tied):
    spec = _check(llama_tied, "--rope-scaling-type", "llama3", "--rope-scaling-factor", "8", "--low-freq-factor", "1",
                  "--high-freq-factor", "4", "--original-max-position-embeddings", "8192", "--rotary-base", "500000",
                  "--norm-epsilon", "1e-6", "--num-attention-heads", "4", "--group-query-attention",
                  "--num-query-groups", "2", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
                  "--position-embedding-type", "rope", "--use-rotary-position-embeddings", "--max-position-embeddings",
                  "16384", "--kv-channels", "16")
    assert spec.family == "llama"


@pytest.mark.parametrize("extra,needles", [
    (["--rotary-base", "10000"], ["--rotary-base 10000 does not match the checkpoint --ref-model", "rotary_base=500000",
                                  "drop the flag"]),
    (["--norm-epsilon", "1e-5"], ["--norm-epsilon 1e-05 does not match", "norm_epsilon=1e-06"]),
    (["--max-position-embeddings", "131072"], ["--max-position-embeddings 131072", "max_position_embeddings=16384"]),
    (["--rope-scaling-factor", "32"], ["--rope-scaling-factor 32 does not match", "llama3 RoPE scaling factor 8"]),
    (["--group-query-attention", "--num-query-groups", "8"], ["--group-query-attention --num-query-groups 8",
                                                             "num_query_groups=2"]),
    (["--group-query-attention"], ["--num-query-groups 1 (Megatron-LM's default)", "num_query_groups=2"]),
    (["--num-attention-heads", "4"], ["without --group-query-attention", "add --group-query-attention "
                                                                         "--num-query-groups 2"]),
    (["--kv-channels", "8"], ["--kv-channels 8", "kv_channels=16"]),
    (["--padded-vocab-size", "128256"], ["--padded-vocab-size 128256", "vocab_size=256"]),
    (["--add-qkv-bias"], ["--add-qkv-bias does not match", "no q/k/v biases"]),
    (["--untie-embeddings-and-output-weights"], ["--untie-embeddings-and-output-weights", "shares the embedding"]),
    (["--qk-layernorm"], ["--qk-layernorm", "no query/key norms"]),
])
def test_model_flag_against_checkpoint_names_flag_value_and_checkpoint(llama_tied, extra, needles):
    with pytest.raises(ValueError) as err:
        _check(llama_tied, *extra)
    for needle in needles:
        assert needle in str(err.value)
    assert llama_tied in str(err.value)


# ------------------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("extra,expected", [
    ([], "sdpa"), (["--use-flash-attn"], "sdpa"), (["--attention-backend", "fused"], "sdpa"),
    (["--attention-backend", "auto", "--use-flash-attn"], "sdpa"), (["--attention-backend", "local"], "local"),
    (["--attention-backend", "unfused"], "local"),
])
def test_attention_backend_flags(extra, expected):
    args = _parse(*extra)
    assert args.settings.model.attention == expected
    # a real switch now, not a performance no-op
    assert "--use-flash-attn" not in dict(args.settings.startup.ignored_flags)
    notes = [n for n in args.settings.startup.startup_notes if "local DotProductAttention" in n]
    assert len(notes) == (expected == "local")  # said at startup only when it is not the default


@pytest.mark.parametrize("backend", ["local", "unfused"])
def test_flash_attn_with_local_attention_is_refused_naming_both(backend):
    with pytest.raises(ArgumentError, match=f"--use-flash-attn and --attention-backend {backend}"):
        _parse("--use-flash-attn", "--attention-backend", backend)
    with pytest.raises(SystemExit):  # not one of Megatron-LM's choices: argparse names the flag and the choices
        _parse("--attention-backend", "triton")


# ------------------------------------------------------------------------------------------- convert / preprocess

MINDSPEED_ORM_CONVERT = ("--use-mcore-models --model-type GPT --load-model-type hf --save-model-type mg "
                         "--target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 --load-dir HF --save-dir MG "
                         "--tokenizer-model HF/tokenizer.json --orm --model-type-hf llama2").split()


def test_convert_ckpt_parses_mindspeed_spellings_and_no_abbreviations():
    import convert_ckpt

    args = convert_ckpt.build_parser().parse_args(MINDSPEED_ORM_CONVERT)
    assert (args.model_type, args.model_type_hf, args.tokenizer_model, args.use_mcore_models) == \
        ("GPT", "llama2", "HF/tokenizer.json", True)
    base = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", "a", "--save-dir", "b"]
    for abbreviated in (["--model-type-h", "llama2"], ["--target-tensor", "2"], ["--tokenizer", "x"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            convert_ckpt.build_parser().parse_args(base + abbreviated)


def test_convert_ckpt_runs_the_mindspeed_orm_command(tmp_path):
    import convert_ckpt
    from tests.helpers.hf_tiny import save_tiny

    save_tiny("llama", tmp_path / "HF", seq_cls=True)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": {}}')  # elsewhere than --load-dir: must be read
    where = {"HF": tmp_path / "HF", "MG": tmp_path / "MG", "HF/tokenizer.json": tmp_path / "tok" / "tokenizer.json"}
    argv = [str(where[a]) if a in where else a for a in MINDSPEED_ORM_CONVERT]
    with contextlib.redirect_stderr(io.StringIO()):
        assert convert_ckpt.main(argv + ["--no-progress"]) == 0
    assert (tmp_path / "MG" / "tokenizer.json").read_text() == '{"model": {}}'
    bad = list(argv)
    bad[bad.index("GPT")] = "BERT"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert convert_ckpt.main(bad + ["--no-progress", "--save-dir", str(tmp_path / "MG2")]) == 1
    assert "--model-type BERT: only GPT" in err.getvalue()


MINDSPEED_PREPROCESS = ("--input IN --tokenizer-name-or-path TOK --output-prefix OUT --workers 4 --log-interval 1000 "
                        "--tokenizer-type PretrainedFromHF --handler-name PPOAlpacaStyleInstructionHandler "
                        "--prompt-type empty --append-eod --seq-length 4096 --tokenizer-not-use-fast").split() + [
    "--map-keys", '{"prompt":"prompt", "query":"", "response": "prompt", "system":""}']


def test_preprocess_parses_mindspeed_flags_and_no_abbreviations():
    from mindspeed_llm.data.preprocess import build_parser

    args = build_parser().parse_args(MINDSPEED_PREPROCESS)
    assert args.handler_name == "PPOAlpacaStyleInstructionHandler" and args.tokenizer_not_use_fast
    assert args.append_eod and args.seq_length == 4096 and args.workers == 4
    for abbreviated in (["--tokenizer-name", "x"], ["--output", "o"], ["--handler", "h"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(MINDSPEED_PREPROCESS + abbreviated)


def test_tokenizer_not_use_fast_reaches_the_loader(monkeypatch):
    import transformers

    from mindspeed_llm.rl.preflight import load_tokenizer

    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: calls.append((path, kw)) or "tok")
    load_tokenizer(_parse("--tokenizer-name-or-path", "T", "--tokenizer-not-use-fast").settings.data)
    load_tokenizer(_parse("--tokenizer-name-or-path", "T").settings.data)
    assert calls == [("T", {"use_fast": False}), ("T", {"use_fast": True})]
