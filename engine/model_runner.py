"""Owns a model and its KV pool; runs one batched forward over several sequences."""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import paged_attention_reference
from engine.batch import StepInput, build_forward_batch
from engine.cuda_graphs import CudaGraphRunner, GraphConfig, GreedyIds
from engine.kv_cache import KVCacheConfig, KVPool
from engine.linear import CUDA_MIN_INT8_OUT_FEATURES, quantize_int8, use_cpu_linear
from engine.llama import AttentionFn, CausalLM
from engine.model_source import LoadedModel, default_cache_dir, load_pretrained
from engine.tokenizer_info import eos_token_ids, tokenizer_fingerprint
from specdec.errors import InvalidRequestError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZE_MODES = ("none", "int8", "w8a8")


@dataclass(frozen=True)
class RuntimeConfig:
    """What a model service needs to run a model; validated once at start."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own limit
    kv_cache_tokens: int = 65536
    kv_cache_memory_fraction: float | None = None  # CUDA: size the pool from free memory instead
    kv_block_size: int = 16
    attention_backend: str = "auto"  # "triton" | "reference"; auto: triton on CUDA, reference on CPU
    # "fused": every decode/verify step (CUDA graphs; on CPU, steps of up to 16 rows) runs
    # engine/fused_stages.py's Triton kernels, batch-invariant (forward_groups); "auto": CUDA graph steps of
    # up to fused_stages.AUTO_MAX_ROWS rows take them (latency-bound), larger ones and CPU take
    # "reference": PyTorch ops (torch.compile'd on CUDA; cuBLAS); "layer": as auto (on CPU: as fused), with
    # a decoder layer one persistent kernel in those steps (engine/triton_layer.py; not batch-invariant: drafts)
    layer_kernels: str = "auto"
    use_cuda_graphs: bool = True  # decode/verify steps replay captured graphs (CUDA only)
    # CUDA: the stages around cuBLAS in forwards the fused kernels do not take (prefill chunks, large graph
    # steps): "kernels": Triton norms and rotary of fixed launch (engine/kernel_stages.py: the same bits in
    # every process; the target service's default); "compiled": torch.compile'd PyTorch (processes compiling
    # apart can compute other bits: bench/results/gpu_replicas_kernels.json); "eager": plain PyTorch.
    # CPU: always plain PyTorch
    stages: str = "compiled"
    # drafts: "int8": weight-only int8 linears (engine/linear.Int8Linear); "w8a8": every linear int8, and on
    # CUDA their inputs too in graph steps (int8 tensor cores: engine/triton_quant.py)
    quantize: str = "none"
    max_batch_size: int = 64  # sequences a forward steps at most: CUDA graphs are captured up to its bucket
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_tokens < self.kv_block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}")
        if self.layer_kernels not in ("auto", "fused", "reference", "layer"):
            raise ValueError(f"layer_kernels must be auto, fused, layer or reference, got {self.layer_kernels!r}")
        if self.stages not in ("kernels", "compiled", "eager"):
            raise ValueError(f"stages must be kernels, compiled or eager, got {self.stages!r}")
        if self.attention_backend not in ("auto", "triton", "reference"):
            raise ValueError(f"attention_backend must be auto, triton or reference, got {self.attention_backend!r}")


@dataclass(frozen=True)
class ModelDescription:
    model_id: str
    architecture: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_model_len: int
    eos_token_ids: list[int]
    device: str = "cpu"  # torch device type the model runs on


# Positions past max_model_len a forward may hold: a batched draft loop feeds every row up to the
# batch's longest proposal, so a sequence at the end of its context runs a few steps beyond it
# (their K/V is reserved and rolled back; their tokens are never returned).
POSITION_HEADROOM = 16


class ModelRunner:
    """A loaded model plus its paged KV pool. Not thread-safe: one caller (the batching loop)."""

    def __init__(self, config: RuntimeConfig, loaded: LoadedModel | None = None) -> None:
        device, dtype = torch.device(config.device), DTYPES[config.dtype]
        if device.type == "cuda":
            # this thread's own stream, never the legacy default stream (which syncs with every other):
            # a draft loading and capturing graphs beside one serving on another thread leaves its capture intact
            self.stream = torch.cuda.Stream(device)
            torch.cuda.set_stream(self.stream)
        loaded = loaded or load_pretrained(config.model, dtype, device, config.cache_dir)
        hf_config = loaded.hf_model.config
        self.max_model_len = _max_model_len(hf_config, config.max_model_len)
        self.model = CausalLM(loaded.hf_model, self.max_model_len + POSITION_HEADROOM)
        if config.quantize == "int8":  # engine/linear.Int8Linear: on CUDA the wide products only
            quantize_int8(self.model, CUDA_MIN_INT8_OUT_FEATURES if device.type == "cuda" else 0)
        elif config.quantize == "w8a8":
            quantize_int8(self.model, int8_activations=True)
        elif device.type == "cpu":
            use_cpu_linear(self.model)  # few-row forwards (verify, catch-up) in MKL's fast form: engine/linear.py
        self.tokenizer = loaded.tokenizer
        shape = self.model.shape
        num_tokens = config.kv_cache_tokens
        if config.kv_cache_memory_fraction is not None and device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype.itemsize
            num_tokens = kv_tokens_for_memory(free_bytes, config.kv_cache_memory_fraction, bytes_per_token)
        num_blocks = num_tokens // config.kv_block_size
        self.kv = KVPool(
            KVCacheConfig(num_blocks, config.kv_block_size),
            shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, device,
        )
        self.device = device
        self.max_batch_size = config.max_batch_size  # the largest graph bucket; an engine's or drafter's batches too
        # the fused kernels compute a row alike in any step; fixed key ranges make attention do so too
        fixed_ranges_for = self.max_model_len if config.layer_kernels == "fused" else None
        self.attention = _attention_backend(config.attention_backend, device, fixed_ranges_for)
        self.num_eager_steps = 0  # forwards that did not replay a graph (long prefill chunks, CPU)
        self.graphs: CudaGraphRunner | None = None
        # see forward_groups; on CUDA the fused kernels run in graph steps only
        self.batch_invariant = config.layer_kernels == "fused" and (device.type == "cpu" or config.use_cuda_graphs)
        self._graph_config = GraphConfig().for_max_batch(config.max_batch_size)
        if config.stages == "compiled" and device.type == "cuda":
            self.model.compile_stages()
        elif config.stages == "kernels" and device.type == "cuda":
            self.model.use_kernel_stages()
        if config.layer_kernels == "fused" or (config.layer_kernels == "layer" and device.type == "cpu"):
            self.model.use_fused_kernels(max_rows=None, layer_kernel=config.layer_kernels == "layer")
        elif config.layer_kernels in ("auto", "layer") and device.type == "cuda":
            from engine.fused_stages import AUTO_MAX_ROWS  # needs triton, only here

            # int8 weights: every graph step (outside them a product dequantizes its whole weight first)
            self.model.use_fused_kernels(max_rows=None if config.quantize != "none" else AUTO_MAX_ROWS,
                                         layer_kernel=config.layer_kernels == "layer")
        if config.use_cuda_graphs and device.type == "cuda":
            self.graphs = CudaGraphRunner(self.model, self.kv, self.attention, self.max_model_len, self._graph_config,
                                          device)
            self.graphs.capture_all()
        self.description = ModelDescription(
            model_id=loaded.model_id,
            architecture=hf_config.model_type,
            vocab_size=shape.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids(loaded.tokenizer, getattr(loaded.hf_model.generation_config, "eos_token_id", None)),
            device=device.type,
        )
        log.info("model ready: %s (%d layers, max_model_len %d, KV %d blocks x %d tokens, layer kernels %s%s, stages %s)",
                 loaded.model_id, shape.num_layers, self.max_model_len, num_blocks, config.kv_block_size,
                 config.layer_kernels, ", batch-invariant" if self.batch_invariant else "",
                 config.stages if device.type == "cuda" else "eager")

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        vocab = self.description.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab})")

    @property
    def inline(self) -> Callable[[], AbstractContextManager] | None:
        """BatchingLoop's `inline` for this runner: on CUDA on_calling_thread; on CPU None (the work
        stays on the loading thread and its OpenMP pool)."""
        return self.on_calling_thread if self.device.type == "cuda" else None

    @contextmanager
    def on_calling_thread(self) -> Iterator[None]:
        """Lets another thread run this runner's work as the loading thread does: on its device and
        its stream (CUDA; see batching_loop.BatchingLoop's `inline`). The thread keeps them after (as
        the loading thread does): the torch.cuda.device and torch.cuda.stream context managers that
        restored them cost ~85 us a call on the H200 host (bench/results/host_profile.json's profile),
        and the event loop's thread runs no CUDA work but the runners' (each sets its own)."""
        torch.cuda.set_stream(self.stream)  # sets the stream's device too
        yield

    def forward(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """Appends each step's tokens to its sequence's KV; returns [num_logits, vocab] per step."""
        return self._forward(steps, greedy=False)[0]

    def forward_greedy(self, steps: list[StepInput]) -> tuple[list[torch.Tensor], GreedyIds]:
        """`forward`, plus the argmax token of each of a step's logit rows, on their way to the host for all
        the steps at once (in a decode/verify graph computed by the graph itself): `GreedyIds.get()` them,
        after waiting for `GreedyIds.ready` if the caller has other work meanwhile, before the next forward."""
        return self._forward(steps, greedy=True)

    def _forward(self, steps: list[StepInput], greedy: bool) -> tuple[list[torch.Tensor], GreedyIds | None]:
        for step in steps:
            step.kv.reserve(len(step.token_ids))
        ids = None
        if self.graphs is not None and self.graphs.can_run(steps):
            per_step, ids = self.graphs.run_greedy(steps) if greedy else (self.graphs.run(steps), None)
        elif self.graphs is not None and self.graphs.can_prefill(steps):
            per_step = [self.graphs.prefill(step) for step in steps]
        else:
            self.num_eager_steps += 1
            logits = self.model(build_forward_batch(steps, self.device), self.kv, self.attention)
            per_step = list(logits.split([s.num_logits for s in steps]))
        for step in steps:
            step.kv.commit(len(step.token_ids))
        if greedy and ids is None:
            ids = GreedyIds.of(per_step)
        return per_step, ids

    def forward_groups(self, steps: list[StepInput]) -> list[list[int]]:
        """Which of `steps` to run in one forward together, as index lists in order.

        Batch-invariant (fused kernels): short steps (decodes, verifies) share forwards the fused
        kernels take (CUDA graphs; on CPU, forwards of up to CPU_MAX_ROWS rows), where each row is
        computed as if alone; a longer step (a prefill chunk) runs alone, so its rows' products depend
        on that step only. Otherwise all in one forward.
        """
        if not self.batch_invariant:
            return [list(range(len(steps)))]
        from engine.fused_stages import CPU_MAX_ROWS  # needs triton, as the fused kernels do

        max_tokens, max_steps = self._graph_config.query_buckets[-1], self._graph_config.batch_buckets[-1]
        max_rows = CPU_MAX_ROWS if self.device.type == "cpu" else math.inf  # CUDA: the graph buckets bound it
        groups: list[list[int]] = []
        long: list[list[int]] = []
        rows = 0
        for i, step in enumerate(steps):
            n = len(step.token_ids)
            if n > max_tokens:
                long.append([i])
                continue
            if not groups or len(groups[-1]) == max_steps or rows + n > max_rows:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += n
        return groups + long


def kv_tokens_for_memory(free_bytes: int, fraction: float, bytes_per_token: int) -> int:
    """KV tokens that fit in `fraction` of the free device memory (K and V of every layer)."""
    return int(free_bytes * fraction) // bytes_per_token


def _attention_backend(name: str, device: torch.device, fixed_ranges_for: int | None) -> AttentionFn:
    """`fixed_ranges_for`: a max_model_len to fix the Triton kernel's key ranges for (batch-invariant)."""
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return paged_attention_reference
    from engine.triton_attention import paged_attention_triton, split_len_for  # needs triton, only here

    if fixed_ranges_for is None:
        return paged_attention_triton
    return functools.partial(paged_attention_triton, split_len=split_len_for(fixed_ranges_for))


def _max_model_len(hf_config: object, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", 2048)
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # we attend to the full context, exact only within the window
    return min(limit, requested) if requested else limit
