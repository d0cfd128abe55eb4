"""TLS on every hop: the gateway serves clients over TLS, and talks to the target over mutual TLS;
certificates are made in the test (openssl). Without the right certificate nothing connects."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from harness import generate

from draft_service.registry import DraftRegistry, model_loader
from draft_service.server import start_draft_server
from engine.model_drafter import ModelDrafter
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.ngram_drafter import NgramDrafter
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec import admin, client
from specdec.errors import ServiceUnavailableError
from specdec.tls import ClientTls, ServerTls
from specdec.v1 import common_pb2, gateway_pb2_grpc, target_pb2_grpc
from target_service.server import start_target_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
SAN = "subjectAltName=DNS:localhost,IP:127.0.0.1"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=directory)


def _leaf(directory: Path, name: str, ca: str) -> None:
    """A certificate for `name` signed by `ca`, valid for localhost / 127.0.0.1, server and client use."""
    (directory / "san.ext").write_text(SAN + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    _ca(directory, "ca")
    _ca(directory, "rogue-ca")
    for name in ("target", "gateway", "gateway-client"):
        _leaf(directory, name, "ca")
    _leaf(directory, "rogue", "rogue-ca")
    return directory


@pytest.fixture(scope="module")
def mtls_target(loop, model_dirs, pki):
    """A target that only talks to clients holding a certificate from our CA."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), kv_cache_tokens=4096))
    tls = ServerTls(pki / "target.pem", pki / "target.key", client_ca_file=pki / "ca.pem")
    server = loop.run(start_target_server(runner, tls=tls))
    yield server
    loop.run(server.stop())


def _client_tls(pki: Path, identity: str | None) -> ClientTls:
    if identity is None:
        return ClientTls(pki / "ca.pem")
    return ClientTls(pki / "ca.pem", pki / f"{identity}.pem", pki / f"{identity}.key")


def test_tls_client_to_gateway_and_mtls_gateway_to_target_generate_exact_output(loop, mtls_target, pki, tokenizer,
                                                                              hf_greedy):
    config = GatewayConfig(f"127.0.0.1:{mtls_target.port}", None, backend_tls=_client_tls(pki, "gateway"))
    gateway = loop.run(start_gateway_server(config, tls=ServerTls(pki / "gateway.pem", pki / "gateway.key")))
    try:
        credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{gateway.port}", credentials) as channel:
            token_ids, _, _ = generate(gateway_pb2_grpc.GatewayStub(channel), prompt="The quick brown fox",
                                       max_new_tokens=12)
        assert token_ids == hf_greedy(tokenizer.encode("The quick brown fox"), 12)
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:  # plaintext cannot talk to it
            with pytest.raises(grpc.RpcError) as info:
                generate(gateway_pb2_grpc.GatewayStub(channel), prompt="hi", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.run(gateway.stop())


@pytest.mark.parametrize("identity", [None, "rogue"], ids=["no_client_certificate", "certificate_from_another_ca"])
def test_target_refuses_gateways_without_a_trusted_client_certificate(identity, loop, mtls_target, pki):
    config = GatewayConfig(f"127.0.0.1:{mtls_target.port}", None, backend_tls=_client_tls(pki, identity),
                           connect_timeout_s=3)
    with pytest.raises(ServiceUnavailableError, match="cannot reach a model service"):
        loop.run(start_gateway_server(config))


def test_plaintext_client_cannot_reach_a_tls_target(mtls_target):
    with grpc.insecure_channel(f"127.0.0.1:{mtls_target.port}") as channel, pytest.raises(grpc.RpcError) as info:
        target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_to_both_model_services_speculates_with_exact_output(loop, mtls_target, model_dirs, pki, tokenizer,
                                                                 hf_greedy):
    drafter = ModelDrafter(ModelRunner(RuntimeConfig(model=str(model_dirs["identical"]), kv_cache_tokens=4096)))
    tls = ServerTls(pki / "target.pem", pki / "target.key", client_ca_file=pki / "ca.pem")  # same CA, same host
    draft = loop.run(start_draft_server(DraftRegistry.of(drafter), tls=tls))
    config = GatewayConfig(f"127.0.0.1:{mtls_target.port}", f"127.0.0.1:{draft.port}",
                           backend_tls=_client_tls(pki, "gateway"))
    gateway = loop.run(start_gateway_server(config))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            token_ids, _, final = generate(gateway_pb2_grpc.GatewayStub(channel), prompt="The quick brown fox",
                                           max_new_tokens=12, num_draft_tokens=3)
        assert token_ids == hf_greedy(tokenizer.encode("The quick brown fox"), 12)
        assert final.stats.num_accepted_tokens > 0  # the identical draft, reached over mTLS
    finally:
        loop.run(gateway.stop())
        loop.run(draft.stop())


def _cli_tls(pki: Path, identity: str | None) -> list[str]:
    flags = ["--tls-ca", str(pki / "ca.pem")]
    return flags if identity is None else [*flags, "--tls-cert", str(pki / f"{identity}.pem"),
                                           "--tls-key", str(pki / f"{identity}.key")]


def test_admin_cli_manages_an_mtls_draft_service_and_is_refused_without_a_client_certificate(loop, mtls_target, pki,
                                                                                          capsys):
    """The admin token travels only over TLS; the --target's fingerprint is asked with the same settings."""
    drafts = DraftRegistry.of(NgramDrafter(), name="lookup", load=model_loader(RuntimeConfig(model="")))
    drafts.add("second", NgramDrafter())
    tls = ServerTls(pki / "target.pem", pki / "target.key", client_ca_file=pki / "ca.pem")
    draft = loop.run(start_draft_server(drafts, tls=tls, admin_token="secret"))
    common = ["--draft", f"127.0.0.1:{draft.port}", "--token", "secret", "--timeout", "10"]
    try:
        assert admin.main([*common, *_cli_tls(pki, "gateway-client"), "set-default", "second"]) == 0
        assert '"name": "second",\n      "info"' in capsys.readouterr().out
        assert [d.name for d in drafts.list() if d.is_default] == ["second"]
        assert admin.main([*common, *_cli_tls(pki, "gateway-client"), "load-draft", "third", "ngram",
                           "--target", f"127.0.0.1:{mtls_target.port}"]) == 0
        assert '"name": "third"' in capsys.readouterr().out
        for refused in (_cli_tls(pki, None), _cli_tls(pki, "rogue"), []):  # no certificate, a rogue one, plaintext
            assert admin.main([*common, *refused, "set-default", "lookup"]) == 1
            assert "UNAVAILABLE" in capsys.readouterr().err
        assert [d.name for d in drafts.list() if d.is_default] == ["second"]
    finally:
        loop.run(draft.stop())


def test_client_cli_streams_from_a_tls_gateway(loop, mtls_target, pki, tokenizer, hf_greedy, capsys):
    config = GatewayConfig(f"127.0.0.1:{mtls_target.port}", None, backend_tls=_client_tls(pki, "gateway"))
    gateway = loop.run(start_gateway_server(config, tls=ServerTls(pki / "gateway.pem", pki / "gateway.key")))
    address = ["The quick brown fox", "--address", f"127.0.0.1:{gateway.port}", "--max-new-tokens", "12"]
    try:
        client.main([*address, "--json", *_cli_tls(pki, None)])
        chunks = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        token_ids = [int(t) for chunk in chunks for t in chunk.get("token_ids", [])]
        assert token_ids == hf_greedy(tokenizer.encode("The quick brown fox"), 12)
        with pytest.raises(SystemExit) as info:  # plaintext cannot talk to it
            client.main(address)
        assert info.value.code == 1 and "UNAVAILABLE" in capsys.readouterr().err
    finally:
        loop.run(gateway.stop())
