"""Every bad request gets the right status and an actionable message; serving goes on."""
from __future__ import annotations

import math
import time

import grpc
import pytest

from harness import generate, kv_blocks_used, mid_stream_deadline_s

from engine.limits import MAX_VERIFY_DRAFT_TOKENS
from specdec.v1 import common_pb2, draft_pb2, gateway_pb2, target_pb2

CONTEXT = 256  # the tiny models' max_position_embeddings


def _error(stub, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **fields)
    return info.value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "", "max_new_tokens": 4}, "prompt is empty"),
        ({"max_new_tokens": 4}, "no input"),
        ({"prompt": "hello " * 400, "max_new_tokens": 4}, "context is 256 tokens"),
        ({"prompt": "hello", "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt": "hello", "max_new_tokens": -3}, "max_new_tokens must be >= 1"),
        ({"prompt": "hello", "max_new_tokens": CONTEXT}, "exceeds the model's context"),
        ({"prompt": "hello", "max_new_tokens": 4, "num_draft_tokens": -1}, "num_draft_tokens must be in [0, 16]"),
        ({"prompt": "hello", "max_new_tokens": 4, "num_draft_tokens": 17}, "num_draft_tokens must be in [0, 16]"),
        ({"prompt": "hello", "max_new_tokens": 4, "temperature": -0.5}, "temperature must be in [0, 100]"),
        ({"prompt": "hello", "max_new_tokens": 4, "temperature": math.nan}, "temperature must be in [0, 100]"),
        ({"prompt": "hello", "max_new_tokens": 4, "temperature": 0.7, "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt": "hello", "max_new_tokens": 4, "temperature": 0.7, "top_k": -2}, "top_k must be >= 0"),
        ({"prompt": "hello", "max_new_tokens": 4, "temperature": 0.7, "min_p": 1.0}, "min_p must be in [0, 1)"),
        ({"prompt": "hello", "max_new_tokens": 4, "stop": ["s"] * 17}, "at most 16 stop strings"),
        ({"prompt": "hello", "max_new_tokens": 4, "stop": [""]}, "stop strings must be 1 to"),
        ({"chat": gateway_pb2.ChatMessages(), "max_new_tokens": 4}, "chat has no messages"),
        ({"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user")] * 4097), "max_new_tokens": 4},
         "chat has 4097 messages; at most 4096"),
        ({"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="robot", content="hi")]),
          "max_new_tokens": 4}, "unknown chat role 'robot'"),
    ],
)
def test_invalid_request_is_rejected_with_an_actionable_message(fields, message, gateway_stub):
    error = _error(gateway_stub("perturbed"), **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


def test_service_keeps_serving_after_bad_requests(gateway_stub, target_stub, draft_stub):
    for _ in range(3):
        _error(gateway_stub("perturbed"), prompt="", max_new_tokens=4)
    token_ids, _, final = generate(gateway_stub("perturbed"), prompt="hello", max_new_tokens=5)
    assert len(token_ids) == final.stats.num_completion_tokens > 0
    _wait_until_idle(target_stub, draft_stub("perturbed"))


def _target_call(target_stub, *requests: target_pb2.TargetRequest) -> list[target_pb2.TargetResponse]:
    return list(target_stub.Sequence(iter(requests), timeout=30))


def test_target_rejects_verify_before_prefill(target_stub):
    with pytest.raises(grpc.RpcError) as info:
        _target_call(target_stub, target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(draft_ids=[1])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one prefill, then verifies" in info.value.details()


def test_target_rejects_token_ids_outside_the_vocabulary(target_stub, tokenizer):
    prefill = target_pb2.PrefillCommand(prompt_ids=[1, 2, 10**6], max_new_tokens=4)
    with pytest.raises(grpc.RpcError) as info:
        _target_call(target_stub, target_pb2.TargetRequest(prefill=prefill))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in info.value.details()


def test_target_rejects_a_verify_past_the_sequence_limit(target_stub, draft_stub):
    prefill = target_pb2.PrefillCommand(prompt_ids=[5, 6, 7], max_new_tokens=2)
    verify = target_pb2.VerifyCommand(draft_ids=[1, 2, 3])
    with pytest.raises(grpc.RpcError) as info:
        _target_call(target_stub, target_pb2.TargetRequest(prefill=prefill), target_pb2.TargetRequest(verify=verify))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit of 5 tokens" in info.value.details()
    _wait_until_idle(target_stub, draft_stub("perturbed"))


def test_target_commits_no_more_than_max_new_tokens(target_stub, draft_stub):
    """A verify commits its drafts' accepted prefix plus one token: it is refused where that one would pass."""
    prefill = target_pb2.TargetRequest(prefill=target_pb2.PrefillCommand(prompt_ids=[5, 6, 7], max_new_tokens=2))
    verify = target_pb2.TargetRequest(verify=target_pb2.VerifyCommand(draft_ids=[]))
    responses = []
    with pytest.raises(grpc.RpcError) as info:
        for response in target_stub.Sequence(iter([prefill, verify, verify]), timeout=30):
            responses.append(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "commits up to 1 tokens, past the sequence's limit of 5 tokens" in info.value.details()
    assert len(responses) == 2  # the first token (prefill) and the second (the first verify): max_new_tokens
    _wait_until_idle(target_stub, draft_stub("perturbed"))


def test_target_rejects_more_draft_tokens_than_a_verify_takes(target_stub):
    prefill = target_pb2.PrefillCommand(prompt_ids=[5, 6, 7], max_new_tokens=200)
    verify = target_pb2.VerifyCommand(draft_ids=[1] * (MAX_VERIFY_DRAFT_TOKENS + 1))
    with pytest.raises(grpc.RpcError) as info:
        _target_call(target_stub, target_pb2.TargetRequest(prefill=prefill), target_pb2.TargetRequest(verify=verify))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_VERIFY_DRAFT_TOKENS} draft tokens" in info.value.details()


@pytest.mark.parametrize("k", [0, 17])
def test_draft_rejects_num_draft_tokens_out_of_range(k, draft_stub):
    requests = [draft_pb2.DraftRequest(start=draft_pb2.StartCommand(prompt_ids=[5, 6], max_new_tokens=8)),
                draft_pb2.DraftRequest(propose=draft_pb2.ProposeCommand(append_ids=[7], num_draft_tokens=k))]
    with pytest.raises(grpc.RpcError) as info:
        list(draft_stub("perturbed").Sequence(iter(requests), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_draft_tokens must be in [1, 16]" in info.value.details()


@pytest.mark.parametrize("drafter", ["perturbed", "ngram"])
def test_draft_rejects_a_propose_past_the_sequence_limit_and_keeps_serving(drafter, target_stub, draft_stub):
    """Positions past prompt + max_new_tokens have no KV promised and may pass a model's rotary
    tables: a draft refuses them as the target refuses such a verify."""
    requests = [draft_pb2.DraftRequest(start=draft_pb2.StartCommand(prompt_ids=[5, 6, 7], max_new_tokens=4)),
                draft_pb2.DraftRequest(propose=draft_pb2.ProposeCommand(append_ids=[8], num_draft_tokens=3)),
                draft_pb2.DraftRequest(propose=draft_pb2.ProposeCommand(append_ids=[9], num_draft_tokens=3))]
    responses = []
    with pytest.raises(grpc.RpcError) as info:
        for response in draft_stub(drafter).Sequence(iter(requests), timeout=30):
            responses.append(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "proposing 3 tokens after 5 committed would pass the sequence's limit of 7 tokens" in info.value.details()
    assert responses[-1].HasField("proposal")  # the first propose (4 + 3 = 7 tokens) was served
    _wait_until_idle(target_stub, draft_stub(drafter))


def test_draft_rejects_propose_before_start(draft_stub):
    request = draft_pb2.DraftRequest(propose=draft_pb2.ProposeCommand(append_ids=[7], num_draft_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(draft_stub("ngram").Sequence(iter([request]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_cancel_mid_stream_frees_all_kv(gateway_stub, target_stub, draft_stub):
    call = gateway_stub("perturbed").Generate(
        gateway_pb2.GenerateRequest(prompt="The quick brown fox " * 5, max_new_tokens=200, num_draft_tokens=3))
    first = next(call)
    assert first.token_ids
    assert kv_blocks_used(target_stub) > 0  # the request holds KV while streaming
    call.cancel()
    _wait_until_idle(target_stub, draft_stub("perturbed"))


def test_deadline_exceeded_mid_stream_frees_all_kv(gateway_stub, target_stub, draft_stub):
    request = {"prompt": "The quick brown fox", "max_new_tokens": 230}
    deadline_s = mid_stream_deadline_s(gateway_stub("perturbed"), **request)
    _wait_until_idle(target_stub, draft_stub("perturbed"))
    call = gateway_stub("perturbed").Generate(gateway_pb2.GenerateRequest(**request), timeout=deadline_s)
    assert next(call).token_ids  # streaming when the deadline passes
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until_idle(target_stub, draft_stub("perturbed"))


def _wait_until_idle(*stubs, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s.GetEngineStats(common_pb2.EngineStatsRequest()) for s in stubs]
        if all(s.num_kv_blocks_used == 0 and s.num_active_sequences == 0 for s in stats):
            return
        assert time.monotonic() < deadline, f"KV not freed: {stats}"
        time.sleep(0.05)
