"""convert_ckpt.py's command line in this process (`convert_cli`) and what its round-trip tests compare: every tensor
of a Hugging Face folder (`hf_tensors`) and two such sets, bit for bit (`assert_identical`)."""

import json
import os

import torch
from safetensors.torch import load_file

import convert_ckpt


def convert_cli(*argv) -> int:
    return convert_ckpt.main([str(a) for a in argv] + ["--no-progress"])


def hf_tensors(path):
    out = {}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out


def assert_identical(a, b):
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name
