"""`specdec-draft`: serve a drafter (a small causal LM, or n-gram prompt lookup)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from draft_service.server import run
from engine import pdl
from engine.model_runner import QUANTIZE_MODES
from engine.model_source import DEFAULT_MODEL
from specdec.cli_args import (add_runtime_args, add_server_args, configure_and_run, env_default, env_flag, runtime_config,
                              parse_service_args)
from specdec.tls import add_server_tls_args, server_tls_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-draft", description=__doc__)
    add_server_args(parser, "SPECDEC_DRAFT", default_port=50053)
    parser.add_argument("--drafter", choices=["model", "ngram"], default=env_default("SPECDEC_DRAFT", "drafter", "ngram"),
                        help="'model' runs --model as the draft; 'ngram' needs no weights")
    parser.add_argument("--draft-name", default=env_default("SPECDEC_DRAFT", "draft_name", "default"),
                        help="the name requests choose the start-up draft by (GenerateRequest.draft_model)")
    parser.add_argument("--admin-token", default=env_default("SPECDEC_DRAFT", "admin_token", None),
                        help="enables LoadDraft/UnloadDraft for callers sending 'authorization: Bearer TOKEN' "
                             "(prefer the env var: flags show in ps)")
    add_runtime_args(parser, "SPECDEC_DRAFT", DEFAULT_MODEL)
    parser.add_argument("--quantize", choices=list(QUANTIZE_MODES),
                        default=env_default("SPECDEC_DRAFT", "quantize", None),
                        help="int8: weight-only int8 drafts (default on CPU, where a draft step is bound by the bytes "
                             "it reads; none on GPU, where int8 takes the wide products only: docs/benchmarks.md, 'A draft in "
                             "int8'); w8a8: every linear int8, and on CUDA its inputs too (int8 tensor cores). "
                             "A draft's numerics never change the output")
    parser.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction,
                        default=env_flag("SPECDEC_DRAFT", "draft_ahead", False),
                        help="greedy requests: go on drafting while the target verifies, as if all were accepted; "
                             "a proposal that finds its chain right costs no draft time (engine/model_drafter.py). "
                             "For a draft on a device of its own: on a shared one the chain takes the target's time")
    add_server_tls_args(parser, "SPECDEC_DRAFT")
    args = parse_service_args(parser, argv)
    quantize = args.quantize or ("int8" if args.device == "cpu" else "none")
    pdl.ENABLED = pdl.from_env(default=True)  # a draft's chains of small kernels gain (engine/pdl.py)
    server_tls_config(args)  # its files checked before the model loads, not after
    configure_and_run(parser, args, lambda: replace(runtime_config(args), quantize=quantize), run)


if __name__ == "__main__":
    main()
