"""The services' runtime flags: which layer kernels each service runs unless told."""
from __future__ import annotations

import argparse

import pytest

from specdec.cli_args import add_runtime_args, runtime_config


def _config(argv: list[str], cuda_layer_kernels: str):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "SPECDEC_TEST", "some/model", cuda_layer_kernels=cuda_layer_kernels)
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
