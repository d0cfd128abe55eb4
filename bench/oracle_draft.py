"""BENCHMARK ONLY: a draft service whose proposals hit a chosen acceptance rate (synthetic acceptance).

Random-weight models accept nothing, so to time the system at an acceptance rate alpha this
service runs the real draft model's forward passes for every proposal (full cost), then replaces
the proposed tokens: position j is the target's known greedy continuation with probability alpha
and a wrong token otherwise (the rest of that proposal is the model's own). Per-token acceptance
alpha gives 1 + alpha + ... + alpha^k tokens per step (3.36 at alpha 0.8, k 4). Numbers measured
through it are synthetic-acceptance results and must be labelled so.

It serves the plain draft as "plain" (the default) and one wrapped draft per alpha as
"oracle-ALPHA", all sharing the one model and its batching loop. With `--draft-ahead` the model
drafts ahead (engine/model_drafter.py) and the oracle replaces the chain's first token, its guess
of the target's next token, like a proposed token: right at rate alpha - so a chain is used after
all k accepted with that probability, as a draft of acceptance alpha would see.
Usage: python -m bench.oracle_draft --model M --continuations FILE.json --alphas 0.6 0.8 [service flags]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

from draft_service.registry import DraftRegistry, model_loader
from draft_service.server import busy_poll_of, start_draft_server
from engine import pdl
from engine.drafter import DraftSequence, ProposeTiming
from engine.model_drafter import ModelDrafter
from engine.model_runner import QUANTIZE_MODES
from engine.sampling import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.cli_args import add_runtime_args, add_server_args, runtime_config, setup_logging
from specdec.serving import RunningServer, serve_until_signal


class Continuations:
    """The target's greedy continuation per prompt, re-read whenever the file changes (the benchmark
    writes the reference of each batch size before timing it: bf16 results depend on batch shapes)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._mtime_ns = -1
        self._table: dict[tuple[int, ...], list[int]] = {}

    def get(self, prompt_ids: tuple[int, ...]) -> list[int] | None:
        mtime_ns = self._path.stat().st_mtime_ns
        if mtime_ns != self._mtime_ns:
            self._table = {tuple(r["prompt_ids"]): r["token_ids"] for r in json.loads(self._path.read_text())}
            self._mtime_ns = mtime_ns
        return self._table.get(prompt_ids)


class OracleDrafter:
    """Wraps a model drafter; rewrites its proposals from the target's known continuations."""

    def __init__(self, inner: ModelDrafter, continuations: Continuations, alpha: float) -> None:
        self.description = inner.description
        self._inner = inner
        self._continuations = continuations
        self._alpha = alpha
        self._state: dict[int, tuple[int, list[int] | None, random.Random]] = {}

    async def start(self, prompt_ids: list[int], max_new_tokens: int,
                    sampling: SamplingParams = SamplingParams()) -> DraftSequence:
        if not sampling.is_greedy:
            raise InvalidRequestError("the benchmark oracle serves greedy requests only")
        seq = await self._inner.start(prompt_ids, max_new_tokens)
        key = tuple(prompt_ids)
        self._state[id(seq)] = (len(prompt_ids), self._continuations.get(key), random.Random(hash(key)))
        return seq

    async def propose(self, seq: DraftSequence, num_accepted: int, append_ids: list[int],
                      num_draft_tokens: int) -> tuple[list[int], ProposeTiming]:
        if seq.may_use_ahead(num_accepted, num_draft_tokens):
            seq.ahead = await self._rewrite_guess(seq, seq.ahead)
        draft_ids, timing = await self._inner.propose(seq, num_accepted, append_ids, num_draft_tokens)
        num_prompt, continuation, rng = self._state[id(seq)]
        if continuation is None or not draft_ids:
            return draft_ids, timing
        done = len(seq.token_ids) - len(draft_ids) - num_prompt  # tokens committed after the prompt
        oracle = list(draft_ids)
        for j in range(len(draft_ids)):
            if done + j >= len(continuation):
                break
            oracle[j] = self._guess(continuation[done + j], rng)
            if oracle[j] != continuation[done + j]:
                break  # rejected for sure; later positions cannot count
        seq.token_ids[-len(draft_ids):] = oracle
        return oracle, timing

    async def _rewrite_guess(self, seq: DraftSequence, ahead: asyncio.Future) -> asyncio.Future:
        """The draft-ahead chain with its first token (at the position after the open proposal)
        replaced: the target's continuation at rate alpha, a wrong token otherwise."""
        try:
            chain, timing = await ahead
        except Exception:  # noqa: BLE001 - the inner drafter proposes afresh
            return ahead
        num_prompt, continuation, rng = self._state[id(seq)]
        position = len(seq.token_ids) - num_prompt
        if continuation is not None and chain and position < len(continuation):
            chain = [self._guess(continuation[position], rng), *chain[1:]]
        rewritten = asyncio.get_running_loop().create_future()
        rewritten.set_result((chain, timing))
        return rewritten

    def _guess(self, truth: int, rng: random.Random) -> int:
        """A proposed token: the target's continuation at rate alpha, else a token it rejects."""
        return truth if rng.random() < self._alpha else (truth + 1) % self.description.vocab_size

    def release(self, seq: DraftSequence) -> None:
        self._state.pop(id(seq), None)
        self._inner.release(seq)

    def start_background(self) -> None:  # the inner drafter's loop is started as "plain"
        pass

    async def stop(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return self._inner.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser, "SPECDEC_ORACLE", default_port=0)
    add_runtime_args(parser, "SPECDEC_ORACLE", "")
    parser.add_argument("--continuations", type=Path, required=True,
                        help='JSON list of {"prompt_ids": [...], "token_ids": [...]} (the target\'s greedy output)')
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    parser.add_argument("--draft-ahead", action="store_true", help="the model drafts ahead (engine/model_drafter.py)")
    parser.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none",
                        help="the draft's weights (engine/linear.py)")
    args = parser.parse_args()
    setup_logging(args.log_level, args.log_format)
    config = replace(runtime_config(args), quantize=args.quantize)
    pdl.ENABLED = pdl.from_env(default=True)  # as the draft service (draft_service/cli.py)
    continuations = Continuations(args.continuations)

    async def start() -> RunningServer:
        inner = await model_loader(config, args.draft_ahead)(config.model)
        drafts = DraftRegistry.of(inner, name="plain")
        for alpha in args.alphas:
            drafts.add(f"oracle-{alpha:g}", OracleDrafter(inner, continuations, alpha))
        return await start_draft_server(drafts, args.host, args.port, args.ready_file,
                                        busy_poll=busy_poll_of(args.busy_poll, config),
                                        idle_poll=busy_poll_of(args.idle_poll, config), unix_socket=args.unix_socket)

    asyncio.run(serve_until_signal(start, args.cpus, args.shutdown_grace_s))


if __name__ == "__main__":
    main()
