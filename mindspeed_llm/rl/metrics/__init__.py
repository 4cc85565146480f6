"""Metrics of the RL stages, one job a module: `timers.py` (``timing/<stage>``), `formulas.py` (throughputs,
mean / min / max, role prefixes), `reduction.py` (over the DP ranks), `writers.py` (stdout, JSONL, TensorBoard).

Metric names follow MindSpeed-RL's GRPO / PPO logs: ``timing/<stage>`` (all, rollout, old_log_p,
reference_model, reward_model, rule_reward, critic_model, adv, update, update_critic), ``actor/*``,
``critic/*``, ``grpo/*``, ``response_length/{mean,min,max}``, ``prompt_length/{mean,min,max}`` and the
throughputs ``e2e_tps``, ``update_tps`` and ``vllm_tps`` (alias ``rollout_tps``).
"""

from mindspeed_llm.rl.metrics.formulas import (masked_mean_min_max, mean_min_max, prefixed, throughput_metrics,
                                               tool_response_length)
from mindspeed_llm.rl.metrics.progress import Progress
from mindspeed_llm.rl.metrics.reduction import reduce_metrics
from mindspeed_llm.rl.metrics.timers import TIMING_PREFIX, Timers
from mindspeed_llm.rl.metrics.writers import MetricsLogger, format_log_line

__all__ = [
    "Timers", "TIMING_PREFIX", "throughput_metrics", "mean_min_max", "masked_mean_min_max", "prefixed", "reduce_metrics", "MetricsLogger",
    "tool_response_length",
    "format_log_line", "Progress",
]
