"""Asks one service instance about itself; used inside the containers (no ports are published but
the gateway's, so `docker compose exec` runs it next to the service).

    python deploy/probe.py health 127.0.0.1:50052      # exit 0 iff grpc.health.v1 says SERVING
    python deploy/probe.py stats target 127.0.0.1:50052  # the engine's counters as one JSON line
"""
from __future__ import annotations

import argparse
import json
import socket
import sys

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 4.0


def is_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}", file=sys.stderr)
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def engine_stats(kind: str, address: str) -> dict:
    from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc  # needs the project installed

    stub_type = {"target": target_pb2_grpc.TargetServiceStub, "draft": draft_pb2_grpc.DraftServiceStub}[kind]
    with grpc.insecure_channel(address) as channel:
        stats = stub_type(channel).GetEngineStats(common_pb2.EngineStatsRequest(), timeout=TIMEOUT_S)
    return MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("health").add_argument("address")
    stats = sub.add_parser("stats")
    stats.add_argument("kind", choices=["target", "draft"])
    stats.add_argument("address")
    args = parser.parse_args()
    if args.command == "health":
        sys.exit(0 if is_serving(args.address) else 1)
    print(json.dumps({"host": socket.gethostname(), **engine_stats(args.kind, args.address)}))


if __name__ == "__main__":
    main()
