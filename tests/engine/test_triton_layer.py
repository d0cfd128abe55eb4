"""The layer kernel (engine/triton_layer.py) computes what the chain of fused kernels computes: its
output and the K/V it writes. On CPU each stage runs as a launch of its own (the interpreter runs
programs in turn); on the GPU the persistent kernel, its stages between grid barriers, also replayed
in a CUDA graph, its barrier left zeroed for the next launch."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.batch import StepInput, build_forward_batch
from engine.fused_stages import FusedStages
from engine.kv_cache import KVCacheConfig, KVPool
from engine.linear import quantize_int8
from engine.llama import CausalLM, LayerStages, Rotary
from engine.triton_attention import paged_attention_triton
from engine.triton_layer import check_every_sm_is_ours, layer_barrier, layer_forward, layer_supported
from engine.triton_linear import split_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
# a Llama-3.2-1B layer: int8 gate/up (--quantize int8), the down projection split along K
MAX_POSITIONS = 1024  # the rotary tables' rows: past the longest context a test steps at
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)


def _model(shape: dict, dtype: torch.dtype, int8: bool) -> CausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, num_hidden_layers=1, max_position_embeddings=MAX_POSITIONS, **shape)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype).to(DEVICE).eval()
    model = CausalLM(hf, MAX_POSITIONS)
    if int8:
        quantize_int8(model, 8192)
    return model


def _step(model: CausalLM, contexts: list[int], new_tokens: int):
    """A step of `new_tokens` a sequence after `contexts` tokens each (their K/V random), its hidden
    states random; the pool and the batch."""
    shape = model.shape
    kv = KVPool(KVCacheConfig(256, 16), 1, shape.num_kv_heads, shape.head_dim, model.cos.dtype, torch.device(DEVICE))
    torch.manual_seed(1)
    kv.k[0].normal_()
    kv.v[0].normal_()
    steps = []
    for context in contexts:
        seq = kv.new_sequence()
        seq.reserve(context)
        seq.commit(context)
        seq.reserve(new_tokens)
        steps.append(StepInput(seq, [5] * new_tokens, new_tokens))
    batch = build_forward_batch(steps, torch.device(DEVICE))
    hidden = torch.randn(len(contexts) * new_tokens, model.embed_tokens.weight.shape[1], device=DEVICE)
    return kv, batch, hidden.to(model.cos.dtype)


def _chain(model: CausalLM, kv: KVPool, batch, hidden: torch.Tensor, programs: int | None) -> torch.Tensor:
    """The layer through the fused stages' kernels, one after another (engine/fused_stages.py)."""
    stages = FusedStages(LayerStages(), None, torch.device(DEVICE))
    stages._is_fused_step = lambda hidden: True  # outside a graph capture too
    attention = lambda q, k, v, batch, scale: paged_attention_triton(q, k, v, batch, scale, programs_per_tile=programs)  # noqa: E731
    return stages.forward_layer(model.layers[0], hidden, Rotary(model.cos, model.sin, batch.positions), kv.k[0],
                                kv.v[0], batch, attention)


def _layer(model: CausalLM, kv: KVPool, batch, hidden: torch.Tensor, programs: int | None, staged: bool,
           barrier: torch.Tensor) -> torch.Tensor:
    return layer_forward(model.layers[0], hidden, Rotary(model.cos, model.sin, batch.positions), kv.k[0], kv.v[0],
                         batch, split_counters(torch.device(DEVICE)), barrier, staged=staged, attention_programs=programs)


@pytest.mark.parametrize(("contexts", "new_tokens"), [([9], 1), ([5, 17, 30], 1), ([12, 3], 2)])
@pytest.mark.parametrize("programs", [1, 3])  # key ranges a tile: 3 takes the merge stage
def test_the_layer_kernel_computes_the_chain_of_kernels_output(contexts, new_tokens, programs):
    model = _model(TINY, torch.float32, int8=False)
    assert layer_supported(model.layers[0])
    kv, batch, hidden = _step(model, contexts, new_tokens)
    kv_chain = KVPool(KVCacheConfig(256, 16), 1, model.shape.num_kv_heads, model.shape.head_dim, torch.float32,
                      torch.device(DEVICE))
    kv_chain.k[0].copy_(kv.k[0])
    kv_chain.v[0].copy_(kv.v[0])
    expected = _chain(model, kv_chain, batch, hidden, programs)
    got = _layer(model, kv, batch, hidden, programs, staged=True, barrier=layer_barrier(torch.device(DEVICE)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv.k[0], kv_chain.k[0]) and torch.equal(kv.v[0], kv_chain.v[0])


@pytest.mark.gpu
@pytest.mark.parametrize(("contexts", "new_tokens"), [([200], 1), ([200, 37, 900], 1), ([150, 64], 2)])
def test_the_persistent_layer_kernel_gives_its_stages_bits_and_the_chains_values_on_the_gpu(contexts, new_tokens):
    model = _model(LLAMA_1B, torch.bfloat16, int8=True)
    assert layer_supported(model.layers[0])
    kv, batch, hidden = _step(model, contexts, new_tokens)
    k0, v0 = kv.k[0].clone(), kv.v[0].clone()
    barrier = layer_barrier(torch.device(DEVICE))
    staged = _layer(model, kv, batch, hidden, None, staged=True, barrier=barrier)
    k_staged, v_staged = kv.k[0].clone(), kv.v[0].clone()
    kv.k[0].copy_(k0)
    kv.v[0].copy_(v0)
    persistent = _layer(model, kv, batch, hidden, None, staged=False, barrier=barrier)
    torch.cuda.synchronize()
    assert torch.equal(persistent, staged)
    assert torch.equal(kv.k[0], k_staged) and torch.equal(kv.v[0], v_staged)
    assert not barrier.any()  # the last program out zeroed it
    kv.k[0].copy_(k0)
    kv.v[0].copy_(v0)
    chain = _chain(model, kv, batch, hidden, None)
    torch.testing.assert_close(persistent.float(), chain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_the_persistent_layer_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed many times: the same bits each time, the barrier zeroed after each."""
    model = _model(LLAMA_1B, torch.bfloat16, int8=True)
    kv, batch, hidden = _step(model, [300, 20], 1)
    barrier, counters = layer_barrier(torch.device(DEVICE)), split_counters(torch.device(DEVICE))
    rotary = Rotary(model.cos, model.sin, batch.positions)

    def run() -> torch.Tensor:
        return layer_forward(model.layers[0], hidden, rotary, kv.k[0], kv.v[0], batch, counters, barrier)

    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert not barrier.any() and not counters.any()


def test_the_layer_kernel_is_refused_where_mps_gives_the_process_a_share_of_the_sms(monkeypatch):
    """Its grid must be resident all at once: with fewer SMs than the device reports it would never pass
    its first barrier, so the runner refuses it at start, saying why and what to do."""
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    with pytest.raises(ValueError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50.*--layer-kernels auto"):
        check_every_sm_is_ours()
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    check_every_sm_is_ours()
