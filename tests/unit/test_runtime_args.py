"""The model services' runtime flags: dtype defaults per service and device."""
from __future__ import annotations

import argparse

import pytest

from specdec.cli_args import add_runtime_args, runtime_config


def _config(cpu_dtype: str, *argv: str):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "SPECDEC_TEST", "some-model", cpu_dtype=cpu_dtype)
    return runtime_config(parser.parse_args(["--device", "cpu", *argv]))


def test_a_target_on_cpu_defaults_to_float32():
    assert _config("float32").dtype == "float32"


def test_a_draft_on_a_cpu_with_native_bfloat16_defaults_to_it_and_a_flag_still_wins():
    assert _config("bfloat16").dtype == "bfloat16"
    assert _config("bfloat16", "--dtype", "float32").dtype == "float32"


@pytest.mark.parametrize("cpu_dtype", ["float32", "bfloat16"])
def test_gpus_default_to_bfloat16(cpu_dtype):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "SPECDEC_TEST", "some-model", cpu_dtype=cpu_dtype)
    args = parser.parse_args(["--device", "cuda"])
    assert runtime_config(args).dtype == "bfloat16"
