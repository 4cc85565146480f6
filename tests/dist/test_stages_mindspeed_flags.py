"""MindSpeed-LLM flags that need a model run (spawned processes): --split's parts of --data-path, --split /
--eval-iters evaluation on the valid part, the scaling and bias flags against a Qwen2 checkpoint, dropout in the
trained models' forward only. The flags' parsing: tests/unit/test_mindspeed_flags.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_assets import posttrain_argv
from mindspeed_llm.arguments import ArgumentError, parse_args

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
        "--global-batch-size", "4", "--ref-model", "r"]


def _parse(*extra, world=1, base=BASE):
    return parse_args(list(base) + list(extra), world_size=world)


def _prompt_sets(paths, *extra):
    from mindspeed_llm.rl.preflight import prompt_sets

    args = parse_args(posttrain_argv(paths, "grpo", iters=1, extra=list(extra)), world_size=1)
    train, held_out = prompt_sets(args.settings.data)  # held-out sets: (name, dataset) pairs, one here
    return train, (None if held_out is None else held_out[0][1])


def test_split_parts_of_data_path(stage_paths):
    from mindspeed_llm.data import PromptDataset

    full = PromptDataset(stage_paths["data_train"])  # 32 prompts
    train, valid = _prompt_sets(stage_paths, "--split", "75,25,0", "--eval-interval", "1")
    assert (len(train), len(valid)) == (24, 8)
    assert not set(train.indices) & set(valid.indices)
    assert train[0] == full[int(train.indices[0])] and valid[3] == full[int(valid.indices[3])]
    assert (train.prompt_lengths == full.prompt_lengths[train.indices]).all()
    assert _prompt_sets(stage_paths, "--split", "75,25,0")[1] is None  # no --eval-interval: nothing evaluated
    train, valid = _prompt_sets(stage_paths, "--split", "100,0,0", "--eval-interval", "1")
    assert len(train) == 32 and valid is None
    train, valid = _prompt_sets(stage_paths, "--split", "100,0,0", "--eval-interval", "1", "--eval-data-path",
                                stage_paths["data_eval"])
    assert len(train) == 32 and len(valid) == 4
    with pytest.raises(ArgumentError, match=r"--split 99,1,0 of --data-path .* \(32 prompts: 32 train, 0 valid, 0 "
                                            r"test\) leaves the valid part empty"):
        _prompt_sets(stage_paths, "--split", "99,1,0", "--eval-interval", "1")
    with pytest.raises(ArgumentError, match="--split 10,90 .* fewer training prompts than one --global-batch-size 4"):
        _prompt_sets(stage_paths, "--split", "10,90", "--eval-interval", "1")


def _split_run(rank, world_size, argv):
    """posttrain_gpt.main with the prompts every training iteration and every evaluation read recorded."""
    import posttrain_gpt
    from mindspeed_llm.data import PromptDataset
    from mindspeed_llm.rl.stages import GRPOStage

    read, seen = [], {"train": [], "eval": []}
    get = PromptDataset.__getitem__

    def recording_get(self, index):
        read.append(int(index))
        return get(self, index)

    def phase(name, method):
        def wrapped(self, *a):
            seen[name].append(list(read))
            read.clear()
            return method(self, *a)
        return wrapped

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):  # put back: these ranks stay warm
        patch.setattr(PromptDataset, "__getitem__", recording_get)
        patch.setattr(GRPOStage, "iteration", phase("train", GRPOStage.iteration))
        patch.setattr(GRPOStage, "evaluate", phase("eval", GRPOStage.evaluate))
        code = posttrain_gpt.main(argv)
    return code, seen, out.getvalue()


def test_split_evaluates_on_the_valid_part_and_trains_on_the_rest(stage_paths, tmp_path):
    from mindspeed_llm.data.prompt_dataset import split_indices

    jsonl = tmp_path / "metrics.jsonl"
    argv = posttrain_argv(stage_paths, "grpo", iters=2, extra=[
        "--split", "75,25,0", "--eval-interval", "2", "--eval-iters", "1", "--metrics-jsonl", str(jsonl),
        "--use-fused-swiglu", "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb", "--use-mcore-models"])
    code, seen, stdout = run_distributed(_split_run, 1, argv)[0]
    assert code == 0, stdout
    train_part, valid_part, _ = split_indices(32, (0.75, 0.25, 0.0), seed=7)
    assert len(seen["train"]) == 2 and all(set(rows) <= set(train_part) and len(rows) == 4 for rows in seen["train"])
    # --eval-iters 1 x --global-batch-size 4: the valid part's first four prompts, at iteration 2 only
    assert seen["eval"] == [list(valid_part[:4])]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert "eval/score/mean" in records[1] and "eval/score/mean" not in records[0]
    # the fused-op flags act (said once at startup), but RoPE, which has no fused op on CPU, is listed as ignored
    assert stdout.count("ignored flags:") == 1 and "--use-fused-rotary-pos-emb (no fused RoPE off the NPU" in stdout
    assert stdout.count("--use-fused-rmsnorm, --use-fused-swiglu: on cpu: an RMSNorm that saves its input") == 1
    assert "24 train, 8 valid, 0 test" in stdout


def _check(root, *extra):
    from mindspeed_llm.rl.update.roles import _checked_spec

    return _checked_spec(root, "--ref-model", _parse(*extra).settings)


def test_scaling_and_bias_flags_against_qwen2(stage_paths):
    qwen2 = stage_paths["mg_actor_tp1pp1"]  # no RoPE scaling, q/k/v biases
    with pytest.raises(ValueError, match=r"--rope-scaling-type llama3 does not match .*\(no RoPE frequency scaling"):
        _check(qwen2, "--rope-scaling-type", "llama3")
    with pytest.raises(ValueError, match=r"--disable-bias-linear \(without --add-qkv-bias\) does not match .*"
                                         "add --add-qkv-bias"):
        _check(qwen2, "--disable-bias-linear")
    assert _check(qwen2, "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention", "--num-query-groups",
                  "2", "--rotary-base", "1000000").family == "qwen2"


def _dropout_worker(rank, world_size, root, reward_root):
    import torch

    from mindspeed_llm import distributed
    from mindspeed_llm.inference import SamplingConfig
    from mindspeed_llm.inference.generation import generate
    from mindspeed_llm.models.attention import model_attention
    from mindspeed_llm.rl.update import roles

    distributed.initialize(1, 1, seed=3)
    argv = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "1",
            "--global-batch-size", "1", "--ref-model", root]
    plain = roles.load_model(root, "--ref-model", parse_args(argv, world_size=1).settings)
    model = roles.load_model(root, "--ref-model", parse_args(argv + ["--attention-dropout", "0.3", "--hidden-dropout",
                                                                     "0.3"], world_size=1).settings)
    tokens = torch.arange(1, 9).view(1, 8)
    positions = torch.arange(8).view(1, 8)
    out = {}
    model.train()
    out["train"] = [model(tokens, positions, None) for _ in range(2)]
    with torch.no_grad():
        model.eval()
        out["eval"] = [model(tokens, positions, None) for _ in range(2)]
        out["plain"] = plain.eval()(tokens, positions, None)
    model.train()  # generation puts it in eval mode itself
    sampling = SamplingConfig(max_new_tokens=6)
    out["generated"] = [generate(model, [[1, 2, 3]], sampling).responses for _ in range(2)]
    out["generated_plain"] = generate(plain, [[1, 2, 3]], sampling).responses
    out["still_training"] = model.training
    # --attention-backend reaches every role's model (policy and value head alike) through roles.load_model
    out["attention"] = {}
    for extra in ([], ["--use-flash-attn"], ["--attention-backend", "flash"], ["--attention-backend", "local"],
                  ["--attention-backend", "unfused"]):
        args = parse_args(argv + extra, world_size=1)
        policy = roles.load_model(root, "--ref-model", args.settings)
        value = roles.load_model(reward_root, "--reward-model", args.settings, value_head=True)
        out["attention"][" ".join(extra)] = (model_attention(policy), model_attention(value))
        if extra == ["--attention-backend", "local"]:
            with torch.no_grad():
                out["local"] = policy.eval()(tokens, positions, None)
    return {k: [t.detach() for t in v] if isinstance(v, list) else v for k, v in out.items()}


def test_dropout_acts_in_the_training_forward_only(stage_paths):
    import torch

    out = run_distributed(_dropout_worker, 1, stage_paths["mg_actor_tp1pp1"], stage_paths["mg_reward_tp1pp1"])[0]
    first, second = out["train"]
    assert not torch.equal(first, second)  # two training forwards drop different units
    assert torch.equal(out["eval"][0], out["eval"][1])
    torch.testing.assert_close(out["eval"][0], out["plain"])  # eval mode: the dropout-free model
    assert torch.equal(out["generated"][0], out["generated"][1])
    assert torch.equal(out["generated"][0], out["generated_plain"])
    assert out["still_training"]
    # the core attention every role is built with: the fused one by default, megatron's local one on request
    fused, local = ("sdpa", "sdpa"), ("local", "local")
    assert out["attention"] == {"": fused, "--use-flash-attn": fused, "--attention-backend flash": fused,
                                "--attention-backend local": local, "--attention-backend unfused": local}
    torch.testing.assert_close(out["local"], out["plain"], atol=1e-5, rtol=1e-5)  # the same model either way
