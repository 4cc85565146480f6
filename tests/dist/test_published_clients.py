"""The real-client lane: MindSpeed users' published files, verbatim in tests/fixtures/ (origins in the folders'
READMEs), run end to end at a tiny shape for two iterations and resumed once. Only shape, path and size values are
substituted, by `tests/helpers/published_clients.py`, which refuses any other change; each case below shows its
substitutions. What a case adds beyond them is said where it is added.

- MindSpeed-RL's `grpo_qwen25_7b_A3.yaml`, `ppo_qwen25_32b_A3.yaml`, `grpo_lora_qwen25_32b_A2.yaml` on 2 gloo ranks
  (TP2 with their sequence parallelism, the distributed optimizer, bf16, offload), resumed as MindSpeed-RL's docs
  say: `finetune: false`, `load` = the save, `no_load_optim` / `no_load_rng` false, the reference's original weights
  in `rl_config.integrated_mode_config.ref_model_load_path`.
- MindSpeed-RL's multi-turn DAPO config `dapo_qwen25_7b_A2_multi_turn.yaml` (ray_dapo, hermes calls to its
  SandboxFusion code tool) for one iteration to its tool calls: its tool config's class and service are stand-ins
  (tests/fixtures/mindspeed_rl/tools/retool_standin.py, a local service), the actor a tiny model that ends its turns,
  the tokenizer one whose words are whole calls; once with the service up, once unreachable (counted failures).
- MindSpeed-LLM's `trl_ppo_llama32_1b_ptd.sh` (`--finetune --no-load-optim --no-load-rng` as published) under its
  own torchrun line, on a tiny Llama-3.2-shaped model (llama3 RoPE scaling, tied embeddings); resumed the way a
  user of it does: the same script with `--load <its --save>` added.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.multiproc import _posttrain_main_cases, run_distributed
from tests.helpers.ports import free_port
from tests.helpers.published_clients import ROOT, rewrite_run_config, rewrite_script

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("published_task"), layouts=((2, 1),), reward=True)


def _sizes(save, task, actor_load, tp_sections, iters):
    """The substitutions every MindSpeed-RL case makes: paths to the tiny task, TP2 x PP1 on 2 ranks, two prompts per
    batch of two samples, short lengths, `iters` iterations saved at each."""
    changes = {("megatron_training", "tokenizer_name_or_path"): task["tokenizer"],
               ("megatron_training", "data_path"): task["data"], ("megatron_training", "global_batch_size"): 2,
               ("megatron_training", "seq_length"): 64, ("megatron_training", "train_iters"): iters,
               ("megatron_training", "save_interval"): 1,
               ("actor_config", "load"): actor_load, ("actor_config", "micro_batch_size"): 2, ("actor_config", "save"): save,
               ("rl_config", "mini_batch_size"): 2, ("rl_config", "max_prompt_length"): 16,
               ("rl_config", "n_samples_per_prompt"): 2,
               ("generate_config", "max_model_len"): 32, ("generate_config", "max_num_batched_tokens"): 64,
               ("generate_config", "max_num_seqs"): 8, ("generate_config", "infer_tensor_parallel_size"): 2,
               ("generate_config", "sampling_config", "max_tokens"): 4}
    for section in tp_sections:
        changes[(section, "tensor_model_parallel_size")] = 2
        changes[(section, "pipeline_model_parallel_size")] = 1
        changes[(section, "micro_batch_size")] = 2
    return changes


def _run(cases):
    """posttrain_gpt.main on the 2 warm ranks, each argv after the other: rank 0's (code, stdout, stderr) per argv,
    every rank's exit code checked."""
    results = run_distributed(_posttrain_main_cases, 2, cases)
    for rank, rank_results in enumerate(results):
        for (code, out, err) in rank_results:
            assert code == 0, f"rank {rank}: exit {code}\n{out[-3000:]}\n{err[-5000:]}"
    return results[0]


def _metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _resumed_file(first: Path, out: Path, roles, save, ref, iters):
    import yaml

    data = yaml.safe_load(first.read_text())
    for role in roles:
        data[role].update(finetune=False, load=save, no_load_optim=False, no_load_rng=False)
    data["megatron_training"]["train_iters"] = iters
    data["rl_config"]["integrated_mode_config"] = {"ref_model_load_path": ref}
    out.mkdir(parents=True, exist_ok=True)
    (out / "model").mkdir(exist_ok=True)
    for model_file in (first.parent / "model").iterdir():
        (out / "model" / model_file.name).write_text(model_file.read_text())
    target = out / first.name
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


CASES = {
    # file: (the sections whose layout is set, the roles a resume loads, what the command line adds)
    "grpo_qwen25_7b_A3.yaml": (("actor_config",), ("actor_config",), ()),
    # the critic starts from a value-head checkpoint here (MindSpeed-RL initialises one on the policy): the
    # command line names it, and the rule reward scores alone (the startup lines say so)
    "ppo_qwen25_32b_A3.yaml": (("actor_config", "critic_config"), ("actor_config", "critic_config"),
                               ("--reward-model", "mg_reward_tp2pp1")),
    "grpo_lora_qwen25_32b_A2.yaml": (("actor_config",), ("actor_config",), ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mindspeed_rl_config_runs_and_resumes(task, tmp_path, name):
    sections, roles, extra = CASES[name]
    save = str(tmp_path / "save")
    changes = _sizes(save, task, task["mg_actor_tp2pp1"], sections, iters=2)
    if name == "ppo_qwen25_32b_A3.yaml":
        changes[("critic_config", "load")] = task["mg_actor_tp2pp1"]  # as published: the policy's checkpoint
        changes[("critic_config", "save")] = save
    if name == "grpo_lora_qwen25_32b_A2.yaml":
        changes[("actor_config", "num_layer_list")] = "2"  # 16,16,16,16 over PP4: the tiny model's 2 layers on PP1
        changes[("rl_config", "ref_forward_micro_batch_size")] = 2
        for key in ("reward_dispatch_size", "adv_dispatch_size", "actor_update_dispatch_size"):
            changes[("rl_config", key)] = 4
    extra = [task[v] if v in task else v for v in extra]
    metrics = tmp_path / "metrics.jsonl"
    first = rewrite_run_config(name, tmp_path / "first", changes)
    resumed = _resumed_file(first, tmp_path / "resume", roles, save, task["mg_actor_tp2pp1"], iters=3)
    (_, out1, _), (_, out2, _) = _run([["--config", str(first), "--metrics-jsonl", str(metrics), *extra],
                                       ["--config", str(resumed), "--metrics-jsonl", str(metrics), *extra]])
    assert "resumed" not in out1
    assert f"resumed from {save} at iteration 2" in out2, out2[-3000:]
    assert [r["iteration"] for r in _metrics(metrics)] == [1, 2, 3]
    assert (Path(save) / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    for role in ("actor", "critic") if "ppo" in name else ("actor",):
        assert (Path(save) / role / "iter_0000003").is_dir()


# ---------------------------------------------------------------------------------------- MindSpeed-LLM's script
LLAMA32 = "trl_ppo_llama32_1b_ptd.sh"


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """A tiny Llama-3.2-shaped policy (llama3 RoPE scaling, tied embeddings) and a value-head reward model of the
    same family, converted to TP1 x PP2 as MindSpeed-LLM's conversion scripts do (--orm for the reward model)."""
    from tests.helpers.hf_tiny import save_tiny, write_tokenizer

    from mindspeed_llm.checkpoint import convert_hf_to_mg

    root = tmp_path_factory.mktemp("llama32")
    write_tokenizer(root / "tokenizer", 256)
    paths = {"tokenizer": str(root / "tokenizer")}
    for role, value_head in (("sft", False), ("reward", True)):
        hf = save_tiny("llama", root / f"hf_{role}", tie=not value_head, seq_cls=value_head, seed=7)
        convert_hf_to_mg(hf, str(root / f"mg_{role}"), 1, 2, value_head=value_head, tokenizer_dir=paths["tokenizer"],
                         progress=False)
        paths[role] = str(root / f"mg_{role}")
    return paths


def _llama32_script(llama32, data, save, iters):
    return rewrite_script(LLAMA32, {
        "NPUS_PER_NODE": 2, "MASTER_PORT": free_port(), "TP": 1, "PP": 2,
        "DATA_PATH": data, "SFT_LOAD_DIR": llama32["sft"], "REWARD_LOAD_DIR": llama32["reward"],
        "TOKENIZER_MODEL": llama32["tokenizer"], "CKPT_SAVE_DIR": save,
        "--num-layers": 2, "--hidden-size": 64, "--ffn-hidden-size": 160, "--num-attention-heads": 4,
        "--num-query-groups": 2, "--seq-length": 64, "--max-position-embeddings": 16384,
        "--padded-vocab-size": 256, "--norm-epsilon": "1e-6", "--rope-scaling-factor": "8.0",
        "--train-iters": iters, "--max-new-tokens": 4, "--max-length": 24,
    })


def test_mindspeed_llm_trl_ppo_script_runs_and_resumes(task, llama32, tmp_path):
    save = str(tmp_path / "ckpt")
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)  # the script tees into logs/, as its README has the user create
    os.symlink(ROOT / "posttrain_gpt.py", work / "posttrain_gpt.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    first = _llama32_script(llama32, task["data"], save, iters=2)
    # resuming: the same script, --load of its own --save added (the user's only edit besides --train-iters)
    resume = _llama32_script(llama32, task["data"], save, iters=3).replace(
        "    --save ${CKPT_SAVE_DIR} \\", "    --save ${CKPT_SAVE_DIR} \\\n    --load ${CKPT_SAVE_DIR} \\")
    assert resume.count("--load ${CKPT_SAVE_DIR}") == 1
    outs = []
    for text in (first, resume):
        result = subprocess.run(["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        outs.append(result.stdout)
    assert "resumed" not in outs[0]
    assert "--finetune is overridden" in outs[1] and f"resumed from {save} at iteration 2" in outs[1], outs[1][-4000:]
    assert "--no-load-optim: the optimizer starts over" in outs[1] and "--no-load-rng:" in outs[1]
    assert (Path(save) / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    log = (work / "logs" / "trl_ppo_llama32_1b.log").read_text()  # the script's tee (of the last run)
    assert f"resumed from {save} at iteration 2" in log


# ------------------------------------------------------------------ MindSpeed-RL's multi-turn DAPO config
MULTI_TURN = "dapo_qwen25_7b_A2_multi_turn.yaml"
RETOOL = ROOT / "tests" / "fixtures" / "mindspeed_rl" / "tools"
CALL = '<tool_call>{"name":"code_interpreter","arguments":{"code":"print(%d*7)"}}</tool_call>'
CALL_IDS = range(4, 68)  # the word task's prompts use w68 .. w255
# assistant turns end with </s>; a tool's answer is framed by w70 .. w71, the next assistant turn opens with w72
CHAT = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}</s>"
        "{% elif m['role'] == 'tool' %} w70 {{ m['content'] }} w71{% else %}{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %} w72{% endif %}")


def _calling_tokenizer(path: Path) -> str:
    """The word task's tokenizer (same ids for the prompts' words) whose ids 4..67 are each a whole hermes call of
    the config's code_interpreter tool (`print(K*7)`), so that the tiny model's sampled turns call it; a chat
    template with a tool role."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({CALL % i: i for i in CALL_IDS})
    vocab.update({f"w{i}": i for i in range(68, 256)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT
    fast.save_pretrained(str(path))
    return str(path)


def _turn_ending_actor(path: Path, tokenizer: str) -> str:
    """The word task's tiny Qwen2 (seed 3) made to end its turns: every token's embedding holds 100 in dimension 0,
    which only EOS's output row reads, so EOS (</s>) is sampled ~29% of the time and the call tokens ~18% (a turn
    cut by the token limit runs no tools; one ended by EOS does). Converted to TP2 x PP1."""
    import torch

    from mindspeed_llm.checkpoint import convert_hf_to_mg
    from tests.helpers.hf_tiny import build_tiny

    model = build_tiny("qwen2", seed=3, vocab_size=256)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[2, 0] = 0.6
    model.save_pretrained(str(path / "hf"))
    convert_hf_to_mg(str(path / "hf"), str(path / "mg_tp2pp1"), 2, 1, tokenizer_dir=tokenizer, progress=False)
    return str(path / "mg_tp2pp1")


@pytest.fixture()
def sandbox_fusion():
    """A local stand-in of the SandboxFusion service (its run_code request and answer): it evaluates `print(K*7)`
    and records every request. Yields (url, requests)."""
    import re
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class RunCode(BaseHTTPRequestHandler):
        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(request)
            match = re.fullmatch(r"print\((\d+)\*7\)", request.get("code", ""))
            run = {"status": "Finished", "stdout": f"{int(match.group(1)) * 7}\n" if match else "", "stderr": ""}
            body = json.dumps({"status": "Success", "run_result": run}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code", received
    server.shutdown()
    thread.join(timeout=10)


@pytest.mark.parametrize("service", ["up", "unreachable"])
def test_mindspeed_rl_multi_turn_dapo_config_runs_to_its_sandbox_calls(task, tmp_path, sandbox_fusion, monkeypatch,
                                                                       service):
    """dapo_qwen25_7b_A2_multi_turn.yaml (ray_dapo with hermes tool calls to MindSpeed-RL's SandboxFusion code tool,
    retool_reward) with paths and sizes substituted: its tool config (MindSpeed-RL's retool_config.yaml, the class
    and service its stand-ins: the tool's `class_name` names tests/fixtures/mindspeed_rl/tools/retool_standin.py's
    ReTool, `sandbox_fusion_url` the local service) is called by the sampled turns, the service's answers come back,
    and the iteration trains (grpo without a reference model, as the startup line says). Without a service (no
    network) every call is a counted failure and the iteration still trains."""
    import yaml

    from tests.helpers.ports import free_port

    url, requests = sandbox_fusion
    if service == "unreachable":
        url = f"http://127.0.0.1:{free_port()}/run_code"  # nothing listens there
    tools = yaml.safe_load((RETOOL / "retool_config.yaml").read_text())
    tools["tools"][0]["class_name"] = "retool_standin.ReTool"
    tools["tools"][0]["config"]["sandbox_fusion_url"] = url
    (tmp_path / "retool_config.yaml").write_text(yaml.safe_dump(tools, sort_keys=False))
    monkeypatch.syspath_prepend(str(RETOOL))  # the ranks take the caller's sys.path
    save = str(tmp_path / "save")
    tokenizer = _calling_tokenizer(tmp_path / "tokenizer")
    changes = _sizes(save, task, _turn_ending_actor(tmp_path / "actor", tokenizer), ("actor_config",), iters=1)
    changes.update({("megatron_training", "tokenizer_name_or_path"): tokenizer,
                    ("rl_config", "tool_config_path"): str(tmp_path / "retool_config.yaml"),
                    ("rl_config", "n_samples_per_prompt"): 4, ("rl_config", "mini_batch_size"): 8,
                    ("rl_config", "max_total_response_length"): 12, ("rl_config", "max_tool_response_length"): 3,
                    ("generate_config", "max_model_len"): 28})
    path = rewrite_run_config(MULTI_TURN, tmp_path / "config", changes)
    metrics = tmp_path / "metrics.jsonl"
    (_, out, _), = _run([["--config", str(path), "--metrics-jsonl", str(metrics)]])
    assert "megatron_training.stage: ray_dapo runs as --stage grpo with DAPO's features: no reference model" in out
    (row,) = _metrics(metrics)
    if service == "unreachable":
        assert not requests and row["tool/calls"] >= 1 and row["tool/failures"] == row["tool/calls"], row
    else:
        assert requests, out[-3000:]
        assert all(r["code"] in {f"print({i}*7)" for i in CALL_IDS} and r["language"] == "python"
                   and r["memory_limit_MB"] == 1024 for r in requests)  # retool_config.yaml's values
        assert row["tool/calls"] >= len(requests) and row["tool/failures"] == 0, row
    assert (Path(save) / "actor" / "iter_0000001").is_dir()
