"""Each --prompt-type renders exactly what the model's own chat template renders."""
import json

import pytest

from tests.helpers.fixtures_data import (ROOT, CHATML_TEMPLATE, EMPTY_TEMPLATE, LLAMA3_TEMPLATE,
                                         QWEN2_TEMPLATE, QWEN25_CHAT_TEMPLATE, SMOLLM2_TEMPLATE, qwen_tok,
                                         qwen_tok_dir)  # noqa: F401

from mindspeed_llm.data import UnknownNameError, get_template, load_templates

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You are a careful math tutor."},
     {"role": "user", "content": "Solve $x^2 = 4$.\nGive all roots."}],
    [{"role": "user", "content": "Translate: 你好，世界"}, {"role": "assistant", "content": "Hello, world"},
     {"role": "user", "content": "And in Korean?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}],
]

# prompt type -> (the model's reference Jinja template, extra render kwargs)
REFERENCES = {
    "qwen": (QWEN25_CHAT_TEMPLATE, {}),
    "qwen2": (QWEN2_TEMPLATE, {}),
    "chatml": (CHATML_TEMPLATE, {}),
    "smollm2": (SMOLLM2_TEMPLATE, {}),
    "llama3": (LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>"}),
    "empty": (EMPTY_TEMPLATE, {}),
}


def reference(tok, name, messages, add_generation_prompt):
    jinja, kwargs = REFERENCES[name]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   chat_template=jinja, **kwargs)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_template_matches_model_chat_template(qwen_tok, name):
    t = get_template(name)
    for conv in CONVERSATIONS:
        if name == "empty" and conv[0]["role"] == "system":
            continue
        for gen in (True, False):
            if gen and conv[-1]["role"] == "assistant":
                continue
            assert t.render(conv, add_generation_prompt=gen) == reference(qwen_tok, name, conv, gen), (conv, gen)


def test_qwen_template_equals_tokenizer_default_chat_template_ids(qwen_tok):
    """The fixture tokenizer carries Qwen2.5's real template: the token ids agree too."""
    t = get_template("qwen")
    for conv in CONVERSATIONS:
        gen = conv[-1]["role"] != "assistant"
        ids = qwen_tok(t.render(conv, add_generation_prompt=gen), add_special_tokens=False)["input_ids"]
        ref = qwen_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert ids == list(ref)


def test_qwen_injects_default_system_prompt_like_qwen25(qwen_tok):
    text = get_template("qwen").render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                           "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen_r1_is_qwen25_chat_with_r1_instruction(qwen_tok):
    t = get_template("qwen_r1")
    assert "<think>" in t.user_instruction and "\\boxed{}" in t.user_instruction
    for conv in CONVERSATIONS:
        gen = conv[-1]["role"] != "assistant"
        first_user = next(i for i, m in enumerate(conv) if m["role"] == "user")
        instructed = [dict(m) for m in conv]
        instructed[first_user]["content"] = t.user_instruction + instructed[first_user]["content"]
        assert t.render(conv, add_generation_prompt=gen) == reference(qwen_tok, "qwen", instructed, gen)


def test_templates_file_is_well_formed():
    raw = json.loads((ROOT / "configs" / "model" / "templates.json").read_text())
    names = [t["name"] for t in raw]
    assert len(names) == len(set(names))
    assert {"empty", "llama3", "qwen", "qwen_r1", "chatml", "smollm2"} <= set(names)
    assert set(load_templates()) == set(names)


def test_unknown_prompt_type_lists_valid_names():
    with pytest.raises(UnknownNameError) as e:
        get_template("qwen25-typo")
    msg = str(e.value)
    assert "qwen25-typo" in msg
    for name in ("chatml", "empty", "llama3", "qwen", "qwen_r1", "smollm2"):
        assert name in msg
