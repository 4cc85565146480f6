"""The batch that flows through one RL iteration: a container of tensors, filled in as the iteration goes.

Each sample is `prompt_i + response_i + padding` in `tokens` (right padded to T = max(prompt + response)),
position ids `arange(T)`. Per-token RL tensors (log-probs, values, rewards, advantages, masks) are
response-aligned `[B, R]`: column j is response token j. How samples feed the model (rows or packed prompt
groups, the read positions) is `rl/update/batch_plan.py`'s job.

Multi-turn rollouts: the response holds the model's sampled tokens and, between its turns, the tool-response tokens
(`tool_mask`). `response_mask` is every token fed after the prompt (lengths, read positions, packing and token
budgets count what is really fed); `action_mask` is the model's own tokens, and the losses, the KL, the entropy, the
advantages and the length metrics follow it (`core_algos/actions.py`). `loss_mask` is derived, never written: the
action mask less the rows the stage leaves out (`truncated_out`, `filtered_out`), by `core_algos.loss_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Dict, List, Optional, Sequence

import torch

from mindspeed_llm.rl.core_algos.actions import action_mask, loss_mask


# The per-token fields, response-aligned `[B, R]` (column j is response token j): a micro-batch may cut them to its
# own longest response (`rl/update/batch_plan.py`).
RESPONSE_FIELDS = ("responses", "response_mask", "tool_mask", "rollout_logp", "loss_mask", "old_logp", "ref_logp",
                   "values", "advantages", "returns", "teacher_logp", "teacher_topk_ids", "teacher_topk_logp")
# The row-padded fields a join pads to its widest row ([B, T] or [B, R]); `routing` is padded along its T axis.
_PADDED = ("tokens", "responses", "response_mask", "tool_mask", "rollout_logp")
# The optional masks a part of a join may lack: zeros (no tool token, no row left out).
_ZERO_WHEN_ABSENT = ("tool_mask", "truncated_out", "filtered_out")
# Not joined: position ids are rebuilt for the joined width; the rest are not tensors.
_NOT_JOINED = ("position_ids", "sample_data", "routing_recorded")


# The dataset row keys that are not columns of their own: the prompt itself, and the trainer's place for it.
_ROW_KEYS = ("input_ids", "labels", "index", "position")


@dataclass
class SampleData:
    """Per-sample python data, one list entry per row of the Experience (None: not recorded by the rollout that made
    it). Every field is a list over the rows, and `select` / `concat` treat them all alike, so a new column is a new
    field here and nothing else: gathers, refills and partial rollouts carry it."""

    labels: Optional[list] = None  # the dataset's reference answer (the verifiers' label), None where it has none
    indices: Optional[List[int]] = None  # the prompt's dataset index (error messages name it)
    texts: Optional[List[str]] = None  # the decoded response (the verifiers read it)
    finish_reasons: Optional[List[str]] = None  # "eos" | "stop" | "length"
    sample_ids: Optional[List[int]] = None  # the sample's random stream (partial rollouts)
    started: Optional[List[int]] = None  # the iteration its generation started (partial rollouts)
    # the multi-turn trajectory of each row, plain JSON-able dicts of the shape `verifiers.trajectory.Trajectory`
    # documents ({"turns": [...], "num_turns", "tool_calls", "tool_reward"}); None: single-turn rollouts
    trajectories: Optional[list] = None
    # each row's score by part, {verifier name: score, "reward_model": ..., "tool": ...}, as the scorer mixed them
    # (`scoring.Scorer`; the sample tables show them)
    score_parts: Optional[List[dict]] = None
    # the dataset's further columns (--dataset-additional-keys) by name, for a verifier that reads them
    columns: Dict[str, list] = field(default_factory=dict)

    @classmethod
    def of_prompts(cls, rows: Sequence[dict], **known) -> "SampleData":
        """The data of samples whose prompts are the dataset rows `rows` (one per sample), plus `known` fields."""
        columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for r in rows for k in r)
                   if key not in _ROW_KEYS}
        return cls(labels=[row.get("labels") for row in rows], indices=[row.get("index") for row in rows],
                   columns=columns, **known)

    def _lists(self) -> Dict[str, list]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "columns"}

    def select(self, rows: Sequence[int]) -> "SampleData":
        picked = {name: None if values is None else [values[i] for i in rows] for name, values in self._lists().items()}
        return SampleData(columns={k: [v[i] for i in rows] for k, v in self.columns.items()}, **picked)

    @staticmethod
    def concat(parts: Sequence["SampleData"]) -> "SampleData":
        """The rows of `parts` one after another; a field some part lacks is lacking in the result."""
        joined = {}
        for name in parts[0]._lists():
            values = [getattr(p, name) for p in parts]
            joined[name] = None if any(v is None for v in values) else [x for v in values for x in v]
        keys = [k for k in parts[0].columns if all(k in p.columns for p in parts)]
        return SampleData(columns={k: [x for p in parts for x in p.columns[k]] for k in keys}, **joined)


@dataclass
class Experience:
    tokens: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long
    prompt_lengths: torch.Tensor  # [B] long
    responses: torch.Tensor  # [B, R] long, pad after the response
    response_mask: torch.Tensor  # [B, R] float, 1 on the tokens fed after the prompt (EOS included; tool tokens too)
    ended_with_eos: torch.Tensor  # [B] bool
    rollout_logp: Optional[torch.Tensor] = None  # [B, R] the sampler's log-probs (generation logits / temperature)
    # [B, R] float, 1 on the tool-response tokens of a multi-turn rollout (the chat template's tool-role deltas between
    # the model's turns: context, not actions), within `response_mask`; None: a single-turn rollout (no tool token).
    tool_mask: Optional[torch.Tensor] = None
    # [B] bool: the rows the stage leaves out of every loss (their lengths, read positions and scores stay): the
    # truncated responses under --mask-truncated-completions, the groups without signal under grpo's --filter-groups.
    # None: no row left out. With `tool_mask` they make `loss_mask`.
    truncated_out: Optional[torch.Tensor] = None
    filtered_out: Optional[torch.Tensor] = None
    # Filled in as the iteration goes.
    old_logp: Optional[torch.Tensor] = None  # [B, R]
    ref_logp: Optional[torch.Tensor] = None  # [B, R]
    # --teacher-load (`rl/distillation.py`): the teacher's log-probs of the sampled tokens at the rollout temperature
    # [B, R]; with --distill-loss topk_forward_kl its top-k per response position, ids (long) and log-probs [B, R, k]
    teacher_logp: Optional[torch.Tensor] = None
    teacher_topk_ids: Optional[torch.Tensor] = None
    teacher_topk_logp: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None  # [B, R]
    scores: Optional[torch.Tensor] = None  # [B]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    sample_data: SampleData = field(default_factory=SampleData)  # per-row python data (labels, texts, ...)
    # [B, MoE layers of this rank, T, topk] int16: the rollout's experts of each token (-1 unknown / padding), for
    # --moe-routing-replay and the moe/routing_mismatch metric (`mindspeed_llm.models.routing`); None: dense model
    routing: Optional[torch.Tensor] = None
    # The generating policy is a mixture of experts that recorded its routing into `routing` (on the ranks holding MoE
    # layers; a pipeline stage without them has None): the old-log-prob pass of that policy compares its own routing
    # with the rollout's (`rl/update/passes.policy_logprobs(compare_routing=...)`). The same on every rank.
    routing_recorded: bool = False

    def __post_init__(self):
        self._derived = {}  # name -> (the parts it was made from, the mask): each mask is made once per set of parts

    def __getstate__(self):  # what crosses a process group: the fields, not the derived masks (made again there)
        return {k: v for k, v in self.__dict__.items() if k != "_derived"}

    def __setstate__(self, state):
        self.__dict__.update(state, _derived={})

    @classmethod
    def from_rollout(cls, rollout) -> "Experience":
        """Take tokens and layout from `mindspeed_llm.inference.Rollout.sequences()` (same convention)."""
        seq = rollout.sequences()
        return cls(
            tokens=seq.tokens,
            position_ids=seq.position_ids,
            prompt_lengths=rollout.prompt_lengths.long(),
            responses=rollout.responses.long(),
            response_mask=rollout.response_mask.float(),
            ended_with_eos=rollout.ended_with_eos.bool(),
            rollout_logp=None if rollout.log_probs is None else rollout.log_probs.float(),
            routing=getattr(rollout, "routing", None),
            tool_mask=None if getattr(rollout, "tool_mask", None) is None else rollout.tool_mask.float(),
        )

    # ------------------------------------------------------------------ shapes
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long: the tokens fed after each prompt (the model's and the tools')."""
        return self.response_mask.sum(-1).long()

    def _mask(self, name: str, make, *parts) -> torch.Tensor:
        """The mask `name` made by `make(*parts)`, once: again only when a part is set to another tensor."""
        cached = self._derived.get(name)
        if cached is None or any(a is not b for a, b in zip(cached[0], parts)):
            cached = self._derived[name] = (parts, make(*parts))
        return cached[1]

    @property
    def action_mask(self) -> torch.Tensor:
        """[B, R]: the model's own sampled tokens, `response_mask * (1 - tool_mask)`; `response_mask` itself (the same
        tensor) without tool tokens (`core_algos.action_mask`)."""
        return self._mask("action_mask", action_mask, self.response_mask, self.tool_mask)

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, R]: the tokens that take part in the losses, the action mask less the rows left out (`truncated_out`,
        `filtered_out`): `core_algos.loss_mask`, its one writer. Lengths, read positions and packing always follow
        `response_mask`."""
        return self._mask("loss_mask", loss_mask, self.response_mask, self.tool_mask, self.truncated_out,
                          self.filtered_out)

    @property
    def action_lengths(self) -> torch.Tensor:
        """[B] long: the model's own tokens of each response (`response_lengths` less the tool tokens)."""
        return self.action_mask.sum(-1).long()

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor field that is set, by name (not the derived masks)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    # ------------------------------------------------------------------ rows
    def select(self, rows: torch.Tensor, device=None) -> "Experience":
        """The Experience of rows `rows` (in that order), its tensors on `device` (default: where they are; the
        host, to send them over a process group)."""
        index = rows.to(self.tokens.device)
        picked = {name: t.index_select(0, index) for name, t in self.tensors().items()}
        if device is not None:
            picked = {name: t.to(device) for name, t in picked.items()}
        return replace(self, **picked, sample_data=self.sample_data.select(rows.tolist()))

    @classmethod
    def concat(cls, parts: Sequence["Experience"], device) -> "Experience":
        """One Experience of the rows of `parts` on `device`, right-padded to the longest sequence and response and no
        wider (a tensor some part lacks is left out, but a part without `tool_mask` has no tool token and one without
        `truncated_out` / `filtered_out` leaves no row out: zeros; routing is padded with -1, "unknown",
        `models/routing.py`)."""
        tensors = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if f.name in _ZERO_WHEN_ABSENT and any(v is not None for v in values):
                values = [(torch.zeros_like(p.response_mask) if f.name == "tool_mask" else
                           torch.zeros(p.batch_size, dtype=torch.bool, device=p.response_mask.device))
                          if v is None else v for p, v in zip(parts, values)]
            if f.name in _NOT_JOINED or any(v is None for v in values):
                continue
            if f.name in _PADDED:
                width = max(v.shape[1] for v in values)
                values = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values]
            elif f.name == "routing":  # [B, layers, T, topk]
                width = max(v.shape[2] for v in values)
                values = [torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[2]), value=-1) for v in values]
            tensors[f.name] = torch.cat(values).to(device)
        # no wider than the rows need: sequences to the longest prompt + response, responses to the longest response
        lengths = tensors["response_mask"].sum(-1).long()
        width_r = int(lengths.max()) if len(lengths) else 0
        width_t = int((tensors["prompt_lengths"] + lengths).max()) if len(lengths) else 0
        for name in _PADDED:
            if name in tensors:
                tensors[name] = tensors[name][:, :width_t if name == "tokens" else width_r].contiguous()
        if "routing" in tensors:
            tensors["routing"] = tensors["routing"][:, :, :width_t].contiguous()
        tokens = tensors["tokens"]
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens).contiguous()
        return cls(position_ids=positions, **tensors, sample_data=SampleData.concat([p.sample_data for p in parts]),
                   routing_recorded=all(p.routing_recorded for p in parts))
