"""The soak's clients (bench/soak.py): a mix of requests, each checked against its undisturbed
reference output, and the tally of how they ended."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specdec.v1 import gateway_pb2, gateway_pb2_grpc

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Speculative decoding: a draft proposes,",
           "Große Straße 🙂", "Numbers 0123456789 and", "x"]
MAX_NEW_TOKENS = 64
CANCEL_PROBABILITY = 0.1
REQUEST_MIX = {"greedy": 45, "sampled": 15, "stop": 10, "deadline": 10, "invalid": 10, "openai": 10}
SAMPLING = {"temperature": 0.8, "top_p": 0.9}
SEEDS = (11, 12)
SAMPLED_KS = (0, 3)
INVALID_REQUESTS = [
    ({"prompt": "x", "max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "temperature": 1.0, "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "max_new_tokens": 100_000}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "draft_model": "no-such-draft"}, grpc.StatusCode.NOT_FOUND),
]
SERVED_MODEL_NAME = "soak"
RESTART_GRACE_S = 5.0  # a restart's disturbance lasts until the replica is back, and this long after


@dataclass(frozen=True)
class Output:
    token_ids: tuple[int, ...]
    text: str


@dataclass
class References:
    """The undisturbed outputs: greedy (target-only) per prompt, sampled per (prompt, seed, k)."""

    greedy: dict[str, Output]
    sampled: dict[tuple[str, int, int], tuple[int, ...]]


@dataclass
class Tally:
    completed: Counter = field(default_factory=Counter)
    cancelled: int = 0
    refused: int = 0
    deadline_exceeded: int = 0
    wrong: Counter = field(default_factory=Counter)
    disturbed_samples: int = 0
    sample_differences: list[dict] = field(default_factory=list)  # samples unlike their reference
    errors: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Disturbances:
    """When replicas were down (from the kill until a while after the restart), to tell a sample that
    changed because its draft was lost from a wrong one."""

    def __init__(self) -> None:
        self._windows: list[list[float]] = []
        self._lock = threading.Lock()

    def begin(self) -> list[float]:
        window = [time.monotonic(), float("inf")]
        with self._lock:
            self._windows.append(window)
        return window

    def end(self, window: list[float]) -> None:
        with self._lock:
            window[1] = time.monotonic() + RESTART_GRACE_S

    def overlaps(self, start: float, end: float) -> bool:
        with self._lock:
            return any(s <= end and start <= e for s, e in self._windows)


def _generate(stub, timeout: float, **fields) -> tuple[list[int], str, gateway_pb2.GenerateResponse]:
    token_ids, text, last = [], "", None
    for chunk in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout):
        token_ids += chunk.token_ids
        text += chunk.text
        last = chunk
    return token_ids, text, last


def references(stub: gateway_pb2_grpc.GatewayStub) -> References:
    """Every reference output, run one at a time before the load starts."""
    greedy = {}
    for prompt in PROMPTS:
        ids, text, _ = _generate(stub, 120, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
        greedy[prompt] = Output(tuple(ids), text)
    sampled = {(prompt, seed, k): tuple(_generate(stub, 120, **_sampled_request(prompt, seed, k))[0])
               for prompt in PROMPTS for seed in SEEDS for k in SAMPLED_KS}
    return References(greedy, sampled)


def _sampled_request(prompt: str, seed: int, k: int) -> dict:
    return dict(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=k, seed=seed, draft_model="default",
                **SAMPLING)


class Client:
    """One client stream: requests of the mix, one after another, each checked."""

    def __init__(self, stub, http_port: int, refs: References, tally: Tally, disturbances: Disturbances,
                 seed: int) -> None:
        self.stub, self.http_port, self.refs, self.tally = stub, http_port, refs, tally
        self.disturbances = disturbances
        self.rng = random.Random(seed)

    def run(self, stop: threading.Event) -> None:
        kinds, weights = zip(*REQUEST_MIX.items())
        while not stop.is_set():
            kind = self.rng.choices(kinds, weights)[0]
            getattr(self, kind)()

    def _record(self, kind: str, ok: bool) -> None:
        with self.tally.lock:
            self.tally.completed[kind] += 1
            if not ok:
                self.tally.wrong[kind] += 1

    def _error(self, e: grpc.RpcError) -> None:
        with self.tally.lock:
            self.tally.errors[f"{e.code().name}: {e.details()}"] += 1

    def _stream(self, request: gateway_pb2.GenerateRequest, timeout: float, cancel_after: int | None = None):
        """Streams a request; returns (token_ids, text, final chunk or None, RpcError or None)."""
        started = time.monotonic()
        token_ids, text, last = [], "", None
        call = self.stub.Generate(request, timeout=timeout)
        try:
            for i, chunk in enumerate(call):
                if not token_ids and chunk.token_ids:
                    with self.tally.lock:
                        self.tally.ttft_s.append(time.monotonic() - started)
                token_ids += chunk.token_ids
                text += chunk.text
                last = chunk
                if cancel_after is not None and i + 1 >= cancel_after:
                    call.cancel()
        except grpc.RpcError as e:
            return token_ids, text, None, e
        return token_ids, text, last, None

    def greedy(self) -> None:
        prompt = self.rng.choice(PROMPTS)
        expected = self.refs.greedy[prompt].token_ids
        max_new = self.rng.randint(4, MAX_NEW_TOKENS)
        k = self.rng.choice([None, 0, 1, 2, 3, 4])
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, num_draft_tokens=k)
        cancel_after = self.rng.randint(1, 5) if self.rng.random() < CANCEL_PROBABILITY else None
        ids, _, _, error = self._stream(request, 300, cancel_after)
        if error is None:
            self._record("greedy", tuple(ids) == expected[:max_new])
        elif error.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            with self.tally.lock:
                self.tally.cancelled += 1
                self.tally.wrong["greedy"] += tuple(ids) != expected[:len(ids)]  # a cut-short stream: a prefix
        else:
            self._error(error)

    def sampled(self) -> None:
        prompt, seed, k = self.rng.choice(PROMPTS), self.rng.choice(SEEDS), self.rng.choice(SAMPLED_KS)
        started = time.monotonic()
        ids, _, last, error = self._stream(gateway_pb2.GenerateRequest(**_sampled_request(prompt, seed, k)), 300)
        if error is not None:
            self._error(error)
            return
        expected = self.refs.sampled[prompt, seed, k]
        same = tuple(ids) == expected
        disturbed = not same and self.disturbances.overlaps(started, time.monotonic())
        if not same:
            with self.tally.lock:
                self.tally.disturbed_samples += disturbed
                self.tally.sample_differences.append(dict(
                    prompt=prompt, seed=seed, k=k, during_a_restart=disturbed,
                    first_difference=next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), None),
                    num_tokens=len(ids), num_expected=len(expected), steps_by_k=list(last.stats.num_steps_by_k)))
        self._record("sampled", same or disturbed)

    def stop(self) -> None:
        prompt = self.rng.choice([p for p in PROMPTS if len(self.refs.greedy[p].text) >= 8])
        text = self.refs.greedy[prompt].text
        start = self.rng.randrange(1, len(text) - 4)
        stop = text[start:start + self.rng.randint(1, 4)]
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, stop=[stop],
                                              num_draft_tokens=self.rng.choice([None, 0, 3]))
        ids, got, last, error = self._stream(request, 300)
        if error is not None:
            self._error(error)
            return
        self._record("stop", got == text[:text.index(stop)] and last.finish_reason == gateway_pb2.FINISH_REASON_STOP
                     and tuple(ids) == self.refs.greedy[prompt].token_ids[:len(ids)])

    def deadline(self) -> None:
        prompt = self.rng.choice(PROMPTS)
        expected = self.refs.greedy[prompt].token_ids
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
        ids, _, _, error = self._stream(request, self.rng.uniform(0.05, 3.0))
        if error is None:
            self._record("deadline", tuple(ids) == expected)
        elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            with self.tally.lock:
                self.tally.deadline_exceeded += 1
                self.tally.wrong["deadline"] += tuple(ids) != expected[:len(ids)]
        else:
            self._error(error)

    def invalid(self) -> None:
        fields, code = self.rng.choice(INVALID_REQUESTS)
        ids, _, _, error = self._stream(gateway_pb2.GenerateRequest(**fields), 60)
        if error is not None and error.code() == code:
            with self.tally.lock:
                self.tally.refused += 1
        elif error is not None:
            self._error(error)
        else:
            self._record("invalid", False)  # served what it should have refused

    def openai(self) -> None:
        prompt = self.rng.choice(PROMPTS)
        body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                text = json.load(response)["choices"][0]["text"]
        except OSError as e:  # urllib's HTTPError and URLError
            with self.tally.lock:
                self.tally.errors[f"openai: {e}"] += 1
            return
        self._record("openai", text == self.refs.greedy[prompt].text)
