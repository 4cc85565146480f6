"""The rollout strategies' flags (`rl/rollout_strategies.py`): --partial-rollout's budget and --tool-config's
trajectory limits, resolved into the run's settings and refused by name where they do not combine. Called from
`validation.validate_args` with its resolving view of the Namespace."""

from __future__ import annotations

import os

from mindspeed_llm.errors import ArgumentError


def check_partial_rollout(run) -> None:
    """--partial-rollout and its budget (`rl/partial_rollout.py`): what does not combine with it is refused."""
    if not run.partial_rollout:
        if run.partial_rollout_max_split is not None:
            raise ArgumentError(f"--partial-rollout-max-split {run.partial_rollout_max_split} has no effect without "
                                "--partial-rollout; add it or drop the budget")
        return
    if run.partial_rollout_max_split is None:
        run.partial_rollout_max_split = 2
    if run.dynamic_sampling:
        raise ArgumentError("--partial-rollout and --dynamic-sampling both draw further generation batches, by "
                            "different rules (finished groups / groups whose rewards differ), and are not combined "
                            "here; drop one of them")
    if run.context_parallel_size > 1:  # the buffers are per DP rank; CP ranks share a DP rank's rollouts
        raise ArgumentError(f"--partial-rollout with --context-parallel-size {run.context_parallel_size} is not "
                            "supported (its buffers are kept per data-parallel rank, not checked under CP); use "
                            "--context-parallel-size 1 or drop --partial-rollout")
    # the carried tokens' log-probs are an earlier policy's: the update's old log-probs come from a training forward
    # under the weights of the update (and --rollout-is weighs the carried tokens against the sampler's)
    run.recompute_old_logprobs = True


def check_multi_turn(run) -> None:
    """--tool-config (multi-turn tool use, `rl/multi_turn.py`): the trajectory's budget, and what it does not combine
    with, refused by name."""
    if not run.tool_config:
        if run.multi_turn:
            raise ArgumentError("--multi-turn (multi_turn_enable) needs the tools: give --tool-config PATH "
                                "(tool_config_path)")
        return
    if not os.path.isfile(run.tool_config):
        raise ArgumentError(f"--tool-config {run.tool_config}: no such file; give a tool config YAML (`tools:` of "
                            "class_name, config, tool_schema, as verl and MindSpeed-RL write it)")
    room = run.max_length - run.max_prompt_length
    if run.max_total_response_length is None:
        run.max_total_response_length = room
    if run.max_total_response_length > room:
        raise ArgumentError(f"--max-total-response-length {run.max_total_response_length} does not fit in "
                            f"--max-length {run.max_length} after --max-prompt-length {run.max_prompt_length}; raise "
                            f"--max-length to {run.max_prompt_length + run.max_total_response_length} or lower it")
    if run.max_new_tokens > run.max_total_response_length:
        raise ArgumentError(f"--max-new-tokens {run.max_new_tokens} (one model turn) exceeds "
                            f"--max-total-response-length {run.max_total_response_length} (the whole trajectory)")
    if run.dynamic_sampling:
        raise ArgumentError("--tool-config (multi-turn rollouts) with --dynamic-sampling is not supported yet; drop "
                            "one")
    run.startup_notes.append(_offered_tools_note(run.tool_config, run.data_path))
    from mindspeed_llm.rl.tools.sandbox import PythonToolConfigError, python_tool_notes

    try:  # the python tool's values and its sandbox (which layers this kernel offers), before any model is built
        run.startup_notes.extend(python_tool_notes(run.tool_config))
    except PythonToolConfigError as exc:
        raise ArgumentError(str(exc)) from None


def _schema_names(path: str) -> list:
    """The tool names a tool config's schemas give (without importing its classes)."""
    from mindspeed_llm.files import YamlFileError, read_yaml

    try:
        entries = (read_yaml(path, f"--tool-config {path}", allow_null=lambda keys: True) or {}).get("tools") or []
        return [((e.get("tool_schema") or {}).get("function") or {}).get("name") or e.get("class_name")
                for e in entries if isinstance(e, dict)]
    except YamlFileError as exc:
        raise ArgumentError(f"{exc}; give a YAML with a `tools:` list") from None
    except (OSError, AttributeError) as exc:
        raise ArgumentError(f"--tool-config {path}: cannot be read as a tool config YAML ({exc}); give a YAML with "
                            "a `tools:` list") from None


def _offered_tools_note(tool_config: str, data_path: str) -> str:
    """Where the model learns of the tools: the prompts' tools as preprocessing recorded them (`_meta.json`), checked
    against the run's tool config; refused when the prompts offer a tool the run does not have."""
    import json

    names = _schema_names(tool_config)
    meta_path = f"{data_path}_meta.json"
    try:
        with open(meta_path, encoding="utf-8") as f:
            offered = (json.load(f).get("tools") or {}).get("names")
    except (OSError, ValueError):
        offered = None
    if not offered:
        return (f"multi-turn: the prompts of --data-path {data_path} offer no tools (preprocessed without "
                f"--tool-config), so only what they say tells the model of the tools {', '.join(map(str, names))}; "
                "preprocess_data.py --tool-config puts their schemas into the prompts")
    missing = [n for n in offered if n not in names]
    if missing:
        raise ArgumentError(f"the prompts of --data-path {data_path} offer the tools {', '.join(offered)} "
                            f"(preprocess_data.py --tool-config, {meta_path}), but --tool-config {tool_config} has no "
                            f"{', '.join(missing)}: the model would call tools that are not there; give the tool "
                            "config the prompts were made with")
    return (f"multi-turn: the prompts offer the tools {', '.join(offered)} (rendered at preprocessing, {meta_path}); "
            f"--tool-config {tool_config} runs {', '.join(map(str, names))}")
