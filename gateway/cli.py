"""`specdec-gateway`: the public Generate service in front of the draft and target services."""
from __future__ import annotations

import argparse

from gateway.config import DEFAULT_MAX_NEW_TOKENS, GatewayConfig
from gateway.server import run
from specdec.cli_args import (
    add_server_args,
    configure_and_run,
    env_default,
    env_flag,
    port_number,
    service_address,
    parse_service_args,
)
from specdec.tls import add_client_tls_args, add_server_tls_args, client_tls_config

PREFIX = "SPECDEC_GATEWAY"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-gateway", description=__doc__)
    add_server_args(parser, PREFIX, default_port=50051)
    parser.add_argument("--target", type=service_address, default=env_default(PREFIX, "target", "127.0.0.1:50052"),
                        help="target service address; dns:///NAME:PORT spreads over all replicas")
    parser.add_argument("--draft", type=service_address, default=env_default(PREFIX, "draft", "127.0.0.1:50053"),
                        help="draft service address; 'none' decodes target-only")
    parser.add_argument("--num-draft-tokens", type=int, default=env_default(PREFIX, "num_draft_tokens", 4),
                        help="default k per request")
    parser.add_argument("--adaptive-num-draft-tokens", action=argparse.BooleanOptionalAction,
                        default=env_flag(PREFIX, "adaptive_num_draft_tokens", True),
                        help="choose k per step for requests that do not pin it, up to --num-draft-tokens")
    parser.add_argument("--max-num-draft-tokens", type=int, default=env_default(PREFIX, "max_num_draft_tokens", 16))
    parser.add_argument("--draft-opens-with-prefill", action=argparse.BooleanOptionalAction,
                        default=env_flag(PREFIX, "draft_opens_with_prefill", False),
                        help="a request's draft prefills beside its target prefill, for a draft on hardware of its own; "
                             "default: once the first token is in (a CPU or GPU the services share runs the target's "
                             "prefill alone: a sooner first token)")
    parser.add_argument("--default-max-new-tokens", type=int, default=env_default(PREFIX, "default_max_new_tokens", None),
                        help=f"max_new_tokens of a request that sets none (default {DEFAULT_MAX_NEW_TOKENS}, or "
                             "--max-new-tokens-limit if lower)")
    parser.add_argument("--http-port", type=port_number, default=env_default(PREFIX, "http_port", None),
                        help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) "
                             "on this port; unset: off, 0: a free port")
    parser.add_argument("--served-model-name", default=env_default(PREFIX, "served_model_name", None),
                        help="the model name OpenAI clients send; default: the target's model id")
    limits = parser.add_argument_group("limits (beyond them: INVALID_ARGUMENT or RESOURCE_EXHAUSTED)")
    limits.add_argument("--max-prompt-tokens", type=int, default=env_default(PREFIX, "max_prompt_tokens", None),
                        help="longest prompt in tokens; unset: the model's context")
    limits.add_argument("--max-new-tokens-limit", type=int, default=env_default(PREFIX, "max_new_tokens_limit", None),
                        help="largest max_new_tokens a request may ask for; unset: the model's context")
    limits.add_argument("--max-request-bytes", type=int,
                        default=env_default(PREFIX, "max_request_bytes", 4 * 1024 * 1024))
    limits.add_argument("--max-concurrent-requests", type=int,
                        default=env_default(PREFIX, "max_concurrent_requests", 256), help="requests generating at once")
    limits.add_argument("--max-queued-requests", type=int, default=env_default(PREFIX, "max_queued_requests", 1024),
                        help="requests waiting for a slot; more are refused with RESOURCE_EXHAUSTED")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--draft-step-timeout-s", type=float, default=env_default(PREFIX, "draft_step_timeout_s", 10.0),
                        help="a draft silent this long is dropped from the request (it goes on target-only)")
    faults.add_argument("--draft-pause-s", type=float, default=env_default(PREFIX, "draft_pause_s", 30.0),
                        help="after a draft timed out (a hung process), new requests run target-only this long "
                             "before the draft is tried again (0: never pause)")
    faults.add_argument("--target-failover-timeout-s", type=float,
                        default=env_default(PREFIX, "target_failover_timeout_s", 5.0),
                        help="how long a request waits for a connected target replica before UNAVAILABLE")
    faults.add_argument("--connect-timeout-s", type=float, default=env_default(PREFIX, "connect_timeout_s", 600.0),
                        help="how long the gateway waits at start for the model services (which may still be loading "
                             "their weights) before it gives up")
    faults.add_argument("--stream-stall-timeout-s", type=float, default=env_default(PREFIX, "stream_stall_timeout_s", 60.0),
                        help="a client that takes none of its stream's messages this long (connected, not reading) is "
                             "dropped: its request is cancelled and its KV freed")
    faults.add_argument("--max-target-retries", type=int, default=env_default(PREFIX, "max_target_retries", 2),
                        help="re-prefills on another target replica per request after a lost one")
    add_server_tls_args(parser, PREFIX)
    add_client_tls_args(parser, PREFIX)
    args = parse_service_args(parser, argv)
    configure_and_run(parser, args, lambda: _config(args), run, fields={"default_num_draft_tokens": "num_draft_tokens"})


def _config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        target_address=args.target,
        draft_address=None if args.draft in ("", "none") else args.draft,
        default_num_draft_tokens=int(args.num_draft_tokens),
        adaptive_num_draft_tokens=args.adaptive_num_draft_tokens,
        max_num_draft_tokens=int(args.max_num_draft_tokens),
        default_max_new_tokens=_default_max_new_tokens(args),
        served_model_name=args.served_model_name or None,
        max_prompt_tokens=_optional_int(args.max_prompt_tokens),
        max_new_tokens_limit=_optional_int(args.max_new_tokens_limit),
        max_request_bytes=int(args.max_request_bytes),
        max_concurrent_requests=int(args.max_concurrent_requests),
        max_queued_requests=int(args.max_queued_requests),
        draft_step_timeout_s=float(args.draft_step_timeout_s),
        draft_pause_s=float(args.draft_pause_s),
        draft_opens_with_prefill=args.draft_opens_with_prefill,
        target_failover_timeout_s=float(args.target_failover_timeout_s),
        connect_timeout_s=float(args.connect_timeout_s),
        max_target_retries=int(args.max_target_retries),
        stream_stall_timeout_s=float(args.stream_stall_timeout_s),
        backend_tls=client_tls_config(args),
    )


def _default_max_new_tokens(args: argparse.Namespace) -> int:
    given, limit = _optional_int(args.default_max_new_tokens), _optional_int(args.max_new_tokens_limit)
    if given is not None:
        return given
    return DEFAULT_MAX_NEW_TOKENS if limit is None else min(DEFAULT_MAX_NEW_TOKENS, limit)


def _optional_int(value: str | int | None) -> int | None:
    return int(value) if value not in (None, "") else None


if __name__ == "__main__":
    main()
