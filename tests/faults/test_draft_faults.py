"""A lost draft (killed, frozen past its step deadline) never costs a token: the request goes on
target-only with the undisturbed output; new requests use the drafts that are left, run
target-only when none is, and speculate again once a draft is back."""
from __future__ import annotations

import time

import pytest
from harness import generate, start_streaming

from specdec.client import collect

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
    deadline = time.monotonic() + 30
    while True:
        token_ids, _, final = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=64, num_draft_tokens=3)
        assert token_ids == reference[:64]
        if final.stats.num_draft_tokens > 0:
            break
        assert time.monotonic() < deadline, "speculation did not resume after the draft came back"
        time.sleep(0.2)
