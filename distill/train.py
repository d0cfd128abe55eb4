"""Trains the draft's decoder layers to predict the target's greedy next tokens.

The draft is the target cut to a few of its own layers (copied, then trained); the target's embedding,
final norm and LM head stay frozen and are borrowed from the target at run time, so only the layers
are trained and shipped. Loss: cross-entropy against the target's greedy token at every answer
position (sequence-level distillation: the inputs are the target's own answers, as at serving time).
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass(frozen=True)
class TrainConfig:
    source_layers: tuple[int, ...]
    batch_size: int = 16  # sequences per step
    lr: float = 5e-4
    warmup_steps: int = 20
    epochs: float = 2.0
    max_minutes: float | None = None  # stop (and export) after this much training time
    max_len: int = 512  # tokens per sequence (prompt + answer), longer ones are cut
    checkpoint_every: int = 50
    eval_every: int = 50
    seed: int = 0


def _sequences(records: list[dict], max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first position whose next token is a label) per record."""
    out = []
    for r in records:
        ids = (r["prompt_ids"] + r["response_ids"])[:max_len]
        first = len(r["prompt_ids"]) - 1  # the last prompt token predicts the first answer token
        if len(ids) - 1 > first:
            out.append((ids, first))
    return out


def _batch(seqs: list[tuple[list[int], int]], pad_id: int, device: torch.device):
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for row, (ids, first) in enumerate(seqs):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        labels[row, first : len(ids) - 1] = torch.tensor(ids[first + 1 :])
    return input_ids.to(device), mask.to(device), labels.to(device)


def draft_logits_loss(model, input_ids, mask, labels) -> tuple[torch.Tensor, int, int]:
    """Mean CE over label positions (the LM head only runs there); returns loss, #correct, #labels."""
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # final-normed
    where = labels != -100
    logits = model.lm_head(hidden[where]).float()
    targets = labels[where]
    loss = F.cross_entropy(logits, targets)
    return loss, int((logits.argmax(-1) == targets).sum()), int(targets.numel())


@torch.no_grad()
def evaluate(model, seqs, pad_id, device, batch_size: int) -> float:
    """Top-1 agreement with the target's greedy tokens (teacher-forced): the per-token acceptance proxy."""
    model.eval()
    correct = total = 0
    for i in range(0, len(seqs), batch_size):
        _, c, n = draft_logits_loss(model, *_batch(seqs[i : i + batch_size], pad_id, device))
        correct, total = correct + c, total + n
    model.train()
    return correct / max(total, 1)


def train(model, records: list[dict], held_out: list[dict], config: TrainConfig, work: Path, pad_id: int,
          device: torch.device, log_file: Path) -> dict:
    """Trains `model.model.layers` in place; checkpoints to work/checkpoint.pt and resumes from it."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.model.layers.parameters())
    for p in params:
        p.requires_grad_(True)
    model.train()
    seqs = _sequences(records, config.max_len)
    eval_seqs = _sequences(held_out, config.max_len)
    steps_per_epoch = math.ceil(len(seqs) / config.batch_size)
    total_steps = max(1, int(steps_per_epoch * config.epochs))
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10 %
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    checkpoint = work / "checkpoint.pt"
    step, seconds = 0, 0.0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if _resumable(state["config"]) != _resumable(asdict(config)) or state["num_sequences"] != len(seqs):
            raise SystemExit(f"{checkpoint} was made with other settings or data; delete it to start over")
        model.model.layers.load_state_dict(state["layers"])
        optimizer.load_state_dict(state["optimizer"])
        step, seconds = state["step"], state["seconds"]
        _log(log_file, {"event": "resume", "step": step})

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"config": asdict(config), "num_sequences": len(seqs), "step": step, "seconds": seconds,
                    "layers": model.model.layers.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        tmp.rename(checkpoint)

    if step == 0:
        agreement = evaluate(model, eval_seqs, pad_id, device, config.batch_size) if eval_seqs else None
        _log(log_file, {"event": "eval", "step": 0, "held_out_agreement": agreement})
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    stopped_early = False
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)
        order = list(range(len(seqs)))
        random.Random(config.seed + epoch).shuffle(order)  # the same order on resume
        batch = [seqs[i] for i in order[index * config.batch_size : (index + 1) * config.batch_size]]
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss, correct, count = draft_logits_loss(model, *_batch(batch, pad_id, device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - start
        seconds += elapsed
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{correct / count:.3f}")
        _log(log_file, {"event": "step", "step": step, "epoch": round(step / steps_per_epoch, 3),
                        "loss": round(loss.item(), 4), "train_agreement": round(correct / count, 4),
                        "num_labels": count, "lr": lr_at(step - 1), "seconds": round(elapsed, 3)})
        if step % config.eval_every == 0 and eval_seqs:
            agreement = evaluate(model, eval_seqs, pad_id, device, config.batch_size)
            _log(log_file, {"event": "eval", "step": step, "held_out_agreement": agreement})
            bar.write(f"step {step}: held-out agreement {agreement:.3f}")
        if step % config.checkpoint_every == 0 or step == total_steps:
            save()
        if config.max_minutes is not None and seconds > config.max_minutes * 60:
            stopped_early = step < total_steps
            save()
            break
    bar.close()
    agreement = evaluate(model, eval_seqs, pad_id, device, config.batch_size) if eval_seqs else None
    summary = {"event": "done", "step": step, "total_steps": total_steps, "train_seconds": round(seconds, 1),
               "held_out_agreement": agreement, "stopped_early": stopped_early,
               "num_train_sequences": len(seqs),
               "num_train_labels": sum(len(ids) - 1 - first for ids, first in seqs)}
    _log(log_file, summary)
    model.eval()
    return summary


def _resumable(config: dict) -> dict:
    """The settings a checkpoint must share with the run that resumes it (limits and intervals may change)."""
    return {k: v for k, v in config.items() if k not in ("max_minutes", "checkpoint_every", "eval_every")}


def _log(log_file: Path, record: dict) -> None:
    with log_file.open("a") as f:
        f.write(json.dumps({"time": round(time.time(), 1), **record}) + "\n")
