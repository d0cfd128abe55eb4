"""CPU benchmark of the default pair: SmolLM2-135M target-only vs speculative with the shipped
distilled draft vs speculative with the n-gram drafter, through the three services, same run.

Held-out prompts (distill/prompts.py: topics and templates the draft never trained on), greedy,
batch 1. One target service, one draft service serving the distilled draft as its default and the
n-gram drafter (loaded through LoadDraft) by name, one gateway. Configurations run interleaved per
prompt (this VM's speed drifts over minutes), and every speculative output is checked against the
target-only output. Writes bench/results/cpu_default_pair.json.
Usage: python bench/cpu_default_pair.py [--draft DIR] [--k 2] [--sweep 1 3] [--ngram-k 2 4] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

from distill.prompts import held_out_prompts  # noqa: E402
from engine.model_source import DEFAULT_MODEL  # noqa: E402
from report import save_report  # noqa: E402
from specdec.client import build_request  # noqa: E402
from specdec.launch import DEFAULT_DRAFT, interrupt_on_sigterm, start_trio  # noqa: E402
from specdec.v1 import draft_pb2, draft_pb2_grpc  # noqa: E402
from totals import Totals, timed_generate  # noqa: E402


def run(address: str, prompt: str, max_new_tokens: int, k: int, draft: str | None, totals: Totals) -> list[int]:
    request = build_request(prompt, True, max_new_tokens, k, [])
    if draft:
        request.draft_model = draft
    return timed_generate(address, request, totals).token_ids


def summary(t: Totals, base: Totals) -> dict:
    return {"tok_s": t.tok_s(), "speedup": t.tok_s() / base.tok_s() if base.tok_s() else 0.0,
            "acceptance_rate": t.ratio("accepted", "drafted"), "mean_accepted_len": t.ratio("verified", "steps"),
            "draft_forward_s_per_token": t.ratio("draft_s", "tokens"),
            "target_forward_s_per_token": t.ratio("target_s", "tokens")}


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="the distilled draft (model spec)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="the k of the headline figures")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 3], help="other k for the distilled draft")
    parser.add_argument("--ngram-k", type=int, nargs="*", default=[2, 4], help="k values for the n-gram drafter")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's dtype")
    parser.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"],
                        help="the distilled draft's (default: --dtype)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_default_pair.json")
    args = parser.parse_args()
    token = secrets.token_hex(8)
    os.environ["SPECDEC_DRAFT_ADMIN_TOKEN"] = token  # the draft service (a child) enables LoadDraft with it
    launch_args = argparse.Namespace(target_model=DEFAULT_MODEL, drafter="model", draft_model=args.draft,
                                     num_draft_tokens=args.k, timeout_s=600, log_level="WARNING",
                                     dtype=args.dtype, draft_dtype=args.draft_dtype)
    prompts = held_out_prompts()
    configs = [("distilled", k) for k in sorted({args.k, *args.sweep})] + [("ngram", k) for k in args.ngram_k]
    totals: dict[str, Totals] = defaultdict(Totals)
    mismatches = 0
    with tempfile.TemporaryDirectory() as tmp:
        trio, address = start_trio(launch_args, Path(tmp))
        try:
            draft_address = trio.services[1].address()
            with grpc.insecure_channel(draft_address) as channel:
                draft_pb2_grpc.DraftServiceStub(channel).LoadDraft(
                    draft_pb2.LoadDraftRequest(name="ngram", model="ngram"),
                    metadata=(("authorization", f"Bearer {token}"),), timeout=60)
            for draft, k in [(None, 0), *configs]:  # warm-up
                run(address, prompts[0], 8, k, "ngram" if draft == "ngram" else None, Totals())
            for round_ in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    reference = run(address, prompt, args.max_new_tokens, 0, None, totals["target_only"])
                    for draft, k in configs:
                        output = run(address, prompt, args.max_new_tokens, k, "ngram" if draft == "ngram" else None,
                                     totals[f"{draft}_k{k}"])
                        mismatches += output != reference
                    print(f"round {round_ + 1} prompt {i + 1}/{len(prompts)}: target-only "
                          f"{totals['target_only'].tok_s():.1f} tok/s, distilled k={args.k} "
                          f"{totals[f'distilled_k{args.k}'].tok_s():.1f} tok/s "
                          f"(acceptance {totals[f'distilled_k{args.k}'].ratio('accepted', 'drafted'):.2f})",
                          file=sys.stderr)
        finally:
            trio.stop()
    base, spec = totals["target_only"], totals[f"distilled_k{args.k}"]
    head = summary(spec, base)
    metrics = {
        "acceptance_rate": head["acceptance_rate"],
        "mean_accepted_len": head["mean_accepted_len"],
        "target_only_tok_s": base.tok_s(),
        "spec_tok_s": head["tok_s"],
        "speedup": head["speedup"],
        "k": args.k,
        "configs": {name: summary(t, base) for name, t in totals.items() if name != "target_only"},
        "target_only_forward_s_per_token": base.ratio("target_s", "tokens"),
        "outputs_differing_from_target_only": mismatches,
        "draft": args.draft,
        "dtype": args.dtype,
        "draft_dtype": args.draft_dtype or args.dtype,
        "num_prompts": len(prompts),
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
    }
    save_report("cpu_default_pair", metrics, args.out)


if __name__ == "__main__":
    main()
