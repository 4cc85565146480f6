"""`rl/experience.py`: `Experience.select` / `Experience.concat` and the per-sample data (`SampleData`) they carry,
on hand-built batches. (The DP-gathered refill they serve: tests/dist/test_stages_dynamic_sampling.py; the routing
padding: tests/dist/test_routing_replay.py.)"""

import pytest
import torch

from mindspeed_llm.rl.experience import Experience, SampleData


def _experience(prompts, responses, tag):
    """Rows of prompt lengths `prompts` and response lengths `responses`; every token of row b is `tag * 10 + b`,
    padding 0; scores b; per-sample data named after (tag, b)."""
    B = len(prompts)
    T, R = max(p + r for p, r in zip(prompts, responses)), max(responses)
    tokens, resp, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, :p + r] = tag * 10 + b
        resp[b, :r] = tag * 10 + b
        mask[b, :r] = 1
    exp = Experience(tokens=tokens, position_ids=torch.arange(T).expand(B, T), prompt_lengths=torch.tensor(prompts),
                     responses=resp, response_mask=mask, ended_with_eos=torch.ones(B, dtype=torch.bool),
                     rollout_logp=-mask * (tag + 1))
    exp.scores = torch.arange(B, dtype=torch.float32) + 10 * tag
    exp.sample_data = SampleData(
        labels=[f"{tag}/{b}" for b in range(B)], indices=[100 * tag + b for b in range(B)],
        texts=[f"text {tag}/{b}" for b in range(B)], finish_reasons=["eos"] * B,
        columns={"difficulty": [tag + b / 10 for b in range(B)], "tools": [[f"t{tag}{b}"] for b in range(B)]})
    return exp


def test_select_picks_rows_of_every_tensor_and_every_per_sample_column():
    exp = _experience([2, 3, 1], [1, 3, 2], tag=1)
    picked = exp.select(torch.tensor([2, 0]), device="cpu")
    assert picked.batch_size == 2
    assert torch.equal(picked.tokens, exp.tokens[[2, 0]]) and torch.equal(picked.scores, torch.tensor([12.0, 10.0]))
    assert torch.equal(picked.rollout_logp, exp.rollout_logp[[2, 0]])
    assert picked.sample_data == SampleData(labels=["1/2", "1/0"], indices=[102, 100], texts=["text 1/2", "text 1/0"],
                                            finish_reasons=["eos", "eos"],
                                            columns={"difficulty": [1.2, 1.0], "tools": [["t12"], ["t10"]]})
    assert exp.batch_size == 3 and exp.sample_data.labels == ["1/0", "1/1", "1/2"]  # the source is unchanged


def test_concat_pads_to_the_widest_row_then_cuts_to_what_the_rows_need():
    short, wide = _experience([2, 2], [1, 2], tag=1), _experience([3, 4], [4, 1], tag=2)
    joined = Experience.concat([short.select(torch.tensor([1])), wide.select(torch.tensor([0]))], "cpu")
    # row 0: prompt 2 + response 2; row 1: prompt 3 + response 4 -> T = 7, R = 4
    assert joined.tokens.shape == (2, 7) and joined.responses.shape == (2, 4)
    assert joined.tokens[0].tolist() == [11] * 4 + [0] * 3 and joined.tokens[1].tolist() == [20] * 7
    assert joined.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert joined.rollout_logp.tolist() == [[-2, -2, 0, 0], [-3, -3, -3, -3]]
    assert torch.equal(joined.position_ids, torch.arange(7).expand(2, 7))
    assert torch.equal(joined.loss_mask, joined.response_mask)
    assert joined.scores.tolist() == [11.0, 20.0]
    assert joined.sample_data == SampleData(labels=["1/1", "2/0"], indices=[101, 200], texts=["text 1/1", "text 2/0"],
                                            finish_reasons=["eos", "eos"],
                                            columns={"difficulty": [1.1, 2.0], "tools": [["t11"], ["t20"]]})
    # rows only ever narrower than their source: the joined batch of one wide row's narrow neighbour is cut
    alone = Experience.concat([wide.select(torch.tensor([1]))], "cpu")
    assert alone.tokens.shape == (1, 5) and alone.responses.shape == (1, 1)


def test_concat_drops_what_a_part_lacks():
    a, b = _experience([2], [1], tag=1), _experience([2], [2], tag=2)
    b.scores, b.rollout_logp = None, None
    b.sample_data.texts = None
    b.sample_data.columns.pop("tools")
    joined = Experience.concat([a, b], "cpu")
    assert joined.scores is None and joined.rollout_logp is None
    assert joined.sample_data.texts is None and joined.sample_data.labels == ["1/0", "2/0"]
    assert joined.sample_data.columns == {"difficulty": [1.0, 2.0]}


def test_sample_data_of_prompts_takes_labels_indices_and_the_dataset_columns():
    rows = [dict(input_ids=[1, 2], labels="4", index=7, position=0, difficulty="easy"),
            dict(input_ids=[3], labels=None, index=9, position=1, difficulty="hard")]
    data = SampleData.of_prompts([rows[0], rows[0], rows[1]], finish_reasons=["eos", "stop", "length"],
                                 texts=["a", "b", "c"])
    assert data == SampleData(labels=["4", "4", None], indices=[7, 7, 9], texts=["a", "b", "c"],
                              finish_reasons=["eos", "stop", "length"],
                              columns={"difficulty": ["easy", "easy", "hard"]})


@pytest.mark.parametrize("extra", [dict(sample_ids=[5, 6]), dict(started=[1, 2])])
def test_a_field_rides_through_select_and_concat_by_the_one_rule(extra):
    data = SampleData(labels=["x", "y"], **extra)
    (name, values), = extra.items()
    assert getattr(data.select([1]), name) == values[1:]
    assert getattr(SampleData.concat([data, data.select([0])]), name) == values + values[:1]
