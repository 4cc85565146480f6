"""In-process RL post-training stages (trl_ppo, grpo) for Megatron core.

Importing the package has no side effects; entry points call `mindspeed_llm.device.setup()`
which picks the accelerator and applies the Megatron patches that device needs.
"""

__version__ = "0.1.0"
