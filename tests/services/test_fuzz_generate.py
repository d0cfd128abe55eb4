"""Bad input against the real services: hypothesis throws random GenerateRequests (fields, sizes,
unicode, huge stop lists, huge k, NaN/inf, oversized messages) at a gateway with explicit limits.
Each gets a valid stream or INVALID_ARGUMENT / RESOURCE_EXHAUSTED / OUT_OF_RANGE with a message,
and well-formed requests running alongside keep their exact greedy output."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from harness import channel, generate, kv_blocks_used
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

# NOT_FOUND: a draft_model name the draft service has not loaded
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.NOT_FOUND}
LIMITS = {"max_prompt_tokens": 120, "max_new_tokens_limit": 24, "default_max_new_tokens": 8, "max_request_bytes": 64 * 1024,
              "max_concurrent_requests": 4, "max_queued_requests": 64}
INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@pytest.fixture(scope="module")
def limited_gateway(loop, target_server, draft_servers):
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft_servers['perturbed'].port}",
                           **LIMITS)
    server = loop.run(start_gateway_server(config))
    with channel(server.port) as c:
        yield gateway_pb2_grpc.GatewayStub(c)
    loop.run(server.stop())


def _text(max_size: int):
    return st.text(st.characters(codec="utf-8"), max_size=max_size)


def _chat():
    role = st.one_of(st.sampled_from(["system", "user", "assistant"]), _text(8))
    message = st.builds(gateway_pb2.ChatMessage, role=role, content=_text(60))
    return st.builds(lambda ms: gateway_pb2.ChatMessages(messages=ms), st.lists(message, max_size=4))


@st.composite
def requests(draw) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "chat", "none", "huge"]))
    if kind == "prompt":
        request.prompt = draw(_text(300))
    elif kind == "chat":
        request.chat.CopyFrom(draw(_chat()))
    elif kind == "huge":  # past the gateway's message limit, or past its prompt-token limit
        request.prompt = "x" * draw(st.sampled_from([2_000, 70_000, 200_000]))
    optional = {
        "max_new_tokens": st.one_of(st.integers(-3, 40), INT32),
        "num_draft_tokens": st.one_of(st.integers(-1, 18), INT32),
        "temperature": st.one_of(st.just(0.0), FLOATS),
        "draft_model": _text(200),
        "top_p": FLOATS, "top_k": INT32, "min_p": FLOATS, "seed": st.integers(0, 2**64 - 1),
    }
    for name, strategy in optional.items():
        if name in gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name and draw(st.booleans()):
            setattr(request, name, draw(strategy))
    stop = draw(st.one_of(st.lists(_text(10), max_size=4), st.lists(st.just("s"), min_size=15, max_size=2000)))
    request.stop.extend(stop)
    return request


def _outcome(stub, request: gateway_pb2.GenerateRequest) -> None:
    try:
        chunks = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()} for {request!r:.300}"
        assert e.details(), "an error without a message"
        return
    final = chunks[-1]
    assert final.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
    assert sum(len(c.token_ids) for c in chunks) == final.stats.num_completion_tokens <= LIMITS["max_new_tokens_limit"]


@pytest.fixture
def well_formed_traffic(limited_gateway, tokenizer, hf_greedy):
    """Good requests on two threads for as long as the test runs; each must keep its greedy output."""
    prompts = ["The quick brown fox", "def add(a, b):", "Große Straße 🙂"]
    expected = {p: hf_greedy(tokenizer.encode(p), 16) for p in prompts}
    stop = threading.Event()
    completed: list[str] = []
    failures: list[BaseException] = []

    def run(offset: int) -> None:
        i = offset
        while not stop.is_set():
            prompt = prompts[i % len(prompts)]
            i += 1
            try:
                token_ids, _, _ = _generate_admitted(limited_gateway, prompt=prompt, max_new_tokens=16,
                                                     num_draft_tokens=3)
                assert token_ids == expected[prompt], prompt
                completed.append(prompt)
            except BaseException as e:  # noqa: BLE001 - reported at teardown
                failures.append(e)
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(120)
    assert not failures, failures[0]
    assert completed


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_random_requests_get_a_stream_or_a_clear_error_while_good_requests_stay_exact(
        request, limited_gateway, well_formed_traffic):
    _outcome(limited_gateway, request)


def _generate_admitted(stub, **fields):
    """generate(), retrying while the gateway says it is at capacity."""
    for _ in range(200):
        try:
            return generate(stub, **fields)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "at capacity" not in e.details():
                raise
    raise AssertionError("never admitted")


def test_excess_concurrent_requests_wait_in_a_bounded_queue_then_get_resource_exhausted(loop, target_server, scrape):
    config = GatewayConfig(f"127.0.0.1:{target_server.port}", None, max_concurrent_requests=1, max_queued_requests=1)
    server = loop.run(start_gateway_server(config, metrics_port=0))
    try:
        with channel(server.port) as c:
            stub = gateway_pb2_grpc.GatewayStub(c)
            request = gateway_pb2.GenerateRequest(prompt="The quick brown fox", max_new_tokens=200)
            running = stub.Generate(request, timeout=60)
            next(running)  # holds the only slot
            queued = stub.Generate(request, timeout=60)  # waits for it
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=60))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at capacity (1 requests generating, 1 waiting)" in info.value.details()
            metrics = scrape(server.metrics_port)
            assert metrics.value("specdec_gateway_requests_waiting") == 1  # the queued one: no first token yet
            assert metrics.value("specdec_gateway_requests_total", api="grpc", outcome="rejected") == 1
            running.cancel()
            assert sum(len(chunk.token_ids) for chunk in queued) == 200  # the queued one ran to the end
    finally:
        loop.run(server.stop())


@pytest.mark.parametrize(("fields", "code", "message"), [
    ({"prompt": "x" * 100_000}, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ({"prompt": "hello " * 30}, grpc.StatusCode.INVALID_ARGUMENT, "accepts at most 120"),
    ({"prompt": "hello", "max_new_tokens": 25}, grpc.StatusCode.INVALID_ARGUMENT, "allows at most 24"),
])
def test_configured_limits_are_refused_with_a_message(fields, code, message, limited_gateway):
    with pytest.raises(grpc.RpcError) as info:
        generate(limited_gateway, **fields)
    assert info.value.code() == code
    assert message in info.value.details()


def test_fuzzing_leaves_no_kv_behind(limited_gateway, target_stub, draft_stub):
    for stub in (target_stub, draft_stub("perturbed")):
        deadline = time.monotonic() + 10
        while kv_blocks_used(stub) != 0:
            assert time.monotonic() < deadline, "KV blocks leaked"
            time.sleep(0.05)
