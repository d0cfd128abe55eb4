"""CPU A/B of when a request's draft opens: beside the target's prefill, or once the first token is in.

The default pair (SmolLM2-135M target, the shipped distilled draft), one target and one draft service, two
gateways over them: one with `--draft-opens-with-prefill`, one with the default (the draft opens after the
first token). Greedy requests over the held-out prompts (distill/prompts.py), the two gateways alternating
per request and swapping which goes first each round (this VM's speed drifts over minutes); each request's
time to first token and tok/s from its final stats, medians per gateway; every output checked equal across
the two. Writes bench/results/cpu_draft_open.json: `beside_ttft_ms`, `after_ttft_ms`, `beside_tok_s`,
`after_tok_s` (medians), `after_over_beside_ttft`, `after_over_beside_tok_s`, `outputs_differ`.
Usage: python bench/cpu_draft_open.py [--num-prompts 12] [--rounds 2] [--k 2] [--max-new-tokens 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from distill.prompts import held_out_prompts  # noqa: E402
from engine.model_source import DEFAULT_MODEL  # noqa: E402
from report import save_report  # noqa: E402
from specdec.client import build_request, collect  # noqa: E402
from specdec.launch import DEFAULT_DRAFT, Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2_grpc  # noqa: E402

GATEWAYS = {"beside": ["--draft-opens-with-prefill"], "after": []}


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_draft_open.json")
    args = parser.parse_args()
    prompts = held_out_prompts()[:args.num_prompts]
    ttft_ms: dict[str, list[float]] = {label: [] for label in GATEWAYS}
    tok_s: dict[str, list[float]] = {label: [] for label in GATEWAYS}
    outputs: dict[str, list[list[int]]] = {label: [] for label in GATEWAYS}
    with tempfile.TemporaryDirectory() as tmp:
        trio = Trio(Path(tmp))
        try:
            target = trio.spawn("target", "target_service", ["--model", DEFAULT_MODEL, "--log-level", "WARNING"],
                                unix_socket=True)
            draft = trio.spawn("draft", "draft_service", ["--drafter", "model", "--model", str(DEFAULT_DRAFT),
                                                          "--log-level", "WARNING"], unix_socket=True)
            target_address, draft_address = trio.wait_ready(target, 600), trio.wait_ready(draft, 600)
            gateways = {label: trio.wait_ready(trio.spawn(f"gateway-{label}", "gateway", [
                "--target", target_address, "--draft", draft_address, "--log-level", "WARNING", *flags]), 120)
                for label, flags in GATEWAYS.items()}
            stubs = {label: gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
                     for label, address in gateways.items()}
            for stub in stubs.values():  # warm-up
                collect(stub.Generate(build_request(prompts[0], True, 8, args.k, []), timeout=300))
            order = list(GATEWAYS)
            for round_ in range(args.rounds):
                for prompt in prompts:
                    for label in order if round_ % 2 == 0 else order[::-1]:
                        out = collect(stubs[label].Generate(build_request(prompt, True, args.max_new_tokens, args.k, []),
                                                            timeout=300))
                        ttft_ms[label].append(1e3 * out.final.stats.time_to_first_token_s)
                        tok_s[label].append(out.final.stats.tokens_per_s)
                        outputs[label].append(list(out.token_ids))
                print(f"round {round_ + 1}: time to first token (median ms) "
                      + ", ".join(f"{label} {statistics.median(v):.1f}" for label, v in ttft_ms.items()), file=sys.stderr)
        finally:
            trio.stop()
    metrics = {f"{label}_{name}": statistics.median(values[label]) for label in GATEWAYS
               for name, values in (("ttft_ms", ttft_ms), ("tok_s", tok_s))}
    metrics["after_over_beside_ttft"] = metrics["after_ttft_ms"] / metrics["beside_ttft_ms"]
    metrics["after_over_beside_tok_s"] = metrics["after_tok_s"] / metrics["beside_tok_s"]
    metrics["outputs_differ"] = sum(a != b for a, b in zip(outputs["beside"], outputs["after"]))
    metrics["requests_each"] = len(ttft_ms["after"])
    save_report("cpu_draft_open", metrics, args.out, note=f"default pair, greedy, k = {args.k}, "
                f"{args.max_new_tokens} new tokens, batch 1")


if __name__ == "__main__":
    main()
