"""What a launcher runs: its parameter counts per rank (`param_counts`), the model-state table (`StateBytes`), its
roles, levers and layout read from its command line (`Launch`, `Levers`, `read_launcher`) and the model state per
stage (`model_states`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from benchmarks.step_memory.measure_state import OFFLOAD_FLAGS, _offload_args
from benchmarks.step_memory.shapes import LAUNCHERS, ROOT, model_shape, Shape


# ---------------------------------------------------------------------------------------------- projection
def param_counts(shape: Shape, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0,
                 value_head: bool = False) -> Dict[str, float]:
    """Parameters one rank holds at pipeline stage `stage`: dense (attention, norms, embeddings, dense MLPs,
    routers, shared experts) and expert (its E / EP routed experts' MLPs), as megatron lays them out (q/k/v/o, fc1
    and fc2 split by TP; norms, routers and multi-latent attention's down projections replicated; the embedding on
    the first stage, the output layer on the last -- a tied output layer is a second copy only when PP > 1; a
    value head is h weights)."""
    s = shape
    layers = s.layers // pp
    if s.kv_lora:  # multi-latent attention: q / kv down projections (+ their norms) replicated, the rest split
        qk_head = s.head_dim + s.qk_rope
        q = (s.hidden * s.q_lora + s.q_lora + s.q_lora * s.heads * qk_head / tp if s.q_lora
             else s.hidden * s.heads * qk_head / tp)
        kv = s.hidden * (s.kv_lora + s.qk_rope) + s.kv_lora + s.kv_lora * s.heads * (s.head_dim + s.v_head) / tp
        attention = q + kv + s.heads * s.v_head * s.hidden / tp
    else:
        attention = (2 * s.hidden * s.q + 2 * s.hidden * s.kv + ((s.q + 2 * s.kv) if s.qkv_bias else 0)) / tp
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    dense, expert = 0.0, 0.0
    for layer in range(stage * layers, (stage + 1) * layers):
        dense += attention + norms
        if s.experts and layer >= s.dense_layers:
            dense += s.experts * s.hidden + 3 * s.hidden * s.shared_ffn / tp  # router, shared expert
            expert += (s.experts // ep) * 3 * s.hidden * s.moe_ffn
        else:
            dense += 3 * s.hidden * s.ffn / tp
    first, last = stage == 0, stage == pp - 1
    if first:
        dense += s.vocab * s.hidden / tp
    if last:
        dense += s.hidden  # final norm
        if value_head:
            dense += s.hidden
        elif not s.tied or pp > 1:
            dense += s.vocab * s.hidden / tp
    return dict(dense=dense, expert=expert, total=dense + expert)


STATE_PARTS = ("weights", "grads", "masters", "moments")  # rl/update/model_state.PARTS
# megatron's rule for bf16 weights (fp32 grad buffer, fp32 main weights, Adam's two fp32 moments), the distributed
# optimizer dividing main weights and moments over DP: used only where the model state was not measured
RULE_BYTES = dict(weights=2.0, grads=4.0, masters=4.0, moments=8.0)


@dataclass
class StateBytes:
    """Model-state bytes per parameter of a trained bf16 model, by part (`rl/update/model_state.PARTS`), as the projection
    uses them: `plain` with megatron's optimizer (any DP); with the distributed optimizer `distributed` at DP 1
    equivalence (a part in `sharded` is that / DP at DP ranks); `left`: role -> part -> the fraction of a part an
    --offload-train-* flag moves that stays on the device after `TrainableModel.offload()`; `frozen`: a frozen
    model's; `source`: where the numbers come from."""

    plain: Dict[str, float]
    distributed: Dict[str, float]
    sharded: Dict[str, bool]
    left: Dict[str, Dict[str, float]]
    frozen: float
    source: str

    def per_param(self, part: str, distributed_optimizer: bool, dp: int) -> float:
        if not distributed_optimizer:
            return self.plain[part]
        return self.distributed[part] / dp if self.sharded[part] else self.distributed[part]

    @classmethod
    def rule(cls) -> "StateBytes":
        return cls(plain=dict(RULE_BYTES), distributed=dict(RULE_BYTES),
                   sharded=dict(weights=False, grads=False, masters=True, moments=True), left={}, frozen=2.0,
                   source="megatron's rule (not measured)")

    @classmethod
    def measured(cls, data: dict) -> "StateBytes":
        """From the JSON's `model_state` (DP1) and `tp2.model_state.distributed_optimizer_dp2` (two gloo processes):
        a part is sharded when its DP2 bytes are below 3/4 of the plain ones; offload fractions from the DP1 runs.
        Missing measurements fall back to megatron's rule, said in `source`."""
        rule = cls.rule()
        plain_run = data.get("model_state") or {}
        dist_run = ((data.get("tp2") or {}).get("model_state") or {}).get("distributed_optimizer_dp2") or {}
        plain = {p: plain_run["bytes_per_param"][p] for p in STATE_PARTS} if "bytes_per_param" in plain_run \
            else dict(rule.plain)
        sources = ["DP1 measured" if "bytes_per_param" in plain_run else "DP1 by megatron's rule"]
        if "bytes_per_param" in dist_run:
            dp = dist_run.get("data_parallel", 2)
            got = {p: dist_run["bytes_per_param"][p] for p in STATE_PARTS}
            sharded = {p: got[p] < 0.75 * plain[p] for p in STATE_PARTS}
            distributed = {p: got[p] * dp if sharded[p] else got[p] for p in STATE_PARTS}
            sources.append(f"distributed optimizer measured at DP{dp}")
        else:
            sharded, distributed = dict(rule.sharded), dict(rule.distributed)
            sources.append("distributed optimizer by megatron's rule (not measured: "
                           f"{dist_run.get('error', 'no DP2 run')[:120]})")
        left: Dict[str, Dict[str, float]] = {}
        for entry in (plain_run.get("offloaded") or {}).values():
            full, now = entry["after_onload"], entry["on_device_during_rollout"]
            for part in entry["parts"]:
                fraction = now[part] / full[part] if full[part] else 0.0
                left.setdefault(entry["role"], {})[part] = max(left.get(entry["role"], {}).get(part, 0.0), fraction)
        if not left:
            sources.append("offload assumed to leave nothing on the device (not measured)")
        return cls(plain=plain, distributed=distributed, sharded=sharded, left=left,
                   frozen=plain_run.get("frozen_bytes_per_param", rule.frozen), source="; ".join(sources))


@dataclass
class Role:
    name: str
    shape: Shape
    trainable: bool
    value_head: bool
    offloadable: bool  # --offload-ref-reward applies (reference, reward model)


@dataclass(frozen=True)
class Levers:
    """One parameter per lever of the projection; `Launch.levers` are a launcher's own."""

    attention: str = "sdpa"  # sdpa | local (--attention-backend local), each with its own measured fit
    recompute: str = "none"  # none | selective (core_attn) | full
    recompute_layers: Optional[int] = None  # full: layers per stage recomputed (block method); None: all (uniform 1)
    layout: str = "row"  # row | packed (prompt groups packed into one row: --micro-batch-size a multiple of n)
    distributed_optimizer: bool = False
    offload_ref_reward: bool = False
    offload_optimizer: bool = False  # --offload-train-optimizer (and -grad, -param): between updates, in host memory
    offload_grad: bool = False
    offload_param: bool = False
    micro_batch_tokens: Optional[int] = None  # --max-tokens-per-micro-batch; None: --micro-batch-size samples
    forward_micro_batch_tokens: Optional[int] = None  # --forward-max-tokens-per-micro-batch (None: the update's)
    rollout_max_num_seqs: Optional[int] = None  # --rollout-max-num-seqs: rows in flight; None: all at once
    rollout_max_num_batched_tokens: Optional[int] = None  # --rollout-max-num-batched-tokens: a prefill's tokens
    expert_parallel: Optional[int] = None  # layout: EP (None: the launcher's)
    pipeline_parallel: Optional[int] = None  # layout: PP (None: the launcher's)
    sequence_parallel: bool = False  # --sequence-parallel: the update's and the passes' activations split over TP
    context_parallel: Optional[int] = None  # layout: --context-parallel-size (None: the launcher's)

    @property
    def offload_flags(self) -> Tuple[str, ...]:
        return tuple(f for f in OFFLOAD_FLAGS if getattr(self, f"offload_{f}"))

    def label(self) -> str:
        full = "recompute full" + (f" {self.recompute_layers}/stage" if self.recompute_layers else "")
        parts = [self.attention, {"none": "no recompute", "selective": "recompute selective", "full": full}[
            self.recompute], "packed" if self.layout == "packed" else "",
                 "dist-opt" if self.distributed_optimizer else "",
                 ("offload " + "+".join(self.offload_flags)) if self.offload_flags else "",
                 "offload-ref" if self.offload_ref_reward else "",
                 f"budget {self.micro_batch_tokens}" if self.micro_batch_tokens else "",
                 f"fwd budget {self.forward_micro_batch_tokens}" if self.forward_micro_batch_tokens else "",
                 f"max-num-seqs {self.rollout_max_num_seqs}" if self.rollout_max_num_seqs else "",
                 f"max-num-batched-tokens {self.rollout_max_num_batched_tokens}"
                 if self.rollout_max_num_batched_tokens else "",
                 f"EP{self.expert_parallel}" if self.expert_parallel else "",
                 f"PP{self.pipeline_parallel}" if self.pipeline_parallel else "",
                 "SP" if self.sequence_parallel else "",
                 f"CP{self.context_parallel}" if self.context_parallel else ""]
        return ", ".join(p for p in parts if p)


@dataclass
class Launch:
    """What the projection reads from a launcher (through its own command line and `parse_args`)."""

    name: str
    stage: str
    world: int
    tp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int
    micro_batch_size: int
    global_batch_size: int
    n_samples: int
    prompt_cap: int
    response_cap: int
    max_length: int
    mini_batch: int  # samples per optimizer step over all DP ranks
    roles: List[Role]
    levers: Levers = Levers()  # as launched
    flags: Dict[str, object] = field(default_factory=dict)
    state_only: bool = False  # the activations of this model are not described (e.g. multi-latent attention)
    cp: int = 1  # --context-parallel-size; `dp` excludes it (megatron's data-parallel size)

    @property
    def rollout_rows(self) -> int:
        # each CP rank generates its own samples as a DP replica does: prompts are dealt over DP x CP
        return max(1, self.global_batch_size * self.n_samples // (self.dp * self.cp))


def read_launcher(path: str) -> Launch:
    """Runs the launcher with a stub in place of python (as tests/dist/test_examples.py does) at its own default node
    count, 8 devices a node (launch_env.sh), and parses the posttrain command line with the real parser."""
    from mindspeed_llm.arguments import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        stub, record = os.path.join(tmp, "stub.py"), os.path.join(tmp, "argv.json")
        with open(stub, "w") as f:
            f.write("import json, sys\njson.dump(sys.argv[2:], open(sys.argv[1], 'w'))\n")
        env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NPUS_PER_NODE", "NODE_RANK", "TP", "PP",
                                                                "EP", "MASTER_ADDR", "CURRENT_IP")}
        env.update(PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=os.path.join(tmp, "log"), NODE_RANK="0",
                   MASTER_ADDR="10.0.0.1")
        proc = subprocess.run(["bash", os.path.join(ROOT, path)], cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{path}: {proc.stderr[-1000:]}")
        with open(record) as f:
            argv = json.load(f)
    world = int(argv[argv.index("--nproc_per_node") + 1]) * int(argv[argv.index("--nnodes") + 1])
    posttrain = argv[argv.index("posttrain_gpt.py") + 1:]
    run = parse_args(posttrain, world_size=world).settings  # the validated command line's typed parts
    algorithm, parallel, batch, offload = run.algorithm, run.parallel, run.batch, run.offload
    info = LAUNCHERS[path]
    shape, rm_shape = model_shape(info["model"]), model_shape(info["reward_model"])
    roles = [Role("actor", shape, True, False, False)]
    if algorithm.stage == "grpo":
        if algorithm.kl_coef > 0:
            roles.append(Role("reference", shape, False, False, True))
        if run.models.reward_model:
            roles.append(Role("reward", rm_shape, False, True, True))
    else:
        roles.append(Role("reference", shape, False, False, True))
        roles.append(Role("critic", rm_shape, True, True, False))
        if run.reward.reward_model_weight != 0 or not run.reward.verifier_function:
            roles.append(Role("reward", rm_shape, False, True, True))
    n = algorithm.n_samples_per_prompt
    tp, pp, ep = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, \
        run.moe.expert_model_parallel_size
    etp, cp = parallel.expert_tensor_parallel_size, parallel.context_parallel_size
    layers = shape.layers // pp
    recompute_flags = run.recompute
    recompute = recompute_flags.recompute_granularity or "none"
    recompute_layers = None
    if recompute == "full" and not (recompute_flags.recompute_method == "uniform"
                                    and recompute_flags.recompute_num_layers == 1):
        # block k: k layers per stage checkpointed; uniform N > 1 is taken as all layers (it saves a little less)
        recompute_layers = recompute_flags.recompute_num_layers if recompute_flags.recompute_method == "block" \
            else None
    if recompute == "selective" and list(recompute_flags.recompute_modules or []) != ["core_attn"]:
        recompute = "selective"  # only core_attn was measured; other modules are projected as core_attn alone
    levers = Levers(attention=run.model.attention, recompute=recompute,
                    recompute_layers=recompute_layers if recompute_layers != layers else None,
                    layout="packed" if n > 1 and batch.micro_batch_size % n == 0 else "row",
                    distributed_optimizer=bool(run.optimizer.use_distributed_optimizer),
                    offload_ref_reward=bool(offload.offload_ref_reward),
                    offload_optimizer=bool(offload.offload_train_optimizer),
                    offload_grad=bool(offload.offload_train_grad), offload_param=bool(offload.offload_train_param),
                    micro_batch_tokens=batch.max_tokens_per_micro_batch,
                    forward_micro_batch_tokens=batch.forward_max_tokens_per_micro_batch,
                    rollout_max_num_seqs=run.sampling.rollout_max_num_seqs,
                    rollout_max_num_batched_tokens=run.sampling.rollout_max_num_batched_tokens,
                    sequence_parallel=bool(run.model.sequence_parallel),
                    context_parallel=cp if cp > 1 else None)
    by_name = {name: value for part in dataclasses.fields(run) for name, value in
               vars(getattr(run, part.name)).items()}  # a field in several parts has one value
    flags = {k: by_name[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                     "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
                                     "n_samples_per_prompt", "max_prompt_length", "max_new_tokens",
                                     "max_length", "ppo_mini_batch_size", "use_distributed_optimizer",
                                     "offload_ref_reward", "offload_train_optimizer", "offload_train_grad",
                                     "offload_train_param", "recompute_granularity", "recompute_method",
                                     "recompute_num_layers", "recompute_modules", "attention",
                                     "max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch",
                                     "moe_routing_replay", "kl_coef", "reward_model_weight",
                                     "sequence_parallel", "context_parallel_size")}
    if flags["recompute_modules"] is not None:
        flags["recompute_modules"] = list(flags["recompute_modules"])  # as the command line gives it
    return Launch(name=path, stage=algorithm.stage, world=world, tp=tp, pp=pp, ep=ep, dp=world // (tp * pp * cp),
                  expert_dp=world // (pp * ep * etp), micro_batch_size=batch.micro_batch_size,
                  global_batch_size=batch.global_batch_size, n_samples=n,
                  prompt_cap=run.data.max_prompt_length, response_cap=run.sampling.max_new_tokens,
                  max_length=run.sampling.max_length, mini_batch=run.update.ppo_mini_batch_size, roles=roles,
                  levers=levers, flags=flags, state_only=bool(info.get("state_only")), cp=cp)


def layouts(launch: Launch) -> List[Tuple[int, int]]:
    """(PP, EP) layouts of the launcher's world and TP that its model splits into: PP dividing the layers, EP (a
    mixture of experts) dividing the experts, the world a multiple of TP x PP and of PP x EP, the prompts of an
    iteration dividing over DP; the launcher's first, then by growing PP, then EP."""
    shape = launch.roles[0].shape
    out = []
    for pp in range(1, shape.layers + 1):
        if shape.layers % pp or launch.world % (launch.tp * pp):
            continue
        dp = launch.world // (launch.tp * pp)
        if launch.global_batch_size % dp or launch.mini_batch % (dp * launch.micro_batch_size):
            continue
        for ep in ([e for e in range(1, shape.experts + 1) if shape.experts % e == 0 and launch.world % (pp * e) == 0]
                   if shape.experts else [1]):
            out.append((pp, ep))
    out.sort(key=lambda l: (l != (launch.pp, launch.ep), l[0], -l[1]))
    return out


def with_layout(launch: Launch, levers: Levers) -> Launch:
    """The launch at the levers' PP / EP / CP (DP, expert DP follow from the world). CP takes its ranks from DP
    (megatron's DP excludes them); where the world has too few devices for TP x PP x CP (DP 1 already), the world
    grows to TP x PP x CP devices at DP 1 (`world` says how many)."""
    pp, ep = levers.pipeline_parallel or launch.pp, levers.expert_parallel or launch.ep
    cp = levers.context_parallel or launch.cp
    if (pp, ep, cp) == (launch.pp, launch.ep, launch.cp):
        return launch
    world = max(launch.world, launch.tp * pp * cp)
    return replace(launch, pp=pp, ep=ep, cp=cp, world=world, dp=world // (launch.tp * pp * cp),
                   expert_dp=world // (pp * ep))


def micro_batch_shape(launch: Launch, levers: Levers, budget: Optional[int]) -> Tuple[float, int, float]:
    """(rows, row length, read positions) of the largest micro-batch, over all its CP ranks. By count:
    `--micro-batch-size` rows at the cap (a micro-batch with a response at the cap is that wide); packed: mbs / n
    prompt groups, each one row of prompt cap + n x response cap. With a token budget B (at least the widest row's
    share of a rank, width / CP: a budget counts the tokens one rank holds, `arguments._check_token_budgets`): B x CP
    tokens, as B x CP / cap rows of the cap (the largest sum of s^2 they can have), every token read (an upper
    bound: prompts can be short)."""
    n = launch.n_samples
    if levers.layout == "packed":  # --micro-batch-size a multiple of n (at least n)
        width, rows, read = launch.prompt_cap + n * launch.response_cap, max(1, launch.micro_batch_size // n), n
    else:
        width, rows, read = launch.prompt_cap + launch.response_cap, launch.micro_batch_size, 1
    if budget is None:
        return rows, width, rows * read * launch.response_cap
    budget = max(budget, -(-width // launch.cp)) * launch.cp
    return budget / width, width, float(budget)


def model_states(launch: Launch, levers: Levers, table: StateBytes, stage: int) -> Dict[str, Dict[str, float]]:
    """Bytes of every role's model state on one rank of `stage` in each phase: `rollout`, `passes` (old / reference
    log-probs, values, scores) and `update.ROLE` for each trained role. A trained role holds every part of its state
    in its own update; otherwise the parts its --offload-train-* flags move (`roles.offload_parts`) are in host
    memory (their measured `left` fraction stays), except the critic's weights in the passes and the actor's update
    (on-loaded for its values pass, offloaded after its own update: stages/trl_ppo.py). A frozen role holds 2 B a
    parameter, or with --offload-ref-reward nothing outside its own pass (the passes phase holds the largest)."""
    from mindspeed_llm.rl.update.roles import offload_parts

    counts = {r.name: param_counts(r.shape, launch.tp, launch.pp, launch.ep, stage, r.value_head)
              for r in launch.roles}
    away = {r.name: offload_parts(_offload_args(levers.offload_flags), r.name) for r in launch.roles if r.trainable}

    def trained(role: Role, phase: str) -> float:
        total = 0.0
        for part in STATE_PARTS:
            # the distributed optimizer shards over megatron's dp_cp group (DP x CP: CP ranks hold whole layers)
            per_param = (counts[role.name]["dense"] * table.per_param(part, levers.distributed_optimizer,
                                                                      launch.dp * launch.cp)
                         + counts[role.name]["expert"] * table.per_param(part, levers.distributed_optimizer,
                                                                        launch.expert_dp))
            on_device = 1.0
            if phase != f"update.{role.name}" and part in away[role.name] and not (
                    role.name == "critic" and part == "weights" and phase != "rollout"):
                on_device = table.left.get(role.name, {}).get(part, 0.0)
            total += per_param * on_device
        return total

    def frozen(role: Role, phase: str) -> float:
        return 0.0 if role.offloadable and levers.offload_ref_reward else table.frozen * counts[role.name]["total"]

    phases = ["rollout", "passes"] + [f"update.{r.name}" for r in launch.roles if r.trainable]
    out = {phase: {r.name: (trained if r.trainable else frozen)(r, phase) for r in launch.roles} for phase in phases}
    onloaded = [table.frozen * counts[r.name]["total"] for r in launch.roles
                if not r.trainable and r.offloadable and levers.offload_ref_reward]
    out["passes"]["on-loaded for its pass"] = max(onloaded or [0.0])
    return out
