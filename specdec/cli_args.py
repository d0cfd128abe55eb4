"""Command-line flags shared by the service entry points; every flag has an env-var default."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from transformers.utils import logging as transformers_logging

from engine.model_runner import RuntimeConfig
from specdec.busy_poll import MODES as BUSY_POLL_MODES
from specdec.cpu_affinity import parse_cpus
from specdec.errors import SpecdecError
from specdec.serving import DEFAULT_SHUTDOWN_GRACE_S
from specdec.request_id import JsonFormatter, RequestIdFilter


C = TypeVar("C")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def env_default(prefix: str, name: str, default: str | int | None) -> str | int | None:
    return os.environ.get(f"{prefix}_{name.upper().replace('-', '_')}", default)


def add_server_args(parser: argparse.ArgumentParser, prefix: str, default_port: int) -> None:
    env = lambda name, default: env_default(prefix, name, default)  # noqa: E731
    parser.add_argument("--host", default=env("host", "127.0.0.1"), help="address to bind (0.0.0.0 in containers)")
    parser.add_argument("--port", type=port_number, default=env("port", default_port), help="port; 0 picks a free one")
    parser.add_argument("--unix-socket", type=Path, default=env("unix_socket", None),
                        help="listen on this Unix socket as well: callers on the same host (a gateway beside its model "
                             "services: --target unix:PATH) then skip the TCP stack on every message")
    parser.add_argument("--shutdown-grace-s", type=float, default=env("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S),
                        help="on SIGTERM/SIGINT, refuse new requests and let running ones finish for up to this long "
                             "(a second signal ends them at once)")
    parser.add_argument("--ready-file", type=Path, default=env("ready_file", None),
                        help="write HOST:PORT here once serving (for launchers)")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=env("log_level", "INFO"))
    parser.add_argument("--log-format", choices=["text", "json"], default=env("log_format", "text"),
                        help="json: one object per line with time, level, logger, request_id, message")
    parser.add_argument("--metrics-port", type=port_number, default=env("metrics_port", None),
                        help="serve Prometheus metrics at http://HOST:PORT/metrics; unset: off, 0: a free port")
    parser.add_argument("--busy-poll", choices=BUSY_POLL_MODES, default=env("busy_poll", "auto"),
                        help="keep the event loop polling while exactly one stream is open (one busy core; a step's round "
                             "trips lose the wake-ups). auto: on with >= 8 CPUs and a CUDA model (the gateway: the target's)")
    parser.add_argument("--cpus", type=_cpus, default=env("cpus", None),
                        help="once serving, pin the process's threads to these CPUs (3, 2-3,6): a busy-polling "
                             "service's gRPC threads then wake on a CPU its loop keeps awake (specdec/cpu_affinity.py)")
    parser.add_argument("--idle-poll", choices=BUSY_POLL_MODES, default=env("idle_poll", "off"),
                        help="keep the host's idle CPUs polling (a SCHED_IDLE spinner each) while any stream is open, so "
                             "gRPC's threads wake without a halted CPU's delay (a VM's); off by default: it sped up "
                             "target-only decoding on the H200 host, not speculation. auto: as --busy-poll")


def add_runtime_args(parser: argparse.ArgumentParser, prefix: str, default_model: str,
                     cuda_layer_kernels: str = "auto", stages: str = "compiled") -> None:
    """`cuda_layer_kernels`: --layer-kernels when not given and the device is CUDA (on CPU: auto, which
    is reference there); `stages`: --stages when not given. The target takes fused layer kernels and
    kernel stages: batch-invariant, and the same bits in every replica, so speculative output equals
    target-only output in bf16 at any batch, on any replica; a draft takes auto, the fastest, and the
    compiled stages, as its rounding changes only which tokens it proposes."""
    env = lambda name, default: env_default(prefix, name, default)  # noqa: E731
    parser.set_defaults(cuda_layer_kernels=cuda_layer_kernels)
    parser.add_argument("--model", default=env("model", default_model),
                        help="HF hub id, local directory, .gguf file, or package:MODULE/FILE")
    parser.add_argument("--device", default=env("device", "cuda" if torch.cuda.is_available() else "cpu"))
    parser.add_argument("--dtype", default=env("dtype", None), help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--max-model-len", type=int, default=env("max_model_len", None))
    parser.add_argument("--kv-cache-tokens", type=int, default=env("kv_cache_tokens", 65536))
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=env("kv_cache_memory_fraction", None),
                        help="CUDA: give the KV pool this fraction of the free memory (overrides --kv-cache-tokens)")
    parser.add_argument("--attention-backend", choices=["auto", "triton", "reference"],
                        default=env("attention_backend", "auto"), help="auto: triton on CUDA, reference on CPU")
    parser.add_argument("--layer-kernels", choices=["auto", "fused", "layer", "reference"],
                        default=env("layer_kernels", None),
                        help="fused: every CUDA-graph step runs engine/fused_stages.py's Triton kernels, batch-invariant; "
                             "auto: steps of up to 16 rows do, larger ones cuBLAS (faster at batch, not batch-invariant); "
                             "layer: as auto, a decoder layer one persistent kernel (engine/triton_layer.py; drafts; "
                             "experimental: slower than auto on the H200 today); "
                             f"reference: none. Default: {cuda_layer_kernels} on CUDA, reference on CPU (see the README)")
    parser.add_argument("--stages", choices=["kernels", "compiled", "eager"], default=env("stages", stages),
                        help="CUDA: a layer's norms, rotary, residuals and activation around cuBLAS in the forwards the "
                             "layer kernels do not take (prefill chunks, larger steps). kernels: Triton kernels of fixed "
                             "launch, the same bits in every process; compiled: torch.compile (processes compiling apart "
                             "can compute other bits, so replicas can answer differently); eager: plain "
                             f"PyTorch. Default: {stages}")
    parser.add_argument("--max-batch-size", type=int, default=env("max_batch_size", 64))
    parser.add_argument("--num-threads", type=int, default=env("num_threads", None), help="torch CPU threads")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    """The runtime flags as a RuntimeConfig; a value it cannot take is a ValueError naming the flag."""
    _check_device(str(args.device))
    if _given(args.num_threads):
        if int(args.num_threads) < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        torch.set_num_threads(int(args.num_threads))
    on_cuda = str(args.device).startswith("cuda")
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    return RuntimeConfig(
        model=args.model,
        device=args.device,
        dtype=dtype,
        max_model_len=int(args.max_model_len) if _given(args.max_model_len) else None,
        kv_cache_tokens=int(args.kv_cache_tokens),
        kv_cache_memory_fraction=float(args.kv_cache_memory_fraction) if _given(args.kv_cache_memory_fraction)
        else None,
        attention_backend=args.attention_backend,
        layer_kernels=args.layer_kernels or (args.cuda_layer_kernels if on_cuda else "auto"),
        stages=args.stages,
        max_batch_size=int(args.max_batch_size),
    )


def _given(value: object) -> bool:
    """Set by a flag or its variable (0 included: it is refused, not taken for unset)."""
    return value not in (None, "")


def _check_device(device: str) -> None:
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r}: {e}") from None


def parse_service_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses the flags and sets up logging. Values from SPECDEC_* variables (argparse's defaults) are held
    to the same choices as the flags, which argparse checks only on the command line."""
    args = parser.parse_args(argv)
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            parser.error(f"argument {'/'.join(action.option_strings)}: invalid choice {value!r} (from the "
                         f"environment; choose from {', '.join(map(str, action.choices))})")
    if not 0 <= args.shutdown_grace_s < math.inf:
        parser.error(f"--shutdown-grace-s must be >= 0 seconds, got {args.shutdown_grace_s}")
    device = getattr(args, "device", None)
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: this torch sees no CUDA GPU (a CPU build, or no driver); use --device cpu")
    setup_logging(args.log_level, args.log_format)
    return args


def env_flag(prefix: str, name: str, default: bool) -> bool:
    """A boolean flag's default from its variable: 1/true/yes/on or 0/false/no/off (any case); unset: `default`."""
    text = os.environ.get(f"{prefix}_{name.upper()}")
    if text is None or text.strip() == "":
        return default
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{prefix}_{name.upper()}={text!r}: use 1/true/yes/on or 0/false/no/off")


def configure_and_run(parser: argparse.ArgumentParser, args: argparse.Namespace, configure: Callable[[], C],
                      run: Callable[[argparse.Namespace, C], None], fields: dict[str, str] | None = None) -> None:
    """A service's entry point after its flags are parsed: a value or combination its config refuses
    (ValueError) is a usage error, its message naming the flags (`fields`: config fields whose flag's
    destination is named otherwise); a refused start (a SpecdecError: a model that cannot load, an
    incompatible draft, a busy port) ends the process with its reason and status 2. Neither is a traceback."""
    try:
        config = configure()
    except ValueError as e:
        parser.error(flag_names(parser, str(e), fields or {}))
    try:
        run(args, config)
    except (SpecdecError, OSError) as e:  # OSError: a port, socket or file it could not take
        print(f"{parser.prog}: {e}", file=sys.stderr)
        sys.exit(2)


def flag_names(parser: argparse.ArgumentParser, message: str, fields: dict[str, str]) -> str:
    """`message` with each config field a flag sets named as the flag (kv_cache_tokens -> --kv-cache-tokens):
    the names a user typed, or whose SPECDEC_* variable they set. Only names with an underscore, so that a
    plain word of the message (model, device) stays a word."""
    flags = {action.dest: flag for action in parser._actions
             if (flag := next((o for o in action.option_strings if o.startswith("--")), None))}
    flags.update({field: flags[dest] for field, dest in fields.items() if dest in flags})
    names = sorted((name for name in flags if "_" in name), key=len, reverse=True)
    if not names:
        return message
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: flags[m.group(1)], message)


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (0: a free one). gRPC takes a larger number modulo 65536 without a word (99999
    served on 34463), so it is refused here."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: 0-65535 (0 picks a free one)")
    return port


_NAME_SCHEMES = ("dns:", "ipv4:", "ipv6:")  # gRPC target schemes followed by HOST:PORT (dns: after an authority)


def service_address(text: str) -> str:
    """A gRPC target (HOST:PORT, [IPV6]:PORT, dns:///NAME:PORT, unix:PATH, ...) whose port, where it names
    one number, is 1-65535: gRPC would take 99999 modulo 65536, or the gateway wait out its connect timeout."""
    rest = text
    for scheme in _NAME_SCHEMES:
        if rest.startswith(scheme):
            rest = rest[len(scheme):].rsplit("/", 1)[-1]
            break
    if rest.startswith("[") and "]:" in rest:
        port = rest.rsplit("]:", 1)[1]
    elif rest.count(":") == 1 and not rest.startswith(("unix:", "unix-abstract:", "vsock:")):
        port = rest.split(":")[1]
    else:  # no port, a socket path, a list of addresses, or a bare IPv6 address: gRPC's to judge
        return text
    if port.isdigit() and not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: port {port} is out of range: 1-65535")
    return text


def _cpus(text: str) -> frozenset[int]:
    try:
        return parse_cpus(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def setup_logging(level: str, log_format: str = "text") -> None:
    """Every record carries the request id of the RPC it was logged in ("-" outside one). With `json`,
    stderr carries log records alone: no progress bars (transformers' weight loading, the hub's downloads,
    our graph captures: engine.progress), whose lines a log pipeline would take for broken records."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        transformers_logging.disable_progress_bar()
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
