"""A benchmark's per-step figures over its requests' decode phase (after each one's first token),
from the gateway's final stats (specdec/v1/gateway.proto GenerationStats).

The prompt's prefill is left out: the time to the first token, and both models' prefill forwards
(`*_prefill_forward_s`), which would otherwise be spread over the steps as verify or proposal time.
So a step is one proposal, one verify, and the host time around them (gRPC, the gateway, the
batching loops): `rpc_overhead_fraction` = that host time / the step's wall time.
"""
from __future__ import annotations

from specdec.v1 import gateway_pb2


def decode_step_times(stats: list[gateway_pb2.GenerationStats]) -> dict[str, float]:
    steps = max(1, sum(s.num_verify_steps for s in stats))
    wall = sum(s.time_per_output_token_s * (s.num_completion_tokens - 1) for s in stats)  # first to last token
    draft = sum(s.draft_forward_s - s.draft_prefill_forward_s for s in stats)
    target = sum(s.target_forward_s - s.target_prefill_forward_s for s in stats)
    outside = wall - draft - target
    return {
        "step_ms": 1e3 * wall / steps,
        "draft_ms_per_step": 1e3 * draft / steps,
        "target_ms_per_step": 1e3 * target / steps,
        "overhead_ms_per_step": 1e3 * outside / steps,
        "rpc_overhead_fraction": outside / wall if wall > 0 else 0.0,
    }
