"""Bad input to posttrain_gpt.py: each mistake is refused before any compute, with a message naming the flag."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_distributed
from tests.helpers.stage_assets import posttrain_argv

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes
FAILING = Path(__file__).resolve().parents[1] / "fixtures" / "user_rewards" / "failing_rewards.py"


def _run_main_cases(rank, world_size, cases):
    import posttrain_gpt

    messages = []
    for argv in cases:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = posttrain_gpt.main(argv)
        messages.append((code, stderr.getvalue()))
    return messages


def _damaged_copies(paths, tmp_path) -> dict:
    """Copies of the stage assets' dataset with a truncated .idx / .bin, and of the actor checkpoint with a
    truncated / zero-filled shard."""
    import shutil
    from pathlib import Path

    data = Path(paths["data_train"])
    out = {}
    for kind in ("idx", "bin"):
        folder = tmp_path / f"data_{kind}"
        shutil.copytree(data.parent, folder)
        prefix = folder / data.name
        target = sorted(folder.glob(f"{data.name}*input_ids*.{kind}"))[0]
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        out[kind] = str(prefix)
    for kind in ("truncated", "zeroed"):
        root = tmp_path / f"actor_{kind}"
        shutil.copytree(paths["mg_actor_tp1pp1"], root)
        shard = sorted(root.rglob("model_optim_rng.pt"))[0]
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[: size // 2] if kind == "truncated" else bytes(size))
        out[f"{kind}_shard"] = str(root)
    return out


def test_bad_checkpoints_data_and_verifiers_fail_before_compute(stage_paths, tmp_path):
    from tests.helpers.hf_tiny import save_tiny
    from mindspeed_llm.checkpoint import convert_hf_to_mg
    from mindspeed_llm.data.preprocess import preprocess

    small_vocab = convert_hf_to_mg(save_tiny("qwen2", tmp_path / "hf_small"), tmp_path / "mg_small", progress=False)
    assert small_vocab.vocab_size == 256
    unlabeled = tmp_path / "unlabeled"
    (tmp_path / "rows.json").write_text(json.dumps([{"instruction": f"Say hi {i}", "input": "", "output": ""}
                                                    for i in range(4)]))
    preprocess(["--input", str(tmp_path / "rows.json"), "--tokenizer-name-or-path", stage_paths["tokenizer"],
                "--output-prefix", str(unlabeled), "--handler-name", "PPOAlpacaStyleInstructionHandler",
                "--prompt-type", "qwen", "--log-interval", "0"])

    def grpo(*extra, paths=stage_paths):
        return posttrain_argv(paths, "grpo", iters=1, extra=list(extra))

    def ppo(*extra):
        return posttrain_argv(stage_paths, "trl_ppo", iters=1, extra=list(extra))

    actor, reward = stage_paths["mg_actor_tp1pp1"], stage_paths["mg_reward_tp1pp1"]
    damaged = _damaged_copies(stage_paths, tmp_path)
    cases = {
        "missing checkpoint": (grpo("--ref-model", str(tmp_path / "nowhere")), ["--ref-model", "does not exist"]),
        "reward without value head": (ppo("--reward-model", actor), ["--reward-model", "value-head", "--orm"]),
        "policy with value head": (grpo("--ref-model", reward), ["--ref-model", "value-head"]),
        "layout mismatch": (grpo("--ref-model", stage_paths["mg_actor_tp2pp1"]),
                            ["--ref-model", "split TP=2", "convert_ckpt.py --load-model-type mg"]),
        "vocab mismatch actor/reward": (ppo("--ref-model", str(tmp_path / "mg_small"), "--reward-model", reward),
                                        ["vocabulary size", "actor=256", "critic=151936"]),
        "flag contradicts checkpoint": (grpo("--num-layers", "5"), ["--num-layers 5 does not match", "num_layers=2"]),
        "unknown verifier": (grpo("--verifier-function", "nonsense"), ["--verifier-function", "math_acc", "format"]),
        "no labels for math_acc": (grpo("--data-path", str(unlabeled)), ["math_acc", "no labels", "--map-keys"]),
        "missing dataset": (grpo("--data-path", str(tmp_path / "none")), ["preprocess_data.py"]),
        "unknown advantage estimator": (grpo("--adv-estimator", "ppo"), ["--adv-estimator ppo", "grpo, rloo"]),
        "rloo with a std scale": (grpo("--adv-estimator", "rloo", "--adv-scale", "group"),
                                  ["--adv-estimator rloo", "--adv-scale group does not apply"]),
        "truncated .idx": (grpo("--data-path", damaged["idx"]), [".idx cannot be read", "the dataset is damaged",
                                                                  "preprocess_data.py"]),
        "truncated .bin": (grpo("--data-path", damaged["bin"]), [".bin holds", "the file is truncated"]),
        "truncated --ref-model shard": (grpo("--ref-model", damaged["truncated_shard"]),
                                        ["--ref-model", "cannot be read: it is truncated or corrupt"]),
        "zero-filled --ref-model shard": (grpo("--ref-model", damaged["zeroed_shard"]),
                                          ["--ref-model", "cannot be read: it is truncated or corrupt"]),
        "stop id outside the tokenizer": (grpo("--stop-token-ids", "999999"),
                                          ["--stop-token-ids 999999: outside the tokenizer's ids"]),
        # on-policy distillation: the teacher must read the actor's token ids; its top-k fit its vocabulary
        "teacher of another vocabulary": (grpo("--teacher-load", str(tmp_path / "mg_small")),
                                          ["--teacher-load", "the teacher's vocabulary has 256 tokens, the actor's "
                                           "151936", "share the actor's tokenizer"]),
        "--distill-topk over the vocabulary": (grpo("--teacher-load", actor, "--distill-loss", "topk_forward_kl",
                                                    "--distill-topk", "200000"),
                                               ["--distill-topk 200000 exceeds the vocabulary of 151936 tokens "
                                                f"(--teacher-load {actor})"]),
        "missing teacher": (grpo("--teacher-load", str(tmp_path / "no_teacher")), ["--teacher-load", "no_teacher"]),
        # a user's reward function that ends the process, or fails on every row: named, not exit 4 / zero rewards
        "reward function calls sys.exit": (grpo("--custom-reward-function", f"{FAILING}:always_exits"),
                                           ["the reward function 'custom' ('always_exits' in", "called sys.exit(4) on "
                                            "row 0 of the batch", "remove the exit"]),
        "reward function fails on every row": (grpo("--custom-reward-function", f"{FAILING}:always_fails"),
                                               [f"--custom-reward-function {FAILING}:always_fails failed on every one "
                                                "of the", "returned a mapping without a 'score' key"]),
        # divergence without a NaN (--check-for-divergence): the first step multiplies the weights' norm
        "--lr 1e6": (ppo("--lr", "1e6", "--train-iters", "2", "--save", str(tmp_path / "diverged"),
                         "--save-interval", "1"),
                     ["iteration 1: actor: rank 0: one optimizer step changed the weights' norm from", "the update diverged",
                      "nothing of this iteration was saved (no checkpoint was written); lower --lr"]),
    }
    exit_codes = {"--lr 1e6": 1}  # training stopped, not a command-line mistake
    results = run_distributed(_run_main_cases, 1, [argv for argv, _ in cases.values()])[0]
    assert not (tmp_path / "diverged" / "latest_checkpointed_iteration.txt").exists()
    assert not (tmp_path / "diverged" / "actor" / "iter_0000001").exists()
    for (name, (_, needles)), (code, message) in zip(cases.items(), results):
        assert code == exit_codes.get(name, 2), f"{name}: exit {code}\n{message}"
        assert "Traceback" not in message, f"{name}: {message}"
        for needle in needles:
            assert needle in message, f"{name}: {needle!r} not in {message!r}"
