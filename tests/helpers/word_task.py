"""A tiny word-level task for the stage tests that run the real stages many times.

A 256-word vocabulary (`w4`..`w255` plus `<pad> <s> </s> <unk>`, `hf_tiny.write_tokenizer`), a tiny random Qwen2
policy (2 layers, hidden 64) and, when asked, a tiny Qwen2 value-head reward model, both converted with
`convert_hf_to_mg` to each requested TP x PP layout, and prompts of 3..5 random words from `w68`..`w255`,
preprocessed with the R1 handler (`--prompt-type empty`, a dummy label). A forward costs a fraction of one over
the Qwen2.5 vocabulary of `stage_assets`, which keeps tests of many runs quick.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 256


def build(root: Path, layouts=((1, 1),), reward: bool = False, prompts: int = 16, model_seed: int = 3) -> dict:
    """Write everything under `root`; returns {"tokenizer", "data", "mg_actor_tp{t}pp{p}", "mg_reward_tp{t}pp{p}"}."""
    from tests.helpers.hf_tiny import save_tiny, write_tokenizer

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    # The tokenizer gets a folder of its own: next to a qwen2 config.json, transformers 5 would load it as a
    # Qwen2Tokenizer (BPE) instead of the word-level tokenizer it is.
    tokenizer = root / "tokenizer"
    write_tokenizer(tokenizer, VOCAB)
    paths = {"tokenizer": str(tokenizer)}
    roles = [("actor", False, model_seed)] + ([("reward", True, model_seed + 1)] if reward else [])
    for role, value_head, seed in roles:
        hf = save_tiny("qwen2", root / f"hf_{role}", seq_cls=value_head, seed=seed, vocab_size=VOCAB)
        for tp, pp in layouts:
            out = root / f"mg_{role}_tp{tp}pp{pp}"
            convert_hf_to_mg(hf, str(out), tp, pp, value_head=value_head, tokenizer_dir=str(tokenizer), progress=False)
            paths[f"mg_{role}_tp{tp}pp{pp}"] = str(out)

    paths["data"] = write_prompts(root, tokenizer, prompts)
    return paths


def write_prompts(root: Path, tokenizer: Path, prompts: int) -> str:
    """`prompts` prompts of 3..5 random words from w68..w255 (seed 0), preprocessed with the R1 handler under
    `root/data/prompts`; returns that prefix."""
    from mindspeed_llm.data.preprocess import preprocess

    rng = random.Random(0)
    rows = [{"problem": " ".join(f"w{rng.randint(68, VOCAB - 1)}" for _ in range(rng.randint(3, 5))), "answer": "-"}
            for _ in range(prompts)]
    raw = root / "prompts.json"
    raw.write_text(json.dumps(rows))
    prefix = root / "data" / "prompts"
    preprocess(["--input", str(raw), "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                str(tokenizer), "--output-prefix", str(prefix), "--handler-name", "R1AlpacaStyleInstructionHandler",
                "--prompt-type", "empty", "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}),
                "--log-interval", "0"])
    return str(prefix)
