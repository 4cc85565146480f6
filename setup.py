"""MindSpeed-LLM RL post-training stages (trl_ppo, grpo) for Megatron core."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements(name):
    lines = (HERE / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-r"))]


setup(
    name="mindspeed_llm",
    version="0.1.0",
    description="In-process PPO / GRPO post-training stages for Megatron core",
    python_requires=">=3.10",
    packages=find_packages(include=["mindspeed_llm", "mindspeed_llm.*"]),
    py_modules=["posttrain_gpt", "preprocess_data", "convert_ckpt"],
    install_requires=_requirements("requirements.txt"),
    extras_require={
        "test": _requirements("requirements-test.txt"),
        # pip install mindspeed_llm[wandb]: --wandb-project (the pin the tests ran, from requirements-test.txt)
        "wandb": [r for r in _requirements("requirements-test.txt") if r.startswith("wandb==")],
    },
)
