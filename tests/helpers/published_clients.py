"""MindSpeed users' published run files at a tiny shape: the rewriting step of the real-client lane
(tests/dist/test_published_clients.py).

A published file is read verbatim from tests/fixtures/ (its origin in that folder's README) and only values of three
kinds are substituted: shapes (the model's, which a tiny checkpoint forces), paths (checkpoints, tokenizer, data,
save) and sizes (parallel layout, batch sizes, lengths, iterations, device counts). Each substitution names a key
the published file has and a kind in `KINDS`; a key of no kind, or one the file lacks, is refused, so a test
cannot change what the user's file means and call it the published file.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Dict, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

# what a tiny model, this machine and a short test may change in a published file
KINDS = {
    "shape": {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "rotary_base", "max_position_embeddings", "padded_vocab_size", "make_vocab_size_divisible_by",
              "norm_epsilon", "untie_embeddings_and_output_weights", "seq_length", "rope_scaling_factor",
              "original_max_position_embeddings"},
    "path": {"tokenizer_name_or_path", "data_path", "load", "save", "ref_model_load_path", "tool_config_path"},
    "size": {"tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layer_list", "global_batch_size",
             "micro_batch_size", "mini_batch_size", "train_iters", "save_interval", "n_samples_per_prompt",
             "max_prompt_length", "max_tokens", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "num_npus",
             "infer_tensor_parallel_size", "infer_pipeline_parallel_size", "ref_forward_micro_batch_size",
             "actor_forward_micro_batch_size", "reward_dispatch_size", "adv_dispatch_size",
             "actor_update_dispatch_size", "max_new_tokens", "max_length", "max_total_response_length",
             "max_tool_response_length", "rollout_max_tokens", "overlong_buffer", "filter_groups_train_batch_size"},
}
SUBSTITUTABLE = set().union(*KINDS.values())
# a launcher's shell variables of those kinds (and the rendezvous port, which this machine picks)
SCRIPT_VARIABLES = {"NPUS_PER_NODE", "MASTER_PORT", "TP", "PP", "DATA_PATH", "SFT_LOAD_DIR", "REWARD_LOAD_DIR",
                    "TOKENIZER_MODEL", "CKPT_SAVE_DIR"}

# The tiny Qwen2 of tests/helpers/word_task.py (hf_tiny's qwen2 at the word task's 256-word vocabulary) in
# MindSpeed-RL's model-file keys: what the model file's shape values become.
TINY_QWEN2 = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": 2, "rotary_base": 1000000, "max_position_embeddings": 512, "padded_vocab_size": 256,
              "make_vocab_size_divisible_by": 1, "norm_epsilon": 1e-6}


def _substitute(section: dict, key: str, value, where: str) -> None:
    if key not in SUBSTITUTABLE:
        raise ValueError(f"{where}.{key} is not a shape, path or size value: the lane does not change it")
    if key not in section:
        raise ValueError(f"{where}.{key}: the published file has no such key to substitute")
    section[key] = value


def rewrite_run_config(name: str, out_dir: Path, changes: Dict[Tuple[str, ...], object],
                       model_shape: Dict[str, object] = TINY_QWEN2) -> Path:
    """MindSpeed-RL's tests/fixtures/mindspeed_rl/`name` with `changes` ({(section, ..., key): value}) substituted,
    written to `out_dir`/`name`, and its model file (`defaults: model:`) beside it under model/ with the shape values
    of `model_shape`. Returns the written config's path."""
    source = FIXTURES / "mindspeed_rl"
    data = yaml.safe_load((source / name).read_text())
    out = copy.deepcopy(data)
    for path, value in changes.items():
        section = out
        for part in path[:-1]:
            section = section[part]
        _substitute(section, path[-1], value, ".".join(path[:-1]))
    (model_name,), = [entry["model"] for entry in out["defaults"] if "model" in entry]
    model = yaml.safe_load((source / "model" / f"{model_name}.yaml").read_text())
    for key, value in model_shape.items():
        _substitute(model[model_name], key, value, f"model/{model_name}")
    (out_dir / "model").mkdir(parents=True, exist_ok=True)
    (out_dir / "model" / f"{model_name}.yaml").write_text(yaml.safe_dump(model, sort_keys=False))
    target = out_dir / name
    target.write_text(yaml.safe_dump(out, sort_keys=False))
    return target


def rewrite_script(name: str, changes: Dict[str, str]) -> str:
    """MindSpeed-LLM's tests/fixtures/mindspeed_llm/`name` with `changes` applied: a shell variable `VAR=...`
    (paths, sizes) or a flag `--flag value` (shapes, sizes) gets the new value, each of which must be in the script;
    the Ascend toolkit's `source .../set_env.sh` line goes (there is no toolkit here). Returns the script's text."""
    text = (FIXTURES / "mindspeed_llm" / name).read_text()
    text = re.sub(r"^source /usr/local/Ascend/.*$", "# (the Ascend toolkit's set_env.sh: not on this machine)", text,
                  flags=re.M)
    for key, value in changes.items():
        if key.startswith("--"):
            if key[2:].replace("-", "_") not in SUBSTITUTABLE:
                raise ValueError(f"{key} is not a shape, path or size flag: the lane does not change it")
            pattern = rf"({re.escape(key)}\s+)\S+"
        else:
            if key not in SCRIPT_VARIABLES:
                raise ValueError(f"{key} is not a path, size or port variable: the lane does not change it")
            pattern = rf"^({re.escape(key)}=).*$"
        text, count = re.subn(pattern, lambda m: m.group(1) + str(value), text, flags=re.M)
        if not count:
            raise ValueError(f"{key}: the published script has no such variable or flag to substitute")
    return text
