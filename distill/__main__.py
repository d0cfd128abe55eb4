"""`python -m distill`: distil a small draft model for a target (hub id, directory or GGUF).

Stages, each resumable (re-run the same command after a kill):
  1. data:   the target's greedy answers to `--num-prompts` chat prompts -> WORK/data/shard-*.pt,
             plus `--samples-per-prompt` sampled answers each -> WORK/sampled-T/ (and its greedy
             answers to the held-out prompts -> WORK/held_out/, for the agreement metric); with
             `--self-prompts N`, N user messages the target writes itself -> WORK/self-prompts/,
             answered the same way -> WORK/self-data/, WORK/self-sampled-T/. `--data-only` stops here
  2. train:  the draft's layers, initialised from `--layers` of the target, against the target as a
             teacher (its argmax, distribution and hidden states) -> WORK/checkpoint.pt
  3. export: OUT/model.safetensors (the trained layers, the reduced head's token ids) +
             OUT/specdec_draft.json (names the target)
Logs: WORK/log.jsonl (one JSON object per shard, step, evaluation). OUT loads anywhere a model spec
goes, e.g. `python -m draft_service --drafter model --model OUT`.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from distill.data import (
    SELF_PROMPT_TOKENS,
    chat_ids,
    coverage,
    generate_shards,
    load_records,
    select_vocab,
    self_prompt_prefix,
    self_prompts,
)
from distill.export import export_draft
from distill.prompts import held_out_prompts, training_prompts
from distill.train import TrainConfig, log_event, train
from engine.model_source import DEFAULT_MODEL, default_cache_dir, keep_layers, load_pretrained
from engine.subset_head import SubsetLMHead
from engine.tokenizer_info import eos_token_ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model spec (default: %(default)s)")
    parser.add_argument("--record-target", default=None,
                        help="the target spec written into the draft (default: --target); e.g. the package spec when "
                             "training from a copy of its file on another machine")
    parser.add_argument("--out", type=Path, required=True, help="the draft directory to write")
    parser.add_argument("--work", type=Path, required=True, help="data, checkpoints and log (not for git)")
    parser.add_argument("--layers", default="0,-1",
                        help="the target's layers the draft starts from, comma-separated (default: first and last)")
    parser.add_argument("--num-prompts", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length generated per prompt")
    parser.add_argument("--gen-batch-size", type=int, default=64)
    parser.add_argument("--self-prompts", type=int, default=0,
                        help="user messages the target samples itself (Magpie-style), answered like the built prompts")
    parser.add_argument("--data-only", action="store_true", help="stop after the data stage")
    parser.add_argument("--samples-per-prompt", type=int, default=0,
                        help="sampled answers per prompt besides the greedy one (variety; default: %(default)s)")
    parser.add_argument("--sample-temperature", type=float, default=0.8)
    parser.add_argument("--data-minutes", type=float, default=None,
                        help="data generation time limit; training uses the shards made by then")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="rows of the draft's LM head: the most frequent answer tokens (0: the whole vocabulary)")
    parser.add_argument("--batch-size", type=int, default=16, help="training sequences per step")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--kl-weight", type=float, default=1.0,
                        help="weight of KL(target || draft) at every answer position (0: off)")
    parser.add_argument("--hidden-weight", type=float, default=1.0,
                        help="weight of the final-hidden-state regression to the target (0: off)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="training time limit (the learning rate decays to its floor by then, or by the last "
                             "epoch, whichever comes first); exports what it has")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the shipped weights")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log_file = args.work / "log.jsonl"
    log_event(log_file, {"event": "start", "args": {k: str(v) for k, v in vars(args).items()}})
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # training only; the data is generated before this matters
    started = time.perf_counter()
    device = torch.device(args.device)
    loaded = load_pretrained(args.target, torch.float32, device, default_cache_dir())
    target, tokenizer = loaded.hf_model, loaded.tokenizer
    eos = eos_token_ids(tokenizer, getattr(target.generation_config, "eos_token_id", None))

    deadline = None if args.data_minutes is None else time.monotonic() + args.data_minutes * 60

    def generate(ids: list[list[int]], out_dir: Path, max_new_tokens: int = args.max_new_tokens, ends=eos, **kw):
        return generate_shards(target, tokenizer, ids, args.work / out_dir, args.gen_batch_size, max_new_tokens, ends,
                               log_file, deadline=deadline, **kw)

    def answer(prompts: list[str], prefix: str = "") -> list[Path]:
        """Greedy answers to `prompts` (WORK/{prefix}data), plus --samples-per-prompt sampled ones each."""
        ids = [chat_ids(tokenizer, p) for p in prompts]
        shards = generate(ids, Path(f"{prefix}data"))
        if args.samples_per_prompt:
            shards += generate(ids * args.samples_per_prompt, Path(f"{prefix}sampled-{args.sample_temperature:g}"),
                               temperature=args.sample_temperature, seed=args.seed)
        return shards

    held_out = generate([chat_ids(tokenizer, p) for p in held_out_prompts()], Path("held_out"))
    shards = answer(training_prompts(args.num_prompts, args.seed))
    if args.self_prompts:
        prefix, end = self_prompt_prefix(tokenizer)
        written = generate([prefix] * args.self_prompts, Path("self-prompts"), SELF_PROMPT_TOKENS, [end, *eos],
                           temperature=1.0, seed=args.seed)
        texts = self_prompts(load_records(written), tokenizer, [end, *eos])
        log_event(log_file, {"event": "self_prompts", "sampled": args.self_prompts, "kept": len(texts)})
        shards += answer(texts, "self-")
    if args.data_only:
        return {"data_shards": len(shards)}
    records, held_out_records = load_records(shards), load_records(held_out)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    num_target_layers = len(target.model.layers)
    source_layers = tuple(int(i) % num_target_layers for i in args.layers.split(","))
    draft = keep_layers(copy.deepcopy(target), [copy.deepcopy(target.model.layers[i]) for i in source_layers])
    if 0 < args.draft_vocab < target.config.vocab_size:
        vocab_ids = select_vocab(records, args.draft_vocab, eos)
        draft.lm_head = SubsetLMHead(target.lm_head.weight, vocab_ids)
        log_event(log_file, {"event": "draft_vocab", "size": len(vocab_ids),
                        "held_out_answer_coverage": round(coverage(held_out_records, vocab_ids), 4)})
    config = TrainConfig(source_layers=source_layers, batch_size=args.batch_size, lr=args.lr, epochs=args.epochs,
                         max_minutes=args.max_minutes, kl_weight=args.kl_weight, hidden_weight=args.hidden_weight,
                         draft_vocab=args.draft_vocab, checkpoint_every=args.checkpoint_every,
                         eval_every=args.eval_every, seed=args.seed)
    summary = train(draft, target, records, held_out_records, config, args.work, pad_id, device, log_file)
    summary["wall_seconds_this_run"] = round(time.perf_counter() - started, 1)
    export_draft(draft, tokenizer, args.out, args.record_target or args.target, source_layers, getattr(torch, args.dtype),
                 {"train": asdict(config), **summary, "num_prompts": args.num_prompts,
                  "self_prompts": args.self_prompts, "samples_per_prompt": args.samples_per_prompt,
                  "sample_temperature": args.sample_temperature,
                  "max_new_tokens": args.max_new_tokens})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
