"""A/B of variants of the whole trio on one GPU, measured in turn in one process.

The trio's figures move by several per cent from one machine start to the next (docs/benchmarks.md:
target-only 164.8-172.9 tok/s in four runs of one code; HF static 114-137), which is as much as most
single changes gain, and runs in sequence within one call drift too. So this starts every variant's
trio side by side (target, plain gateway, oracle draft and gateway each: bench/gpu_e2e.py's shapes and
synthetic acceptance) and measures them in turn, round after round, each round in another order (the
variants rotated, each first in as many rounds): target-only, then speculation at alpha 0.8, k 4, at
batch 1 (`--batch N`: N concurrent streams, the services' graphs and batches up to N; their start-up then
captures graphs for every batch bucket up to N: at 8, two variants were still starting after 250 s on the
H200, so give such a call 8 minutes or more). `--variant SPEC` (two or more; the first is the baseline), SPEC = LABEL[:ITEM,ITEM,...], an item
  * `NAME=VALUE`: a variable for its four services (e.g. SPECDEC_PDL=1, SPECDEC_KEEP_WARM=1);
  * `--FLAG=VALUE`: an argument for its target and draft services, after the common ones (e.g.
    --max-batch-size=8: graphs and batching for up to 8 streams, where the common one is --batch's);
  * `mps`: its services share one GPU context through a CUDA MPS daemon of this run's own
    (bench/mps.py); the other variants' are kept off MPS;
  * `uds`: its gateways reach its target and draft over Unix sockets (--unix-socket), not TCP;
  * `streams=N`: before the rounds, its trio serves N concurrent streams once, target-only then
    speculative (in gpu_e2e.py the target serves 8 target-only streams before the batch-1 speculative
    figures): whether having served several streams leaves a service slower for a lone stream after;
  * `tree=DIR`: its services run from another checkout, so a code change is measured against its
    parent: `git worktree add .ab/base COMMIT && rm -rf .ab/base/drafts` (.ab/ is git-ignored; on the
    device machine name it in the run's `carry`, where its 43 MB of shipped draft weights would not fit).
While one variant runs, the others' services wait idle (no stream open: no busy polling).
Metrics per variant label (medians over the rounds): `LABEL_target_only_tok_s`,
`LABEL_spec_tok_s_alpha0.8_k4`, `LABEL_draft_propose_ms_k4`, `LABEL_target_verify_ms_k4`,
`LABEL_rpc_overhead_fraction`, `LABEL_spec_step_ms`, the times to first token `LABEL_spec_ttft_ms` and
`LABEL_target_only_ttft_ms`, the target's prefill forward in a speculative request `LABEL_spec_target_prefill_ms`;
`LABEL_over_BASE_*` each one's ratio to the baseline's; every round's
figures in the details. Each variant's speculative output is checked equal to its own reference, and
each target-only output against the baseline's (`LABEL_target_only_differs_from_base`: 0 for changes
that keep the bits: two target processes of one flag set agree on the GPU with the target's default `--stages
kernels`, not with `compiled`, bench/gpu_replicas.py). The report is written again after every round all variants completed, so a run
stopped by its timeout keeps the rounds done. `--tiny` runs it with tiny models on the CPU (checks the script; no meaningful numbers).
Usage: python bench/gpu_ab.py --variant base --variant warm:SPECDEC_KEEP_WARM=1 [--variant mps:mps ...]
                              [--tiny] [--rounds 4] [--batch N] [--draft-quantize none|int8|w8a8] [--draft-head-rows N]
                              [--pin-services] [--max-new-tokens N] [--num-prompts N] [--out PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import specdec  # noqa: E402,F401 - before grpc: it picks gRPC's poller (specdec/__init__.py)
import grpc  # noqa: E402

import mps  # noqa: E402
from gpu_e2e import bench_models, run_config, write_continuations  # noqa: E402
from report import save_report  # noqa: E402

from specdec.cpu_affinity import cpus_from_the_last  # noqa: E402
from specdec.launch import Trio, interrupt_on_sigterm  # noqa: E402
from specdec.v1 import gateway_pb2_grpc  # noqa: E402

FIGURES = {  # metric name: (configuration, run_config's key)
    "target_only_tok_s": ("target_only", "tok_s"),
    "spec_tok_s_alpha0.8_k4": ("spec", "tok_s"),
    "draft_propose_ms_k4": ("spec", "draft_ms_per_step"),
    "target_verify_ms_k4": ("spec", "target_ms_per_step"),
    "rpc_overhead_fraction": ("spec", "rpc_overhead_fraction"),
    "spec_step_ms": ("spec", "step_ms"),
    "spec_ttft_ms": ("spec", "ttft_ms"),
    "spec_target_prefill_ms": ("spec", "target_prefill_ms"),
    "target_only_ttft_ms": ("target_only", "ttft_ms"),
}


@dataclass
class Variant:
    label: str
    env: dict[str, str]
    mps: bool
    tree: Path | None
    args: list[str] = field(default_factory=list)  # the model services' extra arguments
    streams: int = 0  # concurrent streams served once before the rounds (0: none)
    uds: bool = False  # its gateways reach its model services over Unix sockets
    target: str = ""  # addresses once started
    plain: str = ""
    gateway: str = ""
    reference: list[list[int]] = field(default_factory=list)  # target-only greedy output
    rounds: list[dict[str, dict]] = field(default_factory=list)  # per round: configuration -> run_config's result


def parse_variant(spec: str) -> Variant:
    """LABEL[:ITEM,...] (module doc); raises ValueError saying what is wrong."""
    label, _, items = spec.partition(":")
    if not label.isidentifier():
        raise ValueError(f"variant {spec!r}: its label must be a name (letters, digits, _), got {label!r}")
    env, mps_on, tree, args, streams, uds = {}, False, None, [], 0, False
    for item in filter(None, items.split(",")):
        name, sep, value = item.partition("=")
        if item.startswith("--") and sep and len(name) > 2:
            args += [name, value]
        elif item == "mps":
            mps_on = True
        elif item == "uds":
            uds = True
        elif name == "tree" and sep:
            tree = Path(value)
        elif name == "streams" and sep:
            if not (value.isdigit() and int(value) > 0):
                raise ValueError(f"variant {spec!r}: streams=N needs a whole number of streams, got {value!r}")
            streams = int(value)
        elif sep and name.isidentifier():
            env[name] = value
        else:
            raise ValueError(f"variant {spec!r}: {item!r} is not NAME=VALUE, --FLAG=VALUE, mps, uds, streams=N or tree=DIR")
    return Variant(label, env, mps_on, tree, args, streams, uds)


def rotations(variants: list[Variant], rounds: int) -> Iterator[Variant]:
    """Round r runs the variants rotated by r: each first in as many rounds (with `rounds` a multiple)."""
    for r in range(rounds):
        shift = r % len(variants)
        yield from variants[shift:] + variants[:shift]


def main() -> None:
    interrupt_on_sigterm()  # a timeout's SIGTERM still stops the services
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the script only")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL[:ITEM,...]",
                        help="a variant (two or more, the first the baseline); items NAME=VALUE, --FLAG=VALUE, mps, uds, streams=N, "
                             "tree=DIR")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="concurrent streams a round serves")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--draft-quantize", choices=["none", "int8", "w8a8"], default="none")
    parser.add_argument("--draft-head-rows", type=int, default=None)
    parser.add_argument("--pin-services", action="store_true",
                        help="each service on a CPU of its own (--cpus; shared round robin beyond the CPUs)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_ab.json")
    args = parser.parse_args()
    try:
        variants = [parse_variant(spec) for spec in args.variant]
    except ValueError as e:
        parser.error(str(e))
    if len(variants) < 2:
        parser.error("give two variants or more (--variant LABEL[:ITEM,...]); the first is the baseline")
    if len({v.label for v in variants}) < len(variants):
        parser.error("each variant needs a label of its own")
    for v in variants:
        if v.tree is not None and not (v.tree / "target_service").is_dir():
            parser.error(f"variant {v.label}: tree {v.tree} is not a checkout of this project (no target_service/)")
    if any(v.mps for v in variants) and (why := mps.check_available()):
        parser.error(f"variant with mps: {why}")
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1")
    with tempfile.TemporaryDirectory(prefix="specdec-ab-") as tmp:
        work = Path(tmp)
        models = bench_models(work, args.tiny, args.draft_head_rows, args.num_prompts, args.prompt_tokens,
                              args.max_new_tokens)
        prompts, prompt_ids = models.prompts, models.prompt_ids
        target_model, draft_model = models.target, models.draft
        common = [*models.service_flags, "--max-batch-size", str(args.batch)]
        cpus = cpus_from_the_last()
        trio = Trio(work)
        with ExitStack() as stack:
            mps_env = (stack.enter_context(mps.mps_daemon(work, set_environ=False))  # left last: after the services
                       if any(v.mps for v in variants) else {})
            stack.callback(trio.stop)
            envs = {v.label: {**v.env, **(mps_env if v.mps else mps.no_mps_env(work))} for v in variants}

            def spawn(v: Variant, name: str, module: str, service_args: list[str], model: bool = False):
                """`model`: a model service (one the variant's gateways may reach over a Unix socket)."""
                pin = ["--cpus", str(next(cpus))] if args.pin_services else []
                return trio.spawn(f"{v.label}-{name}", module, [*service_args, *pin], env=envs[v.label], cwd=v.tree,
                                  unix_socket=model and v.uds)

            targets = {v.label: spawn(v, "target", "target_service", ["--model", target_model, *common, *v.args], True)
                       for v in variants}
            for v in variants:  # started side by side: the slow part (graph capture) overlaps
                v.target = trio.wait_ready(targets[v.label], 900)
                v.plain = trio.wait_ready(spawn(v, "gateway-plain", "gateway", ["--target", v.target, "--draft", "none",
                                                                                 "--log-level", "WARNING"]), 60)
            drafts = {}
            for v in variants:
                with grpc.insecure_channel(v.plain) as channel:
                    v.reference = run_config(gateway_pb2_grpc.GatewayStub(channel), prompts, args.batch,
                                             args.max_new_tokens, 0)["token_ids"]
                continuations = work / f"{v.label}-continuations.json"
                write_continuations(continuations, prompt_ids, v.reference)
                drafts[v.label] = spawn(v, "draft", "bench.oracle_draft", [
                    "--model", draft_model, "--continuations", str(continuations), "--alphas", "0.8",
                    "--quantize", args.draft_quantize, *common, *v.args], True)
            for v in variants:
                draft = trio.wait_ready(drafts[v.label], 900)
                v.gateway = trio.wait_ready(spawn(v, "gateway", "gateway", ["--target", v.target, "--draft", draft,
                                                                            "--log-level", "WARNING"]), 60)
                if v.streams:  # served once, not measured (module doc)
                    with grpc.insecure_channel(v.plain) as plain, grpc.insecure_channel(v.gateway) as gateway:
                        run_config(gateway_pb2_grpc.GatewayStub(plain), prompts, v.streams, args.max_new_tokens, 0)
                        run_config(gateway_pb2_grpc.GatewayStub(gateway), prompts, v.streams, args.max_new_tokens, 4,
                                   "oracle-0.8")
            for v in rotations(variants, args.rounds):
                with grpc.insecure_channel(v.plain) as plain, grpc.insecure_channel(v.gateway) as gateway:
                    target_only = run_config(gateway_pb2_grpc.GatewayStub(plain), prompts, args.batch,
                                             args.max_new_tokens, 0)
                    spec = run_config(gateway_pb2_grpc.GatewayStub(gateway), prompts, args.batch, args.max_new_tokens, 4,
                                      "oracle-0.8")
                v.rounds.append({"target_only": target_only, "spec": spec})
                if len({len(u.rounds) for u in variants}) == 1:  # a round complete: a timeout keeps it
                    save(variants, args.batch, args.out)


def save(variants: list[Variant], batch: int, out: Path) -> None:
    """The report of the rounds every variant has completed so far."""
    save_report("gpu_ab", {**ab_metrics(variants), "batch": batch}, out,
                variants={v.label: {"env": v.env, "args": v.args, "mps": v.mps, "uds": v.uds, "streams": v.streams,
                                    "tree": str(v.tree) if v.tree else None} for v in variants},
                details={v.label: [{config: {k: x for k, x in result.items() if k != "token_ids"}
                                    for config, result in r.items()} for r in v.rounds] for v in variants},
                note=f"spec: SYNTHETIC acceptance (oracle draft, alpha 0.8, k 4); random weights; batch {batch}; "
                     "variants measured in turn on one GPU")


def ab_metrics(variants: list[Variant]) -> dict[str, float]:
    """Medians over the rounds per variant, each one's ratio to the baseline's (the first), and the output checks."""
    base = variants[0]
    metrics: dict[str, float] = {"rounds": len(base.rounds)}
    for name, (config, key) in FIGURES.items():
        medians = {v.label: statistics.median(r[config][key] for r in v.rounds) for v in variants}
        for v in variants:
            metrics[f"{v.label}_{name}"] = medians[v.label]
        for v in variants[1:]:
            metrics[f"{v.label}_over_{base.label}_{name}"] = medians[v.label] / medians[base.label]
    for v in variants:
        metrics[f"{v.label}_spec_outputs_differ"] = sum(
            sum(a != b for a, b in zip(r["spec"]["token_ids"], v.reference)) for r in v.rounds)
        metrics[f"{v.label}_target_only_outputs_differ"] = sum(
            sum(a != b for a, b in zip(r["target_only"]["token_ids"], v.reference)) for r in v.rounds)
    for v in variants[1:]:
        metrics[f"{v.label}_target_only_differs_from_{base.label}"] = sum(a != b for a, b in zip(v.reference, base.reference))
    return metrics


if __name__ == "__main__":
    main()
