"""The lane markers (by folder: tests/unit -> `unit`, tests/dist -> `dist`) and the session fixtures shared by the
stage tests (the data tests import theirs from tests/helpers/fixtures_data.py). Map: tests/README.md."""

from pathlib import Path

import pytest

LANES = {name: Path(__file__).parent / name for name in ("unit", "dist")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        for lane, folder in LANES.items():
            if folder in path.parents:
                item.add_marker(lane)


@pytest.fixture(scope="module")
def warm_ranks():
    """The module's `run_distributed` bodies share processes, kept for this module alone
    (`tests/helpers/multiproc.py`); a module asks with `pytest.mark.usefixtures("warm_ranks")`."""
    from tests.helpers import multiproc

    with multiproc.warm_ranks():
        yield


@pytest.fixture(scope="session")
def stage_paths(tmp_path_factory):
    """Tokenizer, tiny HF policy/reward, their Megatron conversions (TP/PP 1x1, 2x1, 1x2), prompts."""
    from tests.helpers import stage_assets

    return stage_assets.build(tmp_path_factory.mktemp("stage_assets"))


@pytest.fixture(scope="session")
def model_state_runs(tmp_path_factory):
    """The DP2 stage runs of the distributed optimizer and offload tests, one spawn for both modules
    (`tests/helpers/model_state_runs.py`)."""
    from tests.helpers import model_state_runs

    return model_state_runs.build(tmp_path_factory)
