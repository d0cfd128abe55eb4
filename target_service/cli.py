"""`specdec-target`: serve the target model."""
from __future__ import annotations

import argparse
import sys

from engine.model_source import DEFAULT_MODEL
from specdec.errors import SpecdecError
from specdec.cli_args import add_runtime_args, add_server_args, env_default, runtime_config, setup_logging
from specdec.tls import add_server_tls_args
from target_service.server import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-target", description=__doc__)
    add_server_args(parser, "SPECDEC_TARGET", default_port=50052)
    add_runtime_args(parser, "SPECDEC_TARGET", DEFAULT_MODEL, cuda_layer_kernels="fused")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=env_default("SPECDEC_TARGET", "max_num_batched_tokens", 2048),
                        help="tokens per forward; longer prompts are prefilled in chunks")
    add_server_tls_args(parser, "SPECDEC_TARGET")
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = runtime_config(args)
    except ValueError as e:  # a value or combination of flags the runtime refuses: a usage error, not a traceback
        parser.error(str(e))
    try:
        run(args, config)
    except SpecdecError as e:  # refused at start-up (a model that cannot load, ...): its reason, not a traceback
        print(f"{parser.prog}: {e}", file=sys.stderr)
        sys.exit(2)  # as the gateway's


if __name__ == "__main__":
    main()
