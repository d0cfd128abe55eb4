"""Optional TLS: server certificates for any service's port, and the gateway's client side
towards the model services, with mutual TLS (client certificates) when a CA is given for it.

Files are PEM. Flags (each with an env default, e.g. SPECDEC_TARGET_TLS_CERT):
  servers:  --tls-cert, --tls-key, --tls-client-ca (mTLS: only clients with a certificate signed
            by this CA may connect)
  gateway → model services: --backend-tls-ca (verify the services), --backend-tls-cert and
            --backend-tls-key (the gateway's identity for mTLS), --backend-tls-server-name
            (the name the services' certificate carries, when the address differs)
  command-line clients (specdec.client → gateway, specdec.admin → draft service): the same four as
            --tls-ca, --tls-cert, --tls-key, --tls-server-name (SPECDEC_CLIENT_TLS_CA, SPECDEC_ADMIN_TLS_CA, ...)
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: clients must present a certificate signed by it

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([(self.key_file.read_bytes(), self.cert_file.read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTls:
    ca_file: Path | None = None  # None: the system's roots
    cert_file: Path | None = None  # with key_file: our certificate, for servers that require mTLS
    key_file: Path | None = None
    server_name: str | None = None  # the name to check the server's certificate against

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its cert and key files")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _env(prefix: str, name: str) -> str | None:
    return os.environ.get(f"{prefix}_{name.upper()}")  # as specdec.cli_args.env_default, without its imports


def add_server_tls_args(parser: argparse.ArgumentParser, prefix: str) -> None:
    group = parser.add_argument_group("TLS (unset: plaintext)")
    group.add_argument("--tls-cert", default=_env(prefix, "tls_cert"), help="PEM certificate chain")
    group.add_argument("--tls-key", default=_env(prefix, "tls_key"), help="PEM private key")
    group.add_argument("--tls-client-ca", default=_env(prefix, "tls_client_ca"),
                       help="mutual TLS: accept only clients with a certificate signed by this CA")


def server_tls_config(args: argparse.Namespace) -> ServerTls | None:
    if not args.tls_cert and not args.tls_key:
        if args.tls_client_ca:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("TLS needs both --tls-cert and --tls-key")
    return ServerTls(_pem("--tls-cert", args.tls_cert), _pem("--tls-key", args.tls_key),
                     _pem("--tls-client-ca", args.tls_client_ca))


def _pem(flag: str, value: str | None) -> Path | None:
    """The file a flag names, read once at start-up: a missing or unreadable one is said there, with its
    flag, not as a traceback (or at the first connection)."""
    if not value:
        return None
    path = Path(value)
    try:
        path.read_bytes()
    except OSError as e:
        raise SystemExit(f"{flag} {value}: {e.strerror or e}") from None
    return path


def add_client_tls_args(parser: argparse.ArgumentParser, prefix: str, flag: str = "backend-tls",
                        peer: str = "the model services", us: str = "this gateway") -> None:
    """The client side's flags, `--{flag}-ca` and so on (the gateway's towards the model services; `tls` for the
    command-line clients), each with its env default (PREFIX_BACKEND_TLS_CA)."""
    dest = flag.replace("-", "_")
    group = parser.add_argument_group(f"TLS to {peer} (unset: plaintext)")
    group.add_argument(f"--{flag}-ca", dest=f"{dest}_ca", default=_env(prefix, f"{dest}_ca"),
                       help=f"PEM CA that signed the certificates of {peer}; turns TLS on")
    group.add_argument(f"--{flag}-cert", dest=f"{dest}_cert", default=_env(prefix, f"{dest}_cert"),
                       help=f"mutual TLS: {us}'s PEM certificate")
    group.add_argument(f"--{flag}-key", dest=f"{dest}_key", default=_env(prefix, f"{dest}_key"),
                       help=f"mutual TLS: {us}'s PEM private key")
    group.add_argument(f"--{flag}-server-name", dest=f"{dest}_server_name", default=_env(prefix, f"{dest}_server_name"),
                       help=f"the name in the certificates of {peer}, if not the address's host")


def client_tls_config(args: argparse.Namespace, flag: str = "backend-tls") -> ClientTls | None:
    """What add_client_tls_args(..., flag) parsed: None for plaintext (none of the CA, cert or key given)."""
    dest = flag.replace("-", "_")
    ca, cert, key = (getattr(args, f"{dest}_{name}") for name in ("ca", "cert", "key"))
    if not any([ca, cert, key]):
        return None
    return ClientTls(_pem(f"--{flag}-ca", ca), _pem(f"--{flag}-cert", cert), _pem(f"--{flag}-key", key),
                     getattr(args, f"{dest}_server_name") or None)


def blocking_channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    """A blocking channel for the command-line clients: TLS (mTLS with a client certificate) when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.credentials(), options=tls.channel_options())
