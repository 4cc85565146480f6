"""PromptSampler / PromptDataLoader: deterministic order, DP sharding, exact resume."""
import json

import pytest

from tests.helpers.fixtures_data import preprocessed, qwen_tok, qwen_tok_dir  # noqa: F401

from mindspeed_llm.data import DataError, NotEnoughPromptsError, PromptDataLoader, PromptDataset, PromptSampler


def take(sampler, n):
    return [sampler.next_batch_indices() for _ in range(n)]


def test_same_seed_same_order_other_seed_other_order():
    a = take(PromptSampler(103, 8, seed=7), 30)
    b = take(PromptSampler(103, 8, seed=7), 30)
    c = take(PromptSampler(103, 8, seed=8), 30)
    assert a == b and a != c


def test_each_epoch_is_a_fresh_permutation_of_full_batches():
    s = PromptSampler(103, 8, seed=3)
    assert s.batches_per_epoch == 12
    epochs = [sum(take(s, 12), []) for _ in range(3)]
    for e in epochs:
        assert len(e) == len(set(e)) == 96 and set(e) <= set(range(103))
    assert epochs[0] != epochs[1]
    assert s.epoch == 3 and s.iteration == 36 and s.consumed_samples == 288


def test_no_shuffle_is_sequential():
    s = PromptSampler(10, 4, shuffle=False)
    assert take(s, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_dp_ranks_split_each_global_batch_disjointly(dp_size):
    gbs = 16
    ranks = [PromptSampler(100, gbs, dp_rank=r, dp_size=dp_size, seed=11) for r in range(dp_size)]
    reference = PromptSampler(100, gbs, seed=11)
    for _ in range(20):
        shares = [r.next_batch_indices() for r in ranks]
        assert all(len(s) == gbs // dp_size for s in shares)
        flat = sum(shares, [])
        assert len(set(flat)) == gbs
        assert flat == reference.next_batch_indices()  # the global batch does not depend on dp_size


def test_resume_sees_exactly_the_uninterrupted_prompts():
    full = PromptSampler(50, 12, dp_rank=1, dp_size=3, seed=5)
    expected = take(full, 25)
    first = PromptSampler(50, 12, dp_rank=1, dp_size=3, seed=5)
    got = take(first, 9)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON / torch.save checkpoint
    resumed = PromptSampler(50, 12, dp_rank=1, dp_size=3, seed=5)
    resumed.load_state_dict(state)
    got += take(resumed, 16)
    assert got == expected
    assert resumed.state_dict() == full.state_dict()


def test_resume_with_another_dp_size_continues_the_same_global_batches():
    a = PromptSampler(64, 8, dp_rank=0, dp_size=2, seed=1)
    take(a, 5)
    ref = PromptSampler(64, 8, seed=1)
    take(ref, 5)
    ranks = [PromptSampler(64, 8, dp_rank=r, dp_size=4, seed=1) for r in range(4)]
    for r in ranks:
        r.load_state_dict(a.state_dict())
    for _ in range(6):
        assert sum((r.next_batch_indices() for r in ranks), []) == ref.next_batch_indices()


def test_sampler_argument_errors():
    with pytest.raises(NotEnoughPromptsError, match="7 prompts, fewer than one global batch of 8"):
        PromptSampler(7, 8)
    with pytest.raises(DataError, match="not divisible"):
        PromptSampler(100, 10, dp_size=4)
    with pytest.raises(DataError, match="dp_rank"):
        PromptSampler(100, 8, dp_rank=2, dp_size=2)
    s = PromptSampler(100, 8, seed=1)
    with pytest.raises(DataError, match="seed=2"):
        s.load_state_dict(PromptSampler(100, 8, seed=2).state_dict())
    with pytest.raises(DataError, match="dataset_len=90"):
        s.load_state_dict(PromptSampler(90, 8, seed=1).state_dict())


def test_loader_over_preprocessed_prompts_resumes_exactly(preprocessed):
    prefix, _ = preprocessed["deepscaler_r1"]
    ds = PromptDataset(prefix)
    full = PromptDataLoader(ds, global_batch_size=8, dp_rank=1, dp_size=2, seed=42)
    expected = [full.next_batch() for _ in range(12)]  # crosses the epoch boundary (5 batches/epoch)
    part = PromptDataLoader(ds, global_batch_size=8, dp_rank=1, dp_size=2, seed=42)
    got = [part.next_batch() for _ in range(4)]
    resumed = PromptDataLoader(PromptDataset(prefix), global_batch_size=8, dp_rank=1, dp_size=2, seed=42)
    resumed.load_state_dict(part.state_dict())
    got += [resumed.next_batch() for _ in range(8)]
    assert got == expected
    for batch in got:
        assert len(batch) == 4
        for item in batch:
            assert isinstance(item["labels"], str) and item["input_ids"][-3:] == [151644, 77091, 198]
    with pytest.raises(NotEnoughPromptsError):
        PromptDataLoader(ds, global_batch_size=64)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_no_shuffle_is_dataset_order_at_any_dp_size_epoch_after_epoch(dp_size):
    """--no-shuffle: the global batches are the dataset's prompts in order (the last partial batch of an epoch
    dropped, as with shuffling), the same at every DP size, each rank its contiguous share."""
    ranks = [PromptSampler(10, 4, dp_rank=r, dp_size=dp_size, seed=9, shuffle=False) for r in range(dp_size)]
    expected = [[0, 1, 2, 3], [4, 5, 6, 7]] * 3
    for batch in expected:
        shares = [r.next_batch_indices() for r in ranks]
        assert sum(shares, []) == batch


def test_no_shuffle_resumes_exactly_and_refuses_a_shuffled_resume():
    full = PromptSampler(11, 4, dp_rank=1, dp_size=2, seed=5, shuffle=False)
    expected = take(full, 7)
    first = PromptSampler(11, 4, dp_rank=1, dp_size=2, seed=5, shuffle=False)
    got = take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(11, 4, dp_rank=1, dp_size=2, seed=5, shuffle=False)
    resumed.load_state_dict(state)
    assert got + take(resumed, 4) == expected
    with pytest.raises(DataError, match="the checkpoint has shuffle=False, this run has True"):
        PromptSampler(11, 4, dp_rank=1, dp_size=2, seed=5).load_state_dict(state)


def test_the_trainer_builds_the_order_no_shuffle_asks_for():
    from types import SimpleNamespace

    from mindspeed_llm.arguments import build_parser
    from mindspeed_llm.rl.preflight import prompt_sampler

    def order(*flags):
        required = ["--stage", "grpo", "--global-batch-size", "4", "--train-iters", "1", "--data-path", "d"]
        no_shuffle = build_parser().parse_args([*required, *flags]).no_shuffle
        args = SimpleNamespace(global_batch_size=4, seed=3, no_shuffle=no_shuffle)
        return sum(take(prompt_sampler(args, 12, 0, 1), 3), [])

    assert order("--no-shuffle") == list(range(12))
    assert sorted(order()) == list(range(12)) and order() != list(range(12))
