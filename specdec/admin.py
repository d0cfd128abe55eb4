"""`python -m specdec.admin`: manage a draft service's loaded drafts (load / swap / set the default /
unload / list).

The admin token comes from --token or SPECDEC_ADMIN_TOKEN and must match the draft service's
--admin-token. With --target, a load is refused unless the draft uses that target's tokenizer.
Against services serving TLS give --tls-ca (and --tls-cert/--tls-key where they require client
certificates); the same settings reach the --target. Without TLS the token crosses the network in
the clear: keep such a draft service's port on a private network.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf.json_format import MessageToJson

from specdec.tls import ClientTls, add_client_tls_args, blocking_channel, client_tls_config
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc

PREFIX = "SPECDEC_ADMIN"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-admin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=os.environ.get(f"{PREFIX}_DRAFT", "127.0.0.1:50053"),
                        help="draft service address")
    parser.add_argument("--token", default=os.environ.get(f"{PREFIX}_TOKEN", ""), help="admin token")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (a load includes warm-up)")
    add_client_tls_args(parser, PREFIX, flag="tls", peer="the draft service (and --target)", us="this client")
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load-draft", help="load a draft model under a name")
    load.add_argument("name")
    load.add_argument("model", help="HF hub id, directory, .gguf file, package:MODULE/FILE, or 'ngram'")
    load.add_argument("--default", action="store_true", help="switch new requests to it once loaded")
    load.add_argument("--replace", action="store_true", help="replace a loaded draft of the same name")
    load.add_argument("--target", help="target service address: refuse drafts with another tokenizer")
    default = commands.add_parser("set-default", help="make a loaded draft the default for new requests")
    default.add_argument("name")
    unload = commands.add_parser("unload-draft", help="unload a draft (not the default)")
    unload.add_argument("name")
    commands.add_parser("list-drafts", help="list the loaded drafts")
    args = parser.parse_args(argv)
    tls = client_tls_config(args, flag="tls")

    metadata = (("authorization", f"Bearer {args.token}"),)
    with blocking_channel(args.draft, tls) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        try:
            if args.command == "load-draft":
                request = draft_pb2.LoadDraftRequest(name=args.name, model=args.model, make_default=args.default,
                                                     replace=args.replace)
                if args.target:
                    request.expected_tokenizer_fingerprint = _target_fingerprint(args.target, tls, args.timeout)
                response = stub.LoadDraft(request, metadata=metadata, timeout=args.timeout)
            elif args.command == "set-default":
                response = stub.SetDefaultDraft(draft_pb2.SetDefaultDraftRequest(name=args.name), metadata=metadata,
                                                timeout=args.timeout)
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


def _target_fingerprint(address: str, tls: ClientTls | None, timeout: float) -> str:
    with blocking_channel(address, tls) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)
    return info.tokenizer_fingerprint


if __name__ == "__main__":
    sys.exit(main())
