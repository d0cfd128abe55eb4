"""Distillation data: the target's own greedy answers to chat prompts, generated in left-padded
batches with transformers' `generate` and written as resumable shards.

Each shard (`shard-NNNNN.pt`) holds, per prompt, the chat-formatted prompt ids and the target's
greedy continuation (cut after the first EOS). A shard that exists is never regenerated, so a
killed run continues where it stopped.
"""
from __future__ import annotations

import json
import time
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


@torch.inference_mode()
def generate_shards(hf_model, tokenizer, prompts: list[str], out_dir: Path, batch_size: int, max_new_tokens: int,
                    eos_ids: list[int], log_file: Path | None = None) -> list[Path]:
    """Generates the target's greedy answers for `prompts`, one shard per batch; returns the shard paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(hf_model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    batches = [list(range(i, min(i + batch_size, len(encoded)))) for i in range(0, len(encoded), batch_size)]
    paths = [out_dir / f"shard-{i:05d}.pt" for i in range(len(batches))]
    todo = [(b, p) for b, p in zip(batches, paths) if not p.exists()]
    bar = tqdm(todo, desc="generating", unit="batch", initial=len(batches) - len(todo), total=len(batches))
    for batch, path in bar:
        ids = [encoded[i] for i in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        start = time.perf_counter()
        out = hf_model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=pad_id, eos_token_id=eos_ids)
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
    return paths


@torch.inference_mode()
def add_teacher_hidden(hf_model, shard_paths: list[Path], batch_size: int, pad_id: int) -> None:
    """Stores the target's final (normed) hidden state at every position of each shard's sequences
    (fp16, `shard-NNNNN.hidden.pt`): the LM head reads it, so matching it matches the target's whole
    next-token distribution, not only its argmax. One teacher-forced forward per batch; resumable."""
    device = next(hf_model.parameters()).device
    todo = [p for p in shard_paths if not _hidden_path(p).exists()]
    for path in tqdm(todo, desc="teacher states", unit="shard"):
        records, hidden = torch.load(path), []
        for i in range(0, len(records), batch_size):
            seqs = [r["prompt_ids"] + r["response_ids"] for r in records[i : i + batch_size]]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
            states = hf_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            hidden += [states[row, : len(s)].to("cpu", torch.float16).clone() for row, s in enumerate(seqs)]
        tmp = _hidden_path(path).with_suffix(".tmp")
        torch.save(hidden, tmp)
        tmp.rename(_hidden_path(path))


def _hidden_path(shard: Path) -> Path:
    return shard.with_name(shard.stem + ".hidden.pt")


def load_records(paths: list[Path]) -> list[dict]:
    """The shards' records, each with its teacher `hidden` states when they were computed."""
    out = []
    for path in paths:
        records = torch.load(path)
        if _hidden_path(path).exists():
            for record, hidden in zip(records, torch.load(_hidden_path(path))):
                record["hidden"] = hidden
        out += records
    return out
