"""`python -m distill.evaluate --draft DIR ...`: how well drafts would do against their target under
greedy speculation, without the services.

Under greedy verification every accepted draft token equals the target's, so while a step's proposals
are accepted the draft sees exactly the target's own prefix. A step starting at answer position j
therefore accepts the run of consecutive positions j, j+1, ... (at most k) where the draft's
teacher-forced argmax equals the target's token, and then the target adds one token (recovered or
bonus). One teacher-forced forward of the draft over each of the target's greedy answers gives the
acceptance at every k. The answers are the target's own, to the held-out prompts (distill/prompts.py).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from distill.data import chat_ids
from distill.prompts import held_out_prompts
from engine.batch import StepInput
from engine.model_runner import QUANTIZE_MODES, ModelRunner, RuntimeConfig
from engine.model_source import DEFAULT_MODEL


@dataclass(frozen=True)
class GreedyAcceptance:
    k: int
    acceptance_rate: float  # accepted draft tokens / proposed draft tokens
    mean_accepted_len: float  # tokens emitted per verify step (accepted + the target's one)


def greedy_acceptance(matches: list[list[bool]], k: int) -> GreedyAcceptance:
    """Greedy speculation at a fixed k replayed over per-answer teacher-forced match masks."""
    proposed = accepted = steps = 0
    for mask in matches:
        position = 0
        while position < len(mask):
            width = min(k, len(mask) - position)
            run = next((i for i in range(width) if not mask[position + i]), width)
            proposed, accepted, steps = proposed + width, accepted + run, steps + 1
            position += run + 1
    return GreedyAcceptance(k, accepted / max(proposed, 1), (accepted + steps) / max(steps, 1))


@torch.inference_mode()
def target_answers(target: ModelRunner, prompts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer, EOS included) per prompt."""
    eos = set(target.description.eos_token_ids)
    out = []
    for prompt in prompts:
        ids = chat_ids(target.tokenizer, prompt)
        kv = target.kv.new_sequence()
        logits = target.forward([StepInput(kv, ids, num_logits=1)])[0]
        answer = [int(logits[-1].argmax())]
        while len(answer) < max_new_tokens and answer[-1] not in eos:
            logits = target.forward([StepInput(kv, answer[-1:], num_logits=1)])[0]
            answer.append(int(logits[-1].argmax()))
        kv.release()
        out.append((ids, answer))
    return out


@torch.inference_mode()
def match_masks(draft: ModelRunner, answers: list[tuple[list[int], list[int]]]) -> list[list[bool]]:
    """Per answer, whether the draft's teacher-forced argmax is the target's token at each position."""
    masks = []
    for prompt_ids, answer in answers:
        kv = draft.kv.new_sequence()
        logits = draft.forward([StepInput(kv, (prompt_ids + answer)[:-1], num_logits=len(answer))])[0]
        kv.release()
        masks.append((logits.argmax(-1) == torch.tensor(answer)).tolist())
    return masks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m distill.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", action="append", required=True, help="a draft model spec (repeatable)")
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none",
                        help="the drafts' weights as the draft service would run them (its CPU default: int8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runtime = RuntimeConfig(model=args.target, kv_cache_tokens=4096)
    answers = target_answers(ModelRunner(runtime), held_out_prompts(), args.max_new_tokens)
    report = {"target": args.target, "quantize": args.quantize, "num_answers": len(answers),
              "num_tokens": sum(len(a) for _, a in answers), "drafts": {}}
    for spec in args.draft:
        masks = match_masks(ModelRunner(RuntimeConfig(model=spec, kv_cache_tokens=4096, quantize=args.quantize)),
                            answers)
        report["drafts"][spec] = {
            "agreement": round(sum(map(sum, masks)) / report["num_tokens"], 4),
            "greedy": [{key: round(v, 4) if isinstance(v, float) else v for key, v in
                        asdict(greedy_acceptance(masks, k)).items()} for k in args.k]}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
