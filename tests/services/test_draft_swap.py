"""Live draft swap: LoadDraft while serving, drafts chosen per request, refused loads change nothing."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import time
import weakref
from typing import NamedTuple

import grpc
import pytest

from draft_service.registry import DraftRegistry, model_loader
from draft_service.server import start_draft_server
from engine.model_runner import RuntimeConfig
from engine.ngram_drafter import NgramDrafter
from gateway.config import GatewayConfig
from gateway.server import start_gateway_server
from harness import channel, generate
from tiny_models import build_model_dir
from specdec import admin
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc

TOKEN = "swap-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROMPTS = ["The quick brown fox", "Speculative decoding is", "Once upon a time", "1 2 3 4 5 6",
           "Hello, world", "A B C D", "tokens tokens tokens", "the the the"]


class SwapTrio(NamedTuple):
    draft: draft_pb2_grpc.DraftServiceStub
    gateway: gateway_pb2_grpc.GatewayStub
    draft_port: int


@pytest.fixture
def swap_trio(loop, model_dirs, target_server):
    """A draft service (admin token set) starting on the 'unrelated' draft, and a gateway over it."""
    load = model_loader(RuntimeConfig(model="", kv_cache_tokens=8192, device=os.environ.get("SPECDEC_TEST_DEVICE", "cpu")))
    drafts = DraftRegistry(load)
    loop.run(drafts.load("first", str(model_dirs["unrelated"]), make_default=True))
    draft = loop.run(start_draft_server(drafts, admin_token=TOKEN))
    gateway = loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft.port}")))
    with channel(draft.port) as d, channel(gateway.port) as g:
        yield SwapTrio(draft_pb2_grpc.DraftServiceStub(d), gateway_pb2_grpc.GatewayStub(g), draft.port)
    loop.run(gateway.stop())
    loop.run(draft.stop())


def _drafts(draft) -> dict[str, bool]:
    return {e.name: e.is_default for e in draft.ListDrafts(draft_pb2.ListDraftsRequest()).drafts}


def test_swap_in_the_middle_of_concurrent_requests_fails_none_and_stays_lossless(
        swap_trio, gateway_stub, model_dirs, pool):
    draft, gateway, _ = swap_trio
    expected = {p: generate(gateway_stub("none"), prompt=p, max_new_tokens=48)[0] for p in PROMPTS}
    prompts = iter(PROMPTS * 100)
    submitted: dict[concurrent.futures.Future, str] = {}

    def submit() -> None:
        prompt = next(prompts)
        submitted[pool.submit(generate, gateway, prompt=prompt, max_new_tokens=48, num_draft_tokens=4)] = prompt

    for _ in range(6):
        submit()
    while draft.GetEngineStats(common_pb2.EngineStatsRequest()).num_active_sequences < 4:
        time.sleep(0.005)  # wait until requests are in flight on the first draft
    load = pool.submit(draft.LoadDraft, draft_pb2.LoadDraftRequest(name="second", model=str(model_dirs["identical"]),
                                                                   make_default=True), metadata=AUTH)
    while not load.done():  # keep 6 requests in flight until the swap lands (seconds on a GPU: it captures graphs)
        done, _ = concurrent.futures.wait([f for f in submitted if not f.done()] + [load],
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        for _ in done - {load}:
            submit()
    assert not all(f.done() for f in submitted), "the swap should land while requests are in flight"
    loaded = load.result()
    assert loaded.loaded.is_default and loaded.loaded.info.model_id == str(model_dirs["identical"])
    for _ in PROMPTS:
        submit()
    for future, prompt in submitted.items():
        assert future.result(timeout=120)[0] == expected[prompt]  # raises if any request failed
    assert _drafts(draft) == {"first": False, "second": True}
    # requests after the swap ran on the identical draft: every proposal accepted
    _, _, final = generate(gateway, prompt="After the swap", max_new_tokens=16, num_draft_tokens=4)
    assert final.stats.acceptance_rate == 1.0


def test_a_replaced_draft_frees_its_model_at_once_not_at_a_garbage_collection(loop, model_dirs):
    # a draft's weights and KV pool are gigabytes on a GPU: left to the cyclic collector (the drafter and
    # its batching loop held each other), every replaced draft stayed allocated until a full collection
    load = model_loader(RuntimeConfig(model="", kv_cache_tokens=2048, device=os.environ.get("SPECDEC_TEST_DEVICE", "cpu")))

    async def replace_and_watch() -> bool:
        drafts = DraftRegistry(load)
        await drafts.load("first", str(model_dirs["unrelated"]), make_default=True)
        drafts.start()
        old_runner = weakref.ref(drafts.default.runner)
        gc.disable()
        try:
            await drafts.load("first", str(model_dirs["identical"]), make_default=True, replace=True)
            await drafts.retired()  # the old drafter stops in a task of its own
            return old_runner() is None
        finally:
            gc.enable()
            await drafts.stop()

    assert loop.run(replace_and_watch()), "the replaced draft's model is still allocated"


def _swap_memory(loop, model_dirs) -> dict[str, tuple[int, int]]:
    """(allocated, reserved) bytes on the GPU with one draft, with it and its replacement, after the old one stopped."""
    import torch

    async def replace() -> dict[str, tuple[int, int]]:
        drafts = DraftRegistry(model_loader(RuntimeConfig(model="", kv_cache_tokens=65536, device="cuda")))
        await drafts.load("first", str(model_dirs["unrelated"]), make_default=True)
        drafts.start()
        seen = {"one": (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())}
        await drafts.load("first", str(model_dirs["identical"]), make_default=True, replace=True)
        seen["both"] = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        await drafts.retired()
        seen["after"] = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        await drafts.stop()
        return seen

    return loop.run(replace())


@pytest.mark.gpu
def test_a_replaced_draft_gives_its_cached_gpu_memory_back_to_the_device(loop, model_dirs):
    # PyTorch's caching allocator keeps what freed tensors used, for the process: without a release every swap left
    # the service holding both drafts' memory (bench/results/gpu_swap_h100.json, 1B-shape draft: 4,198 MiB before a
    # swap, 7,660 after; 5,544 with it)
    seen = _swap_memory(loop, model_dirs)
    assert seen["both"][1] > seen["one"][1], "the second draft should have taken memory of its own"
    assert seen["after"][1] < seen["both"][1], f"nothing went back to the device: {seen}"


@pytest.mark.gpu
def test_a_replaced_draft_leaves_no_more_than_its_threads_cublas_workspaces_allocated(loop, model_dirs):
    # PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) per (thread handle, stream) until the process ends; when every
    # capture's warm-up took a new stream, a draft's loading thread left 32 of them, 1 GiB, after the draft stopped
    # (docs/benchmarks.md). The few that stay now (its thread's handle on its stream, the warm-up's, the capture's)
    # are reused by the next thread that gets the handle.
    seen = _swap_memory(loop, model_dirs)
    left = (seen["after"][0] - seen["one"][0]) / 2**20
    assert left < 512, f"{left:.0f} MiB more allocated after the swap than with one draft: {seen}"


def test_each_request_picks_its_draft_by_name(swap_trio, model_dirs):
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="exact", model=str(model_dirs["identical"])), metadata=AUTH)
    assert _drafts(draft) == {"first": True, "exact": False}
    by_name = generate(gateway, prompt="Pick a draft", max_new_tokens=16, num_draft_tokens=4, draft_model="exact")
    default = generate(gateway, prompt="Pick a draft", max_new_tokens=16, num_draft_tokens=4)
    assert by_name[0] == default[0]
    assert by_name[2].stats.acceptance_rate == 1.0 > default[2].stats.acceptance_rate


def test_unknown_draft_name_is_not_found_and_frees_everything(swap_trio):
    draft, gateway, _ = swap_trio
    with pytest.raises(grpc.RpcError) as info:
        generate(gateway, prompt="hi", max_new_tokens=4, draft_model="missing")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no draft model named 'missing'" in info.value.details() and "loaded: first" in info.value.details()
    assert draft.GetEngineStats(common_pb2.EngineStatsRequest()).num_active_sequences == 0


@pytest.mark.parametrize("metadata, detail", [
    ((), "missing or wrong admin token"),
    ((("authorization", "Bearer wrong"),), "missing or wrong admin token"),
    ((("authorization", "Bearer wrong"), *AUTH), "missing or wrong admin token"),  # one token, not a guess list
])
def test_load_without_the_admin_token_is_permission_denied(swap_trio, model_dirs, metadata, detail):
    draft, _, _ = swap_trio
    with pytest.raises(grpc.RpcError) as info:
        draft.LoadDraft(draft_pb2.LoadDraftRequest(name="x", model=str(model_dirs["identical"])), metadata=metadata)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and detail in info.value.details()
    assert _drafts(draft) == {"first": True}


def test_admin_rpcs_are_disabled_without_a_configured_token(draft_stub, model_dirs):
    with pytest.raises(grpc.RpcError) as info:
        draft_stub("perturbed").LoadDraft(draft_pb2.LoadDraftRequest(name="x", model=str(model_dirs["identical"])),
                                          metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-token" in info.value.details()


@pytest.mark.parametrize("request_fields, code, detail", [
    (dict(name="bad", model="/no/such/model/dir"), grpc.StatusCode.FAILED_PRECONDITION, "no such file or directory"),
    (dict(name="other", model="other_tokenizer"), grpc.StatusCode.FAILED_PRECONDITION,
     "(vocab 330, tokenizer"),
    (dict(name="first", model="identical"), grpc.StatusCode.INVALID_ARGUMENT, "set replace to swap it"),
    (dict(name="no spaces", model="identical"), grpc.StatusCode.INVALID_ARGUMENT, "must be 1-64 letters"),
    (dict(name="x", model="identical", expected_tokenizer_fingerprint="0" * 64),
     grpc.StatusCode.FAILED_PRECONDITION, "different tokenizer than the expected tokenizer"),
])
def test_refused_loads_leave_the_old_draft_serving(swap_trio, model_dirs, gateway_stub, request_fields, code, detail):
    draft, gateway, _ = swap_trio
    if request_fields["model"] in model_dirs:
        request_fields = {**request_fields, "model": str(model_dirs[request_fields["model"]])}
    with pytest.raises(grpc.RpcError) as info:
        draft.LoadDraft(draft_pb2.LoadDraftRequest(make_default=True, **request_fields), metadata=AUTH)
    assert info.value.code() == code and detail in info.value.details(), info.value.details()
    assert _drafts(draft) == {"first": True}
    tokens, _, final = generate(gateway, prompt="Still serving", max_new_tokens=12, num_draft_tokens=4)
    assert tokens == generate(gateway_stub("none"), prompt="Still serving", max_new_tokens=12)[0]
    assert final.stats.num_draft_tokens > 0


def test_replace_and_unload(swap_trio, model_dirs):
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="lookup", model="ngram"), metadata=AUTH)
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="first", model=str(model_dirs["identical"]), replace=True),
                    metadata=AUTH)
    _, _, final = generate(gateway, prompt="Replaced", max_new_tokens=12, num_draft_tokens=4)
    assert final.stats.acceptance_rate == 1.0  # "first" is now the identical draft
    with pytest.raises(grpc.RpcError) as info:
        draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name="first"), metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is the default draft" in info.value.details()
    remaining = draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name="lookup"), metadata=AUTH)
    assert [e.name for e in remaining.drafts] == ["first"]
    with pytest.raises(grpc.RpcError) as info:
        generate(gateway, prompt="hi", max_new_tokens=4, draft_model="lookup")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_set_default_switches_new_requests_without_a_load_and_frees_the_old_default_for_unloading(
        swap_trio, model_dirs, gateway_stub):
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="exact", model=str(model_dirs["identical"])), metadata=AUTH)
    before = generate(gateway, prompt="Set the default", max_new_tokens=16, num_draft_tokens=4)
    assert before[2].stats.acceptance_rate < 1.0  # the unrelated "first"
    listed = draft.SetDefaultDraft(draft_pb2.SetDefaultDraftRequest(name="exact"), metadata=AUTH)
    assert {e.name: e.is_default for e in listed.drafts} == {"first": False, "exact": True}
    after = generate(gateway, prompt="Set the default", max_new_tokens=16, num_draft_tokens=4)
    assert after[0] == before[0] == generate(gateway_stub("none"), prompt="Set the default", max_new_tokens=16)[0]
    assert after[2].stats.acceptance_rate == 1.0  # the identical draft, with no load in between
    draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name="first"), metadata=AUTH)  # no longer the default
    assert _drafts(draft) == {"exact": True}


@pytest.mark.parametrize("name, metadata, code, detail", [
    ("missing", AUTH, grpc.StatusCode.NOT_FOUND, "no draft model named 'missing' is loaded; loaded: first"),
    ("", AUTH, grpc.StatusCode.INVALID_ARGUMENT, "name is empty; give a loaded draft's: first"),
    ("first", (), grpc.StatusCode.PERMISSION_DENIED, "missing or wrong admin token"),
])
def test_refused_set_default_leaves_the_default_as_it_was(swap_trio, name, metadata, code, detail):
    draft, _, _ = swap_trio
    with pytest.raises(grpc.RpcError) as info:
        draft.SetDefaultDraft(draft_pb2.SetDefaultDraftRequest(name=name), metadata=metadata)
    assert info.value.code() == code and detail in info.value.details(), info.value.details()
    assert _drafts(draft) == {"first": True}


def test_a_draft_unloaded_after_requests_opened_it_is_not_found_before_the_first_token_again(swap_trio, model_dirs):
    """A name requests have opened opens after the first token; once unloaded, the first request naming it finds
    out mid-stream, and every later one before any token (its name is unknown to the gateway again)."""
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="gone", model=str(model_dirs["identical"])), metadata=AUTH)
    generate(gateway, prompt="Open it", max_new_tokens=8, num_draft_tokens=2, draft_model="gone")
    draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name="gone"), metadata=AUTH)

    def tokens_before_the_error() -> int:
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for response in gateway.Generate(gateway_pb2.GenerateRequest(
                    prompt="Then gone", max_new_tokens=8, num_draft_tokens=2, draft_model="gone"), timeout=60):
                received += len(response.token_ids)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'gone'" in info.value.details()
        return received

    assert tokens_before_the_error() > 0
    assert tokens_before_the_error() == tokens_before_the_error() == 0
    assert draft.GetEngineStats(common_pb2.EngineStatsRequest()).num_active_sequences == 0


def test_unloading_a_draft_with_requests_in_flight_lets_them_finish(swap_trio, model_dirs, gateway_stub, pool):
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="busy", model=str(model_dirs["perturbed"])), metadata=AUTH)
    futures = [pool.submit(generate, gateway, prompt=p, max_new_tokens=24, draft_model="busy") for p in PROMPTS]
    time.sleep(0.2)
    draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name="busy"), metadata=AUTH)
    done, _ = concurrent.futures.wait(futures, timeout=120)
    started_after = [f for f in done if f.exception() is not None]
    # requests that had started finish; any that had not yet started get NOT_FOUND, nothing else
    assert all(f.exception().code() == grpc.StatusCode.NOT_FOUND for f in started_after)
    for future, prompt in zip(futures, PROMPTS):
        if future.exception() is None:
            assert future.result()[0] == generate(gateway_stub("none"), prompt=prompt, max_new_tokens=24)[0]


def test_admin_cli_swaps_the_default_checked_against_the_target(swap_trio, target_server, model_dirs, capsys):
    draft, gateway, _ = swap_trio
    port = swap_trio.draft_port
    common = ["--draft", f"127.0.0.1:{port}", "--token", TOKEN]
    assert admin.main([*common, "load-draft", "other", str(model_dirs["other_tokenizer"]),
                       "--target", f"127.0.0.1:{target_server.port}"]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    assert admin.main([*common, "load-draft", "exact", str(model_dirs["identical"]), "--default",
                       "--target", f"127.0.0.1:{target_server.port}"]) == 0
    assert '"isDefault": true' in capsys.readouterr().out
    assert _drafts(draft) == {"first": False, "exact": True}
    assert admin.main([*common, "set-default", "first"]) == 0
    assert _drafts(draft) == {"first": True, "exact": False}
    assert admin.main([*common, "set-default", "missing"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert admin.main([*common, "unload-draft", "exact"]) == 0
    assert admin.main(["--draft", f"127.0.0.1:{port}", "list-drafts"]) == 0
    assert '"name": "first"' in capsys.readouterr().out and _drafts(draft) == {"first": True}


@pytest.fixture
def ngram_trio(loop, target_server):
    """A draft service serving only the n-gram drafter (the service default: no tokenizer to compare a load
    with), admin token set, and a gateway over it."""
    load = model_loader(RuntimeConfig(model="", kv_cache_tokens=8192, device=os.environ.get("SPECDEC_TEST_DEVICE", "cpu")))
    draft = loop.run(start_draft_server(DraftRegistry.of(NgramDrafter(), name="lookup", load=load), admin_token=TOKEN))
    gateway = loop.run(start_gateway_server(GatewayConfig(f"127.0.0.1:{target_server.port}", f"127.0.0.1:{draft.port}")))
    with channel(draft.port) as d, channel(gateway.port) as g:
        yield SwapTrio(draft_pb2_grpc.DraftServiceStub(d), gateway_pb2_grpc.GatewayStub(g), draft.port)
    loop.run(gateway.stop())
    loop.run(draft.stop())


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory, tokenizer) -> str:
    """A draft of the target's tokenizer whose context (64) is a quarter of the target's."""
    return str(build_model_dir(tmp_path_factory.mktemp("short") / "draft", tokenizer, seed=5,
                               max_position_embeddings=SHORT_CONTEXT))


SHORT_CONTEXT = 64


def test_a_draft_the_requests_do_not_fit_leaves_them_target_only_and_exact(ngram_trio, model_dirs, short_draft,
                                                                          gateway_stub):
    """A draft that cannot take a request the target accepted (another vocabulary, loaded where nothing could
    be compared with it; a shorter context) is dropped from that request, which goes on target-only."""
    draft, gateway, _ = ngram_trio
    for name, model, max_new in (("other", str(model_dirs["other_tokenizer"]), 16),
                                 ("short", short_draft, SHORT_CONTEXT + 16)):
        draft.LoadDraft(draft_pb2.LoadDraftRequest(name=name, model=model), metadata=AUTH)
        tokens, _, final = generate(gateway, prompt="The quick brown fox", max_new_tokens=max_new,
                                    num_draft_tokens=3, draft_model=name, ignore_eos=True)
        assert tokens == generate(gateway_stub("none"), prompt="The quick brown fox", max_new_tokens=max_new,
                                  ignore_eos=True)[0], name
        if name == "short":  # refused at its start ("other" drafts until a token it lacks comes by)
            assert final.stats.num_draft_tokens == 0
        if name == "other":  # the next load would be compared with it
            draft.UnloadDraft(draft_pb2.UnloadDraftRequest(name=name), metadata=AUTH)
    _, _, final = generate(gateway, prompt="The quick brown fox", max_new_tokens=16, num_draft_tokens=3,
                           draft_model="short")
    assert final.stats.num_draft_tokens > 0  # a request within its context speculates


def test_engine_stats_count_every_loaded_draft_not_just_the_default(swap_trio, model_dirs):
    draft, gateway, _ = swap_trio
    draft.LoadDraft(draft_pb2.LoadDraftRequest(name="second", model=str(model_dirs["perturbed"])), metadata=AUTH)
    before = draft.GetEngineStats(common_pb2.EngineStatsRequest())
    generate(gateway, prompt="Counted", max_new_tokens=8, num_draft_tokens=3, draft_model="second")
    after = draft.GetEngineStats(common_pb2.EngineStatsRequest())
    assert after.num_sequences_started == before.num_sequences_started + 1  # on "second", not the default



class _StoppedNgram(NgramDrafter):
    def __init__(self) -> None:
        super().__init__()
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True
        await super().stop()


def test_a_load_its_caller_gave_up_on_holds_the_next_until_built_and_switches_nothing(loop):
    """A LoadDraft whose client's deadline passes is cancelled, but its build runs on its thread regardless: the
    next load waits for it (one model built at a time), and what it made is stopped, the drafts as they were."""
    builds: list[tuple[float, float]] = []  # each build's start and end, on its thread
    made: list[_StoppedNgram] = []

    def build() -> _StoppedNgram:
        started = time.monotonic()
        time.sleep(0.3)  # a model's load: nothing cancels it
        builds.append((started, time.monotonic()))
        made.append(_StoppedNgram())
        return made[-1]

    async def load(model: str) -> _StoppedNgram:
        return await asyncio.wrap_future(concurrent.futures.ThreadPoolExecutor(1).submit(build))

    async def scenario() -> tuple[list[str], list[bool]]:
        registry = DraftRegistry(load)
        await registry.load("first", "x")
        abandoned = asyncio.ensure_future(registry.load("late", "y"))
        await asyncio.sleep(0.05)
        abandoned.cancel()  # what the server does to the handler at the client's deadline
        await registry.load("next", "z")
        await asyncio.sleep(0.1)  # the abandoned draft's stop runs in the background
        names, stopped = [info.name for info in registry.list()], [d.stopped for d in made]
        await registry.stop()
        return names, stopped

    names, stopped = loop.run(scenario())
    assert names == ["first", "next"]
    assert builds[1][1] <= builds[2][0]  # the next build started after the abandoned one had ended
    assert stopped == [False, True, False]  # the abandoned load's draft stopped, the served ones not
