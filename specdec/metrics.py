"""Prometheus metrics shared by the model services, and the HTTP endpoint every service serves.

Counters that the engines already keep (sequences, forwards, KV blocks, CUDA-graph replays) are
read at scrape time by a custom collector, so the hot path pays nothing for them; only the
per-forward histograms take a hook (`ForwardMetrics.observe_forward`, called by the batching loop).
Each service has its own registry: several services can share a process (tests do).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Histogram,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from engine.model_runner import ModelDescription, ModelRunner

log = logging.getLogger(__name__)

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FORWARD_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0,
                           2.0, 4.0)

# stats() key -> (metric name, kind, help); kind "gauge" or "counter"
ENGINE_STATS = {
    "num_active_sequences": ("specdec_engine_active_sequences", "gauge", "Sequences (open streams) holding state"),
    "num_waiting_sequences": ("specdec_engine_waiting_sequences", "gauge",
                              "Sequences waiting for KV cache room, or their prefill's turn, before their prefill"),
    "num_sequences_started": ("specdec_engine_sequences_started", "counter", "Sequences opened since start"),
    "num_forwards": ("specdec_engine_forwards", "counter", "Batched forward passes since start"),
    "num_sequence_steps": ("specdec_engine_sequence_steps", "counter",
                           "Sequence-steps since start (a forward over 3 sequences counts 3)"),
    "num_kv_blocks_used": ("specdec_engine_kv_blocks_used", "gauge", "KV cache blocks in use"),
    "num_ahead_hits": ("specdec_engine_ahead_hits", "counter",
                       "Draft-ahead proposals answered from the chain drafted during the last verify"),
    "num_ahead_misses": ("specdec_engine_ahead_misses", "counter", "Draft-ahead chains thrown away"),
}


@dataclass(frozen=True)
class EngineSource:
    """One engine's figures at scrape time; `labels` tell engines of one service apart."""

    labels: dict[str, str]
    stats: dict[str, int]  # keys as in ENGINE_STATS, plus num_kv_blocks_total / kv_block_size
    description: ModelDescription
    runner: ModelRunner | None = None  # for CUDA-graph hits and misses
    info: dict[str, str] = field(default_factory=dict)  # more of specdec_engine_model_info (a draft's `default`)


class EngineCollector(Collector):
    """Reads a model service's counters when Prometheus scrapes.

    `sources()` lists the service's engines: the target's one, or every loaded draft. Missing
    stats keys are simply not exported (the n-gram drafter has no KV cache).
    """

    def __init__(self, role: str, sources: Callable[[], list[EngineSource]], label_names: list[str]) -> None:
        self._role = role
        self._sources = sources
        self._label_names = label_names

    def collect(self) -> Iterator:
        names = self._label_names
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def family(name: str, kind: str, help_text: str, extra: list[str] = ()):
            if name not in families:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                families[name] = cls(name, help_text, labels=[*names, *extra])
            return families[name]

        info = InfoMetricFamily("specdec_engine_model", "The model this service serves", labels=names)
        for source in self._sources():
            values = [source.labels[n] for n in names]
            stats = source.stats
            for key, (name, kind, help_text) in ENGINE_STATS.items():
                if key in stats:
                    family(name, kind, help_text).add_metric(values, stats[key])
            if "num_kv_blocks_total" in stats:
                family("specdec_engine_kv_blocks_free", "gauge", "KV cache blocks free").add_metric(
                    values, stats["num_kv_blocks_total"] - stats.get("num_kv_blocks_used", 0))
            if "kv_block_size" in stats:
                family("specdec_engine_kv_block_size_tokens", "gauge", "Tokens per KV cache block").add_metric(
                    values, stats["kv_block_size"])
            if source.runner is not None:
                graphs = family("specdec_engine_cuda_graph_steps", "counter",
                                "Steps and prefill chunks that replayed a captured CUDA graph (hit), forwards that ran "
                                "eagerly (miss)", ["result"])
                replayed = source.runner.graphs
                graphs.add_metric([*values, "hit"], replayed.num_replays + replayed.num_prefill_replays if replayed else 0)
                graphs.add_metric([*values, "miss"], source.runner.num_eager_steps)
            d = source.description
            info.add_metric(values, {"role": self._role, "model_id": d.model_id, "architecture": d.architecture,
                                     "max_model_len": str(d.max_model_len), **source.info})
        yield from families.values()
        yield info


class ForwardMetrics:
    """Per-forward histograms: batch size, and latency by phase (prefill / verify / propose / mixed)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._batch_size = Histogram("specdec_engine_batch_size", "Sequences per batched forward", ["phase"],
                                     buckets=BATCH_SIZE_BUCKETS, registry=registry)
        self._seconds = Histogram("specdec_engine_forward_seconds",
                                  "Wall time of one batched engine step on the model thread (forward plus "
                                  "sampling/verification)", ["phase"],
                                  buckets=FORWARD_SECONDS_BUCKETS, registry=registry)

    def observe_forward(self, phase: str, batch_size: int, duration_s: float) -> None:
        self._batch_size.labels(phase).observe(batch_size)
        self._seconds.labels(phase).observe(duration_s)


def engine_registry(role: str, sources: Callable[[], list[EngineSource]],
                    label_names: list[str] = ()) -> tuple[CollectorRegistry, ForwardMetrics]:
    """A model service's registry: the scrape-time collector plus the per-forward histograms."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(role, sources, list(label_names)))
    return registry, ForwardMetrics(registry)


@dataclass
class MetricsServer:
    """Prometheus text format on http://HOST:PORT/metrics, served from a daemon thread."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves `registry`, with the process's own figures (CPU, memory, file descriptors, Python's garbage
    collections: prometheus_client's standard collectors); port 0 picks a free port (see `.port`)."""
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    server = MetricsServer(httpd, thread)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
