"""Checks a running compose deployment from the host, through the gateway's published port only.

    python deploy/compose_check.py generate --address 127.0.0.1:15051 [--http 127.0.0.1:18000]
        greedy Generate with speculation == the same request with num_draft_tokens=0 (target alone);
        with --http, the OpenAI-compatible /v1/completions gives the same text
    python deploy/compose_check.py spread --address 127.0.0.1:15051 --target-replicas 2 --draft-replicas 2
        concurrent requests until every replica of both pools has opened new sequences

The model services publish no port, so their engine counters (GetEngineStats) are read inside each
replica with `docker compose exec --index N SERVICE python /app/deploy/probe.py stats ...`; the
compose project and file come from COMPOSE_PROJECT_NAME / COMPOSE_FILE in the environment.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from specdec.client import Completion, build_request, format_stats, stream

PORTS = {"target": 50052, "draft": 50053}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding is a technique that",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.arange(10)\n",
    "The largest planet in the solar system is",
]


def generate(address: str, prompt: str, max_new_tokens: int, num_draft_tokens: int | None) -> Completion:
    request = build_request(prompt, chat=False, max_new_tokens=max_new_tokens,
                            num_draft_tokens=num_draft_tokens, stop=[])
    return stream(address, request, timeout_s=300)


def http_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def check_http_completion(http_address: str, prompt: str, max_new_tokens: int, expected_text: str) -> None:
    """The OpenAI-compatible API on the same gateway gives the gRPC API's greedy text."""
    model = http_json(f"http://{http_address}/v1/models")["data"][0]["id"]
    reply = http_json(f"http://{http_address}/v1/completions",
                      {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0})
    text = reply["choices"][0]["text"]
    print(f"HTTP /v1/completions (model {model!r}): {text!r}")
    assert text == expected_text, "the OpenAI-compatible API disagrees with gRPC Generate"


def check_generate(address: str, max_new_tokens: int, http_address: str | None) -> None:
    """Speculative greedy output must equal the target's own greedy output, token for token."""
    for prompt in PROMPTS[:3]:
        # k pinned: left to the gateway, adaptive k may rightly stop drafting for a draft that loses
        speculative = generate(address, prompt, max_new_tokens, 4)
        target_only = generate(address, prompt, max_new_tokens, 0)
        print(f"prompt      : {prompt!r}")
        print(f"speculative : {speculative.text!r}\n              {format_stats(speculative.final)}")
        print(f"target only : {target_only.text!r}\n              {format_stats(target_only.final)}")
        assert speculative.token_ids, "no tokens generated"
        assert speculative.final.stats.num_draft_tokens > 0, "the speculative request drafted nothing"
        assert speculative.token_ids == target_only.token_ids, "speculative output differs from target-only"
        assert speculative.text == target_only.text
        if http_address and prompt == PROMPTS[0]:
            check_http_completion(http_address, prompt, max_new_tokens, target_only.text)
    print("OK: greedy speculative output == target-only output through the published gateway port")


def replica_stats(service: str, index: int) -> dict:
    command = ["docker", "compose", "exec", "-T", "--index", str(index), service,
               "python", "/app/deploy/probe.py", "stats", service, f"127.0.0.1:{PORTS[service]}"]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def started_counts(replicas: dict[str, int]) -> dict[tuple[str, int], int]:
    return {(service, index): int(replica_stats(service, index)["num_sequences_started"])
            for service, count in replicas.items() for index in range(1, count + 1)}


def run_concurrent_round(address: str, num_requests: int, max_new_tokens: int) -> None:
    """k pinned, so every request opens a draft sequence: left to the gateway, adaptive k stops drafting for a
    draft that loses (the CPU pair does), and a few probes a minute may all land on one draft replica."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    with ThreadPoolExecutor(num_requests) as pool:
        for completion in pool.map(lambda p: generate(address, p, max_new_tokens, 2), prompts):
            assert completion.token_ids, "a concurrent request generated nothing"


def check_spread(address: str, replicas: dict[str, int], num_requests: int, max_new_tokens: int,
                 deadline_s: float) -> None:
    """Rounds of concurrent requests until every replica has started sequences since the first round.

    Replicas added by a scale-up are found when the gateway re-resolves the service name: the
    services age connections out after 60 s, so new replicas get traffic within about a minute."""
    before = started_counts(replicas)
    print("sequences started per replica before:", {f"{s}-{i}": n for (s, i), n in before.items()})
    start = time.monotonic()
    for round_index in range(1, 1000):
        run_concurrent_round(address, num_requests, max_new_tokens)
        after = started_counts(replicas)
        delta = {f"{s}-{i}": after[(s, i)] - before[(s, i)] for (s, i) in before}
        print(f"round {round_index} (+{time.monotonic() - start:.0f} s): {num_requests} concurrent requests; "
              f"new sequences per replica: {delta}", flush=True)
        if all(n > 0 for n in delta.values()):
            for service in replicas:
                for index in range(1, replicas[service] + 1):
                    print(f"{service}-{index}: {json.dumps(replica_stats(service, index))}")
            print("OK: concurrent requests landed on every replica of both pools")
            return
        if time.monotonic() - start > deadline_s:
            sys.exit(f"FAIL: after {deadline_s:.0f} s some replicas got no requests: {delta}")
        time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["generate", "spread"])
    parser.add_argument("--address", required=True, help="the gateway's published HOST:PORT")
    parser.add_argument("--http", help="the gateway's published OpenAI-compatible HTTP HOST:PORT")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--target-replicas", type=int, default=2)
    parser.add_argument("--draft-replicas", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--deadline-s", type=float, default=180)
    args = parser.parse_args()
    if args.check == "generate":
        check_generate(args.address, args.max_new_tokens, args.http)
    else:
        replicas = {"target": args.target_replicas, "draft": args.draft_replicas}
        check_spread(args.address, replicas, args.num_requests, 8, args.deadline_s)


if __name__ == "__main__":
    main()
