"""The real trio as processes (the CLIs), on the embedded SmolLM2-135M-Instruct target."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model_source import DEFAULT_MODEL, converted_gguf_dir, default_cache_dir, resolve_path
from harness import channel, generate
from specdec.launch import Trio, start_trio
from specdec.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors: red,"]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    args = argparse.Namespace(target_model=DEFAULT_MODEL, drafter="ngram", draft_model=None, num_draft_tokens=3,
                              timeout_s=600, log_level="WARNING", dtype=None, draft_dtype=None)
    trio, address = start_trio(args, tmp_path_factory.mktemp("trio"))
    yield trio, address
    trio.stop()
    assert all(s.process.poll() is not None for s in trio.services)


@pytest.fixture(scope="module")
def smollm2(trio):
    """HF greedy `generate` on the same converted weights (the target made the cached conversion)."""
    path = converted_gguf_dir(resolve_path(DEFAULT_MODEL), default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    references = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        generated = generated[0, len(ids):].tolist()
        eos = tokenizer.eos_token_id
        references[prompt] = generated[: generated.index(eos)] if eos in generated else generated
    return tokenizer, references


@pytest.mark.parametrize("k", [0, 2, 4])
def test_smollm2_speculative_output_equals_hf_greedy(k, trio, smollm2):
    tokenizer, references = smollm2
    with channel(int(trio[1].rsplit(":", 1)[1])) as c:
        stub = gateway_pb2_grpc.GatewayStub(c)
        for prompt in PROMPTS:
            token_ids, text, final = generate(stub, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=k)
            assert token_ids == references[prompt], prompt
            assert final.stats.num_completion_tokens == len(token_ids)
            assert text == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_gateway_cli_refuses_an_incompatible_draft(trio, model_dirs, tmp_path):
    draft = Trio(tmp_path)
    service = draft.spawn("tiny-draft", "draft_service", ["--drafter", "model", "--model", str(model_dirs["target"])])
    try:
        address = draft.wait_ready(service, 120)
        target_address = next(s.address() for s in trio[0].services if s.name == "target")
        result = subprocess.run([sys.executable, "-m", "gateway", "--port", "0", "--target", target_address,
                                 "--draft", address], capture_output=True, text=True, timeout=120)
    finally:
        draft.stop()
    assert result.returncode == 2
    assert "use different tokenizers" in result.stderr


def test_demo_command_streams_an_answer_and_stops_everything():
    result = subprocess.run([sys.executable, "-m", "specdec.launch", "--demo", "What is 2+2?",
                             "--max-new-tokens", "12"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()
    assert "acceptance=" in result.stderr and "stopped all services" in result.stderr


def test_a_trio_whose_draft_fails_to_start_leaves_no_process_behind(model_dirs, tmp_path):
    import psutil

    args = argparse.Namespace(target_model=str(model_dirs["target"]), drafter="model", draft_model=str(tmp_path / "none"),
                              num_draft_tokens=3, timeout_s=120, log_level="ERROR", dtype=None,
                              draft_dtype=None)
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RuntimeError, match="draft exited"):
        start_trio(args, tmp_path)
    assert {p.pid for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE} <= before
