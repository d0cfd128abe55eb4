"""The draft's proposal loop with on-device feedback proposes exactly what the step-by-step loop
proposes, for mixed pending lengths and mixed k in one batch (run uncaptured here; the GPU test
in test_cuda_graphs_gpu.py runs the captured graphs the same way)."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ForwardBatch, StepInput
from engine.cuda_graphs import GraphConfig
from engine.draft_loop import DraftLoop, LoopConfig, advance_step_reference
from engine.model_runner import ModelRunner, RuntimeConfig
from engine.sampling import SamplingParams
from engine.subset_head import SubsetLMHead


def check_device_loop_matches_stepwise(device_loop: DraftLoop, stepwise: DraftLoop, num_rounds: int = 8,
                                       seed: int = 1, sampled: bool = False) -> None:
    runners = {device_loop: device_loop._runner, stepwise: stepwise._runner}
    prompts = [list(range(5, 5 + n)) for n in (12, 30, 7, 17, 3)]
    seqs = {loop: [r.kv.new_sequence() for _ in prompts] for loop, r in runners.items()}
    for loop, r in runners.items():
        r.forward([StepInput(kv, p, 0) for kv, p in zip(seqs[loop], prompts)])
    starts = [len(p) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    for round_ in range(num_rounds):  # pending 1 or 2 tokens, a 4-token catch-up in round 5, k in 1..7
        batch = sorted(torch.randperm(len(prompts), generator=gen)[: 1 + round_ % len(prompts)].tolist())
        pending = [[rand(0, 300) for _ in range(4 if round_ == 5 else rand(1, 3))] for _ in batch]
        num_tokens = [rand(1, 8) for _ in batch]
        sampling = [SamplingParams(temperature=rand(0, 3) / 2, top_p=0.9, seed=i) for i in batch] if sampled else None
        out = {loop: loop.propose([StepInput(seqs[loop][i], p, 1) for i, p in zip(batch, pending)], num_tokens, sampling)
               for loop in runners}
        for a, b in zip(out[device_loop], out[stepwise]):
            assert a.token_ids == b.token_ids, f"round {round_}"
            assert [ids for ids, _ in a.probs] == [ids for ids, _ in b.probs]
            for (_, qa), (_, qb) in zip(a.probs, b.probs):
                torch.testing.assert_close(torch.tensor(qa), torch.tensor(qb))
        assert [len(p.token_ids) for p in out[device_loop]] == num_tokens
        for i, p, n in zip(batch, pending, num_tokens):  # keep some proposals, as a verify does
            kept = starts[i] + len(p) + rand(0, n)
            for loop in runners:  # the device loop fed every sequence up to the batch's longest proposal
                seqs[loop][i].truncate(kept)
            starts[i] = kept
    for kv in (kv for loop_seqs in seqs.values() for kv in loop_seqs):
        kv.release()


# fused: the Triton step kernel too; layer: a decoder layer one kernel (engine/triton_layer.py); both greedy
# only: the sampled pick is the same code after the forward, whichever kernels ran it, and each interpreted
# case takes one to two minutes
@pytest.mark.parametrize(("layer_kernels", "sampled"), [
    ("reference", False), ("reference", True), ("fused", False), ("layer", False),
])
def test_device_loop_proposes_what_the_stepwise_loop_proposes(model_dirs, sampled, layer_kernels):
    runner = lambda: ModelRunner(RuntimeConfig(model=str(model_dirs["perturbed"]), kv_cache_tokens=4096,  # noqa: E731
                                               layer_kernels=layer_kernels))
    device_loop, stepwise = DraftLoop(runner(), device_loop=True), DraftLoop(runner(), device_loop=False)
    check_device_loop_matches_stepwise(device_loop, stepwise, sampled=sampled)


@pytest.mark.parametrize("layer_kernels", ["reference", "fused"])
def test_a_reduced_head_draft_proposes_its_argmax_without_vocabulary_wide_logits(model_dirs, layer_kernels, monkeypatch):
    """The device loop's greedy picks take a reduced head's argmax over its own rows (engine/subset_head.py):
    the tokens the stepwise loop picks from the vocabulary-wide logits, and never those logits."""
    runner = lambda: ModelRunner(RuntimeConfig(model=str(model_dirs["reduced_head"]), kv_cache_tokens=4096,  # noqa: E731
                                               layer_kernels=layer_kernels))
    device_loop, stepwise = DraftLoop(runner(), device_loop=True), DraftLoop(runner(), device_loop=False)
    head = device_loop._runner.model.lm_head
    assert isinstance(head, SubsetLMHead)
    placed = []
    to_vocab = SubsetLMHead.to_vocab

    def counted(self, sub: torch.Tensor) -> torch.Tensor:
        if sub.numel():  # (prefills ask for no rows)
            placed.append(self)
        return to_vocab(self, sub)

    monkeypatch.setattr(SubsetLMHead, "to_vocab", counted)
    check_device_loop_matches_stepwise(device_loop, stepwise, num_rounds=4)
    assert placed and all(h is stepwise._runner.model.lm_head for h in placed)  # the device loop placed no row


def test_a_sequence_at_the_end_of_its_context_batches_with_a_longer_proposal(model_dirs):
    # the device loop feeds every row up to the batch's longest proposal: the full sequence's extra
    # steps run past max_model_len, and must neither fail nor change what either sequence gets
    config = RuntimeConfig(model=str(model_dirs["perturbed"]), kv_cache_tokens=1024, max_model_len=40)
    device_loop, stepwise = DraftLoop(ModelRunner(config), device_loop=True), DraftLoop(ModelRunner(config))
    out = {}
    for loop in (device_loop, stepwise):
        full, short = loop._runner.kv.new_sequence(), loop._runner.kv.new_sequence()
        loop._runner.forward([StepInput(full, list(range(5, 43)), 0), StepInput(short, [7, 8, 9], 0)])
        out[loop] = loop.propose([StepInput(full, [44], 1), StepInput(short, [10], 1)], [1, 8])
        full.release(), short.release()
    assert [p.token_ids for p in out[device_loop]] == [p.token_ids for p in out[stepwise]]
    assert [len(p.token_ids) for p in out[device_loop]] == [1, 8]
    assert device_loop._runner.kv.allocator.num_used == 0


def test_the_step_kernel_writes_the_inputs_the_torch_ops_write():
    """engine/triton_draft_step.advance_step (the fused stages' loops) against the loop's PyTorch ops:
    the next token, its position, its KV slot through the block table and the context length."""
    from engine.triton_draft_step import advance_step

    gen = torch.Generator().manual_seed(0)
    b, block_size, width = 5, 4, 9
    tables = torch.randint(1, 100, (b, width), generator=gen, dtype=torch.int32)
    base = torch.randint(0, block_size * width - 8, (b,), generator=gen)
    picked = torch.randint(0, 300, (b, 3), generator=gen)  # a column of a [b, k] tensor: strided

    def step() -> ForwardBatch:
        return ForwardBatch(input_ids=torch.zeros(b, dtype=torch.long), positions=torch.zeros(b, dtype=torch.long),
                            slot_mapping=torch.zeros(b, dtype=torch.long), cu_seqlens_q=list(range(b + 1)),
                            cu_seqlens_q_t=torch.arange(b + 1, dtype=torch.int32),
                            context_lens=torch.zeros(b, dtype=torch.int32), block_tables=tables, max_num_q=1,
                            logits_indices=torch.arange(b))

    for j in (1, 3, 7):
        fused, reference = step(), step()
        advance_step(picked[:, j % 3], base, j, tables, block_size, fused)
        advance_step_reference(picked[:, j % 3], base, j, tables, block_size, reference)
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            assert torch.equal(getattr(fused, name), getattr(reference, name)), name


def test_a_service_of_a_small_max_batch_captures_only_the_buckets_it_can_fill():
    """--max-batch-size bounds the graphs captured at start (the draft's 224 loop graphs took 131 s
    on the H200 at the default 64); a batch beyond every bucket splits or runs step by step."""
    for config in (GraphConfig(), LoopConfig()):
        assert config.batch_buckets == (1, 2, 4, 8, 16, 32, 64)
        assert config.for_max_batch(8).batch_buckets == (1, 2, 4, 8)
        assert config.for_max_batch(5).batch_buckets == (1, 2, 4, 8)
        assert config.for_max_batch(1).batch_buckets == (1,)
        assert config.for_max_batch(65).batch_buckets == config.batch_buckets
    with pytest.raises(ValueError, match="max_batch_size"):
        RuntimeConfig(model="m", max_batch_size=0)
