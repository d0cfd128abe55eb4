"""The soak's clients (bench/soak.py): a mix of requests, each checked against its undisturbed
reference output, and the tally of how they ended."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specdec.client import Completion, collect
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
    ({"prompt": "x", "temperature": 101.0}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "temperature": 1.0, "top_k": -1}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "stop": ["s"] * 17}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="robot", content="hi")])},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt": "x", "draft_model": "no-such-draft"}, grpc.StatusCode.NOT_FOUND),
]
SERVED_MODEL_NAME = "soak"
INVALID_OPENAI_REQUESTS = [  # /v1/completions bodies, and the HTTP status each must get
    ({"model": SERVED_MODEL_NAME, "prompt": "x", "n": 2}, 400),
    ({"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400),
    ({"model": SERVED_MODEL_NAME}, 400),
    ({"model": "no-such-model", "prompt": "x"}, 404),
]
MAX_EXAMPLES = 20
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
    """How the requests ended, by kind; shared by the client threads (under `lock`)."""

    completed: Counter = field(default_factory=Counter)
    cut_short: Counter = field(default_factory=Counter)  # "cancelled" by the client, "deadline_exceeded"
    refused: int = 0
    wrong: Counter = field(default_factory=Counter)
    disturbed_samples: int = 0
    examples: list[dict] = field(default_factory=list)  # outputs unlike their reference (the first MAX_EXAMPLES)
    errors: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Disturbances:
    """When replicas were down (from the kill until a while after the restart), to tell a sample that
    changed because a replica it used was lost from a wrong one."""

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


def _generate(stub, **fields) -> Completion:
    return collect(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120))


def references(stub: gateway_pb2_grpc.GatewayStub) -> References:
    """Every reference output, run one at a time before the load starts."""
    greedy = {}
    for prompt in PROMPTS:
        completion = _generate(stub, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=0)
        greedy[prompt] = Output(tuple(completion.token_ids), completion.text)
    sampled = {(prompt, seed, k): tuple(_generate(stub, **_sampled_request(prompt, seed, k)).token_ids)
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

    def _record(self, kind: str, ok: bool, cut_short: str | None = None, **example) -> None:
        """Counts a request that completed, or was cut short (`cut_short`: "cancelled" or "deadline_exceeded"),
        and whether its output was right; keeps a wrong one's `example` fields."""
        with self.tally.lock:
            if cut_short is None:
                self.tally.completed[kind] += 1
            else:
                self.tally.cut_short[cut_short] += 1
            if not ok:
                self.tally.wrong[kind] += 1
                self._keep_example(kind, example)

    def _keep_example(self, kind: str, example: dict) -> None:
        if len(self.tally.examples) < MAX_EXAMPLES:
            self.tally.examples.append({"kind": kind, **example})

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
        example = dict(prompt=prompt, max_new_tokens=max_new, k=k, first_difference=_first_difference(ids, expected))
        if error is None:
            self._record("greedy", tuple(ids) == expected[:max_new], **example)
        elif error.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:  # a prefix
            self._record("greedy", tuple(ids) == expected[:len(ids)], "cancelled", **example)
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
        example = dict(prompt=prompt, seed=seed, k=k, during_a_restart=disturbed,
                       first_difference=_first_difference(ids, expected), num_tokens=len(ids),
                       num_expected=len(expected), steps_by_k=list(last.stats.num_steps_by_k))
        if disturbed:
            with self.tally.lock:
                self.tally.disturbed_samples += 1
                self._keep_example("sampled", example)
        self._record("sampled", same or disturbed, **example)

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
        expected = text[:text.index(stop)]
        self._record("stop", got == expected and last.finish_reason == gateway_pb2.FINISH_REASON_STOP
                     and tuple(ids) == self.refs.greedy[prompt].token_ids[:len(ids)],
                     prompt=prompt, stop=stop, text=got, expected=expected,
                     finish_reason=gateway_pb2.FinishReason.Name(last.finish_reason))

    def deadline(self) -> None:
        prompt = self.rng.choice(PROMPTS)
        expected = self.refs.greedy[prompt].token_ids
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
        ids, _, _, error = self._stream(request, self.rng.uniform(0.05, 3.0))
        example = dict(prompt=prompt, first_difference=_first_difference(ids, expected))
        if error is None:
            self._record("deadline", tuple(ids) == expected, **example)
        elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._record("deadline", tuple(ids) == expected[:len(ids)], "deadline_exceeded", **example)
        else:
            self._error(error)

    def invalid(self) -> None:
        if self.rng.random() < 0.3:
            self._invalid_openai()
            return
        fields, code = self.rng.choice(INVALID_REQUESTS)
        ids, _, _, error = self._stream(gateway_pb2.GenerateRequest(**fields), 60)
        if error is not None and error.code() == code:
            with self.tally.lock:
                self.tally.refused += 1
        elif error is not None:
            self._error(error)
        else:
            self._record("invalid", False, request=str(fields))  # served what it should have refused

    def _invalid_openai(self) -> None:
        body, status = self.rng.choice(INVALID_OPENAI_REQUESTS)
        request = self._completions_request(body)
        try:
            with urllib.request.urlopen(request, timeout=60):
                self._record("invalid", False, request=str(body))  # served what it should have refused
        except urllib.error.HTTPError as e:
            if e.code == status:
                with self.tally.lock:
                    self.tally.refused += 1
            else:
                with self.tally.lock:
                    self.tally.errors[f"openai {e.code}: {e.read()[:200]!r}"] += 1
        except OSError as e:
            with self.tally.lock:
                self.tally.errors[f"openai: {e}"] += 1

    def _completions_request(self, body: dict) -> urllib.request.Request:
        return urllib.request.Request(f"http://127.0.0.1:{self.http_port}/v1/completions", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})

    def openai(self) -> None:
        """Greedy through /v1/completions, whole or streamed (SSE); a streamed one is sometimes dropped
        after a few events, as a client that goes away: the gateway must notice and free its sequences."""
        prompt, stream = self.rng.choice(PROMPTS), self.rng.random() < 0.5
        drop_after = self.rng.randint(1, 5) if stream and self.rng.random() < CANCEL_PROBABILITY else None
        request = self._completions_request({"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                                             "temperature": 0, "stream": stream})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                text = _sse_text(response, drop_after) if stream else json.load(response)["choices"][0]["text"]
        except OSError as e:  # urllib's HTTPError and URLError
            with self.tally.lock:
                self.tally.errors[f"openai: {e}"] += 1
            return
        expected = self.refs.greedy[prompt].text
        example = dict(prompt=prompt, stream=stream, text=text, expected=expected)
        if drop_after is None:
            self._record("openai", text == expected, **example)
        else:
            self._record("openai", expected.startswith(text), "cancelled", **example)


def _sse_text(response, drop_after: int | None) -> str:
    """The text of a streamed completion's events, or of its first `drop_after` events."""
    text, num_events = "", 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        text += json.loads(line[len(b"data: "):])["choices"][0]["text"]
        num_events += 1
        if num_events == drop_after:
            break  # leaving the with block closes the connection
    return text


def _first_difference(ids: list[int], expected: tuple[int, ...]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), None)
