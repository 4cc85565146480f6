"""The sample tables (`metrics/samples.py`, `MetricsLogger.log_samples`), the rollout dump's files and their reading
back (`rollouts/dump.py`), the replay's refusals (`rollouts/replay.py`), and the flags' checks
(`arguments/observability.check_rollout_records`), in one process. The end-to-end runs (the same rows at every layout, a replay bit for bit) are
tests/dist/test_evaluation_dist.py's."""

import json
from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm import distributed
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.rollouts import dump as rollout_dump
from mindspeed_llm.rl.rollouts.replay import ReplayRollouts
from mindspeed_llm.rl.experience import Experience, SampleData
from mindspeed_llm.rl.metrics import MetricsLogger
from mindspeed_llm.rl.metrics.samples import TRAIN_COLUMNS, eval_rows, first_rows, markdown_table, rollout_rows
from mindspeed_llm.rl.rollouts.base import PromptSource


class _CharTokenizer:
    """ids are character codes (what `decode` is asked for is all a table needs)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _experience():
    """Two samples of one prompt "ab" (ids 97, 98): responses "xyz" (EOS) and "q|\\n" (cut at the length)."""
    tokens = torch.tensor([[97, 98, 120, 121, 122], [97, 98, 113, 124, 10]])
    exp = Experience(tokens=tokens, position_ids=torch.arange(5).expand(2, 5), prompt_lengths=torch.tensor([2, 2]),
                     responses=tokens[:, 2:], response_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0]]),
                     ended_with_eos=torch.tensor([True, False]), rollout_logp=torch.tensor([[-1.0, -2, -3]] * 2))
    exp.scores = torch.tensor([1.0, -0.5])
    exp.sample_data = SampleData(labels=["7", "7"], indices=[11, 11], texts=["xyz", "q|\n"],
                                 finish_reasons=["eos", "length"], sample_ids=[0, 1],
                                 score_parts=[{"acc": 1.0}, {"acc": 0.0, "missing_eos_penalty": -0.5}])
    return exp


def test_rollout_rows_are_the_samples_as_a_person_reads_them():
    rows = rollout_rows(_experience(), _CharTokenizer(), limit=5, first_sample=4)
    assert rows == [
        {"sample": 4, "prompt_index": 11, "score": 1.0, "score_parts": {"acc": 1.0}, "prompt": "ab", "response": "xyz",
         "label": "7", "response_length": 3, "finish_reason": "eos"},
        {"sample": 5, "prompt_index": 11, "score": -0.5, "score_parts": {"acc": 0.0, "missing_eos_penalty": -0.5},
         "prompt": "ab", "response": "q|\n", "label": "7", "response_length": 2, "finish_reason": "length"}]
    assert len(rollout_rows(_experience(), _CharTokenizer(), limit=1)) == 1


def test_a_multi_turn_row_has_its_turns_and_the_models_own_length():
    exp = _experience()
    exp.tool_mask = torch.tensor([[0.0, 1, 0], [0, 0, 0]])  # the middle token of row 0 is a tool's answer
    exp.sample_data.trajectories = [{"num_turns": 2, "tool_calls": 1, "turns": [{"role": "assistant"}]}, None]
    first, second = rollout_rows(exp, _CharTokenizer(), limit=2)
    assert (first["num_turns"], first["tool_calls"], first["turns"]) == (2, 1, [{"role": "assistant"}])
    assert first["response_length"] == 2 and "num_turns" not in second


def test_eval_rows_take_the_sets_first_samples_by_position_then_sample():
    exp = _experience()  # one prompt's 2 samples, at position 1 of its set
    rows = eval_rows(exp, [1.0, 0.0], ["7", None], 1.0, positions=[1], samples_per_prompt=2, tokenizer=_CharTokenizer(),
                     limit=3)  # position 1 x 2 samples: samples 2 and 3 of the set; the first 3 hold sample 2 only
    assert [(r["position"], r["sample"], r["passed"], r["answer"]) for r in rows] == [(1, 0, True, "7")]
    parts = [[{"position": 2, "sample": 0}], [{"position": 0, "sample": 1}, {"position": 0, "sample": 0}]]
    assert first_rows(parts, 2, key="position") == [{"position": 0, "sample": 0}, {"position": 0, "sample": 1}]


def test_the_tensorboard_table_keeps_one_line_a_sample():
    rows = rollout_rows(_experience(), _CharTokenizer(), limit=2)
    table = markdown_table(rows, TRAIN_COLUMNS).splitlines()
    assert table[0] == ("| sample | prompt_index | score | score_parts | label | response_length | finish_reason | "
                        "prompt | response |")  # num_turns: no row has it
    assert len(table) == 4 and table[3].endswith("| ab | q\\|<br> |")  # the pipe escaped, the newline a <br>
    assert "acc: 0, missing_eos_penalty: -0.5" in table[3]


def test_samples_jsonl_sits_beside_the_metrics_and_a_resume_replaces_the_rows_it_logs_again(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = rollout_rows(_experience(), _CharTokenizer(), limit=2)
    logger = MetricsLogger(jsonl_path=str(metrics), print_fn=lambda s: None)
    for it in (1, 2, 3):
        logger.log(it, {"x": 1.0})
        logger.log_samples(it, rows)
    logger.log_samples(3, [], "eval_samples")  # no rows: no file
    logger.close()
    written = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["sample"]) for r in written] == [(it, k) for it in (1, 2, 3) for k in (0, 1)]
    assert written[1]["response"] == "q|\n" and not (tmp_path / "run" / "eval_samples.jsonl").exists()
    resumed = MetricsLogger(jsonl_path=str(metrics), print_fn=lambda s: None, resumed_at=1)
    resumed.log_samples(2, rows[:1])
    resumed.close()
    written = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["sample"]) for r in written] == [(1, 0), (1, 1), (2, 0)]


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(distributed, "data_parallel_info", lambda: (0, 1))


def _settings(**loop):
    from mindspeed_llm.rl.settings import (AlgorithmSettings, CheckpointSettings, DataSettings, LoopSettings,
                                           LossSettings)

    return SimpleNamespace(checkpoint=CheckpointSettings(stage="grpo"),
                           algorithm=AlgorithmSettings(n_samples_per_prompt=2),
                           loop=LoopSettings(global_batch_size=1, **loop), data=DataSettings(seed=3, data_path="d"),
                           loss=LossSettings())


def _dump(root, iterations=(1,)):
    dumper = rollout_dump.RolloutDumper(str(root), rollout_dump.dump_manifest(_settings(), "single_turn"))
    for it in iterations:
        dumper.add(_experience(), {"grpo/acc": 0.5})
        dumper.finish(it, prompts_drawn=1)


def test_a_dump_reads_back_as_the_experience_it_wrote(tmp_path, one_rank):
    _dump(tmp_path / "dump", iterations=(1, 2))
    assert rollout_dump.dumped_iterations(str(tmp_path / "dump")) == [1, 2]
    saved = torch.load(tmp_path / "dump" / "iteration_0000001" / "batch_0_dp_rank_00.pt", weights_only=True)
    assert set(saved) == {"tokens", "prompt_lengths", "responses", "response_mask", "ended_with_eos", "scores",
                          "rollout_logp"}
    exp, metrics = rollout_dump.load_batch(str(tmp_path / "dump"), 2, 0, 0)
    original = _experience()
    for name, tensor in original.tensors().items():
        assert torch.equal(getattr(exp, name), tensor) and getattr(exp, name).dtype == tensor.dtype, name
    assert exp.sample_data == original.sample_data and metrics == {"grpo/acc": 0.5}
    assert not exp.routing_recorded


def test_a_replay_is_refused_for_another_kind_of_run_and_past_the_dump(tmp_path, one_rank):
    _dump(tmp_path / "dump")
    replay = str(tmp_path / "dump")
    other = _settings(rollout_replay_dir=replay)
    other = SimpleNamespace(**{**vars(other), "algorithm": type(other.algorithm)(n_samples_per_prompt=4)})
    with pytest.raises(ArgumentError, match=r"n_samples_per_prompt 2 there, 4 here.*--n-samples-per-prompt"):
        ReplayRollouts.from_settings(other, None)
    strategy = ReplayRollouts.from_settings(_settings(rollout_replay_dir=replay), None)
    exp, _ = strategy.collect(1, PromptSource([{"index": 11}], None))
    assert exp.scores.tolist() == [1.0, -0.5]  # the dump's: the scorer keeps them
    with pytest.raises(ArgumentError, match=r"no rollout for iteration 1 \(generation batch 1\): it has iterations 1"):
        strategy.collect(1, PromptSource([{"index": 11}], None))
    with pytest.raises(ArgumentError, match="no rollout for iteration 2: it has iterations 1 .. 1"):
        strategy.collect(2, PromptSource([{"index": 11}], None))
    fresh = ReplayRollouts.from_settings(_settings(rollout_replay_dir=replay), None)
    with pytest.raises(ArgumentError, match=r"prompts \(11, 11\) are not the ones the sampler drew \(5, 5\).*--seed 3"):
        fresh.collect(1, PromptSource([{"index": 5}], None))


def test_only_the_replay_schedule_says_its_batches_arrive_scored():
    """The stages score a batch unless its schedule says it arrives scored (`Schedule.scored`; a stage that skips
    the scorer then: tests/unit/test_rollout_strategies.py)."""
    from mindspeed_llm.rl.rollouts.base import SCHEDULES

    assert {name: SCHEDULES[name].scored for name in SCHEDULES} == {"one_shot": False, "partial": False,
                                                                     "replay": True}


@pytest.mark.parametrize("argv,message", [
    (["--log-samples-interval", "2"], "without --log-samples N logs no sample"),
    (["--log-samples", "2"], "--log-samples 2 writes samples.jsonl beside --metrics-jsonl"),
    (["--rollout-replay-dir", "{tmp}", "--rollout-dump-dir", "{tmp}"], "would write over the rollouts it reads"),
    (["--rollout-replay-dir", "{tmp}/none"], "holds no rollout dump"),
])
def test_the_flags_are_refused_where_they_cannot_work(tmp_path, argv, message):
    from mindspeed_llm.arguments import parse_args

    base = ["--stage", "grpo", "--data-path", "d", "--ref-model", "m", "--train-iters", "1", "--global-batch-size",
            "2", "--micro-batch-size", "1", "--verifier-function", "math_acc"]
    with pytest.raises(ArgumentError, match=message):
        parse_args(base + [a.format(tmp=tmp_path) for a in argv], 1)


@pytest.mark.parametrize("directory", ["samples.jsonl", "eval_samples.jsonl", "m.jsonl"])
def test_a_directory_where_a_table_goes_is_refused_at_startup(tmp_path, directory):
    from mindspeed_llm.arguments import parse_args

    (tmp_path / directory).mkdir()
    with pytest.raises(ArgumentError, match=f"appends to {tmp_path / directory}, which is a directory; move it away"):
        parse_args(["--stage", "grpo", "--data-path", "d", "--ref-model", "m", "--train-iters", "1",
                    "--global-batch-size", "2", "--micro-batch-size", "1", "--verifier-function", "math_acc",
                    "--log-samples", "4", "--metrics-jsonl", str(tmp_path / "m.jsonl")], 1)


def test_a_directory_appearing_where_the_table_goes_is_a_named_write_error(tmp_path):
    from mindspeed_llm.files import WriteError

    logger = MetricsLogger(jsonl_path=str(tmp_path / "m.jsonl"), print_fn=lambda s: None)
    (tmp_path / "samples.jsonl").mkdir()  # made after the start-up check
    with pytest.raises(WriteError, match=r"cannot write .*samples\.jsonl \(.*it is a directory; move it away\)"):
        logger.log_samples(1, [{"prompt": "a", "response": "b"}])
    logger.close()


def test_log_samples_interval_defaults_to_the_log_interval(tmp_path):
    from mindspeed_llm.arguments import parse_args

    args = parse_args(["--stage", "grpo", "--data-path", "d", "--ref-model", "m", "--train-iters", "1",
                       "--global-batch-size", "2", "--micro-batch-size", "1", "--log-interval", "5",
                       "--verifier-function", "math_acc",
                       "--log-samples", "4", "--metrics-jsonl", str(tmp_path / "m.jsonl")], 1)
    assert (args.settings.loop.log_samples, args.settings.loop.log_samples_interval) == (4, 5)


def test_a_full_disk_while_dumping_is_named_and_leaves_no_file(tmp_path, one_rank, monkeypatch):
    import errno

    from mindspeed_llm.files import WriteError

    def full(obj, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    dumper = rollout_dump.RolloutDumper(str(tmp_path / "dump"), rollout_dump.dump_manifest(_settings(), "single_turn"))
    dumper.add(_experience(), {})
    with pytest.raises(WriteError, match=r"No space left on device.*batch_0_dp_rank_00\.pt"):
        dumper.finish(1, prompts_drawn=1)
    assert sorted(p.name for p in (tmp_path / "dump" / "iteration_0000001").iterdir()) == []
    assert rollout_dump.dumped_iterations(str(tmp_path / "dump")) == []  # no done.json: never replayed


# ------------------------------------------------------------------------------------------ what a replay checks
class _Vocab:
    """A tokenizer as far as the dump's manifest reads one (its vocabulary)."""

    def __init__(self, size, shift=0):
        self.vocab = {f"t{i + shift}": i for i in range(size)}

    def get_vocab(self):
        return dict(self.vocab)


def _actor(seed, vocab_size=200):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    model.model_spec = SimpleNamespace(vocab_size=vocab_size)
    return model


ROWS = [{"index": 11, "input_ids": [97, 98]}]  # the prompt the dumped samples were made from


def _identified_dump(root, settings=None, tokenizer=None, actor=None, rows=ROWS, experience=_experience):
    from mindspeed_llm.rl.rollouts.dump_checks import prompts_digest

    settings = settings or _settings()
    dumper = rollout_dump.RolloutDumper(str(root), rollout_dump.dump_manifest(settings, "single_turn",
                                                                              tokenizer or _Vocab(200)),
                                        actor or _actor(0))
    dumper.add(experience(), {})
    dumper.finish(1, prompts_drawn=1, first_prompts=prompts_digest(rows))
    return str(root)


def _replay(root, tokenizer=None, actor=None, **data):
    settings = _settings(rollout_replay_dir=root)
    if data:
        settings = SimpleNamespace(**{**vars(settings), "data": type(settings.data)(**{"seed": 3, "data_path": "d",
                                                                                        **data})})
    generator = SimpleNamespace(actor_module=actor or _actor(0), tokenizer=tokenizer or _Vocab(200))
    return ReplayRollouts.from_settings(settings, generator)


def test_a_replay_of_the_same_run_passes_every_check(tmp_path, one_rank):
    root = _identified_dump(tmp_path / "dump")
    manifest = json.loads((tmp_path / "dump" / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["tokenizer"]["vocab_size"] == 200
    assert manifest["model"]["layout"] and manifest["data_path"] == "d"
    done = json.loads((tmp_path / "dump" / "iteration_0000001" / "done.json").read_text())
    assert done["actor_weights"][0] == 15  # 4 x 3 weights + 3 biases
    exp, _ = _replay(root).collect(1, PromptSource([dict(row) for row in ROWS], None))
    assert exp.scores.tolist() == [1.0, -0.5]


def test_a_replay_on_another_model_is_refused_by_name(tmp_path, one_rank):
    root = _identified_dump(tmp_path / "dump", settings=_settings())
    with pytest.raises(ArgumentError, match=r"iteration 1: the actor here is not the model whose weights made the "
                                            r"dumped rollouts .*replay from the checkpoint the dumping run had at "
                                            r"iteration 0"):
        _replay(root, actor=_actor(1)).collect(1, PromptSource(list(ROWS), None))


def test_a_replay_with_another_tokenizer_is_refused_by_name(tmp_path, one_rank):
    root = _identified_dump(tmp_path / "dump")
    with pytest.raises(ArgumentError, match=r"dumped with another tokenizer \(vocabulary of 200, hash \w+ there; 200, "
                                            r"hash \w+ here\); replay with the dumping run's --tokenizer-name-or-path"):
        _replay(root, tokenizer=_Vocab(200, shift=1))


def test_a_replay_on_another_dataset_is_refused_by_name(tmp_path, one_rank):
    root = _identified_dump(tmp_path / "dump")
    # the same size and the same rows drawn, other prompts in them
    with pytest.raises(ArgumentError, match=r"iteration 1: the prompts the sampler drew here \(dataset rows 11\) hold "
                                            r"other tokens than those the dump was made from: --data-path is another "
                                            r"dataset than the dumping run's d"):
        _replay(root).collect(1, PromptSource([{"index": 11, "input_ids": [97, 99]}], None))
    # another size: refused before anything runs (the size is the dataset's manifest's)
    for name, size in (("d", 40), ("e", 41)):
        (tmp_path / f"{name}_meta.json").write_text(json.dumps({"num_samples": size}))
    root = _identified_dump(tmp_path / "sized", settings=SimpleNamespace(**{**vars(_settings()), "data": type(
        _settings().data)(seed=3, data_path=str(tmp_path / "d"))}))
    with pytest.raises(ArgumentError, match=rf"was dumped from 40 prompts \(--data-path {tmp_path / 'd'}\); "
                                            rf"--data-path {tmp_path / 'e'} holds 41"):
        _replay(root, data_path=str(tmp_path / "e"))


def test_a_replay_on_another_machine_or_build_says_what_differs(tmp_path, one_rank, capsys):
    root = _identified_dump(tmp_path / "dump")
    with open(f"{root}/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["machine"]["torch"] == torch.__version__ and manifest["machine"]["threads"] >= 1
    _replay(root)
    assert "dumped on another machine" not in capsys.readouterr().out
    manifest["machine"].update(torch="2.0.0", threads=manifest["machine"]["threads"] + 7)
    with open(f"{root}/manifest.json", "w") as f:
        json.dump(manifest, f)
    _replay(root)
    out = capsys.readouterr().out
    assert "was dumped on another machine or build (torch '2.0.0' there" in out and "threads" in out


def _damage(path, how):
    data = path.read_bytes()
    path.write_bytes(bytes(len(data)) if how == "zeros" else data[:len(data) // 2])


@pytest.mark.parametrize("name,how", [("batch_0_dp_rank_00.pt", "zeros"), ("batch_0_dp_rank_00.pt", "cut"),
                                      ("batch_0_dp_rank_00.json", "cut"), ("done.json", "cut"),
                                      ("done.json", "zeros")])
def test_a_damaged_dump_file_is_named(tmp_path, one_rank, name, how):
    from mindspeed_llm.rl.rollouts.dump_checks import DumpError

    root = _identified_dump(tmp_path / "dump")
    path = tmp_path / "dump" / "iteration_0000001" / name
    _damage(path, how)
    with pytest.raises(DumpError, match=rf"{path} cannot be read \(.*\): the dump is damaged; dump that iteration "
                                        "again"):
        _replay(root).collect(1, PromptSource(list(ROWS), None))


def _cut_responses():
    exp = _experience()
    exp.responses = exp.responses[:, :2]  # cut; the mask and the log-probs not
    return exp


def _beyond_vocabulary():
    exp = _experience()
    exp.tokens[0, 4] = exp.responses[0, 2] = 500
    return exp


def _responses_not_tokens():
    exp = _experience()
    exp.responses = exp.responses.clone()
    exp.responses[1, 0] = 7
    return exp


def _longer_than_tokens():
    exp = _experience()
    exp.prompt_lengths = torch.tensor([2, 4])  # row 1: 4 + 2 response tokens in 5
    return exp


@pytest.mark.parametrize("experience,needle", [
    (_cut_responses, r"holds response_mask of shape \[2, 3\], responses \[2, 2\]: the response-aligned tensors "
                     "disagree"),
    (_beyond_vocabulary, r"holds token id 500, outside the model's vocabulary \(0 .. 199\)"),
    (_responses_not_tokens, r"row 1: its responses are not its tokens after the prompt"),
    (_longer_than_tokens, r"row 1: prompt length 4 and response length 2 .* do not fit its 5 tokens"),
])
def test_a_dump_whose_tensors_disagree_is_named(tmp_path, one_rank, experience, needle):
    from mindspeed_llm.rl.rollouts.dump_checks import DumpError

    root = _identified_dump(tmp_path / "dump", experience=experience)
    path = tmp_path / "dump" / "iteration_0000001" / "batch_0_dp_rank_00.pt"
    with pytest.raises(DumpError, match=rf"{path} {needle}"):
        _replay(root).collect(1, PromptSource(list(ROWS), None))
