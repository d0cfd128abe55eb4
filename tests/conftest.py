"""Session fixtures: tiny random models on disk and the real services on loopback (port 0)."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():  # Triton kernels run under the interpreter; set before they are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from draft_service.registry import DraftRegistry  # noqa: E402
from draft_service.server import start_draft_server  # noqa: E402
from engine.model_drafter import ModelDrafter  # noqa: E402
from engine.model_runner import ModelRunner, RuntimeConfig  # noqa: E402
from engine.ngram_drafter import NgramDrafter  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.server import start_gateway_server  # noqa: E402
from harness import LoopThread, channel  # noqa: E402
from specdec.v1 import draft_pb2_grpc, gateway_pb2_grpc, target_pb2_grpc  # noqa: E402
from target_service.cli import CUDA_RUNTIME  # noqa: E402
from target_service.server import start_target_server  # noqa: E402
from tiny_models import build_model_dir, build_reduced_head_draft, build_tokenizer  # noqa: E402

DRAFTS = ("identical", "perturbed", "unrelated", "reduced_head", "int8", "w8a8", "ngram", "ahead")
AHEAD_DRAFT = "perturbed"  # "ahead" serves this model drafting ahead (engine/model_drafter.py)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    target = build_model_dir(root / "target", tokenizer, seed=0)
    return {
        "target": target,
        "identical": target,
        "perturbed": build_model_dir(root / "perturbed", tokenizer, seed=1, perturb_from=target, perturb_scale=0.05),
        "unrelated": build_model_dir(root / "unrelated", tokenizer, seed=2),
        "reduced_head": build_reduced_head_draft(root / "reduced_head", target),
        "int8": target,  # served with weight-only int8 linears (CPU; as is elsewhere): the draft service's CPU default
        "w8a8": target,  # served with int8 linears and int8 activations (--quantize w8a8)
        "other_tokenizer": build_model_dir(root / "other_tok", build_tokenizer(vocab_size=330), seed=3),
    }


@pytest.fixture(scope="session")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


# SPECDEC_TEST_DEVICE=cuda runs the service tests on the GPU (Triton attention); the default is CPU
DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def _runner(path: Path, kv_cache_tokens: int = 8192, attention_backend: str = "auto",
            quantize: str = "none", **config: str) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(path), kv_cache_tokens=kv_cache_tokens, device=DEVICE,
                                     attention_backend=attention_backend, quantize=quantize, **config))


# on the GPU the target as specdec-target runs it (target_service/cli.py); on CPU both are plain PyTorch
TARGET_DEFAULTS = CUDA_RUNTIME if DEVICE == "cuda" else {}  # the target service's (target_service/cli.py)


@pytest.fixture(scope="session")
def target_server(loop, model_dirs):
    server = loop.run(start_target_server(_runner(model_dirs["target"], **TARGET_DEFAULTS)))
    yield server
    loop.run(server.stop())


@pytest.fixture(scope="session")
def draft_servers(loop, model_dirs):
    quantize = {"int8": "int8" if DEVICE == "cpu" else "none", "w8a8": "w8a8"}
    drafters = {name: ModelDrafter(_runner(model_dirs[AHEAD_DRAFT if name == "ahead" else name],
                                           quantize=quantize.get(name, "none")), ahead=name == "ahead")
                for name in DRAFTS if name != "ngram"}
    drafters["ngram"] = NgramDrafter()
    servers = {name: loop.run(start_draft_server(DraftRegistry.of(d))) for name, d in drafters.items()}
    yield servers
    for server in servers.values():
        loop.run(server.stop())


@pytest.fixture(scope="session")
def gateways(loop, target_server, draft_servers):
    """Gateway port by drafter name; "none" is a gateway without a draft service."""
    target = f"127.0.0.1:{target_server.port}"
    servers = {name: loop.run(start_gateway_server(GatewayConfig(target, f"127.0.0.1:{s.port}")))
               for name, s in draft_servers.items()}
    servers["none"] = loop.run(start_gateway_server(GatewayConfig(target, None)))
    yield {name: s.port for name, s in servers.items()}
    for server in servers.values():
        loop.run(server.stop())


@pytest.fixture(scope="session")
def gateway_stub(gateways):
    channels = {name: channel(port) for name, port in gateways.items()}
    yield lambda name="perturbed": gateway_pb2_grpc.GatewayStub(channels[name])
    for c in channels.values():
        c.close()


@pytest.fixture(scope="session")
def target_stub(target_server):
    with channel(target_server.port) as c:
        yield target_pb2_grpc.TargetServiceStub(c)


@pytest.fixture(scope="session")
def draft_stub(draft_servers):
    channels = {name: channel(s.port) for name, s in draft_servers.items()}
    yield lambda name="perturbed": draft_pb2_grpc.DraftServiceStub(channels[name])
    for c in channels.values():
        c.close()


@pytest.fixture(scope="session")
def hf_greedy(model_dirs, tokenizer):
    """The reference: Hugging Face `generate` (greedy) on the target, EOS excluded."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32).eval()

    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        generated = out[0, len(prompt_ids):].tolist()
        return generated[: generated.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in generated else generated

    return run


@pytest.fixture(scope="session")
def pool():
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def pytest_collection_modifyitems(config, items) -> None:
    """GPU tests run on the H200 machine (through the device tool); everywhere else they skip."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def triton_gateway_stub(loop, model_dirs, draft_servers):
    """A gateway in front of a target whose attention is the Triton kernel (interpreted on CPU)."""
    target = loop.run(start_target_server(_runner(model_dirs["target"], attention_backend="triton")))
    gateway = loop.run(start_gateway_server(
        GatewayConfig(f"127.0.0.1:{target.port}", f"127.0.0.1:{draft_servers['perturbed'].port}")))
    with channel(gateway.port) as c:
        yield gateway_pb2_grpc.GatewayStub(c)
    loop.run(gateway.stop())
    loop.run(target.stop())
