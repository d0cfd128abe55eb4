"""The services refuse flags they cannot take, and end a refused start, with a message that says what is wrong."""
from __future__ import annotations

import os
import socket

import pytest

from draft_service.cli import main as draft_main
from gateway.cli import main as gateway_main
from specdec.cli_args import env_flag, service_address
from target_service.cli import main as target_main


@pytest.mark.parametrize(("main", "argv", "message"), [
    (target_main, ["--kv-cache-memory-fraction", "2"], "--kv-cache-memory-fraction must be in (0, 1)"),
    (target_main, ["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (draft_main, ["--drafter", "model", "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (gateway_main, ["--target", "127.0.0.1:1", "--num-draft-tokens", "-1"],
     "--num-draft-tokens must be in [0, --max-num-draft-tokens]"),
    (gateway_main, ["--target", "127.0.0.1:1", "--connect-timeout-s", "0"], "--connect-timeout-s must be > 0"),
    (target_main, ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    (target_main, ["--max-prefills-per-iteration", "-1"], "--max-prefills-per-iteration must be >= 0 (0: no limit)"),
    (target_main, ["--num-threads", "-1"], "--num-threads must be >= 1"),
    (target_main, ["--max-model-len", "0"], "--max-model-len must be >= 2"),
    (target_main, ["--device", "tpu9"], "--device 'tpu9'"),
    (draft_main, ["--drafter", "model", "--stages", "inductor"], "argument --stages: invalid choice"),
    (gateway_main, ["--target", "127.0.0.1:1", "--log-level", "chatty"], "argument --log-level: invalid choice"),
    (gateway_main, ["--target", "127.0.0.1:1", "--max-prompt-tokens", "0"], "--max-prompt-tokens, --max-request-bytes"),
    (gateway_main, ["--target", "127.0.0.1:1", "--shutdown-grace-s", "-5"], "--shutdown-grace-s must be >= 0"),
    (gateway_main, ["--target", "127.0.0.1:1", "--connect-timeout-s", "nan"], "--connect-timeout-s must be > 0"),
    (gateway_main, ["--target", "127.0.0.1:1", "--max-num-draft-tokens", "65"],
     "--max-num-draft-tokens must be in [1, 64] (a target verifies at most 64"),
    (gateway_main, ["--target", "127.0.0.1:1", "--max-new-tokens-limit", "20", "--default-max-new-tokens", "30"],
     "--default-max-new-tokens must be in [1, --max-new-tokens-limit]"),
])
def test_a_runtime_setting_out_of_range_exits_with_its_reason_naming_the_flags(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv if main is gateway_main else ["--device", "cpu", *argv])
    assert exit_info.value.code == 2  # argparse's usage error, before any model loads or service is called
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("main", "argv"), [(target_main, []), (draft_main, ["--drafter", "model"])])
def test_a_model_that_cannot_load_ends_the_service_with_its_reason(main, argv, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", *argv, "--model", str(missing)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("specdec-")  # the program's name, then the reason, not a traceback
    assert f"cannot load model '{missing}': no such file or directory" in error and "Traceback" not in error


@pytest.mark.parametrize(("main", "argv"), [(target_main, []), (draft_main, ["--drafter", "model"])])
def test_a_directory_that_holds_no_model_is_named_as_such(main, argv, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", *argv, "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "the directory has no config.json" in capsys.readouterr().err


def test_the_gateway_gives_up_on_unreachable_services_after_its_connect_timeout(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gateway_main(["--target", "127.0.0.1:1", "--draft", "none", "--connect-timeout-s", "0.3"])
    assert exit_info.value.code == 2
    assert "the target at 127.0.0.1:1 did not answer within 0.3 s" in capsys.readouterr().err


def test_a_max_new_tokens_limit_alone_lowers_the_default_to_it(capsys):
    """Only the services are missing: the configuration, default included, was accepted."""
    with pytest.raises(SystemExit) as exit_info:
        gateway_main(["--target", "127.0.0.1:1", "--draft", "none", "--connect-timeout-s", "0.1",
                      "--max-new-tokens-limit", "20"])
    assert exit_info.value.code == 2
    assert "did not answer within 0.1 s" in capsys.readouterr().err


@pytest.mark.parametrize(("main", "argv", "message"), [
    (target_main, ["--device", "cpu", "--port", "99999"], "argument --port: port 99999 is out of range: 0-65535"),
    (draft_main, ["--device", "cpu", "--metrics-port", "70000"], "argument --metrics-port: port 70000 is out of range"),
    (gateway_main, ["--target", "127.0.0.1:1", "--http-port", "65536"], "argument --http-port: port 65536 is out of range"),
    (gateway_main, ["--target", "127.0.0.1:1", "--port", "http"], "argument --port: 'http' is not a port number"),
])
def test_a_port_out_of_range_is_refused_not_wrapped_around(main, argv, message, capsys):
    """gRPC binds a port past 65535 modulo 65536 (99999 became 34463) without a word."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "address", "message"), [
    ("--target", "127.0.0.1:99999", "argument --target: 127.0.0.1:99999: port 99999 is out of range: 1-65535"),
    ("--draft", "dns:///draft:70000", "argument --draft: dns:///draft:70000: port 70000 is out of range"),
    ("--draft", "[::1]:0", "argument --draft: [::1]:0: port 0 is out of range"),
])
def test_a_service_address_with_a_port_out_of_range_is_refused_at_once(flag, address, message, capsys):
    """Not waited for until the connect timeout (600 s by default), nor wrapped around by gRPC."""
    with pytest.raises(SystemExit) as exit_info:
        gateway_main(["--target", "127.0.0.1:1", flag, address])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("address", ["127.0.0.1:50052", "dns:///target:50052", "[::1]:50052", "unix:/tmp/t.sock",
                                     "ipv4:10.0.0.1:1,10.0.0.2:2", "localhost", "none"])
def test_service_addresses_grpc_takes_pass_unchanged(address):
    assert service_address(address) == address


@pytest.mark.parametrize(("main", "argv", "message"), [
    (target_main, ["--device", "cpu", "--tls-cert", "{missing}", "--tls-key", "{missing}"], "--tls-cert {missing}: No such file"),
    (gateway_main, ["--target", "127.0.0.1:1", "--backend-tls-ca", "{missing}"], "--backend-tls-ca {missing}: No such file"),
])
def test_a_tls_file_that_cannot_be_read_is_named_with_its_flag_at_start(main, argv, message, tmp_path):
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(missing=missing) for arg in argv])
    assert message.format(missing=missing) in str(exit_info.value.code)


@pytest.mark.parametrize(("main", "variable", "value"), [
    (gateway_main, "SPECDEC_GATEWAY_BUSY_POLL", "bogus"),
    (gateway_main, "SPECDEC_GATEWAY_LOG_FORMAT", "xml"),
    (draft_main, "SPECDEC_DRAFT_DRAFTER", "ngrm"),
])
def test_a_variable_outside_its_flags_choices_is_refused_at_start(main, variable, value, monkeypatch, capsys):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "127.0.0.1:1"] if main is gateway_main else ["--device", "cpu"])
    assert exit_info.value.code == 2
    assert f"invalid choice {value!r} (from the environment" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("on", True), ("Yes", True), ("0", False),
                                                ("off", False), ("False", False), ("", False), (None, False)])
def test_a_boolean_variable_reads_the_usual_spellings(text, expected, monkeypatch):
    if text is not None:
        monkeypatch.setenv("SPECDEC_X_FLAG", text)
    assert env_flag("SPECDEC_X", "flag", False) is expected


def test_a_boolean_variable_of_another_spelling_is_refused(monkeypatch):
    monkeypatch.setenv("SPECDEC_X_FLAG", "maybe")
    with pytest.raises(SystemExit, match="SPECDEC_X_FLAG='maybe': use 1/true/yes/on or 0/false/no/off"):
        env_flag("SPECDEC_X", "flag", False)


def test_a_busy_port_ends_the_start_with_one_line_naming_it(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            draft_main(["--drafter", "ngram", "--device", "cpu", "--port", str(port)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in error and "Traceback" not in error


def test_a_gguf_path_that_is_no_regular_file_is_refused_not_read(tmp_path, capsys):
    """A FIFO would block its hashing forever (a device: never end it)."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit) as exit_info:
        target_main(["--device", "cpu", "--model", str(fifo)])
    assert exit_info.value.code == 2
    assert "not a regular file" in capsys.readouterr().err
