"""Hugging Face <-> Megatron-core conversion, Megatron resharding, and the loader the stages use.

    convert_hf_to_mg(hf_dir, mg_root, tp=2, pp=1, params_dtype="bf16", value_head=False)
    convert_hf_to_mg(moe_dir, mg_root, tp=2, ep=2)    # mixture of experts: experts over 2 EP ranks, expert TP 2
    convert_hf_to_mg(moe_dir, mg_root, tp=2, ep=1, moe_tp_extend_ep=True)  # experts over EP x TP ranks, whole
    convert_mg_to_hf(mg_root, hf_dir)                 # any TP/PP/EP; value head detected from the checkpoint
    convert_mg_to_mg(mg_root, new_root, tp=1, pp=2)   # reshard (ep=, etp=, moe_tp_extend_ep= likewise)
    load_megatron_weights(model, mg_root)             # this rank's shard into a built GPTModel, strictly
    convert_mg_to_hf(mg_root, hf_dir, lora=Merger(adapter))   # a LoRA adapter merged in (checkpoint/lora.py)

The conversions stream one pipeline stage at a time (memory: about one stage's weights twice), show a
tqdm bar over layers, and publish atomically (see megatron_layout). Nothing here imports megatron except
`load_megatron_weights`, which reads the ranks from megatron's parallel_state.

Checks before anything is written: config.json sizes against the tensor shapes (vocab_size against the
embedding first), truncated / unreadable weight files named, a training --save root (actor/, critic/)
recognised, and no NaN / inf weight is exported in any direction unless `allow_non_finite`
(--allow-non-finite), which still warns naming the tensors.
"""

from __future__ import annotations

import logging
import os
import sys
import shutil
from typing import Dict, List, Optional

import torch

from mindspeed_llm.checkpoint import hf_export, hf_files
from mindspeed_llm.checkpoint import hf_mapping as hfm
from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint import megatron_names, sharding
from mindspeed_llm.checkpoint.errors import ConversionError
from mindspeed_llm.expert_layout import (
    EP_NOT_MULTIPLE_OF_TP,
    EXPERT_TP_NOT_1_OR_TP,
    EXTEND_WITH_EXPERT_TP,
    ExpertLayoutError,
    resolve_expert_layout,
)

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name) -> Optional[torch.dtype]:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _HF_DTYPES[str(name).lower()]
    except KeyError:
        raise ConversionError(f"--params-dtype {name!r}: use one of fp32, bf16, fp16") from None


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", disable=not enabled, leave=False)


def expert_layout(spec, tp: int, ep: int = 1, etp: Optional[int] = None, moe_tp_extend_ep: bool = False):
    """(effective expert-parallel size, expert tensor-parallel size) of the converter's flags, by the rule the
    training flags resolve them with (`mindspeed_llm.expert_layout`): --moe-tp-extend-ep spreads the experts over
    EP x TP ranks, whole (expert TP 1); otherwise expert TP defaults to TP (experts split like the dense MLP). A
    dense model takes none of them. Errors name the converter's flags."""
    if ep < 1:
        raise ConversionError(f"--target-expert-parallel-size {ep}: must be >= 1")
    if not spec.is_moe:
        if ep != 1:
            raise ConversionError(
                f"--target-expert-parallel-size {ep} needs a mixture-of-experts model, but this {spec.family} model "
                f"is dense; drop the flag")
        if moe_tp_extend_ep:
            raise ConversionError(
                f"--moe-tp-extend-ep needs a mixture-of-experts model, but this {spec.family} model is dense; drop "
                f"the flag")
        if etp not in (None, tp):
            raise ConversionError(
                f"--expert-tensor-parallel-size {etp} needs a mixture-of-experts model, but this {spec.family} model "
                f"is dense; drop the flag")
        return 1, tp
    try:
        return resolve_expert_layout(tp, ep, etp, moe_tp_extend_ep)
    except ExpertLayoutError as exc:
        raise ConversionError({
            EXTEND_WITH_EXPERT_TP: f"--moe-tp-extend-ep keeps every expert whole (expert tensor parallel 1); it cannot "
                                   f"be combined with --expert-tensor-parallel-size {etp} (drop one)",
            EXPERT_TP_NOT_1_OR_TP: f"--expert-tensor-parallel-size {etp} must be 1 or --target-tensor-parallel-size "
                                   f"{tp} (experts are kept either whole or split like the dense layers)",
            EP_NOT_MULTIPLE_OF_TP: f"--expert-tensor-parallel-size 1 with --target-tensor-parallel-size {tp} needs a "
                                   f"--target-expert-parallel-size that is a multiple of {tp} (got {ep}); pass "
                                   f"--moe-tp-extend-ep to split the experts over EP x TP ranks, or drop "
                                   f"--expert-tensor-parallel-size",
        }[exc.rule]) from None


def _check_target_parallel(spec, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None,
                           moe_tp_extend_ep: bool = False) -> None:
    if tp < 1:
        raise ConversionError(f"--target-tensor-parallel-size {tp}: must be >= 1")
    if pp < 1:
        raise ConversionError(f"--target-pipeline-parallel-size {pp}: must be >= 1")
    try:
        spec.check_parallel(tp, pp, ep, etp)
    except ValueError as err:
        message = str(err).replace("--tensor-model-parallel-size", "--target-tensor-parallel-size")
        message = message.replace("--pipeline-model-parallel-size", "--target-pipeline-parallel-size")
        if moe_tp_extend_ep:
            message = message.replace(
                f"--expert-model-parallel-size {ep} (times TP with --moe-tp-extend-ep)",
                f"--target-expert-parallel-size {ep // tp} x --target-tensor-parallel-size {tp} (--moe-tp-extend-ep)")
        message = message.replace("--expert-model-parallel-size", "--target-expert-parallel-size")
        message = message.replace(" (times TP with --moe-tp-extend-ep)", "")
        raise ConversionError(message) from None


# ------------------------------------------------------------------------------------------- input checks

def non_finite_counts(tensor: torch.Tensor):
    """(NaN count, inf count) of a tensor; (0, 0) for integer tensors."""
    if tensor is None or not torch.is_tensor(tensor) or not tensor.is_floating_point():
        return 0, 0
    return int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())


class _FiniteCheck:
    """Refuses (or, with `allow`, records) tensors holding NaN / inf as they are read."""

    def __init__(self, source: str, allow: bool):
        self.source, self.allow = source, bool(allow)
        self.found: List[str] = []

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        nan, inf = non_finite_counts(tensor)
        if nan or inf:
            detail = f"{nan} NaN and {inf} inf of {tensor.numel()} values"
            if not self.allow:
                raise ConversionError(
                    f"tensor {name} in {self.source} holds {detail}: refusing to export non-finite weights (a "
                    f"diverged or corrupt checkpoint); convert an earlier checkpoint, or pass --allow-non-finite "
                    f"to convert it as it is")
            self.found.append(f"{name} ({detail})")
        return tensor

    def check_all(self, state: Dict[str, torch.Tensor], rename=lambda n: n) -> None:
        for name, tensor in state.items():
            self(rename(name), tensor)

    def check_cast(self, name: str, before: torch.Tensor, after: torch.Tensor) -> None:
        """A finite value that a narrower --params-dtype turns into inf (e.g. > 65504 in fp16)."""
        if after.dtype == before.dtype or not after.is_floating_point():
            return
        grown = sum(non_finite_counts(after)) - sum(non_finite_counts(before))
        if grown > 0:
            if not self.allow:
                raise ConversionError(
                    f"tensor {name} from {self.source}: {grown} of its values overflow {after.dtype} and would be "
                    f"written as inf; choose --params-dtype bf16 or fp32 (or pass --allow-non-finite)")
            self.found.append(f"{name} ({grown} values overflow {after.dtype})")

    def report(self) -> None:
        if self.found:
            more = f" and {len(self.found) - 5} more" if len(self.found) > 5 else ""
            logger.warning("--allow-non-finite: exported %d tensors with non-finite values from %s: %s%s",
                           len(self.found), self.source, "; ".join(self.found[:5]), more)


class _CheckedHFWeights:
    """An HFWeights whose `get` passes every tensor through a _FiniteCheck (named as in the HF files)."""

    def __init__(self, weights, check: _FiniteCheck):
        self._weights, self._check = weights, check

    def __getattr__(self, name):
        return getattr(self._weights, name)

    def get(self, name: str) -> torch.Tensor:
        full = name if name in (hf_files.HF_LM_HEAD, hf_files.HF_SCORE) else self._weights.prefix + name
        return self._check(full, self._weights.get(name))


def _check_not_training_root(root: str) -> None:
    """A stage's --save directory holds one Megatron checkpoint per role (actor/, critic/) and a
    top-level tracker for resuming: say so instead of 'iter_... does not exist'."""
    if not os.path.isdir(root):
        return
    if any(n == layout.RELEASE or n.startswith("iter_") for n in os.listdir(root)):
        return
    roles = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, layout.TRACKER_FILE)))
    if not roles:
        return
    roles.sort(key=lambda n: n != "actor")
    ways = [f"--load-dir {os.path.join(root, r)}" + (" with --orm" if r in ("critic", "reward") else "")
            for r in roles]
    raise ConversionError(
        f"--load-dir {root} is a training --save directory, not a checkpoint (it holds "
        f"{', '.join(r + '/' for r in roles)}, one checkpoint per role); pass {ways[0]}"
        + (f" (or {' or '.join(ways[1:])})" if len(ways) > 1 else ""))


def _checkpoint_info(root: str, iteration):
    """layout.checkpoint_info, with a training --save root recognised and an unreadable shard named."""
    _check_not_training_root(root)
    info = layout.checkpoint_info(root, iteration)  # an unreadable shard: layout.CheckpointReadError names it
    if info["lora"]:
        raise ConversionError(_adapters_only(root))
    return info


def _adapters_only(root: str) -> str:
    return (f"{root} holds the LoRA adapters of a LoRA run, not a model: pass the base model it was trained on as "
            f"--load-dir and this folder as --lora-load (merged weights; with --save-lora-to-hf a PEFT adapter)")


def _cast(tensors: Dict[str, torch.Tensor], dtype: torch.dtype, value_head: bool,
          finite: Optional["_FiniteCheck"] = None) -> Dict[str, torch.Tensor]:
    """Everything in `dtype` except the value head, which megatron keeps in fp32."""
    out = {}
    for name, t in tensors.items():
        # the value head, and DeepSeek-V3's expert bias (megatron's router buffer is fp32, as in transformers)
        keep_fp32 = (value_head and name == megatron_names.OUTPUT) or name.endswith(megatron_names.EXPERT_BIAS)
        out[name] = t.to(torch.float32 if keep_fp32 else dtype)
        if finite is not None:
            finite.check_cast(name, t, out[name])
    return out


def _write_checkpoint(save_dir: str, stages, spec, tp: int, pp: int, dtype: torch.dtype, value_head: bool,
                      total_layers: int, desc: str, progress: bool, hf_config=None, tokenizer_src=None,
                      finite: Optional["_FiniteCheck"] = None, ep: int = 1, etp: Optional[int] = None,
                      before_publish=None, hf_source: Optional[str] = None) -> None:
    """`stages(stage) -> full local tensors of that stage`; writes all TP x PP (x EP) shards, then publishes
    (`before_publish()` may still refuse: nothing is left behind then)."""
    etp = tp if etp is None else etp
    staging = layout.prepare_staging(save_dir, layout.RELEASE)
    bar = _progress(total_layers, desc, progress)
    extra = {"hf_config": hf_config} if hf_config is not None else {}
    if hf_source:
        extra["hf_source"] = hf_source  # the Hugging Face folder it came from: a PEFT adapter's base name
    try:
        for stage in range(pp):
            stage_sd = _cast(stages(stage, bar), dtype, value_head, finite)
            if not spec.is_moe:
                for tp_rank, shard in enumerate(sharding.split_stage(stage_sd, tp, value_head, True, spec, pp, stage)):
                    payload = layout.make_payload(shard, spec, tp, pp, tp_rank, stage, dtype, value_head, **extra)
                    layout.save_file(payload, layout.shard_path(staging, tp_rank, stage, pp))
                del stage_sd
                continue
            pairs = [(t, e) for t, p, e in layout.expected_shards(tp, pp, ep, etp) if p == stage]
            shards = sharding.split_stage_experts(stage_sd, spec, pp, stage, tp, ep, etp, pairs, value_head)
            del stage_sd
            for (tp_rank, ep_rank), shard in shards.items():
                payload = layout.make_payload(shard, spec, tp, pp, tp_rank, stage, dtype, value_head, ep=ep, etp=etp,
                                              ep_rank=ep_rank, **extra)
                layout.save_file(payload, layout.shard_path(staging, tp_rank, stage, pp, ep_rank=ep_rank, ep_size=ep))
            del shards
        if before_publish is not None:
            before_publish()
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)  # refused (e.g. non-finite weights): leave nothing behind
        raise
    finally:
        bar.close()
    # Only now touch what a reader sees: no tracker while the release folder is replaced, tracker last.
    layout.remove_latest(save_dir)
    layout.publish(staging, layout.checkpoint_dir(save_dir, layout.RELEASE))
    if tokenizer_src:
        hf_files.copy_tokenizer_files(tokenizer_src, save_dir)
    layout.write_latest(save_dir, layout.RELEASE)


# ------------------------------------------------------------------------------------------- HF -> Megatron

def convert_hf_to_mg(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, params_dtype=None,
                     value_head: bool = False, model_type_hf: Optional[str] = None,
                     tokenizer_dir: Optional[str] = None, progress: bool = True, allow_non_finite: bool = False,
                     ep: int = 1, etp: Optional[int] = None, moe_tp_extend_ep: bool = False, lora=None):
    """Convert a Hugging Face folder into a Megatron-LM release checkpoint (TP x PP shards) under `save_dir`;
    `lora` (a `checkpoint.lora.Merger`) merges an adapter into the weights on the way.

    A mixture of experts is also split over `ep` expert-parallel ranks with expert tensor parallelism `etp`
    (default TP; 1 keeps experts whole); `moe_tp_extend_ep` (MindSpeed's --moe-tp-extend-ep) stores the
    experts over ep x tp ranks, whole. Experts are read in the Hub (per-expert) or transformers' fused format.

    `params_dtype` (fp32/bf16/fp16) defaults to the dtype of the HF weights. With `value_head` the HF
    folder must be a *ForSequenceClassification model (score.weight [1, hidden]); the head stays fp32.
    Tokenizer files of `tokenizer_dir` (default: `load_dir`) are copied into `save_dir`. Returns the ArchitectureSpec.
    Tensors holding NaN / inf raise ConversionError unless `allow_non_finite`.
    """
    from mindspeed_llm.models.architecture import ArchitectureSpec

    load_dir, save_dir = os.fspath(load_dir), os.fspath(save_dir)
    config = hf_files.read_hf_config(load_dir)
    hfm.resolve_family(model_type_hf, config, where=os.path.join(load_dir, "config.json"))
    spec = ArchitectureSpec.from_hf_config(config)
    ep, etp = expert_layout(spec, tp, ep, etp, moe_tp_extend_ep)
    _check_target_parallel(spec, tp, pp, ep, etp, moe_tp_extend_ep)
    weights = hf_files.HFWeights(load_dir)
    weights.expose_fused_experts(spec)
    hfm.check_hf_names(weights, spec, value_head, mtp_layers=hfm.mtp_layer_count(config))
    hfm.check_hf_shapes(weights, spec, value_head, config_file=os.path.join(load_dir, "config.json"))
    mtp = hfm.mtp_names(weights.names(), spec)
    if mtp:
        print(f"note: {len(mtp)} tensors of {hfm.mtp_layer_count(config)} multi-token-prediction layer(s) "
              f"(layers.{spec.num_layers}.* on) are not converted: RL training and generation use the "
              f"{spec.num_layers} decoder layers only",
              file=sys.stderr)
    finite = _FiniteCheck(load_dir, allow_non_finite)
    checked = _CheckedHFWeights(weights, finite)
    dtype = parse_dtype(params_dtype) or weights.dtype()
    if _same_path(load_dir, save_dir):
        raise ConversionError(f"--save-dir {save_dir} is the --load-dir; write the Megatron checkpoint elsewhere")

    def stage_tensors(stage, bar):
        layers = sharding.stage_layers(spec.num_layers, pp, stage)
        full = hfm.hf_nonlayer_to_mg(checked, spec, value_head, first=stage == 0 or (
            spec.tie_word_embeddings and not value_head and stage == pp - 1), last=stage == pp - 1)
        for index in layers:
            for rel, tensor in hfm.hf_layer_to_mg(checked.get, spec, index).items():
                full[megatron_names.layer_key(index, rel)] = tensor
            bar.update(1)
        if lora is not None:
            lora(full)
        return sharding.stage_state_dict(full, spec, pp, stage, value_head)

    _write_checkpoint(save_dir, stage_tensors, spec, tp, pp, dtype, value_head, spec.num_layers,
                      "hf->mg layers", progress, hf_config=config, tokenizer_src=tokenizer_dir or load_dir,
                      finite=finite, ep=ep, etp=etp, before_publish=lora.finish if lora is not None else None,
                      hf_source=os.path.abspath(load_dir))
    finite.report()
    return spec


# ------------------------------------------------------------------------------------------- Megatron -> HF

def _load_stage(info, stage: int) -> Dict[str, torch.Tensor]:
    """One stage's unsplit tensors (local layer names; a mixture of experts' experts under global indices)."""
    tp, pp = info["tp"], info["pp"]
    if not info["spec"].is_moe:
        shards = []
        for r in range(tp):
            shards.append(_read_shard(layout.shard_path(info["dir"], r, stage, pp)))
        return sharding.merge_stage(shards, info["value_head"])
    ep, etp = info.get("ep", 1), info.get("etp", tp)
    shards = {}
    for t, p, e in layout.expected_shards(tp, pp, ep, etp):
        if p == stage:
            shards[(t, e)] = _read_shard(layout.shard_path(info["dir"], t, stage, pp, ep_rank=e, ep_size=ep))
    return sharding.merge_stage_experts(shards, info["spec"], tp, ep, etp, info["value_head"])


def _read_shard(path: str) -> Dict[str, torch.Tensor]:
    return layout.load_file(path)["model"]  # an unreadable shard: layout.CheckpointReadError names it


def _check_value_head_flag(info, value_head: Optional[bool], root: str) -> bool:
    stored = info["value_head"]
    if value_head is not None and bool(value_head) != stored:
        if value_head:
            raise ConversionError(
                f"--orm: the Megatron checkpoint {root} has no value head (it is a causal LM); drop --orm"
            )
        raise ConversionError(f"the Megatron checkpoint {root} holds a value head (reward / critic): pass --orm")
    return stored


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def convert_mg_to_hf(load_dir: str, save_dir: str, params_dtype=None, value_head: Optional[bool] = None,
                     tokenizer_dir: Optional[str] = None, iteration=None, progress: bool = True,
                     allow_non_finite: bool = False, lora=None):
    """Merge a Megatron checkpoint (any TP x PP) into `save_dir`: model.safetensors + a clean config.json
    (`lora`, a `checkpoint.lora.Merger`: with an adapter merged into the weights).

    A value-head checkpoint becomes a *ForSequenceClassification model (score.weight); `value_head`
    (the --orm flag), when given, must agree with the checkpoint. The dtype defaults to the checkpoint's.
    Tokenizer files come from `tokenizer_dir`, else from those convert_hf_to_mg copied into `load_dir`.
    """
    load_dir, save_dir = os.fspath(load_dir), os.fspath(save_dir)
    info = _checkpoint_info(load_dir, iteration)
    spec, tp, pp = info["spec"], info["tp"], info["pp"]
    finite = _FiniteCheck(info["dir"], allow_non_finite)
    value_head = _check_value_head_flag(info, value_head, load_dir)
    dtype = parse_dtype(params_dtype) or info["params_dtype"]
    if _same_path(load_dir, save_dir):
        raise ConversionError(f"--save-dir {save_dir} is the --load-dir; write the Hugging Face model elsewhere")

    hf_state: Dict[str, torch.Tensor] = {}
    bar = _progress(spec.num_layers, "mg->hf layers", progress)
    try:
        for stage in range(pp):  # the one Megatron -> HF path, layer by layer (hf_export; --save-hf streams it too)
            for key, tensors in hf_export.stage_hf_groups(info, stage, lora, finite):
                hf_state.update(tensors)
                bar.update(1 if isinstance(key, int) else 0)
    finally:
        bar.close()
    ordered = {}
    for name, t in _hf_order(hf_state, spec, value_head):
        ordered[name] = hf_export.cast(name, t, dtype)
        finite.check_cast(name, t, ordered[name])
    hf_state = ordered
    if lora is not None:
        lora.finish()

    os.makedirs(save_dir, exist_ok=True)
    stale = os.path.join(save_dir, "config.json")
    if os.path.exists(stale):
        os.remove(stale)  # the config goes back last: a killed export never looks loadable
    hf_files.remove_hf_weights(save_dir)
    hf_files.save_hf_weights(hf_state, save_dir)
    for src in (tokenizer_dir, load_dir):
        if src and hf_files.copy_tokenizer_files(src, save_dir):
            break
    config = spec.to_hf_config(torch_dtype=_DTYPE_NAMES[dtype], value_head=value_head)
    source = info.get("hf_config") or {}
    if source.get("pad_token_id") is not None:
        config["pad_token_id"] = source["pad_token_id"]  # a reward model's pooling position depends on it
    hf_files.write_json_atomic(os.path.join(save_dir, "config.json"), config)
    finite.report()
    return spec


def _hf_order(state: Dict[str, torch.Tensor], spec, value_head: bool):
    """Embeddings, layers in order, final norm, head (stable, readable safetensors)."""
    first = [k for k in state if k.endswith(hf_files.HF_EMBED)]
    heads = [k for k in (hf_files.HF_LM_HEAD, hf_files.HF_SCORE) if k in state]
    norms = [k for k in state if k.endswith("." + hf_files.HF_FINAL_NORM) and ".layers." not in k]
    rest = [k for k in state if k not in set(first + heads + norms)]
    for name in first + rest + norms + heads:
        yield name, state[name]


# ------------------------------------------------------------------------------------------- Megatron -> Megatron

def convert_mg_to_mg(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, params_dtype=None, iteration=None,
                     value_head: Optional[bool] = None, progress: bool = True, allow_non_finite: bool = False,
                     ep: int = 1, etp: Optional[int] = None, moe_tp_extend_ep: bool = False, lora=None,
                     tokenizer_dir: Optional[str] = None):
    """Reshard a Megatron checkpoint to a new TP x PP (x EP, expert TP; see convert_hf_to_mg) and optionally
    dtype, as a release checkpoint (`lora`, a `checkpoint.lora.Merger`: with an adapter merged in). Tokenizer files
    come from `tokenizer_dir`, else from those in `load_dir`."""
    load_dir, save_dir = os.fspath(load_dir), os.fspath(save_dir)
    info = _checkpoint_info(load_dir, iteration)
    spec = info["spec"]
    value_head = _check_value_head_flag(info, value_head, load_dir)
    ep, etp = expert_layout(spec, tp, ep, etp, moe_tp_extend_ep)
    _check_target_parallel(spec, tp, pp, ep, etp, moe_tp_extend_ep)
    dtype = parse_dtype(params_dtype) or info["params_dtype"]
    if _same_path(load_dir, save_dir):
        raise ConversionError(f"--save-dir {save_dir} is the --load-dir; write the resharded checkpoint elsewhere")
    full: Dict[str, torch.Tensor] = {}
    for stage in range(info["pp"]):
        full.update(sharding.stage_to_full(_load_stage(info, stage), spec, info["pp"], stage, value_head))
    if lora is not None:
        lora(full)
        lora.finish()
    finite = _FiniteCheck(info["dir"], allow_non_finite)
    finite.check_all(full)

    def stage_tensors(stage, bar):
        bar.update(len(sharding.stage_layers(spec.num_layers, pp, stage)))
        return sharding.stage_state_dict(full, spec, pp, stage, value_head)

    _write_checkpoint(save_dir, stage_tensors, spec, tp, pp, dtype, value_head, spec.num_layers, "mg->mg layers",
                      progress, hf_config=info.get("hf_config"), tokenizer_src=tokenizer_dir or load_dir, finite=finite,
                      ep=ep, etp=etp,
                      hf_source=info.get("hf_source"))
    finite.report()
    return spec


# ------------------------------------------------------------------------------------------- loader for the stages

_SPEC_FLAGS = {
    "family": "the model family (--model-type-hf / config.json model_type)",
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels", "vocab_size": "--vocab-size / the tokenizer's vocabulary",
    "norm_epsilon": "--norm-epsilon", "rotary_base": "--rotary-base",
    "rope_scaling_factor": "--rope-scaling-factor", "tie_word_embeddings": "--untie-embeddings-and-output-weights",
    "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
    "max_position_embeddings": "--max-position-embeddings",
}
# Fields that do not change the weights or the forward pass.
_SPEC_IGNORED = ("bos_token_id", "eos_token_id", "max_position_embeddings")


def spec_differences(stored, built) -> Dict[str, tuple]:
    a, b = stored.to_dict(), built.to_dict()
    return {k: (a.get(k), b.get(k)) for k in a if k not in _SPEC_IGNORED and a.get(k) != b.get(k)}


def _unwrap(model):
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def load_megatron_weights(model, root: str, iteration=None, strict: bool = True):
    """Load this rank's shard of the checkpoint under `root` into `model` (a GPTModel from build_model,
    possibly wrapped in DDP / Float16Module), after checking that it is the model the checkpoint holds.

    Raises ValueError naming both values when the stored ArchitectureSpec (vocab size, architecture), the
    value head, or the TP/PP layout differ from the model's; KeyError-like ValueError listing missing /
    unexpected / mis-shaped tensors when the key sets differ. Returns the loaded payload minus 'model'.
    """
    from megatron.core import parallel_state

    root = os.fspath(root)
    inner = _unwrap(model)
    info = layout.checkpoint_info(root, iteration)
    if info["lora"]:
        raise ValueError(f"{root} holds the LoRA adapters of a LoRA run, not a model: pass the base model they were "
                         "trained on, and the adapters with --lora-load (or resume that run with --load)")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep, etp, ep_rank = layout.model_expert_layout(inner)
    built = getattr(inner, "model_spec", None)
    if built is not None:
        diffs = spec_differences(info["spec"], built)
        if diffs:
            details = "; ".join(
                f"{k}: checkpoint {v[0]!r} vs model {v[1]!r} ({_SPEC_FLAGS.get(k, k)})" for k, v in diffs.items())
            raise ValueError(
                f"the checkpoint {info['dir']} does not match the model built for it: {details}. Build the model "
                f"from this checkpoint's spec (load_spec) or load the checkpoint converted from the right model"
            )
    want_value_head = bool(getattr(inner, "is_value_model", False))
    if want_value_head != info["value_head"]:
        kind = lambda v: "a value-head (reward / critic) model" if v else "a causal LM"  # noqa: E731
        raise ValueError(
            f"the checkpoint {info['dir']} holds {kind(info['value_head'])} but the model is {kind(want_value_head)}; "
            f"convert with{'out' if not want_value_head else ''} --orm or load it into the other role"
        )
    if (info["tp"], info["pp"], info["ep"], info["etp"]) != (tp, pp, ep, etp):
        extend = etp == 1 and tp > 1  # --moe-tp-extend-ep: the EP ranks run over the TP ranks too
        flag_ep = ep // tp if extend else ep
        experts = lambda e, t: f" x EP={e} (expert TP {t})" if e > 1 else ""  # noqa: E731
        run_flags = f" --expert-model-parallel-size {flag_ep}" + (" --moe-tp-extend-ep" if extend else "")
        target = f" --target-expert-parallel-size {flag_ep}" + (" --moe-tp-extend-ep" if extend else "")
        raise ValueError(
            f"the checkpoint {info['dir']} is split TP={info['tp']} x PP={info['pp']}{experts(info['ep'], info['etp'])}"
            f" but this run uses --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
            f"{run_flags if ep > 1 else ''}; reshard it with convert_ckpt.py --load-model-type mg "
            f"--save-model-type mg --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
            f"{target if ep > 1 else ''}"
        )
    payload = layout.load_file(layout.shard_path(info["dir"], tp_rank, pp_rank, pp, ep_rank, ep), mmap=True)
    stored = payload["model"]
    current = inner.state_dict()
    state = {}
    problems = []
    for name, value in current.items():
        if sharding.is_extra_state(name):
            state[name] = stored.get(name, value)
            continue
        if name not in stored:
            problems.append(f"missing {name}")
            continue
        tensor = stored[name]
        if tuple(tensor.shape) != tuple(value.shape):
            problems.append(f"{name}: checkpoint shape {tuple(tensor.shape)} vs model {tuple(value.shape)}")
        state[name] = tensor
    unexpected = [n for n in stored if n not in current and not sharding.is_extra_state(n)]
    problems += [f"unexpected {n}" for n in unexpected]
    if problems and strict:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ValueError(
            f"the shard tp_rank={tp_rank} pp_rank={pp_rank} of {info['dir']} does not fit the model: "
            f"{'; '.join(problems[:8])}{more}"
        )
    inner.load_state_dict(state, strict=strict)
    return {k: v for k, v in payload.items() if k != "model"}
