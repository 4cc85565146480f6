"""Session fixtures shared by the stage tests (the data tests keep theirs in fixtures_data.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def stage_paths(tmp_path_factory):
    """Tokenizer, tiny HF policy/reward, their Megatron conversions (TP/PP 1x1, 2x1, 1x2), prompts."""
    import stage_assets

    return stage_assets.build(tmp_path_factory.mktemp("stage_assets"))


@pytest.fixture(scope="session")
def model_state_runs(tmp_path_factory):
    """The DP2 stage runs of the distributed optimizer and offload tests, one spawn for both modules
    (`model_state_runs.py`)."""
    import model_state_runs

    return model_state_runs.build(tmp_path_factory)
