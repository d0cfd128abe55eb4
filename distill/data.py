"""Distillation data: the target's own answers to chat prompts (greedy, and sampled for variety),
generated in left-padded batches with transformers' `generate` and written as resumable shards.

Besides the built prompts (distill/prompts.py), the target can write prompts itself ("self prompts",
as in Magpie): sampled from the chat template cut where a user's message begins, they follow the
distribution of requests the target was tuned on, far more varied than templates x topics.

Each shard (`shard-NNNNN.pt`) holds, per prompt, the chat-formatted prompt ids and the target's
continuation (cut after the first EOS). A shard that exists is never regenerated, so a killed run
continues where it stopped.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm


def chat_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = prompt
    return tokenizer.encode(text, add_special_tokens=False)


SELF_PROMPT_TOKENS = 64  # a self prompt not finished by then is dropped
_MARK = "\u2063specdec-user-message\u2063"


def self_prompt_prefix(tokenizer) -> tuple[list[int], int]:
    """The chat-template ids up to where a user's message starts, and the id that ends a user turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--self-prompts needs a target with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    before, after = text.split(_MARK)
    return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)[0]


def self_prompts(records: list[dict], tokenizer, end_ids: list[int]) -> list[str]:
    """The finished, distinct, non-trivial user messages among sampled self-prompt records, in order."""
    out, seen = [], set()
    for r in records:
        ids = r["response_ids"]
        if not ids or ids[-1] not in end_ids:
            continue  # cut off at SELF_PROMPT_TOKENS
        text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
        if len(text) >= 8 and text not in seen:
            seen.add(text)
            out.append(text)
    return out


@torch.inference_mode()
def generate_shards(hf_model, tokenizer, encoded: list[list[int]], out_dir: Path, batch_size: int,
                    max_new_tokens: int, eos_ids: list[int], log_file: Path | None = None, temperature: float = 0.0,
                    seed: int = 0, deadline: float | None = None) -> list[Path]:
    """Generates the target's continuations of the prompts `encoded` (ids; greedy, or sampled at
    `temperature` with a seed per shard), one shard per batch; returns the paths of the shards that
    exist. After `deadline` (time.monotonic()) no new shard is started."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(hf_model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    batches = [list(range(i, min(i + batch_size, len(encoded)))) for i in range(0, len(encoded), batch_size)]
    paths = [out_dir / f"shard-{i:05d}.pt" for i in range(len(batches))]
    todo = [(i, b, p) for i, (b, p) in enumerate(zip(batches, paths)) if not p.exists()]
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else \
        {"do_sample": False}
    bar = tqdm(todo, desc="generating", unit="batch", initial=len(batches) - len(todo), total=len(batches))
    for index, batch, path in bar:
        if deadline is not None and time.monotonic() > deadline:
            bar.write(f"data time is up: {sum(p.exists() for p in paths)} of {len(paths)} shards in {out_dir}")
            break
        ids = [encoded[i] for i in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        start = time.perf_counter()
        torch.manual_seed(seed * 1_000_003 + index)  # a resumed run draws the same answers
        out = hf_model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                pad_token_id=pad_id, eos_token_id=eos_ids, **sampling)
        seconds = time.perf_counter() - start
        records = []
        for row, prompt_ids in zip(out[:, width:].tolist(), ids):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            records.append({"prompt_ids": prompt_ids, "response_ids": row[:cut]})
        num_tokens = sum(len(r["response_ids"]) for r in records)
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(path)  # atomic: a half-written shard never counts as done
        bar.set_postfix(tok_s=f"{num_tokens / seconds:.0f}")
        if log_file is not None:
            with log_file.open("a") as f:
                f.write(json.dumps({"event": "shard", "path": f"{out_dir.name}/{path.name}", "num_sequences": len(records),
                                    "num_response_tokens": num_tokens, "seconds": round(seconds, 2)}) + "\n")
    return [p for p in paths if p.exists()]


def load_records(paths: list[Path]) -> list[dict]:
    return [record for path in paths for record in torch.load(path)]


def select_vocab(records: list[dict], size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids most frequent in the answers (plus `always`, e.g. EOS), sorted: the rows
    of a draft's reduced LM head."""
    counts = Counter(t for r in records for t in r["response_ids"])
    keep = set(always)
    for token, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(token)
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(records: list[dict], vocab_ids: torch.Tensor) -> float:
    """The fraction of answer tokens inside `vocab_ids`."""
    kept = set(vocab_ids.tolist())
    tokens = [t for r in records for t in r["response_ids"]]
    return sum(t in kept for t in tokens) / max(len(tokens), 1)
