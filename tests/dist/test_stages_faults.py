"""Fault injection against the stages' outer loop: nothing lost, nothing silent (README, "Checkpoints").

Each case runs `posttrain_gpt.py` on the tiny word task (`word_task.py`), either as a process of its own (when
it is killed, signalled, or must exit with a code) or, for refusals that happen before training, through
`posttrain_gpt.main` in one shared process. Cases and what they assert:

* NaN stop: `--lr 1e38` makes the weights inf after iteration 1's step. With a save due at iteration 1 the
  save refuses them (exit 1, "iteration 1 was not saved"); without, iteration 2's NaN loss stops the run
  before its optimizer step (exit 1, naming the iteration, the role and the loss). Either way no tracker
  points anywhere and the metrics hold iteration 1 alone.
* `--save` without `--save-interval` saves at the end of training.
* `--load` that holds no checkpoint: a typo'd path, a grpo save given to trl_ppo, an empty directory, each an
  error naming it (exit 2); `--load` equal to `--save` with nothing there starts fresh, saying so.
* A SIGKILL during the FIRST save leaves staging leftovers: the same command line (`--load` = `--save`) then
  starts fresh, removes them and finishes.
* A damaged latest shard: the error names the file and `--ckpt-step` with the previous complete iteration; with
  that flag the run resumes, and the metrics hold one row per iteration (the re-run ones replaced).
* SIGTERM with `--exit-signal-handler`: the run saves the iteration it finished and exits 0.
* A second writer on one `--save` is refused (holder named); a stale lock of a dead process is taken over.
* A changed `--lr` on resume is an error naming both values and the two Megatron-LM flags; with
  `--override-opt_param-scheduler` the command line's applies, and the run says so.
* A write error during a save (ENOSPC injected) removes the staging files and keeps the previous resume point; one
  in the --save-hf folder leaves the checkpoint published and nothing of the folder.
* `--save` that cannot be written and a prompt longer than `--max-prompt-length` are refused before training.
* A `--save` that is not one folder seen by every node (rank 1 does not see rank 0's writer lock) is refused on
  every rank, naming the rank, its host and the file.
"""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.multiproc import posttrain_in_process, run_distributed, single_rank_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("faults_task"), reward=True)


def argv(task, out: Path, *extra, stage="grpo", iters=2):
    base = [
        "--stage", stage, "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path", task["tokenizer"],
        "--data-path", task["data"], "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", str(iters),
        "--max-length", "24", "--max-new-tokens", "4", "--do-sample", "--seed", "5", "--lr", "1e-3",
        "--metrics-jsonl", str(out / "metrics.jsonl"),
    ]
    if stage == "grpo":
        base += ["--n-samples-per-prompt", "2", "--verifier-function", "first_line_answer", "--kl-coef", "0.01"]
    else:
        base += ["--reward-model", task["mg_reward_tp1pp1"]]
    return base + list(extra)


def run(args, script="posttrain_gpt.py", timeout=300):
    """posttrain_gpt.py (or a driver script) as a process of its own; the CompletedProcess."""
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          env=single_rank_env(), timeout=timeout)


def rows(out: Path):
    path = out / "metrics.jsonl"
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()] if path.exists() else []


def tracker(save: Path):
    path = save / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


def in_process(cases):
    return posttrain_in_process(cases)


# ---------------------------------------------------------------------------------------------- NaN / inf
def test_non_finite_training_stops_and_publishes_nothing(task, tmp_path):
    save_due, later = tmp_path / "save_due", tmp_path / "later"
    first = run(argv(task, save_due, "--lr", "1e38", "--save", str(save_due), "--save-interval", "1", iters=3))
    second = run(argv(task, later, "--lr", "1e38", "--save", str(later), "--save-interval", "5", iters=3))

    assert first.returncode == 1, first.stderr[-3000:]
    assert "the weights are not finite" in first.stderr and "iteration 1 was not saved" in first.stderr
    assert second.returncode == 1, second.stderr[-3000:]
    message = [line for line in second.stderr.splitlines() if "posttrain_gpt.py: error" in line]
    assert len(message) == 1 and "iteration 2: actor:" in message[0] and "the loss is nan" in message[0]
    assert "stopped before the optimizer step" in message[0] and "no checkpoint was written" in message[0]
    for run_dir in (save_due, later):
        assert tracker(run_dir) is None and not list(run_dir.glob("*/iter_*")) and not list(run_dir.glob("*/.iter_*"))
        assert rows(run_dir) == [1]
        assert "Traceback" not in (first.stderr + second.stderr)


# ---------------------------------------------------------------------------------------------- save / load
def test_save_without_interval_saves_at_the_end(task, tmp_path):
    out = tmp_path / "run"
    result = run(argv(task, out, "--save", str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tracker(out) == "2" and (out / "actor" / "iter_0000002").is_dir() and not (out / "actor" / "iter_0000001").exists()
    assert not (out / ".writer.lock").exists()  # released at exit


def test_load_without_a_checkpoint(task, tmp_path):
    grpo_save = tmp_path / "grpo_save"
    assert run(argv(task, grpo_save, "--save", str(grpo_save), iters=1)).returncode == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = tmp_path / "fresh"
    cases = {
        "typo": (argv(task, tmp_path / "a", "--load", str(tmp_path / "grpo_sav"), "--save", str(tmp_path / "a")),
                 ["--load", "grpo_sav", "no such directory"]),
        "other stage": (argv(task, tmp_path / "b", "--load", str(grpo_save), stage="trl_ppo"),
                        ["--load", "is a checkpoint of --stage grpo (actor;", "run_record.json says so",
                         f"start trl_ppo from its actor pass --ref-model {grpo_save / 'actor'}"]),
        "empty": (argv(task, tmp_path / "c", "--load", str(empty)),
                  ["--load", "no complete grpo checkpoint", "latest_checkpointed_iteration.txt is missing"]),
        "auto-resume": (argv(task, fresh, "--load", str(fresh), "--save", str(fresh), iters=1), ["starting from scratch"]),
    }
    results = in_process([a for a, _ in cases.values()])
    for (name, (_, needles)), (code, out, err) in zip(cases.items(), results):
        assert code == (0 if name == "auto-resume" else 2), f"{name}: {code}\n{err[-2000:]}"
        for needle in needles:
            assert needle in out + err, f"{name}: {needle!r} not in {out + err!r}"
    assert tracker(fresh) == "1"


KILL_IN_SAVE = textwrap.dedent("""
    # posttrain_gpt.py, SIGKILLed when its first save is about to publish a role (the staging dir is written).
    import os, signal, sys
    import mindspeed_llm.checkpoint.megatron_layout as layout
    layout.publish = lambda tmp, final: os.kill(os.getpid(), signal.SIGKILL)
    import posttrain_gpt
    sys.exit(posttrain_gpt.main(sys.argv[1:]))
""")

ENOSPC_IN_SAVE = textwrap.dedent("""
    # posttrain_gpt.py whose save of iteration FAIL_AT runs out of disk space while writing its shard.
    import errno, os, sys
    import mindspeed_llm.checkpoint.megatron_layout as layout
    original = layout.save_file
    def save_file(payload, path):
        if payload.get("iteration") == int(os.environ.get("FAIL_AT", "2")):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return original(payload, path)
    layout.save_file = save_file
    import posttrain_gpt
    sys.exit(posttrain_gpt.main(sys.argv[1:]))
""")


def test_kill_during_the_first_save_then_the_same_command_resumes(task, tmp_path):
    out = tmp_path / "run"
    command = argv(task, out, "--load", str(out), "--save", str(out), "--save-interval", "1")
    driver = tmp_path / "kill_in_save.py"
    driver.write_text(KILL_IN_SAVE)
    killed = run(command, script=driver)
    assert killed.returncode == -signal.SIGKILL
    assert (out / "actor" / ".iter_0000001.staging").is_dir() and tracker(out) is None  # the skeleton it leaves

    again = run(command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting from scratch" in again.stdout
    assert tracker(out) == "2" and not list(out.glob("*/.iter_*"))  # leftovers removed by the next save
    assert rows(out) == [1, 2]  # the killed run's row of iteration 1 was replaced, not duplicated


def test_damaged_latest_shard_names_the_file_and_ckpt_step(task, tmp_path):
    out = tmp_path / "run"
    assert run(argv(task, out, "--save", str(out), "--save-interval", "1")).returncode == 0
    shard = out / "actor" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated
    resume = argv(task, out, "--load", str(out), "--save", str(out), "--save-interval", "1", iters=3)
    (code, _, err), = in_process([resume])
    assert code == 2 and str(shard) in err and "--ckpt-step 1" in err and "Traceback" not in err, err

    result = run(resume + ["--ckpt-step", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "at iteration 1" in result.stdout
    assert tracker(out) == "3" and rows(out) == [1, 2, 3]


def test_failed_write_keeps_the_previous_resume_point(task, tmp_path):
    out = tmp_path / "run"
    driver = tmp_path / "enospc.py"
    driver.write_text(ENOSPC_IN_SAVE)
    result = run(argv(task, out, "--save", str(out), "--save-interval", "1"), script=driver)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "No space left on device" in result.stderr and "iteration 1 is still the resume point" in result.stderr
    assert "Traceback" not in result.stderr
    assert tracker(out) == "1" and not list(out.glob("*/.iter_*")) and not (out / "actor" / "iter_0000002").exists()


ENOSPC_IN_SAVE_HF = textwrap.dedent("""
    # posttrain_gpt.py whose --save-hf folder of iteration 2 runs out of disk space at its first weight file.
    import errno, os, sys
    import safetensors.torch
    original = safetensors.torch.save_file
    def save_file(tensors, filename, metadata=None):
        if "iter_0000002" in filename and "hf.partial" in filename:
            open(filename, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return original(tensors, filename, metadata=metadata)
    safetensors.torch.save_file = save_file
    import posttrain_gpt
    sys.exit(posttrain_gpt.main(sys.argv[1:]))
""")


def test_a_failed_save_hf_folder_keeps_the_checkpoint_and_names_the_file(task, tmp_path):
    """A full disk while --save-hf writes iteration 2's folder: iteration 2's checkpoint is still published (the
    resume point), nothing of its folder is left, iteration 1's folder stays, and the run stops with one line
    naming the file (exit 2)."""
    out = tmp_path / "run"
    driver = tmp_path / "enospc_hf.py"
    driver.write_text(ENOSPC_IN_SAVE_HF)
    result = run(argv(task, out, "--save", str(out), "--save-interval", "1", "--save-hf"), script=driver)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    second = out / "actor" / "iter_0000002"
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and (
        f"iteration 2 was saved to --save {out} and is the resume point, but its Hugging Face folder (--save-hf) was "
        f"not written: rank 0: No space left on device writing {out}/actor/.iter_0000002.staging/hf.partial/model-0000"
    ) in lines[0], result.stderr[-3000:]
    assert tracker(out) == "2" and not list(out.glob("*/.iter_*"))
    assert sorted(p.name for p in second.iterdir()) == ["mp_rank_00", "run_record.json"]
    assert "hf" not in json.loads((second / "run_record.json").read_text())
    first = out / "actor" / "iter_0000001"
    assert (first / "hf" / "config.json").is_file()
    assert json.loads((first / "run_record.json").read_text())["hf"] == {"dir": "hf", "format": "model"}


# ---------------------------------------------------------------------------------------------- signals, writers
def test_sigterm_with_the_signal_handler_saves_and_exits(task, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "posttrain_gpt.py", *argv(task, out, "--save", str(out),
                                                                         "--exit-signal-handler", iters=200)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=single_rank_env())
    deadline = time.time() + 240
    while not rows(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    done = rows(out)
    assert done and done == list(range(1, len(done) + 1)) and len(done) < 200
    assert f"SIGTERM received: saved iteration {done[-1]}" in stdout
    assert tracker(out) == str(done[-1])


def test_one_writer_per_save_directory(task, tmp_path):
    busy, stale = tmp_path / "busy", tmp_path / "stale"
    for folder in (busy, stale):
        folder.mkdir()
    host = socket.gethostname()
    (busy / ".writer.lock").write_text(json.dumps({"host": host, "pid": os.getpid(), "since": "earlier"}))
    holder = open(busy / ".writer.lock")  # a live holder holds the file's flock (this test process)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (stale / ".writer.lock").write_text(json.dumps({"host": host, "pid": gone.pid, "since": "earlier"}))
    refused, taken = in_process([argv(task, busy, "--save", str(busy), iters=1),
                                 argv(task, stale, "--save", str(stale), iters=1)])
    holder.close()
    assert refused[0] == 2 and f"pid {os.getpid()} on {host}" in refused[2] and "another run" in refused[2]
    assert tracker(busy) is None and (busy / ".writer.lock").exists()  # the holder's lock is left alone
    assert taken[0] == 0 and f"from pid {gone.pid}" in taken[1] and "no longer running" in taken[1]
    assert tracker(stale) == "1" and not (stale / ".writer.lock").exists()


# ---------------------------------------------------------------------------------------------- resume settings
def test_changed_lr_on_resume_needs_a_scheduler_flag(task, tmp_path):
    out = tmp_path / "run"
    assert run(argv(task, out, "--save", str(out), iters=1)).returncode == 0
    resume = argv(task, out, "--load", str(out), "--save", str(out), iters=2)
    resume[resume.index("--lr") + 1] = "2e-3"
    (code, _, err), (override_code, override_out, _) = in_process(
        [resume, resume + ["--override-opt_param-scheduler"]])
    assert code == 2 and "learning rate 0.002 (checkpoint: 0.001)" in err, err
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err
    assert override_code == 0 and "resuming with the command line's LR schedule" in override_out
    lrs = [json.loads(line)["actor/lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [1e-3, 2e-3]


# ---------------------------------------------------------------------------------------------- startup checks
def test_unwritable_save_and_overlong_prompts_are_refused_up_front(task, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cases = [argv(task, tmp_path / "x", "--save", str(blocker / "save")),
             argv(task, tmp_path / "y", "--max-length", "8", "--max-new-tokens", "4")]
    (code, _, err), (long_code, _, long_err) = in_process(cases)
    assert code == 2 and f"--save {blocker / 'save'} lies under {blocker}, which is a file" in err, err
    assert long_code == 2 and "longer than --max-prompt-length 4" in long_err and "--overlong-prompts" in long_err
    assert not (tmp_path / "x" / "metrics.jsonl").exists() and not (tmp_path / "y" / "metrics.jsonl").exists()


def test_disk_space_is_checked_up_front(tmp_path):
    from mindspeed_llm.checkpoint.training import _save_dir_problem

    assert _save_dir_problem(str(tmp_path), 1) is None
    problem = _save_dir_problem(str(tmp_path), 2 ** 60)
    assert "GiB free, but one checkpoint of this run needs about" in problem and str(tmp_path) in problem


def _shared_save_case(rank, world_size, root, shared):
    """Rank 0 holds the writer lock of its --save; rank 1 looks at the same folder (shared) or at its own
    node-local one."""
    import torch

    from mindspeed_llm.checkpoint.training import CheckpointError
    from mindspeed_llm.checkpoint.writer_lock import WriterLock
    from mindspeed_llm.rl.preflight import check_shared_save

    save = os.path.join(root, f"node{0 if shared else rank}")
    os.makedirs(save, exist_ok=True)
    lock = WriterLock(os.path.join(root, "node0"))
    if rank == 0:
        lock.acquire(log=lambda *_: None)
    torch.distributed.barrier()  # as the trainer's broadcast of rank 0's lock result: the lock exists before the check
    try:
        check_shared_save(save, os.path.join(save, WriterLock.NAME), wait_s=0.5)
        return "accepted"
    except CheckpointError as exc:
        return str(exc)
    finally:
        if rank == 0:
            lock.release()


def test_save_folder_not_shared_by_every_node_is_refused(tmp_path):
    assert run_distributed(_shared_save_case, 2, str(tmp_path / "shared"), True) == ["accepted", "accepted"]
    messages = run_distributed(_shared_save_case, 2, str(tmp_path / "local"), False)
    for message in messages:  # every rank raises, naming the rank that does not see the lock
        assert f"rank 1: host {socket.gethostname()} does not see {tmp_path / 'local' / 'node1' / '.writer.lock'}" \
            in message
        assert "not one folder shared by every node" in message and "rank 0:" not in message
