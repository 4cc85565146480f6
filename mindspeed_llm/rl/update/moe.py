"""Mixture-of-experts handling of the RL stages, in one place: the run's MoE options for `build_model`, the
padding mask the routers read, and the MoE metrics of an update.

Load-balancing (aux) loss. Megatron's router adds it during training forwards only (train mode, gradients on), so
frozen models (reference, reward), rollouts and the log-prob / value passes never add or track it. It reaches the
gradient through `MoEAuxLossAutoScaler`, whose scale Megatron's schedule sets to grad_scale / M for each of a rank's
M micro-batches; DDP then averages over the DP ranks. The policy / value loss shares are already divided by the
step's global counts, and `engine.schedule_loss_scale` undoes both of those divisions for them only, so a step's
gradient is that of

    sum of the loss shares  +  coeff x mean over the step's micro-batches (all DP ranks) of sum over MoE layers of
                                        aux_l(micro-batch)

where aux_l = E / (k T^2) x sum_e (sum_t p_te)(sum_t m_te) is Megatron's Switch-Transformer loss of layer l over the
micro-batch's T real tokens (p: router softmax, m: top-k map; padding is masked out by `padding_mask`). Every rank
holds the same number of micro-batches in a step (`ppo_loop` deals equal shares), so this is Megatron-LM's own
weighting (one aux loss per micro-batch, averaged), whatever the DP size.

Metrics (`UpdateStats`, per trained MoE role, over one `ppo_update`):
  moe/<loss name>          Megatron's tracked load-balancing loss (`load_balancing_loss`, `seq_load_balancing_loss`
                           or `global_load_balancing_loss`, without its coefficient): averaged over MoE layers and
                           over all micro-batches of the update on all DP ranks, as Megatron-LM logs it;
                           absent with --moe-router-load-balancing-type none or a zero coefficient.
  moe/tokens_per_expert_min / _max
                           c[l, e] = token-to-expert assignments of expert e in MoE layer l over the update's
                           forwards (real tokens only; each token counts top-k times), summed over the DP ranks
                           (EP ranks included; and the TP ranks under sequence parallelism, where each routes its
                           share of the sequence): the smallest and largest c[l, e].
  moe/expert_imbalance     max over layers of max_e c[l, e] / mean_e c[l, e] (1 = perfectly balanced).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.models import ArchitectureSpec
from mindspeed_llm.models.builder import grouped_gemm_kernel
from mindspeed_llm.rl.model_settings import MoESettings

# Megatron's tracker name of each load-balancing type's loss.
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def model_options(spec: ArchitectureSpec, moe: MoESettings, flag: str, root: str, policy: bool) -> Dict[str, object]:
    """`build_model` overrides for the run's MoE flags (empty for a dense model). `policy`: a causal LM (actor or
    reference), the models --moe-routing-replay applies to."""
    if policy and not spec.is_moe:
        # the critic / reward model may be dense next to an MoE actor (they ignore the expert groups), the policy not
        if moe.moe_routing_replay:
            raise ArgumentError(f"--moe-routing-replay needs a mixture-of-experts actor, but {flag} {root} is a "
                                f"dense {spec.family} model; drop the flag")
        if moe.expert_parallel_size > 1:
            raise ArgumentError(f"--expert-model-parallel-size {moe.expert_model_parallel_size} "
                                f"needs a mixture-of-experts actor, but {flag} {root} is a dense {spec.family} "
                                "model; drop the flag")
    if not spec.is_moe:
        return {}
    cp = moe.context_parallel_size
    if cp > 1:
        raise ArgumentError(f"--context-parallel-size {cp}: {flag} {root} is a mixture of experts, which this build "
                            "runs without context parallelism (its load-balancing loss, padding mask, metrics and "
                            "routing replay count the tokens of whole sequences); use --context-parallel-size 1 "
                            "with --sequence-parallel and expert parallelism")
    coeff = moe.moe_aux_loss_coeff
    coeff = spec.moe_aux_loss_coeff if coeff is None else coeff  # the flag, else the checkpoint's (HF config)
    options = dict(
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(coeff),
        moe_grouped_gemm=bool(moe.moe_grouped_gemm),
    )
    if moe.moe_routing_replay and policy:
        options["moe_enable_routing_replay"] = True
    return options


def startup_notes(moe: MoESettings) -> List[str]:
    """What rank 0 prints once about the MoE flags (empty when nothing needs saying)."""
    if moe.moe_grouped_gemm and grouped_gemm_kernel() is None:
        return ["--moe-grouped-gemm: the experts run as megatron's SequentialMLP (the same math, one matmul per "
                "expert); the grouped kernel path (grouped_gemm, fused expert weights) is not wired in this build"]
    return []


def check_trainable(model, tp: int, name: str, flag: str, sequence_parallel: bool = False) -> None:
    """A MoE model is trained at TP > 1 only under --sequence-parallel: megatron-core refuses MoE training
    forwards with tensor parallelism otherwise (its MoE layer raises in train mode)."""
    spec = model.model_spec
    if spec.is_moe and tp > 1 and not sequence_parallel:
        raise ArgumentError(
            f"the {name} ({flag}) is a mixture-of-experts model, which megatron-core trains with "
            f"--tensor-model-parallel-size {tp} only together with --sequence-parallel; add --sequence-parallel, or "
            f"use --tensor-model-parallel-size 1 and split the experts with --expert-model-parallel-size")


def is_moe(model) -> bool:
    from megatron.core.utils import unwrap_model

    spec = getattr(unwrap_model(model), "model_spec", None)
    return bool(spec is not None and spec.is_moe)


def padding_mask(micro_batch, width: Optional[int] = None) -> Optional[torch.Tensor]:
    """`[rows, S]` True at the model rows' padding (megatron's MoE `padding_mask`): a row's real tokens are its
    prompt `[0, P)` and each of its samples' responses, which end at the sample's `last_token_index` (rows or
    packed groups alike, `batch_plan`); `width`: S when the forward pads the rows wider (sequence parallelism)."""
    if not all(k in micro_batch for k in ("prompt_lengths", "response_mask", "last_token_index", "row_index")):
        return None  # not a `batch_plan` micro-batch: every position counts
    tokens = micro_batch["tokens"]
    rows, width = tokens.shape[0], tokens.shape[1] if width is None else width
    s = torch.arange(width, device=tokens.device)[None, :]
    last = micro_batch["last_token_index"][:, None]
    length = micro_batch["response_mask"].sum(-1).long()[:, None]
    real = (s < micro_batch["prompt_lengths"][:, None]) | ((s > last - length) & (s <= last))  # [samples, S]
    per_row = torch.zeros((rows, width), dtype=torch.int32, device=tokens.device)
    per_row.index_add_(0, micro_batch["row_index"], real.int())
    return per_row == 0


def _routers(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class UpdateStats:
    """The MoE metrics of one update of a trained model (see the module doc). Use as a context manager around
    the update's train steps, counting its micro-batches with `micro_batches(n)`; `metrics()` after it (a
    collective: every rank calls it)."""

    def __init__(self, model):
        from megatron.core.utils import unwrap_model

        core = unwrap_model(model)
        self.spec: Optional[ArchitectureSpec] = getattr(core, "model_spec", None)
        self.enabled = bool(self.spec is not None and self.spec.is_moe)
        self.routers = _routers(core) if self.enabled else []
        self.num_layers = core.config.num_layers if self.enabled else 0
        self.loss_name = LOSS_NAMES.get(core.config.moe_router_load_balancing_type) if self.enabled else None
        self.coeff = float(core.config.moe_aux_loss_coeff or 0.0) if self.enabled else 0.0
        # under sequence parallelism each TP rank's routers see its share of the tokens
        self.sequence_parallel = bool(self.enabled and core.config.sequence_parallel)
        # Kept on the model's device and read once in metrics(): a host copy per router forward would be a
        # device sync in every MoE layer of every training micro-batch.
        from mindspeed_llm import device

        self.counts = torch.zeros(self.num_layers, self.spec.num_experts if self.enabled else 0, dtype=torch.long,
                                  device=device.current_device())
        self.num_micro_batches = 0
        self._handles = []

    def _count(self, router, inputs, output):
        if not (router.training and torch.is_grad_enabled()):
            return
        routing_map = output[1]  # [tokens, experts] (s, b) order
        pad = inputs[1] if len(inputs) > 1 else None
        if pad is not None:
            routing_map = routing_map & ~pad.reshape(-1, 1)
        self.counts[router.layer_number - 1] += routing_map.sum(0).detach().to(self.counts.dtype)

    def micro_batches(self, count: int) -> None:
        self.num_micro_batches += count

    def __enter__(self):
        if self.enabled:
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            clear_aux_losses_tracker()
            self._handles = [r.register_forward_hook(self._count) for r in self.routers]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def metrics(self) -> Dict[str, float]:
        if not self.enabled:
            return {}
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        moe_layers = [i for i, on in enumerate(self.spec.moe_layers()) if on]
        out: Dict[str, float] = {}
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        if self.loss_name is not None and self.coeff > 0:
            # Megatron's tracker: per layer, the sum of this rank's micro-batch losses (pipeline stages hold
            # disjoint layers: summed; DP ranks: averaged, as reduce_aux_losses_tracker_across_ranks does).
            entry = get_moe_layer_wise_logging_tracker().get(self.loss_name)
            values = torch.zeros(self.num_layers, dtype=torch.float64)
            if entry is not None:
                values += entry["values"].detach().double().cpu()
            values = _all_reduce(values, pp_group)
            if entry is not None and entry.get("reduce_group") is not None:
                # megatron's own reduction: each TP (x CP) rank's loss is its tokens' share of the layer's loss
                values = _all_reduce(values, entry["reduce_group"])
            values = _all_reduce(values, dp_group) / dist.get_world_size(dp_group)
            per_micro_batch = float(values[moe_layers].sum()) / max(self.num_micro_batches, 1)
            out[f"moe/{self.loss_name}"] = per_micro_batch / len(moe_layers)
            clear_aux_losses_tracker()
        counts = _all_reduce(_all_reduce(self.counts.clone(), dp_group), pp_group)
        if self.sequence_parallel:
            counts = _all_reduce(counts, parallel_state.get_tensor_model_parallel_group())
        counts = counts[moe_layers].double().cpu()  # [L_moe, E]
        mean = counts.mean(dim=1).clamp(min=1e-12)
        out["moe/tokens_per_expert_min"] = float(counts.min())
        out["moe/tokens_per_expert_max"] = float(counts.max())
        out["moe/expert_imbalance"] = float((counts.max(dim=1).values / mean).max())
        return out


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        from mindspeed_llm import device

        moved = tensor.to(device.current_device())
        dist.all_reduce(moved, group=group)
        return moved.cpu()
    return tensor


@contextlib.contextmanager
def update_stats(model):
    """`with update_stats(model) as stats:` around an update (see `UpdateStats`)."""
    stats = UpdateStats(model)
    with stats:
        yield stats
