"""Optional TLS: server certificates for any service's port, and the gateway's client side
towards the model services, with mutual TLS (client certificates) when a CA is given for it.

Files are PEM. Flags (each with an env default, e.g. SPECDEC_TARGET_TLS_CERT):
  servers:  --tls-cert, --tls-key, --tls-client-ca (mTLS: only clients with a certificate signed
            by this CA may connect)
  gateway → model services: --backend-tls-ca (verify the services), --backend-tls-cert and
            --backend-tls-key (the gateway's identity for mTLS), --backend-tls-server-name
            (the name the services' certificate carries, when the address differs)
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


def add_client_tls_args(parser: argparse.ArgumentParser, prefix: str) -> None:
    group = parser.add_argument_group("TLS to the model services (unset: plaintext)")
    group.add_argument("--backend-tls-ca", default=_env(prefix, "backend_tls_ca"),
                       help="PEM CA that signed the model services' certificates; turns TLS on")
    group.add_argument("--backend-tls-cert", default=_env(prefix, "backend_tls_cert"),
                       help="mutual TLS: this gateway's PEM certificate")
    group.add_argument("--backend-tls-key", default=_env(prefix, "backend_tls_key"),
                       help="mutual TLS: this gateway's PEM private key")
    group.add_argument("--backend-tls-server-name", default=_env(prefix, "backend_tls_server_name"),
                       help="the name in the services' certificates, if not the address's host")


def client_tls_config(args: argparse.Namespace) -> ClientTls | None:
    if not any([args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key]):
        return None
    return ClientTls(_pem("--backend-tls-ca", args.backend_tls_ca), _pem("--backend-tls-cert", args.backend_tls_cert),
                     _pem("--backend-tls-key", args.backend_tls_key), args.backend_tls_server_name or None)
