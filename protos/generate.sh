#!/usr/bin/env bash
# Generates the Python stubs for protos/specdec/v1/*.proto into specdec/v1/.
# Usage: protos/generate.sh [OUT_ROOT]   (default: the repository root)
# grpcio-tools is pinned to 1.84 so the stubs import under grpcio >= 1.84 (the GPU machine's).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/specdec/v1"
"$python" -m grpc_tools.protoc -I "$root/protos" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root"/protos/specdec/v1/*.proto
touch "$out/specdec/v1/__init__.py"
