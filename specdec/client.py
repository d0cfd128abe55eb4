"""`specdec-client`: stream one Generate call to the terminal (or as JSON lines).

Against a gateway serving TLS give --tls-ca (and --tls-cert/--tls-key where it requires client
certificates), or SPECDEC_CLIENT_TLS_CA and so on.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.request_id import REQUEST_ID_KEY
from specdec.tls import ClientTls, add_client_tls_args, blocking_channel, client_tls_config
from specdec.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    final: gateway_pb2.GenerateResponse


def build_request(prompt: str, chat: bool, max_new_tokens: int | None, num_draft_tokens: int | None,
                  stop: list[str], draft_model: str | None = None, temperature: float = 0.0,
                  seed: int | None = None) -> gateway_pb2.GenerateRequest:
    """A Generate request; None leaves a field unset (the gateway's default: its default draft, its k)."""
    request = gateway_pb2.GenerateRequest(stop=stop, temperature=temperature)
    if chat:
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    for name, value in (("max_new_tokens", max_new_tokens), ("num_draft_tokens", num_draft_tokens),
                        ("draft_model", draft_model), ("seed", seed)):
        if value is not None:
            setattr(request, name, value)
    return request


def collect(chunks: Iterable[gateway_pb2.GenerateResponse], on_chunk=None) -> Completion:
    """Joins a Generate stream's chunks; calls on_chunk(chunk) for each as it arrives."""
    token_ids, text, final = [], "", None
    for chunk in chunks:
        token_ids += chunk.token_ids
        text += chunk.text
        final = chunk
        if on_chunk is not None:
            on_chunk(chunk)
    return Completion(token_ids, text, final)


def stream(address: str, request: gateway_pb2.GenerateRequest, on_chunk=None, timeout_s: float = 600,
           request_id: str | None = None, tls: ClientTls | None = None) -> Completion:
    """Runs Generate on the gateway at `address` (over TLS with `tls`); returns the whole completion.

    `request_id` travels as x-request-id metadata; the gateway makes one when it is None.
    """
    metadata = [(REQUEST_ID_KEY, request_id)] if request_id else None
    with blocking_channel(address, tls) as channel:
        chunks = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout_s, metadata=metadata)
        return collect(chunks, on_chunk)


def format_stats(final: gateway_pb2.GenerateResponse) -> str:
    s = final.stats
    reason = gateway_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    return (f"finish={reason} prompt={s.num_prompt_tokens} completion={s.num_completion_tokens} tokens | "
            f"drafted={s.num_draft_tokens} accepted={s.num_accepted_tokens} "
            f"acceptance={s.acceptance_rate:.2f} mean_accepted_len={s.mean_accepted_len:.2f} | "
            f"ttft={s.time_to_first_token_s * 1000:.0f} ms {s.tokens_per_s:.1f} tok/s | "
            f"forward: draft {s.draft_forward_s * 1000:.0f} ms, target {s.target_forward_s * 1000:.0f} ms | "
            f"request_id={s.request_id}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-client", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051", help="the gateway")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("-k", "--num-draft-tokens", type=int, help="draft tokens per step; 0 = no speculation")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--draft-model", help="the draft service's draft of this name (default: its default draft)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--seed", type=int, help="with --temperature: the same seed, the same output")
    parser.add_argument("--json", action="store_true", help="one JSON object per chunk on stdout")
    parser.add_argument("--request-id", help="sent as x-request-id; the services' logs carry it")
    add_client_tls_args(parser, "SPECDEC_CLIENT", flag="tls", peer="the gateway", us="this client")
    args = parser.parse_args(argv)
    tls = client_tls_config(args, flag="tls")
    request = build_request(args.prompt, args.chat, args.max_new_tokens, args.num_draft_tokens, args.stop,
                            args.draft_model, args.temperature, args.seed)

    def show(chunk: gateway_pb2.GenerateResponse) -> None:
        if args.json:
            print(json.dumps(MessageToDict(chunk, preserving_proto_field_name=True)), flush=True)
        else:
            print(chunk.text, end="", flush=True)

    try:
        completion = stream(args.address, request, show, request_id=args.request_id, tls=tls)
    except grpc.RpcError as e:
        print(f"\nspecdec-client: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    if not args.json:
        print("\n" + format_stats(completion.final), file=sys.stderr)


if __name__ == "__main__":
    main()
