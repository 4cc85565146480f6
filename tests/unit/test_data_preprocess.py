"""preprocess_data.py on the real-schema samples: ids, labels, extras, workers, filters, configs
(the example script as a process of its own: tests/dist/test_data_preprocess_dist.py)."""
import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.fixtures_data import (ALPACA_JSON, ALPACA_PARQUET, CASES, DAPO, DEEPSCALER,
                                         QWEN25_CHAT_TEMPLATE, ROOT, load_json_rows, load_parquet_rows,
                                         preprocessed, qwen_tok, qwen_tok_dir, run_preprocess)  # noqa: F401

from mindspeed_llm.data import IGNORE_INDEX, PromptDataset, get_template
from mindspeed_llm.data.preprocess import _config_defaults, build_parser
from mindspeed_llm.data.writer import output_files


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def chat_ids(tok, messages, add_generation_prompt):
    ref = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ref["input_ids"] if hasattr(ref, "keys") else ref)


def test_deepscaler_r1_prompts_and_labels(preprocessed, qwen_tok):
    prefix, res = preprocessed["deepscaler_r1"]
    rows = load_json_rows(DEEPSCALER)
    ds = PromptDataset(prefix)
    assert len(ds) == res.num_samples == len(rows) == 43 and res.dropped == {}
    t = get_template("qwen_r1")
    for i, row in enumerate(rows):
        item = ds[i]
        user = [{"role": "user", "content": row["problem"]}]
        assert item["input_ids"] == ids_of(qwen_tok, t.render(user))
        # the same as the Qwen2.5 tokenizer's own chat template with the R1 instruction in the user turn
        assert item["input_ids"] == chat_ids(
            qwen_tok, [{"role": "user", "content": t.user_instruction + row["problem"]}], True)
        assert item["labels"] == row["answer"] and isinstance(item["labels"], str)
        assert item["difficulty"] == row["difficulty"]
    assert ds[2]["labels"] == "1"  # the README's known answer/solution disagreement is kept as is
    assert ds.stop_words == ["<|im_end|>", "<|endoftext|>"]


def test_dapo_chat_message_prompts_and_nested_labels(preprocessed, qwen_tok):
    prefix, res = preprocessed["dapo_r1"]
    rows = load_parquet_rows(DAPO)
    ds = PromptDataset(prefix)
    assert len(ds) == len(rows) == 30
    for i, row in enumerate(rows):
        item = ds[i]
        # the chat-message prompt goes through Qwen2.5's real template unchanged
        assert item["input_ids"] == chat_ids(qwen_tok, row["prompt"], True)
        assert item["labels"] == row["reward_model"]["ground_truth"]
        assert item["extra_info.index"] == row["extra_info"]["index"]
        assert item["data_source"] == "math_dapo"
        assert item["reward_model"] == row["reward_model"]


def test_alpaca_ppo_prompts(preprocessed, qwen_tok):
    prefix, res = preprocessed["alpaca_ppo"]
    rows = load_json_rows(ALPACA_JSON)
    ds = PromptDataset(prefix)
    assert len(ds) == 40
    for i, row in enumerate(rows):
        content = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        assert ds[i]["input_ids"] == chat_ids(qwen_tok, [{"role": "user", "content": content}], True)
        assert ds[i]["labels"] is None
    assert ds.meta["extra_keys"] == []


def test_alpaca_sft_ids_and_masked_labels(preprocessed, qwen_tok):
    prefix, res = preprocessed["alpaca_sft"]
    rows = load_parquet_rows(ALPACA_PARQUET)
    ds = PromptDataset(prefix)
    assert len(ds) == 40 and ds.packed_keys == ["input_ids", "labels"]
    for i, row in enumerate(rows):
        content = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        prompt = [{"role": "user", "content": content}]
        full = chat_ids(qwen_tok, prompt + [{"role": "assistant", "content": row["output"]}], False)
        n_prompt = len(chat_ids(qwen_tok, prompt, True))
        item = ds[i]
        assert item["input_ids"] == full
        assert item["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
        assert item["labels"][n_prompt:] == full[n_prompt:]
        assert item["text"] == row["text"]


@pytest.mark.parametrize("name", ["deepscaler_r1", "dapo_r1", "alpaca_sft"])
def test_two_workers_write_the_same_bytes_as_one(preprocessed, qwen_tok_dir, tmp_path, name):
    prefix2, res2 = preprocessed[name]  # made with --workers 2
    case = CASES[name]
    prefix1 = tmp_path / "one"
    res1 = run_preprocess(qwen_tok_dir, case["input_path"], prefix1, case["handler"], case["prompt_type"],
                          case["map_keys"], list(case["extra"]) + ["--workers", "1"])
    files1 = output_files(str(prefix1), res1.meta["packed_keys"], res1.meta["extra_keys"])
    files2 = output_files(prefix2, res2.meta["packed_keys"], res2.meta["extra_keys"])
    assert len(files1) == len(files2)
    for f1, f2 in zip(files1[:-1], files2[:-1]):
        assert Path(f1).read_bytes() == Path(f2).read_bytes(), f1
    m1, m2 = (json.loads(Path(f).read_text()) for f in (files1[-1], files2[-1]))
    assert m1 == m2


def test_prompt_length_filter_drops_and_counts(qwen_tok_dir, qwen_tok, tmp_path):
    rows = load_json_rows(DEEPSCALER)
    t = get_template("qwen_r1")
    lengths = [len(ids_of(qwen_tok, t.render([{"role": "user", "content": r["problem"]}]))) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    res = run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "f", "R1AlpacaStyleInstructionHandler", "qwen_r1",
                         {"prompt": "problem", "labels": "answer"}, ["--max-prompt-length", str(limit)])
    too_long = sum(n > limit for n in lengths)
    assert too_long > 0
    assert res.dropped == {"prompt_too_long": too_long}
    assert res.num_samples == len(rows) - too_long
    ds = PromptDataset(str(tmp_path / "f"))
    kept_answers = [r["answer"] for r, n in zip(rows, lengths) if n <= limit]
    assert [ds[i]["labels"] for i in range(len(ds))] == kept_answers
    assert max(ds.prompt_lengths) <= limit
    assert ds.meta["dropped"] == {"prompt_too_long": too_long} and ds.meta["num_input_rows"] == len(rows)


def test_empty_prompts_and_labels_are_dropped_and_counted(qwen_tok_dir, tmp_path):
    rows = load_json_rows(DEEPSCALER)[:6]
    rows[1]["problem"] = "   "
    rows[3]["answer"] = ""
    rows[4]["problem"] = None
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = run_preprocess(qwen_tok_dir, path, tmp_path / "o", "R1AlpacaStyleInstructionHandler", "qwen_r1",
                         {"prompt": "problem", "labels": "answer"})
    assert res.dropped == {"empty_prompt": 2, "empty_label": 1}
    assert [PromptDataset(str(tmp_path / "o"))[i]["labels"] for i in range(3)] == [
        rows[0]["answer"], rows[2]["answer"], rows[5]["answer"]]


def test_seq_length_filters_sft_sequences(qwen_tok_dir, tmp_path):
    res = run_preprocess(qwen_tok_dir, ALPACA_JSON, tmp_path / "s", "AlpacaStyleInstructionHandler", "qwen",
                         None, ["--seq-length", "64"])
    assert res.dropped.get("sequence_too_long", 0) > 0
    ds = PromptDataset(str(tmp_path / "s"))
    assert len(ds) == 40 - res.dropped["sequence_too_long"]
    assert all(len(ds[i]["input_ids"]) <= 64 for i in range(len(ds)))


def test_folder_input_and_jsonl_and_append_eod(qwen_tok_dir, qwen_tok, tmp_path):
    rows = load_json_rows(ALPACA_JSON)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:10]) + "\n")
    (folder / "b.json").write_text(json.dumps(rows[10:25]))
    (folder / "notes.txt").write_text("ignored")
    res = run_preprocess(qwen_tok_dir, folder, tmp_path / "o", "AlpacaStyleInstructionHandler", "chatml", None,
                         ["--append-eod"])
    assert res.num_rows == 25 and res.num_samples == 25
    ds = PromptDataset(str(tmp_path / "o"))
    eos = qwen_tok.eos_token_id
    for i in range(len(ds)):
        assert ds[i]["input_ids"][-1] == eos and ds[i]["labels"][-1] == eos
    assert ds[0]["input_ids"][:-1] == ids_of(qwen_tok, get_template("chatml").render(
        [{"role": "user", "content": rows[0]["instruction"]}, {"role": "assistant", "content": rows[0]["output"]}],
        add_generation_prompt=False))


def test_mindspeed_compat_flags_are_accepted(qwen_tok_dir, tmp_path):
    res = run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "c", "R1AlpacaStyleInstructionHandler", "qwen_r1",
                         {"prompt": "problem", "query": "", "response": "answer", "system": ""},
                         ["--tokenizer-type", "HuggingFaceTokenizer", "--json-keys", "text", "--append-eod",
                          "--dataset-additional-keys", "labels"])
    ds = PromptDataset(str(tmp_path / "c"))
    assert res.num_samples == 43 and ds[0]["labels"] == load_json_rows(DEEPSCALER)[0]["answer"]


@pytest.mark.parametrize("name", ["deepscaler", "math_17k", "alpaca"])
def test_dataset_yaml_configs_hold_valid_flags(name):
    parser = build_parser()
    cfg = _config_defaults(parser, str(ROOT / "configs" / "datasets" / f"{name}.yaml"))
    for key in ("input", "tokenizer_name_or_path", "output_prefix", "handler_name", "prompt_type"):
        assert key in cfg
    from mindspeed_llm.data.handlers import get_handler_class, parse_map_keys

    get_handler_class(cfg["handler_name"])
    get_template(cfg["prompt_type"])
    parse_map_keys(cfg.get("map_keys"))


@pytest.mark.parametrize("text,expected", [
    ("handler_name: R1AlpacaStyleInstructionHandler\nprompt_type:\n", "line 2: 'prompt_type' has no value"),
    ("prompt_type: qwen\nseq_length: 512\nprompt_type: empty\n", "'prompt_type' is given twice (lines 1 and 3)"),
])
def test_a_dataset_yaml_config_without_a_value_or_with_a_key_twice_is_refused(tmp_path, text, expected):
    from mindspeed_llm.data.errors import DataError

    path = tmp_path / "dataset.yaml"
    path.write_text(text)
    with pytest.raises(DataError) as caught:
        _config_defaults(build_parser(), str(path))
    assert f"--config {path}: " in str(caught.value) and expected in str(caught.value), str(caught.value)


def test_math_17k_yaml_config_with_overrides(qwen_tok_dir, tmp_path):
    from mindspeed_llm.data.preprocess import preprocess

    res = preprocess(["--config", str(ROOT / "configs" / "datasets" / "math_17k.yaml"), "--input", str(DAPO),
                      "--tokenizer-name-or-path", str(qwen_tok_dir), "--output-prefix", str(tmp_path / "m"),
                      "--workers", "2", "--log-interval", "0"])
    ds = PromptDataset(str(tmp_path / "m"))
    rows = load_parquet_rows(DAPO)
    assert res.num_samples == len(ds) == 30
    assert [ds[i]["labels"] for i in range(30)] == [r["reward_model"]["ground_truth"] for r in rows]
    assert ds[0]["data_source"] == "math_dapo"


def test_overlong_prompts_truncate_keeps_the_end_and_counts(qwen_tok_dir, qwen_tok, tmp_path, capsys):
    from mindspeed_llm.data.preprocess import main

    rows = load_json_rows(DEEPSCALER)
    t = get_template("qwen_r1")
    full = [ids_of(qwen_tok, t.render([{"role": "user", "content": r["problem"]}])) for r in rows]
    limit = sorted(len(x) for x in full)[len(full) // 2]
    too_long = sum(len(x) > limit for x in full)
    prefix = tmp_path / "t"
    argv = ["--input", str(DEEPSCALER), "--tokenizer-name-or-path", str(qwen_tok_dir), "--output-prefix", str(prefix),
            "--handler-name", "R1AlpacaStyleInstructionHandler", "--prompt-type", "qwen_r1",
            "--map-keys", json.dumps({"prompt": "problem", "labels": "answer"}), "--log-interval", "0",
            "--max-prompt-length", str(limit), "--overlong-prompts", "truncate"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"truncated {too_long} prompts longer than --max-prompt-length {limit} to their last {limit} tokens" in err
    ds = PromptDataset(str(prefix))
    assert len(ds) == len(rows)  # nothing dropped
    assert [ds[i]["input_ids"] for i in range(len(ds))] == [x[-limit:] for x in full]
    generation_prompt = ids_of(qwen_tok, "<|im_start|>assistant\n")
    assert all(ds[i]["input_ids"][-len(generation_prompt):] == generation_prompt for i in range(len(ds)))
    assert ds.meta["truncated"] == {"prompt_too_long": too_long} and ds.meta["dropped"] == {}
    assert ds.meta["overlong_prompts"] == "truncate" and ds.meta["max_input_ids_length"] == limit
    # the default, drop, says how many went
    assert main(argv[:-2] + ["--output-prefix", str(tmp_path / "dr")]) == 0
    assert f"dropped {too_long} prompts longer than {limit} tokens (--overlong-prompts drop" in capsys.readouterr().err
    assert PromptDataset(str(tmp_path / "dr")).meta["truncated"] == {}


def test_overlong_prompts_truncate_sft_keeps_the_response(qwen_tok_dir, qwen_tok, tmp_path):
    rows = load_json_rows(ALPACA_JSON)
    res = run_preprocess(qwen_tok_dir, ALPACA_JSON, tmp_path / "s", "AlpacaStyleInstructionHandler", "qwen", None,
                         ["--max-prompt-length", "30", "--overlong-prompts", "truncate"])
    ds = PromptDataset(str(tmp_path / "s"))
    assert len(ds) == len(rows) and res.truncated["prompt_too_long"] > 0
    for i, row in enumerate(rows):
        content = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        prompt = [{"role": "user", "content": content}]
        ids = chat_ids(qwen_tok, prompt + [{"role": "assistant", "content": row["output"]}], False)
        n_prompt = len(chat_ids(qwen_tok, prompt, True))
        cut = max(0, n_prompt - 30)
        item = ds[i]
        assert item["input_ids"] == ids[cut:]
        assert item["labels"] == [IGNORE_INDEX] * (n_prompt - cut) + ids[n_prompt:]


def test_a_dataset_made_for_sft_is_refused_for_rl(preprocessed):
    """A dataset whose _meta.json says an SFT handler made it (prompt + response in input_ids) would train RL on
    prompts that hold their reference answers: the trainer refuses it, as --data-path or --eval-data-path, naming
    the handler that made it and the ones to use; prompt datasets pass."""
    from mindspeed_llm.data.errors import DataError
    from mindspeed_llm.rl.settings import DataSettings
    from mindspeed_llm.rl.preflight import prompt_sets

    sft, prompts = preprocessed["alpaca_sft"][0], preprocessed["deepscaler_r1"][0]
    dataset, held_out = prompt_sets(DataSettings(data_path=prompts, global_batch_size=1))
    assert len(dataset) > 0 and held_out is None
    for settings, flag in ((DataSettings(data_path=sft, global_batch_size=1), "--data-path"),
                           (DataSettings(data_path=prompts, eval_data_path=(sft,), eval_sets=((None, sft),),
                                         eval_interval=1, global_batch_size=1), "--eval-data-path")):
        with pytest.raises(DataError) as caught:
            prompt_sets(settings)
        message = str(caught.value)
        assert message.startswith(f"{flag} {sft}: this dataset was made by AlpacaStyleInstructionHandler for SFT")
        assert "R1AlpacaStyleInstructionHandler" in message and "PPOAlpacaStyleInstructionHandler" in message
