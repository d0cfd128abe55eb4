"""`specdec-gateway`: the public Generate service in front of the draft and target services."""
from __future__ import annotations

import argparse
import sys

from gateway.config import GatewayConfig
from gateway.server import run
from specdec.cli_args import add_server_args, env_default, setup_logging
from specdec.errors import SpecdecError

PREFIX = "SPECDEC_GATEWAY"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-gateway", description=__doc__)
    add_server_args(parser, PREFIX, default_port=50051)
    parser.add_argument("--target", default=env_default(PREFIX, "target", "127.0.0.1:50052"),
                        help="target service address; dns:///NAME:PORT spreads over all replicas")
    parser.add_argument("--draft", default=env_default(PREFIX, "draft", "127.0.0.1:50053"),
                        help="draft service address; 'none' decodes target-only")
    parser.add_argument("--num-draft-tokens", type=int, default=env_default(PREFIX, "num_draft_tokens", 4),
                        help="default k per request")
    parser.add_argument("--max-num-draft-tokens", type=int, default=env_default(PREFIX, "max_num_draft_tokens", 16))
    parser.add_argument("--default-max-new-tokens", type=int, default=env_default(PREFIX, "default_max_new_tokens", 256))
    parser.add_argument("--http-port", type=int, default=env_default(PREFIX, "http_port", None),
                        help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) "
                             "on this port; unset: off, 0: a free port")
    parser.add_argument("--served-model-name", default=env_default(PREFIX, "served_model_name", None),
                        help="the model name OpenAI clients send; default: the target's model id")
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    config = GatewayConfig(
        target_address=args.target,
        draft_address=None if args.draft in ("", "none") else args.draft,
        default_num_draft_tokens=int(args.num_draft_tokens),
        max_num_draft_tokens=int(args.max_num_draft_tokens),
        default_max_new_tokens=int(args.default_max_new_tokens),
        served_model_name=args.served_model_name or None,
    )
    try:
        run(args, config)
    except SpecdecError as e:  # e.g. an incompatible draft/target pair: say why and exit non-zero
        print(f"specdec-gateway: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
