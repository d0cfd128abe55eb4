"""Builds and runs the draft service around its registry of drafters."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import torch

from draft_service.registry import NGRAM, DraftRegistry, model_loader
from draft_service.servicer import DraftServicer
from engine.model_runner import RuntimeConfig
from specdec.busy_poll import busy_poll_enabled, keep_warm_enabled
from specdec.metrics import EngineSource, engine_registry
from specdec.serving import RunningServer, serve_until_signal, start_server
from specdec.tls import ServerTls, server_tls_config
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def start_draft_server(
    drafts: DraftRegistry, host: str = "127.0.0.1", port: int = 0, ready_file: Path | None = None,
    admin_token: str | None = None, metrics_port: int | None = None, tls: ServerTls | None = None,
    busy_poll: bool = False, idle_poll: bool = False, unix_socket: Path | None = None,
) -> RunningServer:
    """`metrics_port`: serve Prometheus metrics there (0: a free port; None: not at all); `tls`:
    serve over TLS (mTLS when it names a client CA); `busy_poll`, `idle_poll`: specdec/busy_poll.py;
    `unix_socket`: listen there too."""
    registry, forward_metrics = engine_registry("draft", lambda: _engine_sources(drafts), ["draft"])
    drafts.observe_forwards(forward_metrics)
    drafts.start()
    servicer = DraftServicer(drafts, admin_token)
    return await start_server(
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        [SERVICE_NAME], host, port, ready_file, cleanup=drafts.stop,
        metrics_registry=registry, metrics_port=metrics_port, credentials=tls.credentials() if tls else None,
        busy_poll=busy_poll, idle_poll=idle_poll, rehearse=servicer.rehearse if keep_warm_enabled() else None,
        unix_socket=unix_socket,
    )


def _engine_sources(drafts: DraftRegistry) -> list[EngineSource]:
    """Every loaded draft, read at scrape time (the n-gram drafter has no runner); its model info says whether
    requests without a draft name get it."""
    return [EngineSource({"draft": d.name}, d.drafter.stats(), d.drafter.description,
                         getattr(d.drafter, "runner", None), {"default": str(d.is_default).lower()})
            for d in drafts.list()]


async def _start(args: argparse.Namespace, config: RuntimeConfig) -> RunningServer:
    drafts = DraftRegistry(model_loader(config, args.draft_ahead))
    await drafts.load(args.draft_name, NGRAM if args.drafter == "ngram" else config.model, make_default=True)
    return await start_draft_server(drafts, args.host, args.port, args.ready_file, args.admin_token or None,
                                    args.metrics_port, server_tls_config(args), busy_poll_of(args.busy_poll, config),
                                    busy_poll_of(args.idle_poll, config), args.unix_socket)


def busy_poll_of(mode: str, config: RuntimeConfig) -> bool:
    """--busy-poll or --idle-poll for a draft service: auto polls only for drafts on a GPU (the n-gram
    drafter, too, when the service's device is one)."""
    return busy_poll_enabled(mode, torch.device(config.device).type)


def run(args: argparse.Namespace, config: RuntimeConfig) -> None:
    asyncio.run(serve_until_signal(lambda: _start(args, config), args.cpus, args.shutdown_grace_s))
