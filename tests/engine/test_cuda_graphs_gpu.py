"""CUDA-graph replays (decode, verify, prefill chunks) compute what the eager forward computes, and
steady state never recaptures or recompiles (torch.compile'd layer stages)."""
from __future__ import annotations

import pytest
import torch

from engine.batch import StepInput
from engine.draft_loop import DraftLoop
from test_draft_loop import check_device_loop_matches_stepwise
from engine import model_runner
from engine.cuda_graphs import GraphConfig
from engine.linear import Int8Linear
from engine.model_runner import ModelRunner, RuntimeConfig

pytestmark = pytest.mark.gpu


def _runner(path, use_cuda_graphs: bool, quantize: str = "none") -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(path), device="cuda", dtype="float32", kv_cache_tokens=4096,
                                     use_cuda_graphs=use_cuda_graphs, quantize=quantize))


def test_graph_replays_match_eager_forwards_and_never_recapture(model_dirs):
    graphed, eager = _runner(model_dirs["target"], True), _runner(model_dirs["target"], False)
    captures = graphed.graphs.num_captures
    prompts = [list(range(3, 3 + n)) for n in (20, 9, 33)]
    seqs = {r: [r.kv.new_sequence() for _ in prompts] for r in (graphed, eager)}
    prefilled = {r: r.forward([StepInput(kv, p, 1) for kv, p in zip(seqs[r], prompts)]) for r in (graphed, eager)}
    for a, b in zip(prefilled[graphed], prefilled[eager]):  # the graphed: a prefill graph's replay per prompt
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    for step in range(12):  # decode and verify shapes, mixed within a batch, batch sizes 1..3
        sizes = torch.randint(1, 6, (1 + step % 3,)).tolist()
        tokens = [torch.randint(0, 300, (n,)).tolist() for n in sizes]
        out = {r: r.forward([StepInput(kv, t, len(t)) for kv, t in zip(seqs[r], tokens)]) for r in (eager,)}
        if step % 2:  # the greedy read back: the graph's own argmax of the rows, one copy for the batch
            out[graphed], greedy = graphed.forward_greedy([StepInput(kv, t, len(t)) for kv, t in zip(seqs[graphed], tokens)])
            assert greedy.get() == [logits.argmax(-1).tolist() for logits in out[graphed]]
        else:
            out[graphed] = graphed.forward([StepInput(kv, t, len(t)) for kv, t in zip(seqs[graphed], tokens)])
        for a, b in zip(out[graphed], out[eager]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for r in (graphed, eager):  # roll back part of it, as a rejected verify does
            for kv, n in zip(seqs[r], sizes):
                kv.truncate(kv.num_tokens - n // 2)
    assert graphed.graphs.num_replays == 12
    assert graphed.graphs.num_captures == captures  # no capture after start-up
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_graphs  # and no recompile
    assert graphed.graphs.num_prefill_replays == 3
    assert graphed.num_eager_steps == 0 and eager.num_eager_steps == 13


def _cached_mib() -> float:
    """What emptying PyTorch's cache gives back to the device now."""
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return (reserved - torch.cuda.memory_reserved()) / 2**20


def test_captures_leave_none_of_their_warm_ups_memory_cached(model_dirs):
    # `capture` warms each graph up on its side stream without emptying PyTorch's cache before it (a device sync a
    # graph): what the warm-ups freed stayed reserved for the process (an H100 draft service before its first swap:
    # 6,752 MiB against 4,198 when every capture emptied the cache) until the captures gave it back once at their end
    runner = _runner(model_dirs["target"], True)
    assert _cached_mib() == 0, "the runner's graph captures left their warm-ups' temporaries cached"
    loop = DraftLoop(runner, device_loop=True)  # kept: a dropped loop's own buffers would be cached as it dies
    assert _cached_mib() == 0, "the draft loop's graph captures left their warm-ups' temporaries cached"
    del loop


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
# reduced: engine/subset_head.py in the graphs; int8: --quantize int8 (the fused kernels read int8 rows,
# the stepwise loop's eager forwards dequantize); w8a8: int8 activations too (the eager forwards round them)
@pytest.mark.parametrize("draft", ["perturbed", "reduced_head", "int8", "w8a8"])
def test_device_draft_loop_proposes_what_the_stepwise_loop_proposes(model_dirs, captured, sampled, draft, monkeypatch):
    if draft == "w8a8" and captured and sampled:
        # the graphs' int8 sums are exact, the eager forwards add the rounded rows' float products: a value
        # near a rounding boundary rounds to the next int8 step, which moves a top-p set's edge (measured on
        # the H200: the same tokens, another nucleus). Greedy proposals and eager sampling are compared.
        pytest.skip("w8a8 graphs and eager forwards round activations apart; sampled sets may differ")
    quantize = draft if draft in ("int8", "w8a8") else "none"
    monkeypatch.setattr(model_runner, "CUDA_MIN_INT8_OUT_FEATURES", 0)  # the tiny model's products are all narrow
    runner = _runner(model_dirs[draft], captured, quantize)
    assert any(isinstance(m, Int8Linear) for m in runner.model.modules()) == (quantize != "none")
    device_loop = DraftLoop(runner, device_loop=True)
    stepwise = DraftLoop(_runner(model_dirs[draft], False, quantize), device_loop=False)
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    check_device_loop_matches_stepwise(device_loop, stepwise, sampled=sampled)
    assert device_loop.num_graph_replays == (8 if captured else 0)
    if captured:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_graphs


def test_fused_kernels_give_a_token_the_same_logits_in_any_step(model_dirs):
    """--layer-kernels fused, bf16: a token's logits are bit-for-bit the same whether it is decoded,
    verified among 4 others, or verified in a batch of sequences shorter and longer than its own
    (engine/fused_stages.py, and attention's key ranges fixed by position: engine/triton_attention.py).
    Its 150-token context spans two of the 128-key ranges."""
    runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), device="cuda", dtype="bfloat16",
                                       kv_cache_tokens=4096, layer_kernels="fused"))
    prompt, tokens = list(range(3, 153)), [41, 7, 99, 12, 5]

    def open_sequence(ids):
        kv = runner.kv.new_sequence()
        runner.forward([StepInput(kv, ids, 1)])
        return kv

    alone = open_sequence(prompt)
    # .clone(): a replay's logits are a view of the graph's output, which the next replay overwrites
    decoded = torch.cat([runner.forward([StepInput(alone, [t], 1)])[0].clone() for t in tokens])
    verified_kv = open_sequence(prompt)
    [verified] = runner.forward([StepInput(verified_kv, tokens, len(tokens))])
    crowded_kv, short, long = open_sequence(prompt), open_sequence(prompt[:30]), open_sequence(prompt[:90] * 2)
    crowded = runner.forward([StepInput(short, [1, 2], 2), StepInput(crowded_kv, tokens, len(tokens)),
                              StepInput(long, [9], 1)])[1]
    assert runner.num_eager_steps == 0  # every step above replayed a graph, the prefills too
    assert runner.graphs.num_prefill_replays == 5
    for other in (verified, crowded):
        assert torch.equal(decoded, other), f"max |difference| {(decoded.float() - other.float()).abs().max()}"


@pytest.mark.parametrize("quantize", ["none", "w8a8"])
def test_programmatic_dependent_launch_gives_the_same_logits_as_plain_launches(model_dirs, monkeypatch, quantize):
    """engine/pdl.py: with PDL each fused kernel starts while the previous one runs and waits for it
    at its first line; a missing wait would read a stale activation or KV entry and change bits. With
    the products' weights prefetched before that wait (engine/triton_prefetch.py) too."""
    from engine import pdl, triton_prefetch

    def steps_with(enabled: bool, prefetch_kb: int = 0) -> list[torch.Tensor]:
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        monkeypatch.setattr(triton_prefetch, "PREFETCH_KB", prefetch_kb)
        assert pdl.launch_options(torch.device("cuda"))["USE_PDL"] == enabled  # Hopper: PDL is really on
        runner = ModelRunner(RuntimeConfig(model=str(model_dirs["target"]), device="cuda", dtype="bfloat16",
                                           kv_cache_tokens=4096, layer_kernels="fused", quantize=quantize))
        kvs = [runner.kv.new_sequence() for _ in range(3)]
        runner.forward([StepInput(kv, list(range(3, 3 + n)), 1) for kv, n in zip(kvs, (150, 20, 70))])
        out = []
        for step in range(6):  # decodes and verifies of three sequences, every one a graph replay
            sizes = [1 + (step + i) % 5 for i in range(3)]
            logits = runner.forward([StepInput(kv, [5 + step + j for j in range(n)], n) for kv, n in zip(kvs, sizes)])
            out += [x.clone() for x in logits]
        assert runner.num_eager_steps == 0 and runner.graphs.num_prefill_replays == 3
        return out

    plain, dependent, prefetching = steps_with(False), steps_with(True), steps_with(True, prefetch_kb=64)
    for name, other in (("PDL", dependent), ("PDL with prefetch", prefetching)):
        differ = [(i, (a.float() - b.float()).abs().max().item()) for i, (a, b) in enumerate(zip(plain, other))
                  if not torch.equal(a, b)]
        assert not differ, f"{name}: logits (index, max |difference|) not the plain launches' bits: {differ}"


def test_prefill_chunks_replay_their_buckets_graph_and_longer_ones_run_eagerly(model_dirs, monkeypatch):
    """A prefill chunk pads to its bucket (its logits: its last token's); one past the largest bucket,
    or a forward of more chunks than the replays allow, runs eagerly; both continue alike after."""
    monkeypatch.setattr(model_runner, "GraphConfig", lambda: GraphConfig(prefill_buckets=(16, 32)))
    graphed, eager = _runner(model_dirs["target"], True), _runner(model_dirs["target"], False)
    lengths = (10, 16, 17, 32, 33)  # into 16, 16, 32, 32, and past 32 (eager)
    seqs = {r: [r.kv.new_sequence() for _ in lengths] for r in (graphed, eager)}
    for i, n in enumerate(lengths):
        prompt = [3 + (7 * j + i) % 250 for j in range(n)]
        out = {r: r.forward([StepInput(seqs[r][i], prompt, 1)])[0] for r in (graphed, eager)}
        assert out[graphed].shape == (1, graphed.description.vocab_size)
        torch.testing.assert_close(out[graphed], out[eager], atol=1e-4, rtol=1e-4)
    assert (graphed.graphs.num_prefill_replays, graphed.num_eager_steps) == (4, 1)
    no_logits = graphed.forward([StepInput(graphed.kv.new_sequence(), list(range(3, 23)), 0)])
    assert no_logits[0].shape == (0, graphed.description.vocab_size)
    many = [graphed.kv.new_sequence() for _ in range(9)]  # past MAX_PREFILL_REPLAYS: one eager forward
    graphed.forward([StepInput(kv, list(range(3, 15)), 1) for kv in many])
    assert (graphed.graphs.num_prefill_replays, graphed.num_eager_steps) == (5, 2)
    decoded = {r: r.forward([StepInput(kv, [5], 1) for kv in seqs[r]]) for r in (graphed, eager)}
    for a, b in zip(decoded[graphed], decoded[eager]):  # the K/V the graphs wrote is the eager forward's
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
