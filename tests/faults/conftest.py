"""Fault-test fixtures: target and draft replicas as real processes (killable, restartable on
their port), and a gateway over both pools (`ipv4:A,B` address lists, round-robin)."""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from tiny_models import build_model_dir
from transformers import AutoModelForCausalLM, LlamaConfig

from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.processes import Replica
from specdec.v1 import gateway_pb2_grpc

# Long enough that a request is still decoding when a test breaks something under it.
CONTEXT = 2048


def build_long_context_model(path: Path, tokenizer, seed: int) -> Path:
    """A tiny random Llama (4 layers, hidden 128) with a 2048-token context."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def long_models(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long_models")
    target = build_long_context_model(root / "target", tokenizer, seed=10)
    draft = build_model_dir(root / "draft", tokenizer, seed=11, perturb_from=target, perturb_scale=0.05)
    return {"target": target, "draft": draft}


class Cluster:
    """Two target and two draft replicas (processes) and an in-process gateway over both pools."""

    def __init__(self, targets: list[Replica], drafts: list[Replica]) -> None:
        self.targets = targets
        self.drafts = drafts

    @property
    def replicas(self) -> list[Replica]:
        return [*self.targets, *self.drafts]

    @property
    def target_pool(self) -> str:
        """The target replicas as one gateway address (`ipv4:A,B`: round-robin)."""
        return "ipv4:" + ",".join(t.address for t in self.targets)

    @property
    def draft_pool(self) -> str:
        return "ipv4:" + ",".join(d.address for d in self.drafts)

    def ensure_running(self) -> None:
        """Restarts every replica a test killed (on its port), together."""
        down = [r for r in self.replicas if not r.is_running()]
        for replica in down:
            replica.spawn()
        for replica in down:
            replica.wait_ready()

    def holder(self, replicas: list[Replica]) -> Replica:
        """The replica that holds the (single) open sequence."""
        holding = [r for r in replicas if r.is_running() and r.engine_stats().num_active_sequences > 0]
        assert len(holding) == 1, f"expected one replica holding the sequence, got {len(holding)}"
        return holding[0]

    def wait_idle(self, timeout_s: float = 20) -> None:
        """Every running replica's KV pool is back to empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = [(r.name, r.engine_stats()) for r in self.replicas if r.is_running()]
            if all(s.num_kv_blocks_used == 0 and s.num_active_sequences == 0 for _, s in stats):
                return
            assert time.monotonic() < deadline, f"KV not freed: {stats}"
            time.sleep(0.1)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, long_models):
    workdir = tmp_path_factory.mktemp("cluster")
    kv = ["--kv-cache-tokens", "16384", "--num-threads", "1"]
    targets = [Replica(f"target{i}", "target_service", ["--model", str(long_models["target"]), *kv], workdir)
               for i in range(2)]
    drafts = [Replica(f"draft{i}", "draft_service",
                      ["--drafter", "model", "--model", str(long_models["draft"]), *kv], workdir) for i in range(2)]
    cluster = Cluster(targets, drafts)
    try:
        cluster.ensure_running()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def replicas_up(cluster):
    """Every replica running and idle when a test starts (a test before may have killed or stopped one)."""
    cluster.ensure_running()
    cluster.wait_idle()


@pytest.fixture(scope="session")
def cluster_gateway_port(loop, cluster) -> int:
    """A gateway over both pools; a draft that is silent for 1 s is dropped from the request (and new requests
    still try the drafts: no pause, so each test sees the pools as it left them)."""
    config = GatewayConfig(target_address=cluster.target_pool, draft_address=cluster.draft_pool,
                           default_num_draft_tokens=3, draft_step_timeout_s=1.0, draft_pause_s=0,
                           connect_timeout_s=60)
    server = loop.run(start_gateway_server(config))
    yield server.port
    loop.run(server.stop())


@pytest.fixture(scope="session")
def cluster_gateway(cluster_gateway_port):
    with grpc.insecure_channel(f"127.0.0.1:{cluster_gateway_port}") as c:
        yield gateway_pb2_grpc.GatewayStub(c)
