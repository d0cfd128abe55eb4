"""Builds and runs the draft service around a drafter."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from draft_service.servicer import DraftServicer
from engine.batching_loop import torch_thread
from engine.drafter import Drafter
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.ngram_drafter import NgramDrafter
from specdec.serving import RunningServer, serve_until_signal, start_server
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def start_draft_server(
    drafter: Drafter, host: str = "127.0.0.1", port: int = 0, ready_file: Path | None = None
) -> RunningServer:
    drafter.start_background()
    servicer = DraftServicer(drafter)
    return await start_server(
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        [SERVICE_NAME], host, port, ready_file, cleanup=drafter.stop,
    )


def build_drafter(kind: str, config: RuntimeConfig, max_batch_size: int) -> Drafter:
    if kind == "ngram":
        return NgramDrafter()
    executor = torch_thread()
    runner = executor.submit(ModelRunner, config).result()  # load on the thread that will run it
    return ModelDrafter(runner, max_batch_size=max_batch_size, executor=executor)


def run(args: argparse.Namespace, config: RuntimeConfig) -> None:
    drafter = build_drafter(args.drafter, config, args.max_batch_size)
    asyncio.run(serve_until_signal(lambda: start_draft_server(drafter, args.host, args.port, args.ready_file)))
