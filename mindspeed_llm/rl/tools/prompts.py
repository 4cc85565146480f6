"""The tools offered in the prompts, rendered at rollout time from the run's own --tool-config.

Preprocessing stores each prompt as the token ids of the dataset's chat template (`data/templates.py`, recorded in
``_meta.json`` as ``template``) without tools. The run puts the tools' block into the first system message, after
its text (the conversation's own, else the template's default), else as a system message of its own: the block the
tokenizer's chat template renders for ``tools=`` after the system text (Qwen2.5's ``# Tools`` section, found by
rendering a probe conversation with and without the tools: `template_tools_block`), or, for a template without a
tools section (SmolLM2's, ChatML), the Hermes block (`chat_delta.hermes_tools_block`), as `chat_delta.tools_prompt`
renders a conversation. Changing the tool config therefore needs no new preprocessing.

Token-in / token-out: the ids the engine gets are the tokenizer's encoding of that rendering, not ids spliced
together. A prompt's ids are decoded to text, the block inserted as text, and the text encoded again; the decoded
text must encode back to the stored ids (else the prompt is refused by name: a tokenizer other than the dataset's,
or a prompt cut by ``--overlong-prompts truncate``). Splicing the block's own ids in would not be exact: Qwen2.5's
pre-tokenizer merges the newlines after a system text ending in a period with it (``".\\n\\n"`` is one token).

A dataset preprocessed with tools by an earlier version (``_meta.json`` records ``tools``: names, schemas and the
Hermes rendering): where that block is the very block the run renders, its prompts are used as they are; otherwise
the block is taken out of each system message and the run's put in (never two blocks); a prompt whose system
message does not end with the recorded block, or a record without schemas, is refused by name (preprocess again,
without tools). A template without a system turn (``"system": null``, or a system format that does not frame its
text on both sides) cannot offer the tools: said at startup, the prompts used as they are.

Every prompt is rendered once, when the run opens its datasets (so --max-prompt-length is checked on the prompts
the engine gets), and once per run, not once per rank: each rank renders its share of the prompts and the ranks
gather the shares (`ToolsOffered`, over the `Ranks` the run passes), each then holding every prompt's ids as it
holds the dataset's. A prompt that cannot be offered is refused on every rank with the message one process
rendering them all gives. Rendering a prompt at its first access instead would leave the lengths unknown to the
--max-prompt-length check, and costs about 40x reading rendered ids (benchmarks/tool_prompts.py).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindspeed_llm.data.errors import DataError
from mindspeed_llm.data.prompt_dataset import PromptDatasetView
from mindspeed_llm.data.templates import CONTENT, ChatTemplate
from mindspeed_llm.rl.tools.chat_delta import _render, hermes_tools_block

RENDERING = "hermes block in the system message"  # what an earlier preprocessing recorded as tools.rendering
# The processes that render the prompts together (`shared_render`): this one's rank, their number, and a gather of a
# picklable object from each, in rank order (the run's: `distributed.world_share`); one process by default.
Ranks = Tuple[int, int, Callable[[Any], list]]
ONE_PROCESS: Ranks = (0, 1, lambda obj: [obj])
_BLOCK_SEPARATOR = "\n\n"
_PROBE_SYSTEM, _PROBE_USER = "TOOLS_PROBE_SYSTEM", "TOOLS_PROBE_USER"  # a probe conversation; never in a prompt


def template_of(meta: dict) -> Optional[ChatTemplate]:
    """The chat template a dataset's prompts were rendered with (its ``_meta.json``); None when not recorded."""
    fields = meta.get("template")
    if not isinstance(fields, dict) or "name" not in fields:
        return None
    return ChatTemplate(**{**fields, "stop_words": tuple(fields.get("stop_words") or ())})


def system_frame(template: Optional[ChatTemplate]):
    """The text before and after a system message's content, or None when the template cannot render one that
    frames its content on both sides (the tools then cannot be offered through it)."""
    if template is None or not template.system or template.system.count(CONTENT) != 1:
        return None
    before, after = template.system.split(CONTENT)
    return (before, after) if before and after else None


def offer_text(template: ChatTemplate, text: str, block: str, old_block: Optional[str] = None) -> str:
    """``text`` (a prompt rendered by ``template``) with ``block`` in its first system message (after its text), or
    in a system message of its own at the start; ``old_block`` (an earlier preprocessing's) taken out first. Raises
    ValueError when the text is not the template's or does not hold ``old_block``."""
    before, after = system_frame(template)
    if not text.startswith(template.prefix):
        raise ValueError(f"it does not start with the template's prefix {template.prefix!r}")
    head = template.prefix + before
    end = text.find(after, len(head)) if text.startswith(head) else -1
    if end < 0:  # no system message: one of its own (as the template renders a system text that is the block alone)
        if old_block is not None:
            raise ValueError("it has no system message, so it does not hold the recorded tools' block")
        cut = len(template.prefix)
        return text[:cut] + before + block + after + text[cut:]
    content = text[len(head):end]
    if old_block is not None:
        if content == old_block:
            content = ""
        elif content.endswith(_BLOCK_SEPARATOR + old_block):
            content = content[:-len(_BLOCK_SEPARATOR + old_block)]
        else:
            raise ValueError("its system message does not end with the recorded tools' block")
    content = f"{content}{_BLOCK_SEPARATOR}{block}" if content.strip() else block
    return text[:len(head)] + content + text[end:]


def _encode(tokenizer, texts: List[str]) -> List[List[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def template_tools_block(tokenizer, schemas: Sequence[Dict[str, Any]]) -> str:
    """The text the tokenizer's chat template puts after the system text for ``tools=schemas`` (Qwen2.5's ``# Tools``
    section), found by rendering a probe conversation with and without the tools; `hermes_tools_block` where the
    template renders the tools no differently (SmolLM2's, ChatML) or the tokenizer has none. ValueError where the
    template puts the tools anywhere else."""
    if not getattr(tokenizer, "chat_template", None):
        return hermes_tools_block(schemas)
    chat = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}]
    plain = _render(tokenizer, chat, True)
    with_tools = _render(tokenizer, chat, True, tools=list(schemas))
    if with_tools == plain:
        return hermes_tools_block(schemas)
    at = plain.find(_PROBE_SYSTEM) + len(_PROBE_SYSTEM)
    added = len(with_tools) - len(plain)
    inserted = with_tools[at:at + added] if at >= len(_PROBE_SYSTEM) and added > 0 else ""
    if not inserted.startswith(_BLOCK_SEPARATOR) or with_tools != plain[:at] + inserted + plain[at:]:
        raise ValueError("the tokenizer's chat template does not put the tools after the system text (as Qwen2.5's "
                         "does), so the prompts cannot offer them exactly; give a tokenizer whose template does, or "
                         "one without a tools section (the Hermes block is then used)")
    return inserted[len(_BLOCK_SEPARATOR):]


class ToolPrompts:
    """How a dataset's prompts offer the run's tools (module docstring). ``mode``: ``render`` (the block put in),
    ``rerender`` (an earlier preprocessing's block replaced), ``as_is`` (the prompts already hold this very block) or
    ``unable`` (the template has no system turn). Without ``block`` (argument validation, no tokenizer yet) an
    earlier block counts as ``rerender``."""

    def __init__(self, meta: dict, source: str, block: Optional[str] = None):
        self.source, self.block = source, block
        self.template = template_of(meta)
        recorded = meta.get("tools") or None
        self.recorded_names = list((recorded or {}).get("names") or [])
        self.old_block = None
        if system_frame(self.template) is None:
            self.mode = "unable"
        elif recorded is None:
            self.mode = "render"
        elif recorded.get("schemas") and recorded.get("rendering", RENDERING) == RENDERING:
            # what preprocess_data.py --tool-config wrote before the tools were offered at rollout time
            self.old_block = hermes_tools_block(recorded["schemas"])
            self.mode = "as_is" if self.old_block == block else "rerender"
        else:
            raise DataError(f"{source}: its prompts were preprocessed with the tools {self.recorded_names} "
                            f"({recorded.get('rendering', 'rendering unknown')}, no schemas recorded), whose block "
                            "cannot be taken out of them; preprocess the data again (without tools: the run offers "
                            "its own --tool-config)")

    def note(self, names: Sequence[str]) -> str:
        """The startup line: where the model learns of the tools."""
        tools = ", ".join(map(str, names))
        if self.mode == "unable":
            name = self.template.name if self.template else "(not recorded)"
            return (f"multi-turn: the chat template {name} of {self.source} has no system turn to offer the tools "
                    f"{tools} in, so only what the prompts say tells the model of them")
        line = (f"multi-turn: the prompts of {self.source} offer the tools {tools}, rendered at rollout time from "
                f"--tool-config through the chat template {self.template.name} (the tokenizer's own tools section "
                "where it has one, else the Hermes block, in the system message)")
        if self.mode == "as_is":
            return line + "; they already hold that block (preprocessed with these tools): used as they are"
        if self.old_block is not None:
            return (line + f"; the block of the tools {', '.join(map(str, self.recorded_names))} an earlier "
                    "preprocessing put in is kept where it is that block, else replaced by it (never two blocks)")
        return line

    def render(self, prompts: Sequence[Sequence[int]], tokenizer) -> List[List[int]]:
        """Each prompt's ids offering the tools (``prompts`` as they are for ``as_is`` / ``unable``)."""
        ids, problems = self.render_part(prompts, tokenizer)
        _raise_first([problems])
        return ids

    def render_part(self, prompts: Sequence[Sequence[int]], tokenizer, first: int = 0):
        """(ids, problems) of the prompts numbered ``first``, ``first + 1``, ...: each prompt's ids offering the tools,
        or, where one cannot, no ids and the first problem of each kind, (index, message) or None: a prompt that does
        not encode back to its ids (every prompt is checked for it before any is offered the tools), a prompt that
        cannot offer them."""
        prompts = [list(p) for p in prompts]
        if self.mode in ("as_is", "unable"):
            return prompts, (None, None)
        texts = tokenizer.batch_decode(prompts, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for i, (ids, again) in enumerate(zip(prompts, _encode(tokenizer, texts)), first):
            if ids != again:
                return [], ((i, f"{self.source}: prompt {i} does not encode back to its token ids after decoding (a "
                                "tokenizer other than the one it was preprocessed with, or a prompt cut by "
                                "--overlong-prompts truncate), so the tools cannot be put in exactly; preprocess it "
                                "with this run's tokenizer and --overlong-prompts drop"), None)
        out = []
        for i, text in enumerate(texts, first):
            try:
                out.append(offer_text(self.template, text, self.block, self.old_block))
            except ValueError as exc:
                return [], (None, (i, f"{self.source}: prompt {i} cannot offer the tools: {exc}; preprocess the "
                                      "data again (without tools: the run offers its own)"))
        return _encode(tokenizer, out), (None, None)


def _raise_first(problems) -> None:
    """The DataError a single process rendering every prompt in order meets first, from each part's problems."""
    for kind in (0, 1):  # the prompts are all checked to encode back to themselves before any is offered the tools
        found = [part[kind] for part in problems if part[kind] is not None]
        if found:
            raise DataError(min(found)[1])


def _packed(ids: List[List[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """Prompts' ids as one flat array (4 bytes a token; a list of Python ints takes a reference of 8 and an int of
    28 bytes) and their lengths."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for row in ids for t in row), dtype=np.int64, count=int(lengths.sum()))
    return (flat.astype(np.int32) if not len(flat) or int(flat.max()) < 2 ** 31 else flat), lengths


def shared_render(offered: ToolPrompts, dataset, tokenizer, ranks: Optional[Ranks] = None):
    """Every prompt of ``dataset`` offering the tools, as (flat ids, lengths), rendered once over ``ranks`` (`Ranks`;
    one process by default): each renders a contiguous share, the shares are gathered. A problem is raised on every
    rank alike (`_raise_first`)."""
    rank, size, gather = ranks or ONE_PROCESS
    n = len(dataset)
    lo, hi = n * rank // size, n * (rank + 1) // size
    ids, problems = offered.render_part([dataset[i]["input_ids"] for i in range(lo, hi)], tokenizer, lo)
    parts = gather((_packed(ids), problems))
    _raise_first([p[1] for p in parts])
    flat = np.concatenate([p[0][0] for p in parts])
    return flat, np.concatenate([p[0][1] for p in parts])


class ToolsOffered(PromptDatasetView):
    """A prompt dataset (`PromptDataset` / `PromptSubset`) whose prompts offer the run's tools: every prompt rendered
    once here, over ``ranks`` (`shared_render`); everything else is the dataset's."""

    def __init__(self, dataset, offered: ToolPrompts, tokenizer, ranks: Optional[Ranks] = None):
        super().__init__(dataset)
        self.offered = offered
        self._ids, self._lengths = shared_render(offered, dataset, tokenizer, ranks)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict:
        item = self.dataset[index]
        i = int(index) % len(self) if int(index) < 0 else int(index)  # the dataset's own item checked the range
        item["input_ids"] = self._ids[self._starts[i]:self._starts[i + 1]].tolist()
        return item

    def check_prompts(self, flag: str) -> None:
        self.dataset.check_prompts(flag)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self._lengths.copy()


def offer_tools(dataset, schemas: Sequence[Dict[str, Any]], tokenizer, source: str, ranks: Optional[Ranks] = None):
    """``dataset`` with its prompts offering the tools of ``schemas`` (`ToolsOffered`, rendered over ``ranks``), or
    ``dataset`` itself where they already do or cannot (`ToolPrompts.mode`)."""
    if system_frame(template_of(dataset.meta)) is None:  # no system turn to offer them in (said at startup)
        return dataset
    try:
        block = template_tools_block(tokenizer, schemas)
    except ValueError as exc:
        raise DataError(f"{source}: {exc}") from None
    offered = ToolPrompts(dataset.meta, source, block)
    if offered.mode in ("as_is", "unable"):
        return dataset
    return ToolsOffered(dataset, offered, tokenizer, ranks)


def offer_run_tools(tool_config: Optional[str], tokenizer, dataset, eval_sets, ranks: Optional[Ranks] = None):
    """The run's training prompts and held-out sets ((name, dataset) pairs, or None), offering the tools of
    ``tool_config`` (`offer_tools`, rendered over ``ranks``: every rank of the run calls it); as they are without
    one."""
    if not tool_config:
        return dataset, eval_sets
    from mindspeed_llm.rl.tools.config import tool_schemas

    schemas = tool_schemas(tool_config)
    offered = offer_tools(dataset, schemas, tokenizer, f"--data-path {dataset.prefix}", ranks)
    if eval_sets is None:
        return offered, None
    return offered, [(name, offer_tools(held_out, schemas, tokenizer, f"the held-out prompts {held_out.prefix}",
                                        ranks)) for name, held_out in eval_sets]
