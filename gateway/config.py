"""The gateway's configuration: a frozen dataclass validated once at start."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.limits import MAX_VERIFY_DRAFT_TOKENS
from specdec.tls import ClientTls

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class GatewayConfig:
    target_address: str  # e.g. "127.0.0.1:50052" or "dns:///target:50052" (all replicas)
    draft_address: str | None  # None: no draft service, every request decodes target-only
    default_num_draft_tokens: int = 4  # measured best for the n-gram drafter on CPU (bench/cpu_smollm2)
    # requests that do not pin num_draft_tokens get k per step from gateway/speculation_policy.py,
    # up to default_num_draft_tokens; False: always default_num_draft_tokens
    adaptive_num_draft_tokens: bool = True
    max_num_draft_tokens: int = 16
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    connect_timeout_s: float = 600.0  # model services may still be loading weights
    served_model_name: str | None = None  # the OpenAI API's model name; None: the target's model id
    # Faults: a draft that does not answer a step within this time is dropped from the request
    # (it decodes on target-only); a request that lost its target replica waits this long for a
    # connected one, and re-prefills on another replica at most max_target_retries times.
    # Limits, each refused with a status and a message: prompt tokens (None: the model's context),
    # max_new_tokens, the request message's bytes (RESOURCE_EXHAUSTED from gRPC), requests
    # generating at once and requests waiting for a slot (beyond both: RESOURCE_EXHAUSTED).
    max_prompt_tokens: int | None = None
    max_new_tokens_limit: int | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 256
    max_queued_requests: int = 1024
    draft_step_timeout_s: float = 10.0
    draft_pause_s: float = 30.0  # after a draft step timed out, new requests run target-only this long (0: never)
    # a request's draft opens (prefills) once the first token is in, so a CPU or GPU the two services share runs the
    # target's prefill alone and the first token comes sooner; True: beside the target's prefill (a draft on
    # hardware of its own is then ready sooner). A draft name no request has opened yet opens beside the prefill either way.
    draft_opens_with_prefill: bool = False
    target_failover_timeout_s: float = 5.0
    max_target_retries: int = 2
    # a client that takes none of its stream's messages this long (connected, its flow-control window full) is
    # dropped: its request is cancelled, freeing its slot and KV, which it would otherwise hold until its deadline
    stream_stall_timeout_s: float = 60.0
    backend_tls: ClientTls | None = None  # TLS (mTLS with a client certificate) to the model services

    def __post_init__(self) -> None:
        if not 0 <= self.default_num_draft_tokens <= self.max_num_draft_tokens:
            raise ValueError("default_num_draft_tokens must be in [0, max_num_draft_tokens]")
        if not 1 <= self.max_num_draft_tokens <= MAX_VERIFY_DRAFT_TOKENS:
            raise ValueError(f"max_num_draft_tokens must be in [1, {MAX_VERIFY_DRAFT_TOKENS}] (a target verifies at most "
                             f"{MAX_VERIFY_DRAFT_TOKENS} draft tokens at once), got {self.max_num_draft_tokens}")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be >= 1")
        if self.max_new_tokens_limit is not None and not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError("default_max_new_tokens must be in [1, max_new_tokens_limit]")
        if min(1 if self.max_prompt_tokens is None else self.max_prompt_tokens, self.max_request_bytes,
               self.max_concurrent_requests) < 1 or self.max_queued_requests < 0:
            raise ValueError("max_prompt_tokens, max_request_bytes, max_concurrent_requests must be >= 1, "
                             "max_queued_requests >= 0")
        if self.draft_step_timeout_s <= 0 or min(self.target_failover_timeout_s, self.max_target_retries,
                                                 self.draft_pause_s) < 0:
            raise ValueError("draft_step_timeout_s must be > 0, target_failover_timeout_s, max_target_retries and "
                             "draft_pause_s >= 0")
        for name in ("connect_timeout_s", "stream_stall_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be > 0, got {value}")
