"""`python -m specdec.admin`: manage a draft service's loaded drafts (load / swap / unload / list).

The admin token comes from --token or SPECDEC_ADMIN_TOKEN and must match the draft service's
--admin-token. With --target, a load is refused unless the draft uses that target's tokenizer.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf.json_format import MessageToJson

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-admin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=os.environ.get("SPECDEC_ADMIN_DRAFT", "127.0.0.1:50053"),
                        help="draft service address")
    parser.add_argument("--token", default=os.environ.get("SPECDEC_ADMIN_TOKEN", ""), help="admin token")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (a load includes warm-up)")
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load-draft", help="load a draft model under a name")
    load.add_argument("name")
    load.add_argument("model", help="HF hub id, directory, .gguf file, package:MODULE/FILE, or 'ngram'")
    load.add_argument("--default", action="store_true", help="switch new requests to it once loaded")
    load.add_argument("--replace", action="store_true", help="replace a loaded draft of the same name")
    load.add_argument("--target", help="target service address: refuse drafts with another tokenizer")
    unload = commands.add_parser("unload-draft", help="unload a draft (not the default)")
    unload.add_argument("name")
    commands.add_parser("list-drafts", help="list the loaded drafts")
    args = parser.parse_args(argv)

    metadata = (("authorization", f"Bearer {args.token}"),)
    with grpc.insecure_channel(args.draft) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        try:
            if args.command == "load-draft":
                request = draft_pb2.LoadDraftRequest(name=args.name, model=args.model, make_default=args.default,
                                                     replace=args.replace)
                if args.target:
                    request.expected_tokenizer_fingerprint = _target_fingerprint(args.target, args.timeout)
                response = stub.LoadDraft(request, metadata=metadata, timeout=args.timeout)
            elif args.command == "unload-draft":
                response = stub.UnloadDraft(draft_pb2.UnloadDraftRequest(name=args.name), metadata=metadata,
                                            timeout=args.timeout)
            else:
                response = stub.ListDrafts(draft_pb2.ListDraftsRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"specdec-admin: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(MessageToJson(response, indent=2))
    return 0


def _target_fingerprint(address: str, timeout: float) -> str:
    with grpc.insecure_channel(address) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)
    return info.tokenizer_fingerprint


if __name__ == "__main__":
    sys.exit(main())
