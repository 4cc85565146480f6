"""Fault injection on the data and conversion tools: a preprocess run SIGKILLed inside its commit,
a full disk, and checkpoints holding NaN / inf.

The kills use the test-only hook of :mod:`mindspeed_llm.data.writer`: with
``MINDSPEED_LLM_FAULT_AT=<point>`` the process SIGKILLs itself when its commit reaches ``<point>``.
The run is a forked child of the test process (``fixtures_data.run_forked``), so it needs no fresh
interpreter and really dies mid-commit: no ``finally`` block, no cleanup.
"""
import errno
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.fixtures_data import (DEEPSCALER, load_json_rows, preprocess_args, qwen_tok_dir,
                                         run_forked)  # noqa: F401

from mindspeed_llm.data import OutputExistsError, PromptDataset
from mindspeed_llm.data.preprocess import main, preprocess
from mindspeed_llm.data.writer import FAULT_ENV, existing_outputs, meta_path

R1 = "R1AlpacaStyleInstructionHandler"
DS_KEYS = {"prompt": "problem", "labels": "answer"}
ROOT = Path(__file__).resolve().parents[2]


def listing(folder: Path):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def hidden(folder: Path):
    return [n for n in listing(folder) if n.startswith(".")]


def snapshot(prefix: Path):
    return {Path(p).name: Path(p).read_bytes() for p in existing_outputs(str(prefix))}


def labels_of(prefix: Path):
    ds = PromptDataset(str(prefix))
    return [ds[i]["labels"] for i in range(len(ds))]


@pytest.fixture
def two_inputs(tmp_path):
    """An 'old' input (12 rows) and a 'new' one (9 other rows) with different answers."""
    rows = load_json_rows(DEEPSCALER)
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text("\n".join(json.dumps(r) for r in rows[:12]) + "\n")
    new.write_text("\n".join(json.dumps(r) for r in rows[20:29]) + "\n")
    return (old, [r["answer"] for r in rows[:12]]), (new, [r["answer"] for r in rows[20:29]])


def _argv(tok_dir, src, prefix, *extra):
    return preprocess_args(tok_dir, src, prefix, R1, "qwen_r1", DS_KEYS) + list(extra)


# ------------------------------------------------------------------------------------------- killed commit

@pytest.mark.parametrize("point", ["staged", "aside", "swap", "published"])
def test_overwrite_killed_inside_commit_keeps_a_complete_dataset(qwen_tok_dir, tmp_path, two_inputs, point):
    (old_src, old_labels), (new_src, new_labels) = two_inputs
    out = tmp_path / "out"
    prefix = out / "d"
    preprocess(_argv(qwen_tok_dir, old_src, prefix))
    before = snapshot(prefix)

    status, err = run_forked(lambda: main(_argv(qwen_tok_dir, new_src, prefix, "--overwrite-cache")),
                             env={FAULT_ENV: point})
    assert status == -signal.SIGKILL, err
    left = hidden(out)
    assert any(".d.partial-" in n for n in left) or point == "published", left
    if point == "swap":  # the prefix has no manifest and already one new file: the old copy is aside
        assert not os.path.exists(meta_path(str(prefix)))
        assert any(n.startswith(".d.old-") for n in left)
    # a reader sees a complete dataset: the previous one until the new one is complete
    assert labels_of(prefix) == (new_labels if point == "published" else old_labels)

    # the rerun succeeds and leaves nothing of the killed run behind
    res = preprocess(_argv(qwen_tok_dir, new_src, prefix, "--overwrite-cache"))
    assert res.num_samples == len(new_labels)
    assert hidden(out) == []
    assert listing(out) == sorted(Path(p).name for p in res.files)
    assert labels_of(prefix) == new_labels
    assert set(before) == set(snapshot(prefix))  # same file names, new contents


def test_rerun_after_killed_swap_restores_the_previous_dataset(qwen_tok_dir, tmp_path, two_inputs, capsys):
    """Killed half-way through the swap; a rerun without --overwrite-cache first puts the previous
    dataset back, byte for byte, then refuses to replace it."""
    (old_src, old_labels), (new_src, _) = two_inputs
    out = tmp_path / "out"
    prefix = out / "d"
    preprocess(_argv(qwen_tok_dir, old_src, prefix))
    before = snapshot(prefix)
    status, err = run_forked(lambda: main(_argv(qwen_tok_dir, new_src, prefix, "--overwrite-cache")),
                             env={FAULT_ENV: "swap"})
    assert status == -signal.SIGKILL, err
    assert snapshot(prefix) != before

    # a rerun killed while it puts the previous dataset back: the copy is still whole and readable
    status, err = run_forked(lambda: main(_argv(qwen_tok_dir, new_src, prefix)), env={FAULT_ENV: "restoring"})
    assert status == -signal.SIGKILL, err
    assert not os.path.exists(meta_path(str(prefix)))  # the manifest goes back last
    assert labels_of(prefix) == old_labels

    assert main(_argv(qwen_tok_dir, new_src, prefix)) == 2
    err = capsys.readouterr().err
    assert f"restored the previous dataset at {prefix}" in err
    assert "removed" in err and ".d.partial-" in err  # the staging folder, named
    assert "already holds a dataset" in err and "--overwrite-cache" in err and "Traceback" not in err
    assert snapshot(prefix) == before
    assert hidden(out) == []
    assert labels_of(prefix) == old_labels


def test_live_runs_folders_are_left_alone(qwen_tok_dir, tmp_path, two_inputs):
    """Only folders of dead runs are cleaned: one whose process is alive (here: this one) stays."""
    (old_src, _), _ = two_inputs
    from mindspeed_llm.data.writer import _owner_tag

    out = tmp_path / "out"
    out.mkdir()
    mine = out / f".d.partial-{_owner_tag()}-abcd1234"
    mine.mkdir()
    legacy = out / ".d.partial-x1y2z3"  # an older version's name, without an owner: stale
    legacy.mkdir()
    preprocess(_argv(qwen_tok_dir, old_src, out / "d"))
    assert hidden(out) == [mine.name]


# ------------------------------------------------------------------------------------------- disk full

@pytest.mark.parametrize("where,overwrite", [("data", False), ("index", True)], ids=["bin-fresh", "idx-overwrite"])
def test_disk_full_is_one_line_and_leaves_no_partial_files(qwen_tok_dir, tmp_path, two_inputs, monkeypatch, capsys,
                                                           where, overwrite):
    import megatron.core.datasets.indexed_dataset as idx

    (old_src, old_labels), (new_src, _) = two_inputs
    out = tmp_path / "out"
    prefix = out / "d"
    if overwrite:
        preprocess(_argv(qwen_tok_dir, old_src, prefix))
    before = snapshot(prefix)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "data":
        real, calls = idx.IndexedDatasetBuilder.add_item, []

        def add_item(self, tensor, mode=0):  # the 4th row's token ids hit a full disk
            calls.append(1)
            if len(calls) == 7:
                no_space()
            return real(self, tensor, mode)

        monkeypatch.setattr(idx.IndexedDatasetBuilder, "add_item", add_item)
        expected_path = f"{prefix}_packed_input_ids_document.bin"
    else:
        monkeypatch.setattr(idx._IndexWriter, "write", no_space)
        expected_path = f"{prefix}_packed_input_ids_document.idx"

    argv = _argv(qwen_tok_dir, new_src, prefix, *(["--overwrite-cache"] if overwrite else []))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    assert f"cannot write {expected_path}: No space left on device (ENOSPC)" in lines[0]
    assert "free space" in lines[0] and "partial output was removed" in lines[0]
    assert hidden(out) == []  # no staging folder keeps the disk full
    assert snapshot(prefix) == before
    if overwrite:
        assert labels_of(prefix) == old_labels


def _full_disk_safetensors(monkeypatch, after=0):
    """safetensors' writer hits a full disk (a SafetensorError, not an OSError) on its call number `after` + 1,
    after writing part of the file."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) <= after:
            return real(tensors, filename, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(b"\0" * 64)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_full_disk_exporting_hugging_face_and_peft_is_one_named_line(tmp_path, monkeypatch, capsys):
    """A full disk while convert_ckpt.py writes Hugging Face weights, or a PEFT adapter (--save-lora-to-hf),
    is one line naming the file, and leaves no temp file, no shard written before it and no config that would make
    the folder look loadable."""
    from tests.helpers.convert_checks import hf_tensors, write_adapter_checkpoint
    from tests.helpers.hf_tiny import save_tiny

    hf = save_tiny("llama", tmp_path / "hf", seed=5)
    adapter = write_adapter_checkpoint(hf, tmp_path / "adapter")
    assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf,
                    "--save-dir", tmp_path / "mg") == 0
    capsys.readouterr()
    _full_disk_safetensors(monkeypatch)
    for extra, out, file in (((), tmp_path / "out", "model.safetensors"),
                             (("--lora-load", adapter, "--save-lora-to-hf"), tmp_path / "peft",
                              "adapter_model.safetensors")):
        assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", tmp_path / "mg",
                        "--save-dir", out, *extra) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert lines == [f"convert_ckpt.py: error: No space left on device writing {out / file}; free space there "
                         "or pass another --save-dir"], err
        assert sorted(p.name for p in out.iterdir()) == [], sorted(p.name for p in out.iterdir())
    # a sharded export whose second shard hits the full disk: the first shard goes too
    from mindspeed_llm.checkpoint import hf_files

    monkeypatch.undo()
    _full_disk_safetensors(monkeypatch, after=1)
    with pytest.raises(OSError, match=f"No space left on device writing {tmp_path / 'sharded'}/model-00002-of-"):
        (tmp_path / "sharded").mkdir()
        hf_files.save_hf_weights(hf_tensors(hf), str(tmp_path / "sharded"), max_shard_bytes=4096)
    assert list((tmp_path / "sharded").iterdir()) == []


def test_a_full_disk_cuts_no_metrics_row_in_half(tmp_path):
    """The metrics JSONL and eval.csv: a write that fails half way (a full disk) is named with the file, and the
    rows already there stay whole, with no half row after them."""
    from mindspeed_llm.files import WriteError
    from mindspeed_llm.rl.evaluation import EvalTable
    from mindspeed_llm.rl.metrics.writers import MetricsLogger

    class FullDisk:  # the open file, whose next write stops half way
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def write(self, text):
            self.handle.write(text[:len(text) // 2])
            self.handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(jsonl_path=str(path), print_fn=lambda line: None)
    logger.log(1, {"loss": 0.5})
    logger._jsonl = FullDisk(logger._jsonl)
    with pytest.raises(WriteError, match=f"No space left on device writing {path}$"):
        logger.log(2, {"loss": 0.25})
    logger._jsonl = logger._jsonl.handle
    logger.close()
    assert path.read_text() == '{"iteration": 1, "loss": 0.5}\n'

    table = EvalTable(str(tmp_path / "eval" / "eval.csv"))
    table.write(1, [("held_out", "accuracy", 0.5)])
    table._file = FullDisk(table._file)
    with pytest.raises(WriteError, match="No space left on device writing .*eval.csv$"):
        table.write(2, [("held_out", "accuracy", 0.75)])
    table._file.handle.close()
    assert (tmp_path / "eval" / "eval.csv").read_text().splitlines() == [
        "iteration,set,metric,value", "1,held_out,accuracy,0.5"]


# ------------------------------------------------------------------------------------------- non-finite weights

def _convert(*argv) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import convert_ckpt

    return convert_ckpt.main([str(a) for a in argv] + ["--no-progress"])


def _poison(path, name, nan=3, inf=1):
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    t = state[name]
    t.view(-1)[:nan] = float("nan")
    t.view(-1)[nan:nan + inf] = float("inf")
    save_file(state, path, metadata={"format": "pt"})


def test_convert_refuses_non_finite_weights_in_every_direction(tmp_path, capsys):
    from tests.helpers.hf_tiny import save_tiny
    from safetensors.torch import load_file

    from mindspeed_llm.checkpoint import megatron_layout as layout

    src = save_tiny("qwen2", tmp_path / "hf", num_layers=2, seed=21)
    _poison(os.path.join(src, "model.safetensors"), "model.layers.1.mlp.up_proj.weight")
    mg, out = tmp_path / "mg", tmp_path / "out"

    # hf -> mg: refused, the HF tensor and the counts named, nothing written
    assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src, "--save-dir", mg) == 1
    err = capsys.readouterr().err
    assert "tensor model.layers.1.mlp.up_proj.weight" in err and "3 NaN and 1 inf of 8192 values" in err
    assert "--allow-non-finite" in err and "Traceback" not in err
    assert listing(mg) == []  # no tracker, no staging folder

    # --allow-non-finite converts as it is, with a warning naming the tensor
    assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src, "--save-dir", mg,
                    "--allow-non-finite") == 0
    err = capsys.readouterr().err
    assert "warning: --allow-non-finite" in err and "model.layers.1.mlp.up_proj.weight (3 NaN and 1 inf" in err
    fc1 = layout.load_shard(mg, 0, 0)["model"]["decoder.layers.1.mlp.linear_fc1.weight"]
    assert int(torch.isnan(fc1).sum()) == 3 and int(torch.isinf(fc1).sum()) == 1

    # mg -> hf and mg -> mg: refused, the Megatron tensor named, no weights written
    assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", out) == 1
    err = capsys.readouterr().err
    assert "tensor decoder.layers.1.mlp.linear_fc1.weight" in err and "3 NaN and 1 inf" in err
    assert not os.path.exists(out / "model.safetensors") and not os.path.exists(out / "config.json")
    assert _convert("--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", mg, "--save-dir",
                    tmp_path / "mg2", "--target-tensor-parallel-size", 2) == 1
    assert "decoder.layers.1.mlp.linear_fc1.weight" in capsys.readouterr().err
    assert listing(tmp_path / "mg2") == []
    assert _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", out,
                    "--allow-non-finite") == 0
    up = load_file(out / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    assert int(torch.isnan(up).sum()) == 3 and int(torch.isinf(up).sum()) == 1


def test_convert_refuses_a_dtype_that_overflows(tmp_path, capsys):
    from tests.helpers.hf_tiny import save_tiny
    from safetensors.torch import load_file, save_file

    src = save_tiny("llama", tmp_path / "hf", num_layers=2, seed=22)
    state = load_file(os.path.join(src, "model.safetensors"))
    state["model.norm.weight"][:2] = 1e6  # finite in fp32, inf in fp16
    save_file(state, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                    "--save-dir", tmp_path / "mg", "--params-dtype", "fp16") == 1
    err = capsys.readouterr().err
    assert "tensor decoder.final_layernorm.weight" in err and "2 of its values overflow torch.float16" in err
    assert "--params-dtype bf16 or fp32" in err
    assert _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", src,
                    "--save-dir", tmp_path / "mg", "--params-dtype", "bf16") == 0


def test_a_failed_save_hf_folder_leaves_nothing_and_names_the_file(tmp_path, monkeypatch):
    """--save-hf's folder (`save_hf.write_folder`): a full disk at its third weight file, or a checkpoint directory
    that cannot be written, is named with the file, and neither `hf/` nor its partial folder is left; the
    checkpoint's own files are untouched."""
    import os

    from tests.helpers.hf_tiny import save_tiny

    from mindspeed_llm.checkpoint import convert_hf_to_mg, save_hf
    from mindspeed_llm.checkpoint import megatron_layout as layout

    hf = save_tiny("qwen2", tmp_path / "hf", num_layers=4, seed=5)
    convert_hf_to_mg(hf, str(tmp_path / "mg"), 2, 2, progress=False)
    release = layout.checkpoint_dir(str(tmp_path / "mg"), layout.RELEASE)
    before = sorted(os.listdir(release))
    _full_disk_safetensors(monkeypatch, after=2)
    _, problem = save_hf.write_folder(release, [0, 1], save_hf.SaveHF())
    assert problem.startswith(f"No space left on device writing {release}/hf.partial/model-0000"), problem
    assert sorted(os.listdir(release)) == before
    monkeypatch.undo()

    def read_only(path, *args, **kwargs):  # a read-only checkpoint directory (chmod does not stop root)
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", read_only)
    _, problem = save_hf.write_folder(release, [0, 1], save_hf.SaveHF())
    monkeypatch.undo()
    assert problem == f"permission denied writing {release}/hf.partial", problem
    assert sorted(os.listdir(release)) == before
