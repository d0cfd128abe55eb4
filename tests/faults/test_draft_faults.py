"""A lost draft (killed, frozen past its step deadline) never costs a token: the request goes on
target-only with the undisturbed output; new requests use the drafts that are left, run
target-only when none is, and speculate again once a draft is back."""
from __future__ import annotations

import time

import grpc
import pytest
from harness import generate, start_streaming

from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from specdec.client import collect
from specdec.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.slow  # starts service processes
PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_NEW_TOKENS = 800


@pytest.fixture(autouse=True)
def all_replicas_up(replicas_up, cluster):
    yield
    for replica in cluster.replicas:
        if replica.is_running():
            replica.resume()


@pytest.fixture(scope="module")
def reference(cluster, cluster_gateway) -> list[int]:
    """The undisturbed greedy output, target-only."""
    cluster.ensure_running()
    token_ids, _, _ = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
    assert len(token_ids) > 100
    return token_ids


def _start(stub, **fields):
    return start_streaming(stub, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, **fields)


def _finish(call, received):
    rest = collect(call)
    return received + rest.token_ids, rest.final


def test_draft_killed_mid_request_completes_target_only_with_identical_output(cluster, cluster_gateway, reference):
    call, first = _start(cluster_gateway, num_draft_tokens=3)
    cluster.holder(cluster.drafts).kill()
    token_ids, final = _finish(call, first)
    assert token_ids == reference
    assert 0 < final.stats.num_draft_tokens  # it speculated before the kill ...
    assert final.stats.num_draft_tokens < 3 * len(reference) / 2  # ... and stopped after it
    cluster.wait_idle()


def test_draft_frozen_past_its_step_deadline_is_dropped_and_output_is_identical(cluster, cluster_gateway, reference):
    call, first = _start(cluster_gateway, num_draft_tokens=3)
    frozen = cluster.holder(cluster.drafts)
    frozen.pause()  # SIGSTOP: the connection stays up, the draft just never answers
    started = time.monotonic()
    token_ids, _final = _finish(call, first)
    assert time.monotonic() - started < 60
    assert token_ids == reference
    frozen.resume()
    cluster.wait_idle()  # the resumed draft sees the cancelled stream and frees the sequence


def test_new_requests_use_surviving_drafts_then_target_only_then_speculate_again(cluster, cluster_gateway,
                                                                                   reference):
    cluster.drafts[0].kill()
    for _ in range(3):  # round-robin skips the dead replica
        token_ids, _, final = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
        assert token_ids == reference[:64]
        assert final.stats.num_draft_tokens > 0
    cluster.drafts[1].kill()
    token_ids, _, final = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
    assert token_ids == reference[:64]
    assert final.stats.num_draft_tokens == 0  # no draft left: target-only
    cluster.drafts[0].start()  # back on its port
    _until_speculating(cluster_gateway, reference, 30, "after the draft came back")


def _until_speculating(stub, reference: list[int], within_s: float, what: str) -> None:
    """Requests (each exact) until one speculates again."""
    deadline = time.monotonic() + within_s
    while True:
        token_ids, _, final = generate(stub, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
        assert token_ids == reference[:64]
        if final.stats.num_draft_tokens > 0:
            return
        assert time.monotonic() < deadline, f"speculation did not resume {what}"
        time.sleep(0.2)


PAUSE_S = 3.0


@pytest.fixture
def pausing_gateway(loop, cluster):
    """A gateway that, once a draft timed out (1 s), leaves the draft pool alone for PAUSE_S."""
    config = GatewayConfig(target_address=cluster.target_pool, draft_address=cluster.draft_pool,
                           draft_step_timeout_s=1.0, draft_pause_s=PAUSE_S, connect_timeout_s=60)
    server = loop.run(start_gateway_server(config))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as c:
        yield gateway_pb2_grpc.GatewayStub(c)
    loop.run(server.stop())


def test_a_hung_draft_holds_up_neither_first_tokens_nor_the_requests_after_it(cluster, pausing_gateway, reference):
    for draft in cluster.drafts:
        draft.pause()  # SIGSTOP: connected, never answering (a hung GPU, say)
    token_ids, _, final = generate(pausing_gateway, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
    assert token_ids == reference[:64]
    assert final.stats.time_to_first_token_s < 1.0  # the target's prefill, not the draft's 1 s step timeout
    token_ids, _, final = generate(pausing_gateway, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
    assert token_ids == reference[:64]
    assert final.stats.num_draft_tokens == 0 and final.stats.draft_prefill_forward_s == 0  # the pool was let be
    for draft in cluster.drafts:
        draft.resume()
    _until_speculating(pausing_gateway, reference, PAUSE_S + 30, "after the pause")  # the drafts tried again
    cluster.wait_idle()
