"""``preprocess_data.py``: raw instruction data -> Megatron indexed datasets for the RL stages.

Example (DeepScaleR for GRPO)::

    python preprocess_data.py --input deepscaler.json \\
        --tokenizer-type PretrainedFromHF --tokenizer-name-or-path ./Qwen2.5-7B \\
        --output-prefix ./dataset/deepscaler --handler-name R1AlpacaStyleInstructionHandler \\
        --prompt-type qwen_r1 --map-keys '{"prompt": "problem", "labels": "answer"}' \\
        --workers 4 --log-interval 1000

or ``bash examples/data/preprocess_data.sh deepscaler`` with ``configs/datasets/deepscaler.yaml``.
``--config FILE.yaml`` reads the same flags from YAML (keys with ``_`` or ``-``); flags given
on the command line win. See :mod:`mindspeed_llm.data.writer` for the output files.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from mindspeed_llm.data.errors import DataError, UnknownNameError
from mindspeed_llm.data.handlers import (OVERLONG_MODES, PROMPT_TOO_LONG, get_handler_class, handler_names,
                                         parse_map_keys)
from mindspeed_llm.data.readers import iter_rows, list_input_files
from mindspeed_llm.data.templates import get_template
from mindspeed_llm.data.tokenizer import TOKENIZER_TYPES, load_tokenizer, tokenizer_info
from mindspeed_llm.data.writer import DatasetWriter, check_prefix, prepare_output

logger = logging.getLogger("mindspeed_llm.data.preprocess")

CHUNK_ROWS = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess_data.py", allow_abbrev=False,
        description="Tokenize instruction data into Megatron indexed datasets for trl_ppo / grpo / SFT.")
    p.add_argument("--config", default=None,
                   help="YAML file with any of these flags as keys (configs/datasets/*.yaml); "
                        "command-line flags override it")
    g = p.add_argument_group("input")
    g.add_argument("--input", default=None, help="a .json (array or JSON Lines), .jsonl or .parquet file, or a folder of them")
    g.add_argument("--handler-name", default="AlpacaStyleInstructionHandler",
                   help=f"one of: {', '.join(handler_names())}")
    g.add_argument("--map-keys", default=None,
                   help='JSON {role: column}, roles prompt/query/response/system/labels; nested columns '
                        'as "a.b"; roles not given are empty')
    g.add_argument("--dataset-additional-keys", nargs="*", default=[],
                   help="columns kept per sample (as JSON) and returned by PromptDataset, e.g. labels")
    g.add_argument("--json-keys", nargs="*", default=["text"],
                   help="accepted for MindSpeed compatibility; instruction handlers do not use it")
    g = p.add_argument_group("tokenizer and template")
    g.add_argument("--tokenizer-type", default="PretrainedFromHF", help=f"one of: {', '.join(TOKENIZER_TYPES)}")
    g.add_argument("--tokenizer-name-or-path", default=None, help="local Hugging Face tokenizer folder")
    g.add_argument("--tokenizer-not-use-fast", action="store_true", help="load the slow (Python) tokenizer")
    g.add_argument("--prompt-type", default="empty", help="chat template name in configs/model/templates.json")
    g.add_argument("--prompt-type-path", default=None, help="another templates.json")
    g.add_argument("--tool-config", default=None,
                   help="refused: the tools are offered at rollout time, rendered from the stage's own --tool-config "
                        "(docs/multi_turn.md); the prompts are preprocessed without them")
    g.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's EOS token to SFT sequences (ignored for prompt-only handlers)")
    g = p.add_argument_group("filtering")
    g.add_argument("--seq-length", type=int, default=None,
                   help="drop samples whose stored input_ids are longer than this (counted)")
    g.add_argument("--max-prompt-length", type=int, default=None,
                   help="the longest templated prompt, in tokens; longer ones are handled by --overlong-prompts")
    g.add_argument("--overlong-prompts", choices=OVERLONG_MODES, default="drop",
                   help="a prompt longer than --max-prompt-length is dropped (default), truncate: cut to its "
                        "last --max-prompt-length tokens (the end holds the question and the assistant turn), "
                        "error: stop naming the row; dropped / truncated rows are counted in the log and _meta.json")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", default=None,
                   help="folder plus file-name stem of the output files, e.g. dataset/train")
    g.add_argument("--overwrite-cache", action="store_true", help="replace an existing dataset at --output-prefix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes for templating and tokenizing")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every N rows (0: never)")
    return p


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    from mindspeed_llm.files import YamlFileError, read_yaml

    try:  # strictly: not UTF-8 / not YAML / a key twice / a key without a value are named with the line
        cfg = read_yaml(path, f"--config {path}") or {}
    except FileNotFoundError:
        raise DataError(f"--config {path} does not exist") from None
    except YamlFileError as e:
        raise DataError(str(e)) from None
    if not isinstance(cfg, dict):
        raise DataError(f"--config {path} must be a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out = {}
    for key, value in cfg.items():
        dest = str(key).replace("-", "_")
        if dest not in dests:
            raise UnknownNameError(
                f"--config {path}: unknown key {key!r}; valid keys: {', '.join(sorted(dests))}")
        if dest == "map_keys" and isinstance(value, dict):
            value = json.dumps(value)
        if dest in ("dataset_additional_keys", "json_keys") and isinstance(value, str):
            value = [value]
        out[dest] = value
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**_config_defaults(parser, first.config))
    args = parser.parse_args(argv)
    for name in ("input", "tokenizer_name_or_path", "output_prefix"):
        if not getattr(args, name):
            raise DataError(f"--{name.replace('_', '-')} is required (on the command line or in --config)")
    if args.workers < 1:
        raise DataError(f"--workers must be at least 1, got {args.workers}")
    for name in ("seq_length", "max_prompt_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise DataError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.overlong_prompts not in OVERLONG_MODES:  # a --config value bypasses argparse's choices
        raise DataError(f"--overlong-prompts {args.overlong_prompts!r}: use one of {', '.join(OVERLONG_MODES)}")
    if args.overlong_prompts != "drop" and args.max_prompt_length is None:
        raise DataError(f"--overlong-prompts {args.overlong_prompts} needs --max-prompt-length N (the longest "
                        f"prompt to keep, in tokens)")
    check_prefix(args.output_prefix)
    return args


@dataclass
class PreprocessResult:
    output_prefix: str
    files: List[str]
    num_rows: int
    num_samples: int
    dropped: Dict[str, int]
    seconds: float
    meta: dict = field(repr=False, default_factory=dict)
    truncated: Dict[str, int] = field(default_factory=dict)

    @property
    def rows_per_second(self) -> float:
        return self.num_rows / self.seconds if self.seconds > 0 else float("inf")


# ---- worker side -------------------------------------------------------------------------------
_HANDLER = None  # set in the parent before forking, or built by _init_worker under spawn


def _make_handler(spec: dict):
    tokenizer = load_tokenizer(spec["tokenizer_type"], spec["tokenizer_name_or_path"], spec["use_fast"])
    template = get_template(spec["prompt_type"], spec["prompt_type_path"])
    cls = get_handler_class(spec["handler_name"])
    return cls(tokenizer, template, map_keys=spec["map_keys"], additional_keys=spec["additional_keys"],
               max_prompt_length=spec["max_prompt_length"], seq_length=spec["seq_length"],
               append_eod=spec["append_eod"], overlong_prompts=spec["overlong_prompts"])


def _init_worker(spec: dict) -> None:
    global _HANDLER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if _HANDLER is None:
        _HANDLER = _make_handler(spec)


def _process_chunk(chunk):
    return _HANDLER.process_batch(chunk)


def _chunks(rows, size):
    it = iter(rows)
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


def _ordered_results(pool, chunks, max_in_flight):
    """Results of ``_process_chunk`` over ``chunks`` in input order, at most ``max_in_flight``
    chunks queued. Input is read here in the calling thread, so reader errors surface directly."""
    pending = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_process_chunk, (chunk,)))
        while len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def run(args: argparse.Namespace) -> PreprocessResult:
    """Preprocess according to parsed ``args``; raises :class:`DataError` on user errors."""
    global _HANDLER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "tool_config", None):
        raise DataError(f"--tool-config {args.tool_config}: preprocessing no longer puts the tools into the prompts; "
                        "the run renders them from its own --tool-config at rollout time (a new tool config needs no "
                        "new preprocessing): drop the flag here and give it to posttrain_gpt.py")
    prefix = args.output_prefix
    # fail fast, before any expensive work: the prefix's form, a writable folder, leftovers of a
    # killed run (cleaned up; an interrupted --overwrite-cache gets its previous dataset back), and
    # an existing dataset without --overwrite-cache
    prepare_output(prefix, args.overwrite_cache)
    inputs = list_input_files(args.input)
    map_keys = parse_map_keys(args.map_keys)
    spec = dict(tokenizer_type=args.tokenizer_type, tokenizer_name_or_path=args.tokenizer_name_or_path,
                use_fast=not args.tokenizer_not_use_fast, prompt_type=args.prompt_type,
                prompt_type_path=args.prompt_type_path, handler_name=args.handler_name, map_keys=map_keys,
                additional_keys=list(args.dataset_additional_keys or []),
                max_prompt_length=args.max_prompt_length, seq_length=args.seq_length,
                append_eod=args.append_eod, overlong_prompts=args.overlong_prompts)
    get_handler_class(args.handler_name)  # name errors before loading the tokenizer
    template = get_template(args.prompt_type, args.prompt_type_path)
    handler = _make_handler(spec)
    for note in handler.notes:
        logger.warning(note)
    if args.append_eod and "labels" not in handler.packed_keys:
        logger.info("--append-eod is ignored by %s (prompts end with the generation prompt)", args.handler_name)

    counts: Counter = Counter()
    truncated: Counter = Counter()
    longest = 0
    n_rows = 0
    last_log = 0
    rows = iter_rows(args.input)
    pool = None
    with DatasetWriter(prefix, handler.packed_keys, handler.extra_keys, overwrite=args.overwrite_cache) as writer:
        start = time.perf_counter()
        try:
            if args.workers > 1:
                methods = mp.get_all_start_methods()
                ctx = mp.get_context("fork" if "fork" in methods else "spawn")
                _HANDLER = handler if ctx.get_start_method() == "fork" else None
                pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(spec,))
                batches = _ordered_results(pool, _chunks(rows, CHUNK_ROWS), args.workers * 4)
            else:
                batches = (handler.process_batch(chunk) for chunk in _chunks(rows, CHUNK_ROWS))
            for batch in batches:
                for res in batch:
                    n_rows += 1
                    if res[0] == "ok":
                        writer.add(res[1], res[2])
                        counts["kept"] += 1
                        longest = max(longest, len(res[1]["input_ids"]))
                        if len(res) > 3:
                            truncated[res[3]] += 1
                    else:
                        counts[res[1]] += 1
                if args.log_interval and n_rows - last_log >= args.log_interval:
                    last_log = n_rows
                    el = time.perf_counter() - start
                    logger.info("processed %d rows (%.1f rows/s), kept %d, dropped %d",
                                n_rows, n_rows / max(el, 1e-9), counts["kept"], n_rows - counts["kept"])
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            _HANDLER = None
        dropped = {k: v for k, v in sorted(counts.items()) if k != "kept"}
        if counts["kept"] == 0:
            raise DataError(
                f"no sample was kept from {n_rows} input rows of {args.input} "
                f"(dropped: {dropped or 'none'}); nothing was written")
        seconds = time.perf_counter() - start
        meta = dict(
            handler=args.handler_name,
            prompt_type=args.prompt_type,
            template=template.to_dict(),
            tokenizer=tokenizer_info(handler.tokenizer, args.tokenizer_name_or_path),
            map_keys=handler.map_keys,
            dataset_additional_keys=list(handler.additional_keys),
            inputs=[str(p) for p in inputs],
            num_input_rows=n_rows,
            dropped=dropped,
            truncated=dict(sorted(truncated.items())),
            overlong_prompts=args.overlong_prompts,
            max_input_ids_length=longest,
            max_prompt_length=args.max_prompt_length,
            seq_length=args.seq_length,
            append_eod=bool(args.append_eod and "labels" in handler.packed_keys),
        )
        files = writer.commit(meta)
        meta = writer.meta
    if dropped.get(PROMPT_TOO_LONG):
        sft = "labels" in handler.packed_keys  # prompt-only handlers also hold prompts to --seq-length
        limit = args.max_prompt_length if sft else min(x for x in (args.max_prompt_length, args.seq_length) if x)
        logger.warning("dropped %d prompts longer than %d tokens (--overlong-prompts drop; counted in %s_meta.json)",
                       dropped[PROMPT_TOO_LONG], limit, prefix)
    if truncated.get(PROMPT_TOO_LONG):
        logger.warning("truncated %d prompts longer than --max-prompt-length %d to their last %d tokens "
                       "(--overlong-prompts truncate; counted in %s_meta.json)", truncated[PROMPT_TOO_LONG],
                       args.max_prompt_length, args.max_prompt_length, prefix)
    logger.info("kept %d of %d rows (dropped: %s; truncated: %s) in %.1fs (%.1f rows/s); longest input_ids %d "
                "tokens; wrote %s_*", counts["kept"], n_rows,
                ", ".join(f"{k}={v}" for k, v in dropped.items()) or "none",
                ", ".join(f"{k}={v}" for k, v in sorted(truncated.items())) or "none",
                seconds, n_rows / max(seconds, 1e-9), longest, prefix)
    return PreprocessResult(prefix, files, n_rows, counts["kept"], dropped, seconds, meta,
                            truncated=dict(sorted(truncated.items())))


def preprocess(argv: Optional[List[str]] = None) -> PreprocessResult:
    """Parse ``argv`` like the CLI and run; raises :class:`DataError` on user errors."""
    return run(parse_args(argv))


class _StderrHandler(logging.Handler):
    """Writes to the current ``sys.stderr`` at each message (not the one at setup time)."""

    def emit(self, record):
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry: user errors are printed without a traceback, exit status 2."""
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[preprocess] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        preprocess(argv)
    except DataError as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("preprocess_data.py: interrupted; nothing was written", file=sys.stderr)
        return 130
    except OSError as e:  # e.g. an unreadable input file: name it, no traceback
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    return 0
