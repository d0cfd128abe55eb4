"""`python -m distill` end to end on a tiny random target: data, a few steps, a checkpoint that a second
run resumes, and a draft directory that loads through ModelRunner and the draft service's loader
with the target's tokenizer."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from distill.__main__ import main as distill
from distill.data import chat_ids, load_records, self_prompt_prefix, self_prompts
from distill.train import TrainConfig, _progress, lr_at
from draft_service.registry import DraftRegistry, model_loader
from engine.batch import StepInput
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.model_source import DRAFT_FILE, load_pretrained
from specdec.errors import UnsupportedModelError


def _events(log_file, name):
    return [r for r in map(json.loads, log_file.read_text().splitlines()) if r["event"] == name]


def _args(target, out, work, *extra):
    return ["--target", str(target), "--out", str(out), "--work", str(work), "--layers", "1", "--num-prompts", "12",
            "--max-new-tokens", "6", "--gen-batch-size", "8", "--batch-size", "4", "--epochs", "2",
            "--device", "cpu", "--eval-every", "2", "--checkpoint-every", "100", "--dtype", "float32",
            "--draft-vocab", "0", *extra]


def test_distill_resumes_and_the_draft_loads_with_the_targets_tokenizer(model_dirs, tmp_path):
    target, out, work = model_dirs["target"], tmp_path / "draft", tmp_path / "work"
    first = distill(_args(target, out, work, "--max-minutes", "0"))  # stops (and checkpoints) after one step
    assert first["stopped_early"] and first["step"] == 1
    assert len(list((work / "data").glob("shard-?????.pt"))) == 2
    second = distill(_args(target, out, work))
    log = work / "log.jsonl"
    assert _events(log, "resume") == [{"time": _events(log, "resume")[0]["time"], "event": "resume", "step": 1}]
    steps = [r["step"] for r in _events(log, "step")]
    assert steps == list(range(1, second["total_steps"] + 1))  # the second run went on from step 2
    assert second["step"] == second["total_steps"] == 6 and not second["stopped_early"]
    assert len(_events(log, "shard")) == 4  # 2 training + 2 held-out shards, generated once

    meta = json.loads((out / DRAFT_FILE).read_text())
    assert meta["num_layers"] == 1 and meta["source_layers"] == [1] and meta["target"] == str(target)
    draft = ModelRunner(RuntimeConfig(model=str(out), kv_cache_tokens=1024))
    target_runner = ModelRunner(RuntimeConfig(model=str(target), kv_cache_tokens=1024))
    assert draft.model.shape.num_layers == 1 and meta["head_rows"] is None
    assert draft.description.tokenizer_fingerprint == target_runner.description.tokenizer_fingerprint
    assert draft.description.vocab_size == target_runner.description.vocab_size
    # the shipped layer is the trained one; embedding and head are the target's
    trained = torch.load(work / "checkpoint.pt", weights_only=False)["layers"]
    assert torch.equal(draft.model.layers[0].o_proj.weight, trained["0.self_attn.o_proj.weight"])
    assert torch.equal(draft.model.embed_tokens.weight, target_runner.model.embed_tokens.weight)
    logits = draft.forward([StepInput(draft.kv.new_sequence(), [1, 2, 3], num_logits=1)])[0]
    assert logits.shape == (1, draft.description.vocab_size)

    async def load_in_service():
        registry = DraftRegistry(model_loader(RuntimeConfig(model="", kv_cache_tokens=1024, max_batch_size=4)))
        info, _ = await registry.load("distilled", str(out), make_default=True,
                                      expected_fingerprint=target_runner.description.tokenizer_fingerprint)
        await registry.stop()
        return info

    info = asyncio.run(load_in_service())
    assert info.is_default and info.drafter.description.model_id == str(out)


def test_a_draft_on_another_tokenizer_is_refused(model_dirs, tmp_path):
    out, work = tmp_path / "draft", tmp_path / "work"
    distill(_args(model_dirs["target"], out, work, "--epochs", "0.1"))
    meta = json.loads((out / DRAFT_FILE).read_text())
    meta["target"] = str(model_dirs["other_tokenizer"])
    (out / DRAFT_FILE).write_text(json.dumps(meta))
    with pytest.raises(UnsupportedModelError, match="different tokenizer"):
        load_pretrained(str(out), torch.float32, torch.device("cpu"), tmp_path / "cache")


def test_a_reduced_head_draft_proposes_only_its_tokens_and_stays_lossless(model_dirs, tmp_path):
    target, out, work = model_dirs["target"], tmp_path / "draft", tmp_path / "work"
    summary = distill(_args(target, out, work, "--epochs", "0.5", "--draft-vocab", "40", "--samples-per-prompt", "1"))
    log = work / "log.jsonl"
    assert len(list((work / "sampled-0.8").glob("shard-?????.pt"))) == 2  # 12 sampled answers, 8 a shard
    assert summary["num_train_sequences"] == 24  # greedy + sampled answers
    (vocab_event,) = _events(log, "draft_vocab")
    assert vocab_event["size"] == 40 and 0 < vocab_event["held_out_answer_coverage"] <= 1
    meta = json.loads((out / DRAFT_FILE).read_text())
    assert meta["head_rows"] == 40
    draft = ModelRunner(RuntimeConfig(model=str(out), kv_cache_tokens=1024))
    vocab_ids = draft.model.lm_head.vocab_ids
    logits = draft.forward([StepInput(draft.kv.new_sequence(), [1, 2, 3], num_logits=3)])[0]
    assert logits.shape == (3, draft.description.vocab_size)
    outside = torch.ones(draft.description.vocab_size, dtype=torch.bool)
    outside[vocab_ids] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, vocab_ids]).all()
    assert set(logits.argmax(-1).tolist()) <= set(vocab_ids.tolist())


def test_self_prompts_are_sampled_from_the_chat_template_and_answered_like_built_ones(model_dirs, tmp_path, tokenizer):
    target, out, work = model_dirs["target"], tmp_path / "draft", tmp_path / "work"
    prefix, end = self_prompt_prefix(tokenizer)
    assert tokenizer.decode(prefix).endswith("user\n") and end == tokenizer.eos_token_id
    data = distill(_args(target, out, work, "--num-prompts", "0", "--self-prompts", "16", "--data-only"))
    assert data["data_shards"] > 0 and not out.exists()  # stopped after the data stage
    sampled = load_records(sorted((work / "self-prompts").glob("shard-?????.pt")))
    assert len(sampled) == 16 and all(r["prompt_ids"] == prefix for r in sampled)
    kept = self_prompts(sampled, tokenizer, [end])
    (event,) = _events(work / "log.jsonl", "self_prompts")
    assert event == {**event, "sampled": 16, "kept": len(kept)} and len(set(kept)) == len(kept)
    answers = load_records(sorted((work / "self-data").glob("shard-?????.pt")))
    assert [r["prompt_ids"] for r in answers] == [chat_ids(tokenizer, p) for p in kept]
    # a later run with the same settings finds every shard and trains on the self-prompt answers alone
    summary = distill(_args(target, out, work, "--num-prompts", "0", "--self-prompts", "16", "--epochs", "0.5"))
    assert summary["num_train_sequences"] == sum(len(r["response_ids"]) > 0 for r in answers)
    assert len(_events(work / "log.jsonl", "shard")) == len(list(work.glob("*/shard-?????.pt")))


def test_an_unfinished_or_repeated_self_prompt_is_dropped(tokenizer):
    end = tokenizer.eos_token_id
    hello = tokenizer.encode("Tell me about kites.")
    records = [{"prompt_ids": [], "response_ids": ids} for ids in
               (hello + [end], hello + [end], tokenizer.encode("unfinished message"), tokenizer.encode("hi") + [end])]
    assert self_prompts(records, tokenizer, [end]) == ["Tell me about kites."]


def test_a_time_limited_run_ends_its_learning_rate_schedule_when_time_is_up():
    config = TrainConfig(source_layers=(0,), lr=1.0, warmup_steps=2, max_minutes=10)
    untimed = TrainConfig(source_layers=(0,), lr=1.0, warmup_steps=2)
    assert lr_at(config, 0, _progress(config, 0, 1000, 0.0)) == 0.5  # warm-up
    assert lr_at(config, 500, _progress(config, 500, 1000, 0.0)) == pytest.approx(0.55)  # half the steps
    assert lr_at(config, 10, _progress(config, 10, 1000, 300.0)) == pytest.approx(0.55)  # half the time
    assert lr_at(config, 10, _progress(config, 10, 1000, 900.0)) == pytest.approx(0.1)  # time is up: the floor
    assert lr_at(untimed, 10, _progress(untimed, 10, 1000, 900.0)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(0.01 * math.pi)))
