"""The rollout generators' and schedules' flags (`rl/rollouts/base.py`): --partial-rollout's budget and --tool-config's
trajectory limits, resolved into the run's settings and refused by name where they do not combine. Called from
`validation.validate_args` with its resolving view of the Namespace."""

from __future__ import annotations

import os

from mindspeed_llm.errors import ArgumentError


def check_dynamic_sampling(run) -> None:
    """--dynamic-sampling's metric and budget (`rl/rollouts/dynamic_sampling.py`): set without it they are refused, a metric
    must be the reward or a verifier of the run, and 0 generation batches (no limit) is its own."""
    if run.max_num_gen_batches == 0 and not run.dynamic_sampling:  # >= 0: argument_ranges
        raise ArgumentError("--max-num-gen-batches 0 (no limit) is --dynamic-sampling's only: --partial-rollout "
                            "needs a bound; give a number >= 1")
    metric = run.dynamic_sampling_metric
    if metric == "reward":
        return
    if not run.dynamic_sampling:
        raise ArgumentError(f"--dynamic-sampling-metric {metric} has no effect without --dynamic-sampling; add it or "
                            "drop the metric")
    if metric not in (run.verifier_function or []):
        raise ArgumentError(f"--dynamic-sampling-metric {metric} is not one of --verifier-function "
                            f"{' '.join(run.verifier_function or []) or '(none)'}: a group is kept when its scores by "
                            "that verifier differ; name one of them, or reward (the groups' rewards)")


def check_partial_rollout(run) -> None:
    """--partial-rollout and its budget (`rl/rollouts/partial.py`): what does not combine with it is refused."""
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
    """--tool-config (multi-turn tool use, `rl/rollouts/tool_turns.py`): the trajectory's budget, and what it does not combine
    with, refused by name."""
    if not run.tool_config:
        if run.multi_turn:
            raise ArgumentError("--multi-turn (multi_turn_enable) needs the tools: give --tool-config PATH "
                                "(tool_config_path)")
        if run.tool_rewards is not None:
            raise ArgumentError(f"--tool-rewards {run.tool_rewards} has no effect without --tool-config (only tools "
                                "return step rewards); drop it or give the tools")
        if run.tool_parser_format is not None:  # MindSpeed-RL's YAML sets it for every run: said, not refused
            run.startup_notes.append(f"--tool-parser-format {run.tool_parser_format} is ignored: no --tool-config "
                                     "(no tool calls are read)")
        return
    if run.tool_parser_format is None:
        from mindspeed_llm.rl.tools.parsers import DEFAULT_TOOL_PARSER

        run.tool_parser_format = DEFAULT_TOOL_PARSER
    if run.tool_rewards is None:
        run.tool_rewards = "add"
    if not os.path.exists(run.tool_config):
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
    from mindspeed_llm.rl.tools.sandbox import PythonToolConfigError, python_tool_notes

    try:  # the python tool's values and its sandbox (which layers this kernel offers), before any tool is built
        sandbox_notes = python_tool_notes(run.tool_config)
    except PythonToolConfigError as exc:
        raise ArgumentError(str(exc)) from None
    names = _tool_names(run.tool_config)
    _check_parser(run.tool_parser_format)  # after the tools: a tool module may register a parser
    run.startup_notes.append(_offered_tools_note(run.data_path, names))
    run.startup_notes.extend(sandbox_notes)


def _tool_names(path: str) -> list:
    """The tools of --tool-config, built here, before any model (every entry checked: `rl/tools/config.py`); the run's
    rollouts take the same objects (``load_tool_config(path, cache="take")``). Their names."""
    from mindspeed_llm.rl.tools import ToolConfigError, load_tool_config, tool_name

    try:
        return [tool_name(tool) for tool in load_tool_config(path, cache="store")]
    except ToolConfigError as exc:
        raise ArgumentError(f"--tool-config: {exc}") from None


def _check_parser(name: str) -> None:
    from mindspeed_llm.rl.tools import TOOL_PARSERS

    if name not in TOOL_PARSERS:
        raise ArgumentError(f"--tool-parser-format {name}: no such tool call parser; known: "
                            f"{', '.join(sorted(TOOL_PARSERS))} (a tool module may add one to "
                            "mindspeed_llm.rl.tools.TOOL_PARSERS)")


def _offered_tools_note(data_path: str, names: list) -> str:
    """Where the model learns of the tools: the prompts offer them, rendered at rollout time through the dataset's chat
    template (`rl/tools/prompts.py`; the run checks each prompt when it opens the data); a dataset preprocessed with
    tools whose block cannot be taken out is refused here."""
    import json

    from mindspeed_llm.data.errors import DataError
    from mindspeed_llm.rl.tools.prompts import ToolPrompts

    try:
        with open(f"{data_path}_meta.json", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = {}  # a missing or damaged dataset is named when the run opens it
    try:
        return ToolPrompts(meta, f"--data-path {data_path}").note(names)
    except DataError as exc:
        raise ArgumentError(str(exc)) from None


def check_rollout_pair(settings) -> None:
    """The run's sample generator and schedule (`rl/rollouts/base.chosen_pair`): two of one axis, or a pair that
    cannot work together, refused naming their flags, before any model is built."""
    from mindspeed_llm.rl.rollouts.base import chosen_pair

    chosen_pair(settings)
