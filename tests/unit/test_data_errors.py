"""Bad input: clear errors, no traceback from the CLI, and never a half-written dataset."""
import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.fixtures_data import (ALPACA_JSON, DAPO, DEEPSCALER, load_json_rows, preprocess_args, qwen_tok,
                                         qwen_tok_dir, run_preprocess)  # noqa: F401

from mindspeed_llm.data import (DataError, DatasetNotFoundError, InputFormatError, MissingColumnError,
                                OutputExistsError, PromptDataset, UnknownNameError)
from mindspeed_llm.data.preprocess import main
from mindspeed_llm.data.writer import existing_outputs

R1 = "R1AlpacaStyleInstructionHandler"
DS_KEYS = {"prompt": "problem", "labels": "answer"}


def leftovers(folder: Path):
    """Everything in ``folder``, including hidden temporary folders."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def write_jsonl(path, rows, bad_line=None, bad_text='{"problem": "broken",'):
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(bad_line - 1, bad_text)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_json_line_names_file_and_line(qwen_tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", load_json_rows(DEEPSCALER)[:5], bad_line=3)
    with pytest.raises(InputFormatError) as e:
        run_preprocess(qwen_tok_dir, src, tmp_path / "out" / "d", R1, "qwen_r1", DS_KEYS)
    assert f"{src}:3" in str(e.value) and "malformed JSON" in str(e.value)
    assert leftovers(tmp_path / "out") == []


def test_malformed_json_array_names_file_and_line(qwen_tok_dir, tmp_path):
    lines = ALPACA_JSON.read_text().split("\n")  # indented like the Stanford file
    lines.insert(9, "oops,")
    src = tmp_path / "bad.json"
    src.write_text("\n".join(lines))
    with pytest.raises(InputFormatError) as e:
        run_preprocess(qwen_tok_dir, src, tmp_path / "out" / "d", "PPOAlpacaStyleInstructionHandler", "qwen")
    assert f"{src}:10" in str(e.value) and "malformed JSON" in str(e.value)


def test_missing_column_names_key_and_lists_columns(qwen_tok_dir, tmp_path):
    with pytest.raises(MissingColumnError) as e:
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", {"prompt": "question", "labels": "answer"})
    msg = str(e.value)
    assert "'question'" in msg and "'prompt'" in msg
    for col in ("problem", "solution", "answer", "difficulty"):
        assert col in msg
    assert existing_outputs(str(tmp_path / "d")) == []


def test_missing_nested_column_lists_nested_fields(qwen_tok_dir, tmp_path):
    with pytest.raises(MissingColumnError) as e:
        run_preprocess(qwen_tok_dir, DAPO, tmp_path / "d", R1, "qwen",
                       {"prompt": "prompt", "labels": "reward_model.answer"})
    msg = str(e.value)
    assert "reward_model.answer" in msg and "reward_model.ground_truth" in msg and "extra_info.index" in msg


def test_missing_additional_key_column(qwen_tok_dir, tmp_path):
    with pytest.raises(MissingColumnError) as e:
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", DS_KEYS,
                       ["--dataset-additional-keys", "level"])
    assert "'level'" in str(e.value) and "--dataset-additional-keys" in str(e.value) and "difficulty" in str(e.value)


def test_r1_handler_needs_a_label_column(qwen_tok_dir, tmp_path):
    with pytest.raises(DataError, match="labels"):
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", {"prompt": "problem"})


@pytest.mark.parametrize("flag,value,valid", [
    ("--handler-name", "R1Handler", ["AlpacaStyleInstructionHandler", "PPOAlpacaStyleInstructionHandler", R1]),
    ("--prompt-type", "qwen3", ["qwen", "qwen_r1", "chatml", "llama3", "smollm2", "empty"]),
    ("--tokenizer-type", "Llama2Tokenizer", ["PretrainedFromHF", "HuggingFaceTokenizer"]),
])
def test_unknown_names_list_valid_ones(qwen_tok_dir, tmp_path, flag, value, valid):
    argv = preprocess_args(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", DS_KEYS) + [flag, value]
    from mindspeed_llm.data.preprocess import preprocess

    with pytest.raises(UnknownNameError) as e:
        preprocess(argv)
    assert value in str(e.value)
    for name in valid:
        assert name in str(e.value)


def test_unknown_map_keys_role_and_bad_json(qwen_tok_dir, tmp_path):
    with pytest.raises(UnknownNameError, match="valid roles: prompt, query, response, system, labels"):
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", {"question": "problem"})
    from mindspeed_llm.data.preprocess import preprocess

    argv = preprocess_args(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1") + ["--map-keys", "{prompt: x}"]
    with pytest.raises(DataError, match="--map-keys is not valid JSON"):
        preprocess(argv)


def test_existing_output_is_never_overwritten_without_flag(qwen_tok_dir, tmp_path):
    prefix = tmp_path / "d"
    run_preprocess(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS, ["--max-prompt-length", "200"])
    before = {p: Path(p).read_bytes() for p in existing_outputs(str(prefix))}
    with pytest.raises(OutputExistsError) as e:
        run_preprocess(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS)
    assert "--overwrite-cache" in str(e.value) and str(prefix) in str(e.value)
    assert {p: Path(p).read_bytes() for p in existing_outputs(str(prefix))} == before
    res = run_preprocess(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS, ["--overwrite-cache"])
    assert res.num_samples == 43 and len(PromptDataset(str(prefix))) == 43


def test_failure_part_way_leaves_no_dataset(qwen_tok_dir, tmp_path):
    rows = load_json_rows(DEEPSCALER) * 4  # 172 rows: the first chunks are written before the bad line
    src = write_jsonl(tmp_path / "in.jsonl", rows, bad_line=150)
    out = tmp_path / "out"
    for workers in ("1", "2"):
        with pytest.raises(InputFormatError, match="in.jsonl:150"):
            run_preprocess(qwen_tok_dir, src, out / "d", R1, "qwen_r1", DS_KEYS, ["--workers", workers])
        assert leftovers(out) == []
    with pytest.raises(DatasetNotFoundError):
        PromptDataset(str(out / "d"))


def test_failed_overwrite_keeps_the_old_dataset(qwen_tok_dir, tmp_path):
    prefix = tmp_path / "d"
    run_preprocess(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS)
    before = {p: Path(p).read_bytes() for p in existing_outputs(str(prefix))}
    rows = load_json_rows(DEEPSCALER) * 3
    rows[100] = {"problem": "no answer column here"}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(MissingColumnError, match="in.jsonl:101"):
        run_preprocess(qwen_tok_dir, src, prefix, R1, "qwen_r1", DS_KEYS, ["--overwrite-cache", "--workers", "2"])
    assert {p: Path(p).read_bytes() for p in existing_outputs(str(prefix))} == before
    assert leftovers(tmp_path) == sorted(["in.jsonl"] + [Path(p).name for p in before])


def test_no_kept_rows_writes_nothing(qwen_tok_dir, tmp_path):
    with pytest.raises(DataError, match="no sample was kept"):
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "out" / "d", R1, "qwen_r1", DS_KEYS,
                       ["--max-prompt-length", "5"])
    assert leftovers(tmp_path / "out") == []


def test_cli_prints_error_without_traceback(qwen_tok_dir, tmp_path, capsys):
    prefix = tmp_path / "d"
    rc = main(preprocess_args(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", {"prompt": "nope", "labels": "answer"}))
    err = capsys.readouterr().err
    assert rc != 0 and "error:" in err and "'nope'" in err and "Traceback" not in err


def test_missing_required_flag_and_bad_input_path(qwen_tok_dir, tmp_path, capsys):
    assert main(["--input", str(DEEPSCALER), "--tokenizer-name-or-path", str(qwen_tok_dir)]) == 2
    assert "--output-prefix is required" in capsys.readouterr().err
    assert main(preprocess_args(qwen_tok_dir, tmp_path / "missing.json", tmp_path / "d", R1, "qwen_r1", DS_KEYS)) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "data.csv").write_text("a,b\n")
    assert main(preprocess_args(qwen_tok_dir, tmp_path / "data.csv", tmp_path / "d", R1, "qwen_r1", DS_KEYS)) == 2
    assert "unsupported file type '.csv'" in capsys.readouterr().err


def test_missing_or_incomplete_dataset_names_prefix_and_command(qwen_tok_dir, tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        PromptDataset(str(tmp_path / "nothing" / "data"))
    assert str(tmp_path / "nothing" / "data") in str(e.value) and "preprocess_data.py" in str(e.value)
    prefix = tmp_path / "d"
    run_preprocess(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS)
    os.remove(str(prefix) + "_extra_labels_document.bin")
    with pytest.raises(DatasetNotFoundError, match="incomplete.*_extra_labels_document.bin"):
        PromptDataset(str(prefix))
    os.remove(str(prefix) + "_meta.json")
    with pytest.raises(DatasetNotFoundError, match="incomplete"):
        PromptDataset(str(prefix))


def test_an_empty_dataset_is_named_empty_not_damaged(tmp_path):
    """A dataset with no rows (a writer committed without samples, as another tool may): megatron cannot mmap its
    empty .bin, which used to be reported as a damaged index."""
    from mindspeed_llm.data.writer import DatasetWriter

    prefix = tmp_path / "d"
    with DatasetWriter(str(prefix), ["input_ids"], ["labels"]) as writer:
        writer.commit({})
    with pytest.raises(DataError) as e:
        PromptDataset(str(prefix))
    assert "is empty: the dataset holds no prompts" in str(e.value) and "damaged" not in str(e.value)
    assert "preprocess_data.py" in str(e.value)


def test_chat_message_prompt_must_be_role_content_objects(qwen_tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": [{"text": "hi"}], "answer": "1"}])
    with pytest.raises(InputFormatError, match="in.jsonl:1.*role"):
        run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen", {"prompt": "prompt", "labels": "answer"})


# ---- output location -----------------------------------------------------------------------------

def test_read_only_output_folder_fails_before_tokenizing(tmp_path):
    """A real permission check: the run is a child process without root's override (as 'nobody'
    when the tests run as root). The tokenizer path does not exist, so reaching it would be
    another error: the output folder is checked first."""
    import shutil
    import tempfile

    from tests.helpers.fixtures_data import run_forked

    base = Path(tempfile.mkdtemp(prefix="ro-out-"))  # outside root's 0700 pytest folder
    try:
        os.chmod(base, 0o755)
        ro = base / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        prefix = ro / "train"
        argv = preprocess_args(tmp_path / "no-tokenizer", DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS)
        status, err = run_forked(lambda: main(argv), as_user=65534 if os.geteuid() == 0 else None)
        assert status == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"--output-prefix {prefix}: the folder {ro} is not writable" in err
        assert "Permission denied (EACCES)" in err and "choose a --output-prefix in a writable folder" in err
        assert leftovers(ro) == []
    finally:
        os.chmod(base / "ro", 0o755)
        shutil.rmtree(base)


def test_output_folder_under_a_file(qwen_tok_dir, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    prefix = tmp_path / "afile" / "sub" / "train"
    assert main(preprocess_args(qwen_tok_dir, DEEPSCALER, prefix, R1, "qwen_r1", DS_KEYS)) == 2
    err = capsys.readouterr().err
    assert f"--output-prefix {prefix}: cannot create the folder {prefix.parent}" in err
    assert "Not a directory" in err and "Traceback" not in err


def test_output_prefix_ending_in_slash(qwen_tok_dir, tmp_path, capsys):
    folder = str(tmp_path / "dataset") + "/"
    assert main(preprocess_args(qwen_tok_dir, DEEPSCALER, folder, R1, "qwen_r1", DS_KEYS)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"--output-prefix {folder!r} names a folder, not a prefix" in err
    assert "a path plus a file-name stem" in err and "dataset/train" in err
    assert f"use e.g. --output-prefix {tmp_path / 'dataset' / 'train'}" in err
    assert leftovers(tmp_path) == []  # checked before anything was created


# ---- text roles must be text -----------------------------------------------------------------------

def test_number_in_a_text_column_is_an_error_naming_column_and_type(qwen_tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"problem": "What is 1+1?", "answer": "2"},
                                              {"problem": 7, "answer": "3"}])
    with pytest.raises(InputFormatError) as e:
        run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen_r1", DS_KEYS)
    msg = str(e.value)
    assert f"{src}:2: column 'problem' (--map-keys 'prompt') holds int64 7, not text" in msg
    assert "only 'labels' may be numbers" in msg
    assert existing_outputs(str(tmp_path / "d")) == []
    src = write_jsonl(tmp_path / "q.jsonl", [{"problem": "Add:", "extra": 2.5, "answer": "1"}])
    with pytest.raises(InputFormatError, match=r"column 'extra' \(--map-keys 'query'\) holds float64 2.5"):
        run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen_r1", dict(DS_KEYS, query="extra"))
    src = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": 12}], "answer": "1"}])
    with pytest.raises(InputFormatError, match=r"column 'prompt' \(--map-keys 'prompt'\) message content holds int64"):
        run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen", {"prompt": "prompt", "labels": "answer"})


def test_int64_parquet_column_as_prompt_is_an_error_but_numeric_labels_are_strings(qwen_tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int64()), "question": ["What is 2+1?", "What is 3+1?"],
                             "answer": pa.array([3, 4], pa.int64())}), src)
    with pytest.raises(InputFormatError) as e:
        run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen_r1", {"prompt": "id", "labels": "answer"})
    assert f"{src}[row 0]: column 'id' (--map-keys 'prompt') holds int64 1, not text" in str(e.value)
    run_preprocess(qwen_tok_dir, src, tmp_path / "d", R1, "qwen_r1", {"prompt": "question", "labels": "answer"})
    ds = PromptDataset(str(tmp_path / "d"))
    assert [ds[0]["labels"], ds[1]["labels"]] == ["3", "4"]  # verifiers compare answers as strings


# ---- over-long prompts -----------------------------------------------------------------------------

def test_overlong_prompts_error_names_the_row_and_the_flags(qwen_tok_dir, tmp_path):
    with pytest.raises(DataError) as e:
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", DS_KEYS,
                       ["--max-prompt-length", "60", "--overlong-prompts", "error"])
    msg = str(e.value)
    assert f"{DEEPSCALER}[row " in msg and "tokens, more than --max-prompt-length 60" in msg
    assert "--overlong-prompts drop" in msg and "truncate" in msg
    assert existing_outputs(str(tmp_path / "d")) == []


def test_overlong_prompts_mode_needs_a_limit(qwen_tok_dir, tmp_path):
    with pytest.raises(DataError, match="--overlong-prompts truncate needs --max-prompt-length N"):
        run_preprocess(qwen_tok_dir, DEEPSCALER, tmp_path / "d", R1, "qwen_r1", DS_KEYS,
                       ["--overlong-prompts", "truncate"])
