"""Checking the on-policy distillation flags (`--teacher-load`, `--distill-loss`, `--distill-mode`, `--distill-topk`,
`--distill-coef`) and resolving their defaults (`rl/settings.DistillSettings`; the teacher itself is
`rl/distillation.py`'s).

Each refusal names the flag and the fix: a --distill-* flag without --teacher-load (it would change nothing), k1 as a
loss (its gradient has no teacher in it), the loss mode in trl_ppo (its KL terms are rewards before GAE), --distill-topk
with a sampled-token estimator. Whether --distill-topk fits the vocabulary is checked when the teacher's checkpoint
is opened (`rl/update/roles.RoleFactory.teacher`), before its weights are built.
"""

from __future__ import annotations

from mindspeed_llm.errors import ArgumentError

DEFAULTS = dict(distill_loss="k1", distill_mode="reward", distill_coef=1.0)
DEFAULT_TOPK = 32
FLAGS = ("distill_loss", "distill_mode", "distill_topk", "distill_coef")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_distill(run) -> None:
    """Refuse the combinations that cannot work and fill in the defaults (on `run`, validation's view of the
    Namespace)."""
    if not run.teacher_load:
        given = [f"{_flag(name)} {getattr(run, name)}" for name in FLAGS if getattr(run, name) is not None]
        if given:
            raise ArgumentError(f"{', '.join(given)} without --teacher-load: distillation needs a teacher; add "
                                "--teacher-load PATH (a Megatron checkpoint of the same vocabulary) or drop "
                                f"{'them' if len(given) > 1 else 'it'}")
        return
    for name, value in DEFAULTS.items():
        if getattr(run, name) is None:
            setattr(run, name, value)
    loss, mode = run.distill_loss, run.distill_mode
    if loss == "k1" and mode == "loss":
        raise ArgumentError("--distill-loss k1 cannot be --distill-mode loss: its gradient is that of the student's "
                            "log-prob alone, with no teacher in it; use --distill-loss k3 or topk_forward_kl as a "
                            "loss, or --distill-mode reward")
    if run.stage == "trl_ppo" and mode == "loss":
        raise ArgumentError("--distill-mode loss is grpo's: --stage trl_ppo takes the distillation as a per-token "
                            "reward (with the KL penalty, before GAE); use --distill-mode reward")
    if loss == "topk_forward_kl":
        if run.distill_topk is None:
            run.distill_topk = DEFAULT_TOPK
    elif run.distill_topk is not None:
        raise ArgumentError(f"--distill-topk {run.distill_topk} applies to --distill-loss topk_forward_kl, not to "
                            f"--distill-loss {loss} (the sampled tokens' log-probs); drop it or use topk_forward_kl")
