"""TRL 1.12's GRPO loss as a reference: a `GRPOTrainer` made without `__init__`, with just the attributes its
`_compute_loss` reads (`trl_grpo`), for the TRL parity tests of the loss and of LoRA training."""

import types
import warnings
from collections import defaultdict

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.trainer.grpo_trainer import GRPOTrainer


def trl_grpo(loss_type, beta, entropy_coef, temperature, eps, eps_high, max_completion_length, model, gas, spg,
             importance_sampling_level="token", vllm_is=False):
    trainer = object.__new__(GRPOTrainer)  # no __init__: only the attributes _compute_loss reads
    accelerator = types.SimpleNamespace(
        num_processes=1,
        is_main_process=True,
        sync_gradients=True,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
    )
    attrs = {
        "accelerator": accelerator,
        "model": model,
        "model_kwarg_keys": (),
        "temperature": temperature,
        "loss_type": loss_type,
        "beta": beta,
        "epsilon_low": eps,
        "epsilon_high": eps_high,
        "importance_sampling_level": importance_sampling_level,
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "use_vllm": vllm_is,
        "vllm_importance_sampling_correction": vllm_is,
        "aux_loss_enabled": False,
        "max_completion_length": max_completion_length,
        "current_gradient_accumulation_steps": gas,
        "entropy_coef": entropy_coef,
        "use_adaptive_entropy": False,
        "_entropy_bonus_enabled": entropy_coef != 0.0,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "args": types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=spg),
    }
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer
