"""A lost target replica costs no token: the gateway re-prefills the committed tokens on another
replica (and restarts the draft on the same prefix) and the output is the undisturbed one; with no
target left the request ends UNAVAILABLE and what was streamed stays valid."""
from __future__ import annotations

import grpc
import pytest
from harness import generate, start_streaming

from specdec.client import collect

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("replicas_up")]  # starts service processes
PROMPT = "Speculative decoding: a draft proposes, the target verifies."
MAX_NEW_TOKENS = 800


@pytest.fixture(scope="module")
def reference(cluster, cluster_gateway) -> list[int]:
    cluster.ensure_running()
    token_ids, _, _ = generate(cluster_gateway, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
    assert len(token_ids) > 100
    return token_ids


def _start(stub, num_draft_tokens: int):
    return start_streaming(stub, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=num_draft_tokens)


@pytest.mark.parametrize("k", [0, 3])
def test_target_killed_mid_request_reprefills_on_another_replica_with_identical_output(k, cluster, cluster_gateway,
                                                                                        reference):
    call, received = _start(cluster_gateway, k)
    lost = cluster.holder(cluster.targets)
    lost.kill()
    rest = collect(call)
    assert received + rest.token_ids == reference
    assert rest.final.stats.num_completion_tokens == len(reference)
    survivor = next(t for t in cluster.targets if t is not lost)
    assert survivor.engine_stats().num_sequences_started >= 1
    cluster.wait_idle()  # the survivor's and the drafts' sequences are freed too


def test_no_target_left_ends_unavailable_and_streamed_tokens_stay_valid(cluster, cluster_gateway, reference):
    cluster.targets[0].kill()
    call, received = _start(cluster_gateway, 3)
    cluster.targets[1].kill()
    with pytest.raises(grpc.RpcError) as info:
        for chunk in call:
            received += chunk.token_ids
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no target replica" in info.value.details()
    assert "already streamed are valid" in info.value.details()
    assert received == reference[:len(received)]
    cluster.wait_idle()  # the drafts free their sequences
