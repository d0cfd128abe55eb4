#!/usr/bin/env bash
# The compose deployment, tested for real on a CPU-only CI machine (as root; reaches only Debian's
# archive and PyPI): a private Docker engine, the local base image, the project image (its volume mount
# points checked empty), then
#   1. docker compose up --wait (one replica each): greedy Generate through the published gateway
#      port gives the same tokens as the target alone (num_draft_tokens=0);
#   2. docker compose up --wait --scale draft=2 --scale target=2 (the gateway keeps running):
#      concurrent requests land on both replicas of each pool, proven by each replica's own
#      GetEngineStats counters;
#   3. scaled back to one replica each: requests keep working on the replicas that remain;
#   4. the model services share one compile-cache volume (Triton's and inductor's caches), writable;
#   5. docker compose stop: every container exits 0 (SIGTERM handled through init: true), then
#      docker compose down -v leaves no container, network or volume behind.
# The GPU reservations in compose.yaml stay as they are (docker_engine.sh makes dockerd accept
# them). Models: the defaults (SmolLM2-135M embedded in the image, the n-gram drafter).
# Whatever happens, the project, dockerd and its data are removed at exit (SPECDEC_KEEP_DOCKER=1
# keeps dockerd and its images for the next run: for development only).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$SECONDS
step() { echo; echo "=== [compose test +$((SECONDS - T0))s] $*"; }

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}   # the project's venv (`make setup`): runs the checks
export SPECDEC_DOCKER_DIR=${SPECDEC_DOCKER_DIR:-/tmp/specdec-docker-ci}
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-specdec-ci}
export COMPOSE_FILE=$ROOT/compose.yaml COMPOSE_ANSI=never
# the image: the local base, the CPU torch wheel, no triton
export SPECDEC_BASE_IMAGE=specdec-base:bookworm SPECDEC_TORCH=torch==2.13.0 SPECDEC_PIP_EXTRAS=
# the deployment: gateway on a loopback port; a KV pool and threads that fit two targets on 2 cores
GATEWAY=127.0.0.1:${SPECDEC_CI_GATEWAY_PORT:-15051}
export SPECDEC_GATEWAY_PUBLISH=$GATEWAY
GATEWAY_HTTP=127.0.0.1:${SPECDEC_CI_GATEWAY_HTTP_PORT:-18000}
export SPECDEC_GATEWAY_HTTP_PUBLISH=$GATEWAY_HTTP
export SPECDEC_TARGET_KV_CACHE_TOKENS=4096 SPECDEC_TARGET_NUM_THREADS=1
WHEEL_DIR=$ROOT/deploy/wheelhouse

cleanup() {
  local rc=$?
  set +e
  if [ -n "${DOCKER_HOST:-}" ] && docker info >/dev/null 2>&1; then
    if [ "$rc" != 0 ]; then
      echo "--- compose logs (last 60 lines per container) ---"
      docker compose ps -a
      docker compose logs --no-color --tail 60
    fi
    docker compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1
  fi
  rm -f "$WHEEL_DIR"/*.whl
  if [ "${SPECDEC_KEEP_DOCKER:-0}" = 1 ]; then
    echo "SPECDEC_KEEP_DOCKER=1: dockerd stays up ($SPECDEC_DOCKER_DIR)"
  else
    deploy/docker_engine.sh purge
  fi
  echo "=== [compose test +$((SECONDS - T0))s] finished with exit code $rc"
  exit "$rc"
}
trap cleanup EXIT

step "Docker engine + compose v2 (deploy/docker_engine.sh)"
eval "$(deploy/docker_engine.sh start)"

step "base image (deploy/base_image.sh: debootstrap + docker import)"
deploy/base_image.sh "$SPECDEC_BASE_IMAGE"

step "project image (docker compose build; torch from the local CPU wheel)"
# the build cannot read the host's disk: put the wheel pip would install here into the context
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WHEEL_DIR" "$SPECDEC_TORCH"
ls "$WHEEL_DIR"/*.whl
docker compose build --quiet target   # gateway and draft run the same image (specdec:latest)
docker image ls specdec
echo "--- the volumes' mount points are empty in the image (two containers' first mounts of one new volume race on copying its files) ---"
leftover=$(docker run --rm --entrypoint sh specdec:latest -c 'ls -A /cache/huggingface /cache/compile | grep -v -e "^/" -e "^$" || true')
[ -z "$leftover" ] || { echo "files under the image's volume mount points: $leftover"; exit 1; }

step "docker compose up --wait (one replica each)"
docker compose up -d --wait --wait-timeout 600
docker compose ps

step "Generate through the gateway's published port $GATEWAY: speculative == target only"
"$PYTHON" deploy/compose_check.py generate --address "$GATEWAY" --http "$GATEWAY_HTTP"
echo "--- the README's call: the project's client inside the gateway container ---"
docker compose exec -T gateway specdec-client --max-new-tokens 16 "The capital of France is"

step "docker compose up --wait --scale draft=2 --scale target=2"
gateway_before=$(docker compose ps -q gateway)
docker compose up -d --wait --wait-timeout 600 --scale draft=2 --scale target=2
docker compose ps
if [ "$(docker compose ps -q gateway)" = "$gateway_before" ]; then
  echo "the gateway kept running: it finds the new replicas by re-resolving DNS"
fi

step "concurrent requests land on both replicas of each pool (their own GetEngineStats)"
"$PYTHON" deploy/compose_check.py spread --address "$GATEWAY" --target-replicas 2 --draft-replicas 2
echo "--- the gateway's log of the last requests (request ids) ---"
docker compose logs --no-color --no-log-prefix gateway | sed 's/\x1b\[[0-9;]*[A-Za-z]//g' | grep "finished:" | tail -n 4

step "docker compose up --wait --scale draft=1 --scale target=1: replicas go, requests keep working"
docker compose up -d --wait --wait-timeout 600 --scale draft=1 --scale target=1
docker compose ps
"$PYTHON" deploy/compose_check.py spread --address "$GATEWAY" --target-replicas 1 --draft-replicas 1

step "Prometheus metrics inside the compose network (gateway 9400, target 9401, draft 9402; not published)"
for svc_port in gateway:9400 target:9401 draft:9402; do
  svc=${svc_port%:*} port=${svc_port#*:}
  lines=$(docker compose exec -T "$svc" python -c \
    "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics', timeout=5).read().decode())" \
    | grep '^specdec_' || true)
  echo "$svc: $(printf '%s\n' "$lines" | grep -c . ) specdec_* samples, e.g.:"
  printf '%s\n' "$lines" | sed -n '1,3s/^/    /p'  # sed reads it all: head's early exit SIGPIPEd printf (exit 141)
  if [ -z "$lines" ]; then echo "FAIL: no metrics from $svc"; exit 1; fi
done

step "the compile caches (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR): one volume the model services write and share"
docker compose exec -T target python -c "
import os, pathlib
for var in ('TRITON_CACHE_DIR', 'TORCHINDUCTOR_CACHE_DIR'):
    path = pathlib.Path(os.environ[var]); path.mkdir(parents=True, exist_ok=True)
    (path / 'ci-probe').write_text(var); print(var, path, 'written by the target')"
docker compose exec -T draft python -c "
import os, pathlib
for var in ('TRITON_CACHE_DIR', 'TORCHINDUCTOR_CACHE_DIR'):
    probe = pathlib.Path(os.environ[var]) / 'ci-probe'
    assert probe.read_text() == var, probe; probe.unlink(); print(var, 'read by the draft')"

step "docker compose stop + down: every container exits 0, nothing is left"
docker compose stop --timeout 20
docker compose ps -a --format '{{.Name}}: {{.Status}}'
bad=$(docker compose ps -a --format '{{.Name}} {{.State}} {{.ExitCode}}' | awk '$2 != "exited" || $3 != 0')
[ -z "$bad" ] || { echo "FAIL: containers that did not stop cleanly: $bad"; exit 1; }
docker compose down -v --remove-orphans
left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
left+=$(docker network ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
left+=$(docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
[ -z "$left" ] || { echo "FAIL: left behind after down: $left"; exit 1; }
echo "OK: down removed every container, network and volume of $COMPOSE_PROJECT_NAME"
step "compose test passed"
echo "compose: 6 passed, 0 failed"   # equality, OpenAI equality, spread, scale-down, metrics, stop/down
