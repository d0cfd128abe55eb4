"""Sampling: a request's transforms, counter-based randomness, and lossless speculative sampling.

Randomness is a pure function of (seed, position, stream, token id): the uniform noise behind the
token at absolute position t of a request is a hash of those numbers. A seeded request therefore
samples the same tokens whatever batch it lands in, and the draws run inside CUDA graphs. The
target's acceptance draws, the target's own samples and the draft's samples use separate streams,
so they are independent of each other.

Speculative sampling (the terms of engine/verification.py): draft token x at position i is accepted
with probability min(1, p_i(x) / q_i(x)); at the first rejection the recovered token is sampled from
norm(max(0, p_i - q_i)); when all k are accepted the bonus token is sampled from p_k. p is the
target's distribution after the request's transforms, q exactly the distribution the draft sampled
from (sparse: its top-k after the same transforms). The committed tokens are distributed exactly as
the target's own samples, for any q.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.verification import Verification
from specdec.errors import InvalidRequestError

STREAM_ACCEPT, STREAM_TARGET, STREAM_DRAFT = 1, 2, 3
Distribution = tuple[list[int], list[float]]  # a sparse distribution: (token ids, probabilities)
_MASK64 = (1 << 64) - 1


MIN_TEMPERATURE = 1e-5  # below it decoding is greedy, as in vLLM: logits / temperature would overflow float32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE): greedy, every other field ignored
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> SamplingParams:
        """Raises InvalidRequestError naming the bad field; returns self."""
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100] (0: greedy), got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p < 1:
            raise InvalidRequestError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.seed <= _MASK64:
            raise InvalidRequestError(f"seed must be in [0, 2^64), got {self.seed}")
        return self


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k, min-p, top-p."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    probs = x.softmax(dim=-1)
    return _min_p_top_p(probs, params.min_p, params.top_p)


def _min_p_top_p(probs: torch.Tensor, min_p: float | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zeroes tokens below min_p * max and outside the top-p nucleus (the top token always stays); renormalises."""
    if isinstance(min_p, torch.Tensor) or min_p > 0:
        min_p = min_p if not isinstance(min_p, torch.Tensor) else min_p[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if isinstance(top_p, torch.Tensor) or top_p < 1:
        top_p = top_p if not isinstance(top_p, torch.Tensor) else top_p[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        drop_sorted = before >= top_p * sorted_probs.sum(dim=-1, keepdim=True)
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform noise in (0, 1): float32 of broadcast(seed, position, token_ids).

    `seed` and `position` are int64 [n] (or [n, 1]); `token_ids` int64 [..., m]. A splitmix64-style
    hash; int64 arithmetic wraps, and right shifts are masked to make them logical.
    """
    x = seed * -7046029254386353131 + position * -4658895280553007687 + token_ids * 6364136223846793005
    x = x + stream * 1442695040888963407
    x = (x ^ _shr(x, 30)) * -4658895280553007687
    x = (x ^ _shr(x, 27)) * -7723592293110705685
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).float() + 0.5) * (1.0 / (1 << 24))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def sample(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int,
           token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of [n, m] probabilities (an exponential race: argmax p / Exp(1)).

    `token_ids` [n, m] names the columns (sparse distributions); default: the vocabulary.
    Returns the winning column index per row.
    """
    if token_ids is None:
        token_ids = torch.arange(probs.shape[-1], device=probs.device)[None]
    noise = uniform(seed.reshape(-1, 1), position.reshape(-1, 1), stream, token_ids)
    return (probs / -noise.log()).argmax(dim=-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at `position` sampled from one row of logits under the request's transforms."""
    probs = probabilities(logits[None], params)
    seed, pos = _scalars(params.seed, position, logits.device)
    return int(sample(probs, seed, pos, STREAM_TARGET)[0])


def verify_sampled(
    draft_ids: list[int],
    draft_probs: list[Distribution],  # q_i per draft token
    target_logits: torch.Tensor,  # [k + 1, vocab]
    params: SamplingParams,
    position: int,  # absolute position of the first draft token
) -> Verification:
    """Speculative rejection sampling (module doc); one host sync."""
    k = len(draft_ids)
    assert target_logits.shape[0] == k + 1 and len(draft_probs) == k, "need k + 1 logit rows and k draft distributions"
    device = target_logits.device
    p = probabilities(target_logits, params)  # [k + 1, vocab]
    q = torch.zeros_like(p)
    for i, (ids, probs) in enumerate(draft_probs):
        q[i, torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(probs, device=device, dtype=q.dtype)
    x = torch.tensor(draft_ids, dtype=torch.long, device=device)
    rows = torch.arange(k, device=device)
    seed = torch.full((k + 1,), as_int64(params.seed), device=device)
    positions = torch.arange(position, position + k + 1, device=device)
    u = uniform(seed[:k], positions[:k], STREAM_ACCEPT, torch.zeros(k, dtype=torch.long, device=device))
    accepted = u * q[rows, x] < p[rows, x]  # with probability min(1, p(x) / q(x))
    residual = (p[:k] - q[:k]).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])  # p == q: never rejected
    final = torch.cat([residual / residual.sum(-1, keepdim=True), p[k:]])  # recovered rows, then bonus row
    candidates = sample(final, seed, positions, STREAM_TARGET)
    accepted, candidates = accepted.tolist(), candidates.tolist()
    num_accepted = accepted.index(False) if False in accepted else k
    return Verification(num_accepted, draft_ids[:num_accepted] + [candidates[num_accepted]])


def check_draft_probs(draft_ids: list[int], draft_probs: list[Distribution], vocab_size: int) -> None:
    """A draft distribution must be a distribution over vocabulary ids that gives its token a chance."""
    if len(draft_probs) != len(draft_ids):
        raise InvalidRequestError(f"{len(draft_ids)} draft tokens but {len(draft_probs)} draft distributions; "
                                  "sampled requests need one distribution per draft token")
    for x, (ids, probs) in zip(draft_ids, draft_probs):
        if len(ids) != len(probs) or not ids:
            raise InvalidRequestError("a draft distribution needs as many probabilities as token ids (at least one)")
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"a draft distribution names a token outside the vocabulary [0, {vocab_size})")
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("a draft distribution names a token twice; give each token one probability")
        if any(not (math.isfinite(v) and v >= 0) for v in probs) or not abs(sum(probs) - 1) < 1e-3:
            raise InvalidRequestError("draft probabilities must be finite, >= 0 and sum to 1")
        if x not in ids or probs[ids.index(x)] <= 0:
            raise InvalidRequestError(f"draft token {x} has no probability in its own draft distribution")


def as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _scalars(seed: int, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([as_int64(seed)], device=device), torch.tensor([position], device=device))


def sample_draft(
    logits: torch.Tensor,  # [b, vocab]
    temperature: torch.Tensor,  # [b] float32; 0: greedy
    top_p: torch.Tensor,  # [b] float32
    top_k: torch.Tensor,  # [b] int64; 0: off
    min_p: torch.Tensor,  # [b] float32
    seed: torch.Tensor,  # [b] int64
    position: torch.Tensor,  # [b] int64, where each sampled token will sit
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's draw per row from its `num_candidates` most likely tokens after the request's transforms.

    Returns (tokens [b], candidate ids [b, c], q [b, c]); q is exactly the distribution the token
    was drawn from (one-hot on the argmax for greedy rows). Shapes are static: runs in CUDA graphs.
    """
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    values, ids = scaled.topk(num_candidates, dim=-1)  # sorted, most likely first
    ranks = torch.arange(num_candidates, device=logits.device)[None]
    values = values.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), -math.inf)
    q = _min_p_top_p(values.softmax(dim=-1), min_p, top_p)
    q = torch.where(greedy[:, None], (ranks == 0).float(), q)
    choice = sample(q, seed, position, STREAM_DRAFT, token_ids=ids)
    return ids.gather(1, choice[:, None]).squeeze(1), ids, q
