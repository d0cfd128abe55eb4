"""The OpenAI HTTP API against what the official client never sends: raw bodies (nulls, lone surrogates,
32-bit overflows, broken JSON, oversized bodies), features we do not have, clients that leave early.
Each gets an OpenAI-shaped error with the right status, or its generation stopped; the gateway goes on."""
from __future__ import annotations

import json
import socket
import time

import requests
import pytest
from harness import channel, generate

from fastapi import FastAPI

from gateway.config import GatewayConfig
from gateway.http_server import HttpServer
from gateway.server import start_gateway_server
from specdec.request_id import REQUEST_ID_KEY
from specdec.v1 import common_pb2, target_pb2_grpc

PROMPT = "The quick brown fox"
LIMIT_BYTES = 64 * 1024  # the small gateway's --max-request-bytes


class Http:
    """requests against one gateway's HTTP port."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.session = requests.Session()

    def get(self, path: str) -> requests.Response:
        return self.session.get(self.base + path, timeout=60)

    def post(self, path: str, **kwargs) -> requests.Response:
        return self.session.post(self.base + path, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def http(observed_gateway):
    return Http(observed_gateway.http_port)


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def small_gateway(loop, observed_target, observed_draft):
    config = GatewayConfig(f"127.0.0.1:{observed_target.port}", f"127.0.0.1:{observed_draft.port}",
                           max_request_bytes=LIMIT_BYTES)
    server = loop.run(start_gateway_server(config, http_port=0))
    yield server
    loop.run(server.stop())


@pytest.fixture(scope="module")
def target_stats(observed_target):
    with channel(observed_target.port) as c:
        stub = target_pb2_grpc.TargetServiceStub(c)
        yield lambda: stub.GetEngineStats(common_pb2.EngineStatsRequest())


def _post(http: Http, path: str, body: bytes | dict) -> requests.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, data=content, headers={"content-type": "application/json"})


def _error(response: requests.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert response.headers[REQUEST_ID_KEY]
    return error


def test_explicit_nulls_mean_the_defaults(http, model, observed_stub):
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "echo": None,
             "ignore_eos": None, "temperature": None, "stop": None, "seed": None, "logit_bias": None}
    response = _post(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == generate(observed_stub, prompt=PROMPT, max_new_tokens=8)[1]


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "num_draft_tokens"])
def test_an_integer_beyond_32_bits_is_400_naming_it(field, http, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, field: 2**31}
    error = _error(_post(http, "/v1/completions", body), 400)
    assert error["param"] == field and "2147483647" in error["message"]


def test_a_limit_message_names_openais_field(http, model):
    error = _error(_post(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 100_000}), 400)
    assert "max_tokens (100000)" in error["message"] and "max_new_tokens" not in error["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_temperature_that_is_not_finite_is_400(value, http, model):
    body = f'{{"model": "{model}", "prompt": "hi", "max_tokens": 4, "temperature": {value}}}'.encode()
    error = _error(_post(http, "/v1/completions", body), 400)
    assert error["param"] == "temperature" and "finite" in error["message"]


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", '{"model": "M", "max_tokens": 4, "prompt": "abc \\ud800 def"}', "prompt"),
    ("/v1/completions", '{"model": "M", "max_tokens": 4, "prompt": "hi", "stop": ["\\udc00"]}', "stop.0"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages.0.content"),
])
def test_a_lone_surrogate_is_400_saying_where(path, body, where, http, model):
    error = _error(_post(http, path, body.replace('"M"', json.dumps(model)).encode()), 400)
    assert f"{where} holds invalid Unicode" in error["message"]


def test_a_model_name_with_a_lone_surrogate_is_refused_in_a_readable_error(http):
    error = _error(_post(http, "/v1/completions", b'{"model": "\\ud800x", "prompt": "hi"}'), 400)
    assert "model holds invalid Unicode" in error["message"]


def test_broken_json_says_what_is_wrong_and_where(http):
    error = _error(_post(http, "/v1/completions", b'{"model": "x", "prompt": '), 400)
    assert error["message"].startswith("the body is not valid JSON: ") and "at character" in error["message"]


def test_a_content_part_of_an_unknown_type_names_the_part(http, model):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = _error(_post(http, "/v1/chat/completions", {"model": model, "messages": messages}), 400)
    assert error["param"] == "messages.0.content.0.type" and "'text'" in error["message"]


@pytest.mark.parametrize("path, fields, fragment", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format 'json_object'"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tools and functions"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "tools and functions"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"logit_bias": {"50": 5}}, "logit_bias"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "only allowed with stream"),
])
def test_a_feature_we_lack_is_refused_not_ignored(path, fields, fragment, http, model):
    body = {"model": model, "max_tokens": 4, **fields,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}
    assert fragment in _error(_post(http, path, body), 400)["message"]


def test_text_response_format_is_plain_generation(http, model):
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "text"}}
    assert _post(http, "/v1/chat/completions", body).status_code == 200


def test_a_stream_that_fails_before_its_first_token_gets_its_own_status(http, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True, "draft_model": "no-such-draft"}
    response = http.post("/v1/completions", json=body, stream=True)
    error = _error(response, 404)
    assert "no-such-draft" in error["message"]
    assert response.headers["content-type"].startswith("application/json")


def test_a_body_over_the_limit_is_413_and_the_gateway_goes_on(small_gateway, model):
    http = Http(small_gateway.http_port)
    big = {"model": model, "prompt": "hi " * LIMIT_BYTES, "max_tokens": 2}
    error = _error(_post(http, "/v1/completions", big), 413)
    assert str(LIMIT_BYTES) in error["message"] and "--max-request-bytes" in error["message"]

    def chunks():  # no content-length: the limit is counted as the body arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(LIMIT_BYTES // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'

    chunked = http.post("/v1/completions", data=chunks(), headers={"content-type": "application/json"})
    assert _error(chunked, 413)["type"] == "invalid_request_error"
    ok = _post(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


def test_a_malformed_request_id_is_400_naming_the_header_and_counted_as_invalid(http, model, observed_gateway,
                                                                              scrape):
    def invalid() -> float:
        return scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="openai",
                                                           outcome="invalid_request")

    before = invalid()
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 4}).encode()
    response = http.post("/v1/completions", data=body,
                         headers={"content-type": "application/json", REQUEST_ID_KEY: "has spaces"})
    error = _error(response, 400)
    assert error["param"] == REQUEST_ID_KEY and REQUEST_ID_KEY in error["message"]
    assert invalid() == before + 1


def test_health_answers_200(http):
    assert http.get("/health").status_code == 200


def test_an_unrouted_method_is_405_in_openais_shape(http):
    assert _error(http.get("/v1/completions"), 405)["type"] == "invalid_request_error"


def test_a_non_streamed_request_whose_client_leaves_stops_generating(http, model, target_stats, observed_gateway,
                                                                     scrape):
    def cancelled() -> float:
        return scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="openai",
                                                           outcome="cancelled")

    before = cancelled()
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                       "num_draft_tokens": 0}).encode()
    with socket.create_connection(("127.0.0.1", observed_gateway.http_port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while target_stats().num_active_sequences == 0:  # generating
            assert time.monotonic() < deadline
            time.sleep(0.002)
    deadline = time.monotonic() + 10
    while target_stats().num_active_sequences or target_stats().num_kv_blocks_used:
        assert time.monotonic() < deadline, "the abandoned request kept generating"
        time.sleep(0.02)
    assert cancelled() == before + 1  # stopped, not finished at max_tokens


def test_connections_beyond_the_limit_get_503_so_idle_ones_cannot_take_every_descriptor(loop):
    app = FastAPI()
    app.get("/health")(lambda: {})
    server = HttpServer(app, "127.0.0.1", 0, max_connections=2)
    loop.run(server.start())
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]  # never send a request
    try:
        time.sleep(0.2)  # accepted
        assert requests.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code == 503
    finally:
        for connection in idle:
            connection.close()
        loop.run(server.stop(1.0))
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{server.port}/health", timeout=10)  # stopped
