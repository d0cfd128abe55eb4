"""The services' runtime flags: which layer kernels and stages each service runs unless told."""
from __future__ import annotations

import argparse

import pytest

from specdec.cli_args import add_runtime_args, runtime_config


def _config(argv: list[str], cuda_layer_kernels: str = "auto", **service_defaults: str):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "SPECDEC_TEST", "some/model", cuda_layer_kernels=cuda_layer_kernels, **service_defaults)
    return runtime_config(parser.parse_args(argv))


@pytest.mark.parametrize("service_default", ["fused", "auto"])
def test_on_cuda_a_service_runs_its_own_default_layer_kernels(service_default):
    """The target asks for fused (batch-invariant), a draft for auto: neither needs a GPU to parse."""
    assert _config(["--device", "cuda"], service_default).layer_kernels == service_default


def test_on_cpu_the_default_is_auto_whatever_the_service_runs_on_cuda():
    """fused on CPU would run the Triton interpreter: only an explicit flag asks for that."""
    assert _config(["--device", "cpu"], "fused").layer_kernels == "auto"
    assert _config(["--device", "cpu", "--layer-kernels", "fused"], "fused").layer_kernels == "fused"


def test_the_flag_and_its_env_var_override_the_service_default(monkeypatch):
    assert _config(["--device", "cuda", "--layer-kernels", "auto"], "fused").layer_kernels == "auto"
    monkeypatch.setenv("SPECDEC_TEST_LAYER_KERNELS", "reference")
    assert _config(["--device", "cuda"], "fused").layer_kernels == "reference"


def test_a_target_takes_the_kernel_stages_and_a_draft_the_compiled_ones_unless_told(monkeypatch):
    """The target's stages are the same bits in every replica (engine/kernel_stages.py); a draft's
    rounding only changes its proposals, so it keeps torch.compile's."""
    assert _config(["--device", "cuda"], "fused", stages="kernels").stages == "kernels"
    assert _config(["--device", "cuda"]).stages == "compiled"
    assert _config(["--device", "cuda", "--stages", "eager"], "fused", stages="kernels").stages == "eager"
    monkeypatch.setenv("SPECDEC_TEST_STAGES", "compiled")
    assert _config(["--device", "cuda"], "fused", stages="kernels").stages == "compiled"


def test_the_target_service_defaults_to_the_kernel_stages(monkeypatch):
    """specdec-target's own parser, stopped where it would load the model."""
    from target_service import cli

    seen = {}
    monkeypatch.setattr(cli, "configure_and_run", lambda parser, args, config, run: seen.update(config=config()))
    cli.main(["--device", "cpu", "--model", "some/model"])
    assert seen["config"].stages == "kernels"
