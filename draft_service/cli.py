"""`specdec-draft`: serve a drafter (a small causal LM, or n-gram prompt lookup)."""
from __future__ import annotations

import argparse

from draft_service.server import run
from engine.model_source import DEFAULT_MODEL
from specdec.cli_args import add_runtime_args, add_server_args, env_default, runtime_config, setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-draft", description=__doc__)
    add_server_args(parser, "SPECDEC_DRAFT", default_port=50053)
    parser.add_argument("--drafter", choices=["model", "ngram"], default=env_default("SPECDEC_DRAFT", "drafter", "ngram"),
                        help="'model' runs --model as the draft; 'ngram' needs no weights")
    add_runtime_args(parser, "SPECDEC_DRAFT", DEFAULT_MODEL)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    run(args, runtime_config(args))


if __name__ == "__main__":
    main()
