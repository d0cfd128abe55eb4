"""`specdec-target`: serve the target model."""
from __future__ import annotations

import argparse

from engine.model_runner import RuntimeConfig
from engine.model_source import DEFAULT_MODEL
from specdec.cli_args import (add_runtime_args, add_server_args, configure_and_run, env_default, runtime_config,
                              parse_service_args)
from specdec.tls import add_server_tls_args, server_tls_config
from target_service.server import engine_config, run

# The target's runtime on CUDA unless flags say otherwise: fused layer kernels (batch-invariant) and kernel stages (the
# same bits in every process; specdec/cli_args.add_runtime_args). On CPU the runtime's own defaults.
CUDA_RUNTIME = {"layer_kernels": "fused", "stages": "kernels"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec-target", description=__doc__)
    add_server_args(parser, "SPECDEC_TARGET", default_port=50052)
    add_runtime_args(parser, "SPECDEC_TARGET", DEFAULT_MODEL, cuda_layer_kernels=CUDA_RUNTIME["layer_kernels"],
                     stages=CUDA_RUNTIME["stages"])
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=env_default("SPECDEC_TARGET", "max_num_batched_tokens", 2048),
                        help="tokens per forward; longer prompts are prefilled in chunks")
    parser.add_argument("--max-prefills-per-iteration", type=int,
                        default=env_default("SPECDEC_TARGET", "max_prefills_per_iteration", 0),
                        help="prompts prefilled in one engine iteration, at most; others wait their turn in arrival "
                             "order (0: as many as --max-num-batched-tokens takes). 1: with the fused kernels each "
                             "prompt is a forward of its own, and running requests wait for one, not a burst's")
    add_server_tls_args(parser, "SPECDEC_TARGET")
    args = parse_service_args(parser, argv)
    server_tls_config(args)  # its files checked before the model loads, not after
    configure_and_run(parser, args, lambda: _config(args), run)


def _config(args: argparse.Namespace) -> RuntimeConfig:
    engine_config(args)  # refused here, before the model loads
    return runtime_config(args)


if __name__ == "__main__":
    main()
