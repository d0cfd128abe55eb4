"""The committed stubs are what protos/generate.sh makes from the committed .proto files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run([str(ROOT / "protos" / "generate.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specdec" / "v1").glob("*") if p.is_file())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "specdec" / "v1").glob("*") if p.is_file())
    assert generated == committed, "run `make protos` and commit the stubs"
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} is stale: run `make protos`"


def test_stubs_target_grpcio_1_84():
    """The GPU machine has grpcio 1.84: stubs from a newer grpcio-tools refuse to import there."""
    text = (ROOT / "specdec" / "v1" / "target_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.84.0'" in text
