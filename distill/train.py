"""Trains the draft's decoder layers to predict the target's own next tokens.

The draft is the target cut to a few of its own layers (copied, then trained); the target's embedding
and final norm stay frozen and are borrowed from the target at run time, so only the layers (and,
for a reduced head, the ids of the vocabulary rows it keeps: engine/subset_head.py) are shipped.

The inputs are the target's own answers (greedy and sampled: the text a draft sees at serving
time). A teacher-forced forward of the frozen target over each batch gives, at every answer position,
its next-token distribution p and its final normed hidden state. The loss, per answer position:
cross-entropy against the target's argmax (the greedy acceptance criterion), plus `kl_weight` x
KL(p || q_draft) (sampled acceptance is sum min(p, q)), plus `hidden_weight` x the relative squared
error between the draft's and the target's final hidden states (EAGLE-style feature regression).
With a reduced head, p is taken over the kept rows and the target's argmax outside them is a miss.
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

from engine.subset_head import SubsetLMHead


@dataclass(frozen=True)
class TrainConfig:
    source_layers: tuple[int, ...]
    batch_size: int = 16  # sequences per step
    lr: float = 5e-4
    warmup_steps: int = 20
    epochs: float = 2.0
    max_minutes: float | None = None  # stop (and export) after this much training time; the lr decays by it too
    max_len: int = 512  # tokens per sequence (prompt + answer), longer ones are cut
    kl_weight: float = 1.0  # 0: no distribution matching
    hidden_weight: float = 1.0  # 0: no hidden-state regression
    draft_vocab: int = 0  # rows of the draft's LM head (0: the whole vocabulary)
    checkpoint_every: int = 50
    eval_every: int = 50
    seed: int = 0


Seq = tuple[list[int], int]


def _sequences(records: list[dict], max_len: int) -> list[Seq]:
    """(token ids, index of the first position whose next token is a label) per record."""
    out = []
    for r in records:
        ids = (r["prompt_ids"] + r["response_ids"])[:max_len]
        first = len(r["prompt_ids"]) - 1  # the last prompt token predicts the first answer token
        if len(ids) - 1 > first:
            out.append((ids, first))
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 on real tokens
    where: torch.Tensor  # [B, T] bool: answer positions (their next token is predicted)


def _batch(seqs: list[Seq], pad_id: int, device: torch.device) -> Batch:
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    where = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (ids, first) in enumerate(seqs):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        where[row, first : len(ids) - 1] = True
    return Batch(input_ids.to(device), mask.to(device), where.to(device))


@torch.no_grad()
def teacher_outputs(target, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final normed hidden states [B, T, H] and its logits at the answer positions [N, vocab]."""
    hidden = target.model(input_ids=batch.input_ids, attention_mask=batch.mask).last_hidden_state
    return hidden.float(), target.lm_head(hidden[batch.where]).float()


def draft_loss(model, target, batch: Batch, kl_weight: float = 0.0, hidden_weight: float = 0.0):
    """The loss (module doc) and its parts, #positions where the draft's argmax is the target's, #positions."""
    teacher_hidden, teacher_logits = teacher_outputs(target, batch)
    labels = teacher_logits.argmax(-1)  # full-vocabulary ids
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.mask).last_hidden_state  # final-normed
    head = model.lm_head
    if isinstance(head, SubsetLMHead):
        logits = head.subset_logits(hidden[batch.where]).float()
        teacher_logits = teacher_logits[:, head.vocab_ids]
        column = torch.full((head.vocab_size,), -100, dtype=torch.long, device=labels.device)
        column[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=labels.device)
        targets, picked = column[labels], head.vocab_ids[logits.argmax(-1)]
    else:
        logits = head(hidden[batch.where]).float()
        targets, picked = labels, logits.argmax(-1)
    ce = F.cross_entropy(logits, targets, ignore_index=-100) if (targets >= 0).any() else logits.sum() * 0
    loss, parts = ce, {"ce": ce.item()}
    if kl_weight:
        kl = F.kl_div(logits.log_softmax(-1), teacher_logits.log_softmax(-1), log_target=True, reduction="batchmean")
        loss = loss + kl_weight * kl
        parts["kl"] = kl.item()
    if hidden_weight:
        real = batch.mask.bool()
        t = teacher_hidden[real]
        rel = ((hidden[real].float() - t) ** 2).mean() / (t**2).mean()
        loss = loss + hidden_weight * rel
        parts["hidden_rel_err"] = rel.item()
    return loss, parts, int((picked == labels).sum()), int(labels.numel())


@torch.no_grad()
def evaluate(model, target, seqs, pad_id, device, batch_size: int) -> float:
    """Top-1 agreement with the target's argmax on its own greedy answers (teacher-forced): the
    per-token acceptance proxy."""
    model.eval()
    correct = total = 0
    for i in range(0, len(seqs), batch_size):
        _, _, c, n = draft_loss(model, target, _batch(seqs[i : i + batch_size], pad_id, device))
        correct, total = correct + c, total + n
    model.train()
    return correct / max(total, 1)


def train(model, target, records: list[dict], held_out: list[dict], config: TrainConfig, work: Path, pad_id: int,
          device: torch.device, log_file: Path) -> dict:
    """Trains `model.model.layers` in place against the frozen `target`; checkpoints to
    work/checkpoint.pt and resumes from it."""
    params = _trainable_layers(model)
    target.eval()
    seqs, eval_seqs = _sequences(records, config.max_len), _sequences(held_out, config.max_len)
    steps_per_epoch = math.ceil(len(seqs) / config.batch_size)
    total_steps = max(1, int(steps_per_epoch * config.epochs))
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))
    checkpoint = work / "checkpoint.pt"
    step, seconds = _load_checkpoint(checkpoint, model, optimizer, config, len(seqs), log_file)

    def evaluate_and_log() -> float | None:
        agreement = evaluate(model, target, eval_seqs, pad_id, device, config.batch_size) if eval_seqs else None
        log_event(log_file, {"event": "eval", "step": step, "held_out_agreement": agreement})
        return agreement

    if step == 0:
        evaluate_and_log()
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step")
    stopped_early = False
    while step < total_steps:
        lr = lr_at(config, step, _progress(config, step, total_steps, seconds))
        batch = _batch(_epoch_slice(seqs, config, step, steps_per_epoch), pad_id, device)
        record = _train_step(model, target, optimizer, params, batch, lr, config)
        step, seconds = step + 1, seconds + record["seconds"]
        bar.update(1)
        bar.set_postfix(loss=record["loss"], acc=record["train_agreement"])
        log_event(log_file, {"event": "step", "step": step, "epoch": round(step / steps_per_epoch, 3), **record})
        if step % config.eval_every == 0:
            bar.write(f"step {step}: held-out agreement {evaluate_and_log()}")
        out_of_time = config.max_minutes is not None and seconds > config.max_minutes * 60
        if step % config.checkpoint_every == 0 or step == total_steps or out_of_time:
            _save_checkpoint(checkpoint, model, optimizer, config, len(seqs), step, seconds)
        if out_of_time:
            stopped_early = step < total_steps
            break
    bar.close()
    summary = {"event": "done", "step": step, "total_steps": total_steps, "train_seconds": round(seconds, 1),
               "held_out_agreement": evaluate(model, target, eval_seqs, pad_id, device, config.batch_size)
               if eval_seqs else None,
               "stopped_early": stopped_early, "num_train_sequences": len(seqs),
               "num_train_labels": sum(len(ids) - 1 - first for ids, first in seqs)}
    log_event(log_file, summary)
    model.eval()
    return summary


def _progress(config: TrainConfig, step: int, total_steps: int, seconds: float) -> float:
    """How far the run is towards its end, 0..1: the steps done, or the time spent of --max-minutes,
    whichever is further (so a run cut by time still ends its schedule)."""
    progress = step / total_steps
    if config.max_minutes:
        progress = max(progress, seconds / (config.max_minutes * 60))
    return min(progress, 1.0)


def lr_at(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over the first steps, then cosine decay to 10 % of config.lr at progress 1."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _trainable_layers(model) -> list[torch.nn.Parameter]:
    """Freezes everything but the decoder layers (embedding, final norm and LM head are the target's)."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.model.layers.parameters())
    for p in params:
        p.requires_grad_(True)
    model.train()
    return params


def _epoch_slice(seqs: list[Seq], config: TrainConfig, step: int, steps_per_epoch: int) -> list[Seq]:
    """The sequences of `step`: each epoch a seeded shuffle, so a resumed run sees the same batches."""
    epoch, index = divmod(step, steps_per_epoch)
    order = list(range(len(seqs)))
    random.Random(config.seed + epoch).shuffle(order)
    return [seqs[i] for i in order[index * config.batch_size : (index + 1) * config.batch_size]]


def _train_step(model, target, optimizer, params, batch: Batch, lr: float, config: TrainConfig) -> dict:
    start = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, parts, correct, count = draft_loss(model, target, batch, config.kl_weight, config.hidden_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return {"loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()},
            "train_agreement": round(correct / count, 4), "num_labels": count, "lr": lr,
            "seconds": round(time.perf_counter() - start, 3)}


def _load_checkpoint(path: Path, model, optimizer, config: TrainConfig, num_sequences: int,
                     log_file: Path) -> tuple[int, float]:
    """(step, training seconds) of the checkpoint at `path`, loaded into model and optimizer; (0, 0) without one."""
    if not path.exists():
        return 0, 0.0
    state = torch.load(path, weights_only=False)
    if _resumable(state["config"]) != _resumable(asdict(config)) or state["num_sequences"] != num_sequences:
        raise SystemExit(f"{path} was made with other settings or data; delete it to start over")
    model.model.layers.load_state_dict(state["layers"])
    optimizer.load_state_dict(state["optimizer"])
    log_event(log_file, {"event": "resume", "step": state["step"]})
    return state["step"], state["seconds"]


def _save_checkpoint(path: Path, model, optimizer, config: TrainConfig, num_sequences: int, step: int,
                     seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"config": asdict(config), "num_sequences": num_sequences, "step": step, "seconds": seconds,
                "layers": model.model.layers.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    tmp.rename(path)  # atomic: a kill mid-save keeps the previous checkpoint


def _resumable(config: dict) -> dict:
    """The settings a checkpoint must share with the run that resumes it (limits and intervals may change)."""
    return {k: v for k, v in config.items() if k not in ("max_minutes", "checkpoint_every", "eval_every")}


def log_event(log_file: Path, record: dict) -> None:
    with log_file.open("a") as f:
        f.write(json.dumps({"time": round(time.time(), 1), **record}) + "\n")
