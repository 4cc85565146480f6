"""The memory benchmark of one RL training step (`benchmarks/memory.py` is its command line and describes it): `shapes`
(the data), `measure` / `measure_state` / `peak_checks` (measurement), `micro_batching`, `fit`, `launch` /
`projection` (the projection of every launcher), `cases` / `analyse` (the run and its analyses), `report`.

Below: the names its tests and `benchmarks/lora_memory.py` use, from the module of each."""

from benchmarks.step_memory.fit import predict_layer_saved
from benchmarks.step_memory.launch import (
    RULE_BYTES, Launch, Levers, Role, StateBytes, model_states, param_counts, read_launcher,
)
from benchmarks.step_memory.measure import free_port, init_process
from benchmarks.step_memory.micro_batching import micro_batch_costs, plan_micro_batch_tokens, skewed_mix
from benchmarks.step_memory.projection import FIT_MARGIN, lever_flags, project, recommend
from benchmarks.step_memory.shapes import GB, LAUNCHERS, MODELS, RECOMPUTE, Shape, model_shape

__all__ = [
    "predict_layer_saved", "RULE_BYTES", "Launch", "Levers", "Role", "StateBytes", "model_states", "param_counts",
    "read_launcher", "free_port", "init_process", "micro_batch_costs", "plan_micro_batch_tokens", "skewed_mix",
    "FIT_MARGIN", "lever_flags", "project", "recommend", "GB", "LAUNCHERS", "MODELS", "RECOMPUTE", "Shape",
    "model_shape",
]
