"""Checkpoints: Hugging Face <-> Megatron-core conversion, TP/PP sharding and Megatron-LM's on-disk layout.

Public API (conversion and loading; importing this package does not import megatron):

    convert_hf_to_mg, convert_mg_to_hf, convert_mg_to_mg   whole-checkpoint conversions (convert_ckpt.py)
    load_megatron_weights(model, root, iteration=None)     this rank's shard into a built GPTModel, strictly
    load_spec(root, iteration=None)                        the ArchitectureSpec a checkpoint holds
    checkpoint_info(root, iteration=None)                  spec, TP/PP/EP, dtype, value head of a checkpoint
    HFWeights(dir)                                         lazy reader of HF safetensors / .bin (sharded or not)
    layout helpers: checkpoint_dir, shard_path, staging_dir, prepare_staging, publish, write_latest,
                    read_latest, load_shard, save_file, make_payload, find_layout, read_layout, expected_shards
"""

from mindspeed_llm.checkpoint.convert import (
    convert_hf_to_mg,
    convert_mg_to_hf,
    convert_mg_to_mg,
    load_megatron_weights,
    spec_differences,
)
from mindspeed_llm.checkpoint.errors import ConversionError
from mindspeed_llm.checkpoint.hf_files import HFWeights
from mindspeed_llm.checkpoint.hf_mapping import resolve_family
from mindspeed_llm.checkpoint.megatron_layout import (
    CHECKPOINT_VERSION,
    RELEASE,
    TRACKER_FILE,
    CheckpointNotFoundError,
    checkpoint_dir,
    checkpoint_info,
    expected_shards,
    find_layout,
    load_shard,
    load_spec,
    make_args,
    make_payload,
    prepare_staging,
    publish,
    read_latest,
    read_layout,
    remove_latest,
    save_file,
    shard_path,
    staging_dir,
    write_latest,
)
from mindspeed_llm.checkpoint.sharding import merge_model, split_model

__all__ = [
    "convert_hf_to_mg", "convert_mg_to_hf", "convert_mg_to_mg", "load_megatron_weights", "load_spec",
    "spec_differences", "ConversionError", "HFWeights", "resolve_family", "CHECKPOINT_VERSION", "RELEASE",
    "TRACKER_FILE", "CheckpointNotFoundError", "checkpoint_dir", "checkpoint_info", "expected_shards", "find_layout", "read_layout", "load_shard",
    "make_args", "make_payload", "prepare_staging", "publish", "read_latest", "remove_latest", "save_file",
    "shard_path", "staging_dir", "write_latest", "merge_model", "split_model",
]
