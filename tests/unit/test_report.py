"""bench/report.py: every benchmark's JSON names the GPU, and the host CPU whose time moves between machine starts."""
from __future__ import annotations

import json

import pytest
from harness import bench_module


@pytest.fixture(scope="module")
def report():
    yield from bench_module("report")


def test_a_saved_report_has_the_shape_every_benchmark_shares_and_names_the_host_cpu(report, tmp_path, capsys):
    out = tmp_path / "results" / "probe.json"
    report.save_report("probe", {"tok_s": 1 / 3, "nested": {"ms": 2 / 3}}, out)
    saved = json.loads(out.read_text())
    assert set(saved) == {"name", "command", "machine", "host", "when", "metrics"}
    assert saved["metrics"] == {"tok_s": 0.3333, "nested": {"ms": 0.6667}}
    assert saved["host"]["cpus"] >= 1 and saved["host"]["kernel"] and "cpu" in saved["host"]
    assert json.loads(capsys.readouterr().out) == saved["metrics"]
