"""rl/tools/chat_delta.py: the tool-role delta as token ids (token-in / token-out) on the offline Qwen2.5 tokenizer,
the template check that refuses a template rewriting its prefix, truncation of a tool response, and the prompt
that offers the tools (the template's own tools section, or the Hermes system block)."""

import copy
import json

import pytest

from mindspeed_llm.rl.tools import CalculatorTool, ToolDelta, hermes_tools_block, tools_prompt, truncate, truncate_text
from tests.helpers.fixtures_data import (  # noqa: F401 - pytest fixtures
    CHATML_TEMPLATE, EMPTY_TEMPLATE, SMOLLM2_TEMPLATE, qwen_tok, qwen_tok_dir,
)

SCHEMAS = [CalculatorTool().tool_schema]
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'

# moves every tool message into the system message at the top: the rendering with tool messages no longer
# starts with the rendering without them
SYSTEM_MOVING_TEMPLATE = (
    "<|im_start|>system\n{% for m in messages %}{% if m['role'] == 'tool' %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}<|im_end|>\n{% for m in messages %}{% if m['role'] != 'tool' and m['role'] != 'system' %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_DROPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'tool' %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tok, template):
    """A copy of the shared tokenizer with another chat template (the cached one stays as it is)."""
    other = copy.copy(tok)
    other.chat_template = template
    return other


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_qwen25_delta_equals_the_hand_written_text(qwen_tok):
    delta = ToolDelta(qwen_tok)
    one = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert delta.delta_text(["5"]) == one
    assert delta.delta_ids(["5"]) == encode(qwen_tok, one)
    assert delta.delta_ids(["5"])[:3] == [198, 151644, 872]  # "\n", <|im_start|>, "user": right after <|im_end|>
    two = ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>"
           "<|im_end|>\n<|im_start|>assistant\n")  # consecutive tool messages share one user turn
    assert delta.delta_ids(["5", "error: x"]) == encode(qwen_tok, two)


def test_token_in_token_out_prompt_plus_sampled_plus_delta_is_the_full_rendering(qwen_tok):
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tools_prompt(qwen_tok, user, SCHEMAS)
    assert "<tools>\n" + json.dumps(SCHEMAS[0]) in prompt  # Qwen2.5's own tools section
    sampled_ids = encode(qwen_tok, CALL_TEXT + "<|im_end|>")  # what the model sampled, its stop token included
    ids = encode(qwen_tok, prompt) + sampled_ids + ToolDelta(qwen_tok).delta_ids(["5"])
    full = qwen_tok.apply_chat_template(
        user + [{"role": "assistant", "content": CALL_TEXT}, {"role": "tool", "content": "5"}],
        tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    assert ids == encode(qwen_tok, full)


def test_a_template_that_rewrites_its_prefix_is_refused_by_name(qwen_tok):
    with pytest.raises(ValueError, match="does not extend the conversation's prefix unchanged.*token-in/token-out"):
        ToolDelta(with_template(qwen_tok, SYSTEM_MOVING_TEMPLATE))


def test_a_template_that_drops_tool_messages_is_refused(qwen_tok):
    with pytest.raises(ValueError, match="drops or reorders tool messages"):
        ToolDelta(with_template(qwen_tok, TOOL_DROPPING_TEMPLATE))


def test_a_template_without_the_end_of_turn_token_is_refused(qwen_tok):
    with pytest.raises(ValueError, match="does not end with the end-of-turn token '<\\|im_end\\|>'.*end_of_turn="):
        ToolDelta(with_template(qwen_tok, EMPTY_TEMPLATE))


def test_a_template_that_cannot_render_tool_messages_is_refused(qwen_tok):
    raising = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
              "{{ m['content'] + '<|im_end|>' }}{% endfor %}"
    with pytest.raises(ValueError, match="cannot render a conversation of roles system/user/assistant/tool"):
        ToolDelta(with_template(qwen_tok, raising))


def test_chatml_style_templates_give_a_tool_turn(qwen_tok):
    for template in (CHATML_TEMPLATE, SMOLLM2_TEMPLATE):
        delta = ToolDelta(with_template(qwen_tok, template))
        assert delta.delta_text(["5"]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_template_without_tools_section_gets_the_hermes_block(qwen_tok):
    smol = with_template(qwen_tok, SMOLLM2_TEMPLATE)
    prompt = tools_prompt(smol, [{"role": "user", "content": "2 + 3?"}], SCHEMAS)
    assert prompt == (f"<|im_start|>system\n{hermes_tools_block(SCHEMAS)}<|im_end|>\n"
                      "<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>\n" + json.dumps(SCHEMAS[0]) + "\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    merged = tools_prompt(smol, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                          SCHEMAS)
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and merged.count("<|im_start|>system") == 1
    assert tools_prompt(smol, [{"role": "user", "content": "hi"}], []) == \
        smol.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("side, expected", [
    ("left", [0, 1, 2, 3]), ("right", [6, 7, 8, 9]), ("middle", [0, 1, 8, 9]),
])
def test_truncate_sides_keep_verls_parts(side, expected):
    assert truncate(range(10), 4, side) == expected
    assert truncate(range(3), 4, side) == [0, 1, 2]
    assert truncate(range(10), 0, side) == []


def test_truncate_odd_middle_and_bad_side():
    assert truncate(range(10), 5, "middle") == [0, 1, 2, 8, 9]
    with pytest.raises(ValueError, match="use one of left, right, middle"):
        truncate([1], 1, "top")


def test_truncation_cuts_the_tool_text_not_the_template(qwen_tok):
    text = " ".join(f"w{i}" for i in range(200))
    assert truncate_text(qwen_tok, "short", 50) == "short"
    for side in ("left", "right", "middle"):
        cut = truncate_text(qwen_tok, text, 10, side)
        assert "...(truncated)" in cut and len(encode(qwen_tok, cut.replace("...(truncated)", ""))) <= 11
    assert truncate_text(qwen_tok, text, 10, "left").startswith("w0 w1")
    assert truncate_text(qwen_tok, text, 10, "right").endswith("w199")
    delta = ToolDelta(qwen_tok, max_tool_response_length=10, truncate_side="middle")
    rendered = delta.delta_text([text])
    assert rendered.startswith("\n<|im_start|>user\n<tool_response>\nw0") and "w199\n</tool_response>" in rendered
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="--tool-response-truncate-side 'up'"):
        ToolDelta(qwen_tok, truncate_side="up")


class _CountingTokenizer:
    """The Qwen tokenizer, recording the length of each text it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.encoded = tok, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_long_answer_is_cut_by_characters_before_tokenizing_and_keeps_the_same_tokens(qwen_tok):
    """A 400k-character answer cut to 32 tokens: only a character window bounded by the token budget is tokenized
    (32 tokens x the longest token's characters), and the kept text is what cutting the whole text's tokens keeps."""
    from mindspeed_llm.rl.tools.chat_delta import longest_token_chars

    words = ["alpha", "  ", "\n", "数据", "😀", "x=1;", "0123456789", "naïve"]
    text = "".join(words[(i * 7) % len(words)] + " " for i in range(90_000))
    assert len(text) > 400_000
    window = 32 * longest_token_chars(qwen_tok) + 16
    ids = encode(qwen_tok, text)  # the reference: the whole text's tokens, cut
    for side in ("left", "right", "middle"):
        counting = _CountingTokenizer(qwen_tok)
        cut = truncate_text(counting, text, 32, side)
        assert counting.encoded and max(counting.encoded) <= 2 * window < len(text) // 10
        kept = truncate(ids, 32, side)
        decode = lambda part: qwen_tok.decode(part, skip_special_tokens=False)  # noqa: E731
        expected = {"left": lambda: decode(kept) + "...(truncated)", "right": lambda: "...(truncated)" + decode(kept),
                    "middle": lambda: decode(kept[:16]) + "...(truncated)" + decode(kept[16:])}[side]()
        assert cut == expected, side


# ---- the tools offered in the prompts at rollout time (rl/tools/prompts.py) -------------------------------------

QWEN_ROWS = [  # one with its own system message, one that gets Qwen2.5's default system text
    {"instruction": "What is 2 + 3?", "system": "You solve sums."},
    {"instruction": "What is 12 * 7? Use the tool.", "system": ""},
]


def _qwen_dataset(tmp_path, qwen_tok_dir, rows=QWEN_ROWS):
    from mindspeed_llm.data import PromptDataset
    from tests.helpers.fixtures_data import run_preprocess

    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    run_preprocess(qwen_tok_dir, src, tmp_path / "data", "R1AlpacaStyleInstructionHandler", "qwen",
                   map_keys={"prompt": "instruction", "system": "system", "labels": "instruction"})
    return PromptDataset(str(tmp_path / "data"))


def _qwen_reference(qwen_tok, row, schemas):
    """Qwen2.5's own Jinja template with ``tools=``: the independent reference."""
    messages = ([{"role": "system", "content": row["system"]}] if row["system"] else []) + \
        [{"role": "user", "content": row["instruction"]}]
    return encode(qwen_tok, qwen_tok.apply_chat_template(messages, tools=list(schemas), add_generation_prompt=True,
                                                         tokenize=False))


def test_the_run_offers_the_tools_as_qwen25_renders_tools(tmp_path, qwen_tok_dir, qwen_tok):
    from mindspeed_llm.rl.tools.prompts import ToolsOffered, offer_tools

    dataset = _qwen_dataset(tmp_path, qwen_tok_dir)  # preprocessed without tools
    offered = offer_tools(dataset, SCHEMAS, qwen_tok, "--data-path x")
    assert isinstance(offered, ToolsOffered)
    for i, row in enumerate(QWEN_ROWS):
        assert offered[i]["input_ids"] == _qwen_reference(qwen_tok, row, SCHEMAS)  # token for token
        assert offered[i]["labels"] == row["instruction"]  # the rest of the row is the dataset's
    assert list(offered.prompt_lengths) == [len(offered[i]["input_ids"]) for i in range(2)]
    # why the ids are re-encoded, not spliced: the default system text ends in "." and ".\n\n" is one token
    stored = dataset[1]["input_ids"]
    cut = stored.index(qwen_tok.convert_tokens_to_ids("<|im_end|>"))
    spliced = stored[:cut] + encode(qwen_tok, "\n\n" + hermes_tools_block(SCHEMAS)) + stored[cut:]
    assert spliced != offered[1]["input_ids"]
    # a template without a system turn (--prompt-type empty) cannot offer them: the prompts as they are
    from mindspeed_llm.data.templates import get_template

    bare = type("Bare", (), {"meta": {"template": get_template("empty").to_dict()}})()
    assert offer_tools(bare, SCHEMAS, qwen_tok, "--data-path x") is bare


def test_an_older_dataset_with_a_tools_block_never_gets_two(tmp_path, qwen_tok_dir, qwen_tok):
    from mindspeed_llm.data.errors import DataError
    from mindspeed_llm.rl.tools.prompts import ToolPrompts, offer_tools

    # what preprocess_data.py --tool-config wrote before: the Hermes block after the system text, in _meta.json
    old = [dict(QWEN_ROWS[0], system=QWEN_ROWS[0]["system"] + "\n\n" + hermes_tools_block(SCHEMAS))]
    dataset = _qwen_dataset(tmp_path, qwen_tok_dir, old)
    dataset.meta["tools"] = dict(names=["calculator"], schemas=SCHEMAS, rendering="hermes block in the system message")
    # Qwen2.5's own tools section differs from that block ('{{"name": ...}}'): replaced by it, one block
    ids = offer_tools(dataset, SCHEMAS, qwen_tok, "--data-path x")[0]["input_ids"]
    assert ids == _qwen_reference(qwen_tok, QWEN_ROWS[0], SCHEMAS)
    assert qwen_tok.decode(ids).count("# Tools") == 1
    # a template without a tools section renders that very block: the prompts are used as they are
    chatml = with_template(qwen_tok, CHATML_TEMPLATE)
    assert offer_tools(dataset, SCHEMAS, chatml, "--data-path x") is dataset
    other = [dict(SCHEMAS[0], function=dict(SCHEMAS[0]["function"], description="Adds and multiplies."))]
    ids = offer_tools(dataset, other, chatml, "--data-path x")[0]["input_ids"]
    messages = [{"role": "system", "content": QWEN_ROWS[0]["system"]}, {"role": "user", "content": old[0]["instruction"]}]
    assert ids == encode(qwen_tok, tools_prompt(chatml, messages, other))  # the run's block, not the recorded one
    assert qwen_tok.decode(ids).count("# Tools") == 1 and "Adds and multiplies." in qwen_tok.decode(ids)
    # recorded tools whose block the prompts do not hold, or recorded without schemas: refused by name
    dataset.meta["tools"] = dict(names=["search"], schemas=[dict(SCHEMAS[0], function={"name": "search"})])
    with pytest.raises(DataError, match="--data-path x: prompt 0 cannot offer the tools: its system message does not "
                                        "end with the recorded tools' block; preprocess the data again"):
        offer_tools(dataset, SCHEMAS, qwen_tok, "--data-path x")
    with pytest.raises(DataError, match=r"preprocessed with the tools \['search'\].*cannot be taken out"):
        ToolPrompts({"template": dataset.meta["template"], "tools": {"names": ["search"]}}, "--data-path x")


def test_a_prompt_that_does_not_re_encode_to_itself_is_refused(tmp_path, qwen_tok_dir, qwen_tok):
    from mindspeed_llm.data.errors import DataError
    from mindspeed_llm.rl.tools.prompts import ToolsOffered, offer_tools

    dataset = _qwen_dataset(tmp_path, qwen_tok_dir)
    split = encode(qwen_tok, "system")  # "system" as one token; the prompt below spells it in two
    assert len(split) == 1

    class Cut:  # a prompt whose ids are not the tokenizer's encoding of their text
        prefix, extra_keys, meta = dataset.prefix, dataset.extra_keys, dataset.meta

        def __len__(self):
            return 1

        def __getitem__(self, i):
            ids = dataset[0]["input_ids"]
            return {"input_ids": ids[:1] + encode(qwen_tok, "sys") + encode(qwen_tok, "tem") + ids[2:]}

    with pytest.raises(DataError, match="prompt 0 does not encode back to its token ids"):
        ToolsOffered(Cut(), offer_tools(dataset, SCHEMAS, qwen_tok, "x").offered, qwen_tok)


class _Rows:
    """A dataset's prompts with some replaced by other ids (``replaced``: {index: ids})."""

    def __init__(self, dataset, replaced=None):
        self.dataset, self.replaced = dataset, dict(replaced or {})
        self.prefix, self.extra_keys, self.meta = dataset.prefix, dataset.extra_keys, dataset.meta

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        if i in self.replaced:
            item["input_ids"] = list(self.replaced[i])
        return item


def _as_ranks(world, build):
    """`build(ranks)` as each of ``world`` ranks (`prompts.Ranks`) whose gather gathers what the ranks give it: each
    rank's part ({rank: part}) and each rank's result (or the DataError it raised)."""
    from mindspeed_llm.data.errors import DataError

    class Gathered(Exception):
        pass

    parts, results = {}, []
    for rank in range(world):  # first each rank's own part
        def keep(obj, rank=rank):
            parts[rank] = obj
            raise Gathered
        with pytest.raises(Gathered):
            build((rank, world, keep))
    for rank in range(world):  # then every rank with all of them
        try:
            results.append(build((rank, world, lambda obj: [parts[r] for r in range(world)])))
        except DataError as exc:
            results.append(exc)
    return parts, results


def test_the_ranks_render_a_share_each_and_all_get_every_prompt(tmp_path, qwen_tok_dir, qwen_tok):
    """Once per run, not per rank: with 3 ranks each renders a contiguous third of the prompts, and every rank gets
    the ids (and lengths, for the --max-prompt-length check) one process rendering them all gets."""
    from mindspeed_llm.rl.tools.prompts import ToolsOffered, offer_tools

    rows = [dict(QWEN_ROWS[i % 2], instruction=f"What is {i} + {i}?") for i in range(7)]
    dataset = _qwen_dataset(tmp_path, qwen_tok_dir, rows)
    alone = offer_tools(dataset, SCHEMAS, qwen_tok, "--data-path x")  # one process
    expected = [alone[i]["input_ids"] for i in range(7)]
    assert expected[0] == _qwen_reference(qwen_tok, rows[0], SCHEMAS)
    parts, ranks = _as_ranks(3, lambda share: ToolsOffered(dataset, alone.offered, qwen_tok, share))
    assert [len(parts[r][0][1]) for r in range(3)] == [2, 2, 3]  # the prompts each rank rendered
    for offered in ranks:
        assert [offered[i]["input_ids"] for i in range(7)] == expected
        assert offered[-1]["input_ids"] == expected[-1] and offered[3]["labels"] == rows[3]["instruction"]
        assert list(offered.prompt_lengths) == list(map(len, expected))


@pytest.mark.parametrize("cut,refused,expected", [
    (4, 1, "prompt 4 does not encode back to its token ids"),  # every prompt is checked for that first
    (None, 1, "prompt 1 cannot offer the tools: its system message does not end with the recorded tools' block"),
    (None, 5, "prompt 5 cannot offer the tools"),
])
def test_a_prompt_refused_on_one_rank_is_refused_on_every_rank_as_one_process_refuses_it(
        tmp_path, qwen_tok_dir, qwen_tok, cut, refused, expected):
    from mindspeed_llm.data.errors import DataError
    from mindspeed_llm.rl.tools.prompts import ToolPrompts, ToolsOffered, template_tools_block

    old = dict(QWEN_ROWS[0], system=QWEN_ROWS[0]["system"] + "\n\n" + hermes_tools_block(SCHEMAS))
    rows = [QWEN_ROWS[0] if i in (refused, 5) else old for i in range(6)]  # 5 refused in every case: the latest
    dataset = _qwen_dataset(tmp_path, qwen_tok_dir, rows)
    dataset.meta["tools"] = dict(names=["calculator"], schemas=SCHEMAS, rendering="hermes block in the system message")
    replaced = {}
    if cut is not None:  # "system" spelled in two tokens: decodes to a text that encodes to other ids
        ids = dataset[cut]["input_ids"]
        replaced[cut] = ids[:1] + encode(qwen_tok, "sys") + encode(qwen_tok, "tem") + ids[2:]
    prompts = _Rows(dataset, replaced)
    offered = ToolPrompts(dataset.meta, "--data-path x", template_tools_block(qwen_tok, SCHEMAS))
    with pytest.raises(DataError) as alone:
        ToolsOffered(prompts, offered, qwen_tok)
    assert expected in str(alone.value)
    _, ranks = _as_ranks(3, lambda share: ToolsOffered(prompts, offered, qwen_tok, share))
    assert [str(r) for r in ranks] == [str(alone.value)] * 3
