#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels of what the services need and the GPU machine's
# image lacks (Python 3.12, x86_64; no registry is reachable there). Run here, then on the GPU
# machine, with .whl carried over:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# before the GPU tests or bench/gpu_*.py. grpcio and protobuf are on the image (1.84 / 7.36); the
# stubs in specdec/v1 are generated to import under them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 uvicorn fastapi starlette pydantic pydantic-core \
  annotated-types typing-inspection typing-extensions opentelemetry-api py-spy \
  openai httpx2 httpcore2 truststore anyio sniffio jiter idna h11  # the OpenAI-compatible API's tests' client
ls .whl
