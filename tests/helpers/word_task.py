"""A tiny word-level task for the stage tests that run the real stages many times.

A 256-word vocabulary (`w4`..`w255` plus `<pad> <s> </s> <unk>`, `hf_tiny.write_tokenizer`), a tiny random Qwen2
policy (2 layers, hidden 64) and, when asked, a tiny Qwen2 value-head reward model, both converted with
`convert_hf_to_mg` to each requested TP x PP layout, and prompts of 3..5 random words from `w68`..`w255`,
preprocessed with the R1 handler (`--prompt-type empty`, a dummy label). A forward costs a fraction of one over
the Qwen2.5 vocabulary of `stage_assets`, which keeps tests of many runs quick. `build(vocab=..., **shape)` makes the
same task at another vocabulary and model shape (the replay test at a real model's shape).

Multi-turn tool use (`write_chat_tools`): the tokenizer with a word-level chat template that has a tool role, and a
tool config naming the user's tool of tests/fixtures/word_tools (`TOOLS_DIR`, which the runs put on PYTHONPATH).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 256
TOOLS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "word_tools"
# assistant turns end with </s>; a tool's answer is framed by w20 .. w21, the next assistant turn opens with w22
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}</s>"
                 "{% elif m['role'] == 'tool' %} w20 {{ m['content'] }} w21{% else %}{{ m['content'] }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %} w22{% endif %}")
TOOL_CONFIG = """tools:
  - class_name: word_tools.EchoTool
    config: {reward: 0.25}
    tool_schema:
      type: function
      function:
        name: echo
        description: Says the words back, last first.
        parameters: {type: object, properties: {words: {type: array}}, required: [words]}
"""


# the teacher of on-policy distillation (--teacher-load): another size of the actor's family, the same vocabulary
TEACHER_SHAPE = dict(num_layers=4, hidden_size=32, intermediate_size=64)  # PP2 splits its 4 layers


def build(root: Path, layouts=((1, 1),), reward: bool = False, prompts: int = 16, model_seed: int = 3,
          vocab: int = VOCAB, teacher: bool = False, **shape) -> dict:
    """Write everything under `root`; returns {"tokenizer", "data", "mg_actor_tp{t}pp{p}", "mg_reward_tp{t}pp{p}"}
    (and with `teacher` "mg_teacher_tp{t}pp{p}" and "hf_teacher": a qwen2 of `TEACHER_SHAPE`, another size than the
    actor's).
    `vocab` words (the prompts stay within the first 256) and `shape` (`hf_tiny.tiny_config` overrides: hidden_size,
    tie, ...) make the same task on another model."""
    from tests.helpers.hf_tiny import save_tiny, write_tokenizer

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    # The tokenizer gets a folder of its own: next to a qwen2 config.json, transformers 5 would load it as a
    # Qwen2Tokenizer (BPE) instead of the word-level tokenizer it is.
    tokenizer = root / "tokenizer"
    write_tokenizer(tokenizer, vocab)
    paths = {"tokenizer": str(tokenizer)}
    roles = [("actor", False, model_seed, shape)] + ([("reward", True, model_seed + 1, shape)] if reward else [])
    if teacher:
        roles.append(("teacher", False, model_seed + 2, {**shape, **TEACHER_SHAPE}))
    for role, value_head, seed, role_shape in roles:
        hf = save_tiny("qwen2", root / f"hf_{role}", seq_cls=value_head, seed=seed, vocab_size=vocab, **role_shape)
        if role == "teacher":  # the reference of the teacher's pass (tests/dist/test_stages_distill.py)
            paths["hf_teacher"] = hf
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


def write_chat_tools(root: Path, tokenizer: str) -> dict:
    """The word tokenizer `tokenizer` with `CHAT_TEMPLATE` (saved to `root/chat_tokenizer`) and `TOOL_CONFIG`
    (`root/tools.yaml`); returns {"chat_tokenizer", "tools"}."""
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    chat.save_pretrained(root / "chat_tokenizer")
    (root / "tools.yaml").write_text(TOOL_CONFIG)
    return {"chat_tokenizer": str(root / "chat_tokenizer"), "tools": str(root / "tools.yaml")}
