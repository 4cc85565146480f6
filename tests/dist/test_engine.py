"""`rl/update/trainable.py`'s step guards, on a tiny model in one process: NaN / inf gradients behind a finite loss
stop the step before the optimizer moves (the guard reduces each gradient buffer to its norm first, and counts the bad
values only when that is not finite), and a step that moves the weights by more than half their norm is divergence.
(Stage-level runs of both guards: tests/dist/test_stages_faults.py, tests/dist/test_stages_errors.py.)"""

import pytest

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


def _guards(rank, world_size):
    import torch

    from mindspeed_llm import distributed
    from mindspeed_llm.checkpoint.errors import DivergenceError, NonFiniteError
    from mindspeed_llm.models import build_model
    from mindspeed_llm.models.architecture import ArchitectureSpec
    from mindspeed_llm.rl.model_settings import OptimizerSettings
    from mindspeed_llm.rl.update.trainable import TrainableModel

    distributed.initialize(1, 1, seed=3)
    spec = ArchitectureSpec(family="llama", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            num_query_groups=4, kv_channels=8, vocab_size=64, max_position_embeddings=32)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": tokens, "position_ids": torch.arange(6).repeat(2, 1)}]

    def nan_gradients(output, micro_batch):  # a finite loss (0) whose gradient is NaN everywhere
        out = output.float()
        return torch.where(out > 1e30, torch.sqrt(-out), torch.zeros_like(out)).sum(), {}

    def plain(output, micro_batch):
        return output.float().pow(2).mean(), {}

    results = {}
    model = TrainableModel(build_model(spec), OptimizerSettings(lr=1e-3, optimizer="sgd", clip_grad=0.0),
                           name="actor")
    before = [p.detach().clone() for p in model.module.parameters()]
    try:
        model.train_step(batch, nan_gradients)
        results["nan"] = None
    except NonFiniteError as exc:
        results["nan"] = str(exc)
    results["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    results["plain"] = model.train_step(batch, plain)["grad_norm"]  # a finite step goes through

    huge = TrainableModel(build_model(spec), OptimizerSettings(lr=1e6, optimizer="sgd", clip_grad=0.0), name="actor")
    try:
        huge.train_step(batch, plain)
        results["diverged"] = None
    except DivergenceError as exc:
        results["diverged"] = str(exc)
    unguarded = TrainableModel(build_model(spec), OptimizerSettings(lr=1e6, optimizer="sgd", clip_grad=0.0),
                               name="actor", check_divergence=False)
    unguarded.train_step(batch, plain)  # --no-check-for-divergence trains on
    return results


def test_step_guards():
    results = run_distributed(_guards, 1)[0]
    assert results["nan"] is not None and "gradient values are NaN or inf" in results["nan"], results["nan"]
    assert "the loss is" not in results["nan"]  # the loss itself was finite
    assert results["unchanged"], "the optimizer stepped on NaN gradients"
    assert results["plain"] > 0
    assert results["diverged"] is not None and "the update diverged" in results["diverged"]


if __name__ == "__main__":
    pytest.main([__file__])
