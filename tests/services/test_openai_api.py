"""The OpenAI-compatible HTTP API, driven by the official openai client against the real trio:
greedy output equals the gRPC path's, streaming and not, chat and completions; bad parameters
get OpenAI-shaped errors with the right HTTP status."""
from __future__ import annotations

import openai
import pytest
from harness import generate, seed_ending_at_eos

from specdec.request_id import REQUEST_ID_KEY
from specdec.v1 import gateway_pb2

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(observed_gateway):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{observed_gateway.http_port}/v1", api_key="unused",
                       max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _grpc_chat(stub, max_new_tokens: int, k: int):
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in CHAT])
    return generate(stub, chat=chat, max_new_tokens=max_new_tokens, num_draft_tokens=k)


def test_models_lists_the_served_model(client, observed_target):
    (entry,) = client.models.list().data
    assert entry.object == "model" and entry.owned_by == "specdec"


@pytest.mark.parametrize("k", [0, 3])
def test_completion_matches_grpc_greedy(k, client, model, observed_stub):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"num_draft_tokens": k})
    token_ids, text, final = generate(observed_stub, prompt=PROMPT, max_new_tokens=16, num_draft_tokens=k)
    assert response.choices[0].text == text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == len(token_ids) == final.stats.num_completion_tokens
    assert response.usage.prompt_tokens == final.stats.num_prompt_tokens
    speculation = response.usage.model_extra["speculation"]
    assert speculation["num_draft_tokens"] == final.stats.num_draft_tokens
    assert speculation["num_accepted_tokens"] == final.stats.num_accepted_tokens
    assert speculation["target_forward_s"] > 0


def test_streamed_completion_matches_grpc_greedy(client, model, observed_stub):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    _, text, final = generate(observed_stub, prompt=PROMPT, max_new_tokens=20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == final.stats.num_completion_tokens


def test_chat_completion_matches_grpc_chat(client, model, observed_stub):
    response = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12,
                                              extra_body={"num_draft_tokens": 2})
    _, text, final = _grpc_chat(observed_stub, 12, 2)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.usage.prompt_tokens == final.stats.num_prompt_tokens
    assert response.usage.model_extra["speculation"]["num_verify_steps"] == final.stats.num_verify_steps


def test_streamed_chat_matches_grpc_chat(client, model, observed_stub):
    stream = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=12, stream=True,
                                            extra_body={"num_draft_tokens": 2})
    chunks = list(stream)
    _, text, _ = _grpc_chat(observed_stub, 12, 2)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_string_ends_the_completion(client, model, observed_stub):
    _, text, _ = generate(observed_stub, prompt=PROMPT, max_new_tokens=20)
    stop = text[len(text) // 2:][:3]
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, stop=stop)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == text[:text.index(stop)]


def test_ignore_eos_completes_to_max_tokens(client, model, observed_stub):
    seed, ended = seed_ending_at_eos(observed_stub, prompt=PROMPT, max_new_tokens=48, temperature=2.0)
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=2.0, seed=seed,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 48 > len(ended)


@pytest.mark.parametrize("fields, fragment", [
    ({"n": 2}, "n must be 1"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 1.0, "top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"num_draft_tokens": 99}}, "num_draft_tokens"),
    ({"max_tokens": 100_000}, "context"),
    ({"prompt": [[1, 2, 3]]}, "token-id prompts"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
])
def test_bad_completion_parameters_are_400(fields, fragment, client, model):
    request = {"model": model, "prompt": PROMPT, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**request)
    assert e.value.status_code == 400
    assert fragment in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, fragment", [
    ([], "no messages"),
    ([{"role": "robot", "content": "hi"}], "unknown chat role"),
    ([{"role": "user"}], "messages.0.content"),
])
def test_bad_chat_messages_are_400(messages, fragment, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    assert fragment in e.value.body["message"]


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    assert "/v1/models" in e.value.body["message"]


def test_streaming_request_with_bad_parameters_fails_before_streaming(client, model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, stream=True, temperature=3.0)


def test_request_id_header_is_echoed_and_made(client, model):
    raw = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2,
                                                      extra_headers={REQUEST_ID_KEY: "http-req-7"})
    assert raw.headers[REQUEST_ID_KEY] == "http-req-7"
    assert raw.parse().id == "cmpl-http-req-7"
    made = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2)
    assert len(made.headers[REQUEST_ID_KEY]) == 32


def test_openai_requests_are_counted_in_the_gateway_metrics(observed_gateway, client, model, scrape):
    before = scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="openai",
                                                         outcome="length")
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3)
    after = scrape(observed_gateway.metrics_port).value("specdec_gateway_requests_total", api="openai",
                                                        outcome="length")
    assert after == before + 1
