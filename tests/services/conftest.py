"""Fixtures of the observability tests: a target, a draft (the perturbed model) and a gateway with
their metrics endpoints (and the gateway's OpenAI HTTP port) on free ports."""
from __future__ import annotations

import urllib.request
from collections import defaultdict

import pytest
from harness import channel
from prometheus_client.parser import text_string_to_metric_families

from draft_service.registry import DraftRegistry
from draft_service.server import start_draft_server
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.v1 import gateway_pb2_grpc
from target_service.server import start_target_server


def _runner(path) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(path), kv_cache_tokens=8192))


@pytest.fixture(scope="session")
def observed_target(loop, model_dirs):
    server = loop.run(start_target_server(_runner(model_dirs["target"]), metrics_port=0))
    yield server
    loop.run(server.stop())


@pytest.fixture(scope="session")
def observed_draft(loop, model_dirs):
    drafts = DraftRegistry.of(ModelDrafter(_runner(model_dirs["perturbed"])), name="perturbed")
    server = loop.run(start_draft_server(drafts, metrics_port=0))
    yield server
    loop.run(server.stop())


@pytest.fixture(scope="session")
def observed_gateway(loop, observed_target, observed_draft):
    config = GatewayConfig(f"127.0.0.1:{observed_target.port}", f"127.0.0.1:{observed_draft.port}",
                           default_max_new_tokens=32)
    server = loop.run(start_gateway_server(config, metrics_port=0, http_port=0))
    yield server
    loop.run(server.stop())


@pytest.fixture(scope="session")
def observed_stub(observed_gateway):
    with channel(observed_gateway.port) as c:
        yield gateway_pb2_grpc.GatewayStub(c)


class Scrape:
    """One scrape of a /metrics endpoint: sample values by name and labels."""

    def __init__(self, port: int) -> None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        self.samples: dict[str, dict[frozenset, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name][frozenset(sample.labels.items())] = sample.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[name].get(frozenset(labels.items()), 0.0)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(key)[label]: value for key, value in self.samples[name].items()}

    def labelled(self, name: str) -> list[dict[str, str]]:
        return [dict(key) for key in self.samples[name]]


@pytest.fixture
def scrape():
    return Scrape
